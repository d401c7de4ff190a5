"""``/v1/audio/*`` Whisper options through the gateway (``stack``: Whisper tiny.en, English-only), with the official
``openai`` client and raw HTTP: ``verbose_json`` segments and words, ``srt`` / ``vtt`` bodies, ``prompt``, and
what tiny.en cannot do (another language, translation) as the decoder's refusal in OpenAI's 400 naming the field.

Every answer is checked against the gRPC Generate of the same audio with the ``WhisperOptions`` the gateway should
have sent: a field dropped or mistranslated on the way shows as a difference.
"""

from __future__ import annotations

import grpc
import httpx
import numpy as np
import openai
import pytest
import soundfile

from encdec import DATA_DIR
from gateway_svc.routes.audio import language_code, language_name, whisper_error
from shared.proto import decoder_pb2, decoder_pb2_grpc
from shared.subtitles import to_srt, to_vtt

WHISPER = "whisper-tiny.en"
TRANSCRIBE = "/v1/audio/transcriptions"
CLIP = "sample.wav"
SEGMENT, WORD = decoder_pb2.TIMESTAMP_GRANULARITY_SEGMENT, decoder_pb2.TIMESTAMP_GRANULARITY_WORD


def audio(name: str) -> tuple[str, bytes, str]:
    return name, (DATA_DIR / name).read_bytes(), "audio/wav"


def grpc_messages(address: str, clip: str, **whisper) -> list[decoder_pb2.GenerateResponse]:
    request = decoder_pb2.GenerateRequest(
        audio=(DATA_DIR / clip).read_bytes(), whisper=decoder_pb2.WhisperOptions(**whisper)
    )
    with grpc.insecure_channel(address) as channel:
        return list(decoder_pb2_grpc.DecoderServiceStub(channel).Generate(request, timeout=120))


def f32(value: float) -> float:
    return float(np.float32(value))


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def word_segments(stack) -> list[decoder_pb2.Segment]:
    """The gRPC segments of ``CLIP`` with word timestamps (what verbose_json + word granularity asks)."""
    return [s for m in grpc_messages(stack.whisper.decoder_address, CLIP, timestamps=WORD) for s in m.segments]


@pytest.fixture(scope="module")
def segments(stack) -> list[decoder_pb2.Segment]:
    """The gRPC segments of ``CLIP`` with segment timestamps (verbose_json / srt / vtt)."""
    return [s for m in grpc_messages(stack.whisper.decoder_address, CLIP, timestamps=SEGMENT) for s in m.segments]


def test_verbose_json_segments_and_words_equal_grpc(client, word_segments):
    got = client.audio.transcriptions.create(
        model=WHISPER, file=audio(CLIP), response_format="verbose_json", timestamp_granularities=["segment", "word"]
    )
    assert (got.task, got.language) == ("transcribe", "english")
    assert got.duration == pytest.approx(soundfile.info(DATA_DIR / CLIP).duration, abs=1e-3)
    assert word_segments and got.text == "".join(s.text for s in word_segments).strip()
    assert [s.id for s in got.segments] == list(range(len(word_segments)))
    for ours, want in zip(got.segments, word_segments, strict=True):
        assert (ours.text, ours.seek, list(ours.tokens)) == (want.text, want.seek, list(want.tokens))
        assert (f32(ours.start), f32(ours.end), f32(ours.avg_logprob)) == (want.start, want.end, want.avg_logprob)
        assert (f32(ours.temperature), f32(ours.no_speech_prob)) == (want.temperature, want.no_speech_prob)
        assert 0.0 <= ours.start < ours.end <= got.duration + 0.02
    words = [w for s in word_segments for w in s.words]
    assert [(w.word, f32(w.start), f32(w.end)) for w in got.words] == [(w.word.strip(), w.start, w.end) for w in words]
    assert " ".join(w.word for w in got.words) == " ".join(got.text.split())  # every word of the text, in order
    starts = [w.start for w in got.words]
    assert starts == sorted(starts) and all(w.start <= w.end for w in got.words)


@pytest.mark.parametrize(
    "granularities, has_segments, has_words", [(None, True, False), (["word"], False, True), (["segment"], True, False)]
)
def test_verbose_json_carries_what_the_granularities_ask(http, granularities, has_segments, has_words):
    data = {"model": WHISPER, "response_format": "verbose_json"}
    if granularities:
        data["timestamp_granularities[]"] = granularities
    response = http.post(TRANSCRIBE, files={"file": audio("short.wav")}, data=data)
    assert response.status_code == 200, response.text
    body = response.json()
    assert ("segments" in body, "words" in body) == (has_segments, has_words), body
    assert body["usage"] == {"type": "duration", "seconds": 3}  # short.wav: 2.58 s, rounded up as OpenAI
    assert body["segments"] if has_segments else body["words"], body


@pytest.mark.parametrize("fmt, writer, first_line", [("srt", to_srt, "1"), ("vtt", to_vtt, "WEBVTT")])
def test_subtitles_are_text_bodies_of_the_grpc_segments(http, segments, fmt, writer, first_line):
    response = http.post(TRANSCRIBE, files={"file": audio(CLIP)}, data={"model": WHISPER, "response_format": fmt})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    assert segments and response.text == writer(segments)
    assert response.text.splitlines()[0] == first_line
    assert "-->" in response.text


def test_prompt_reaches_the_decoder(stack, client):
    # This prompt turns numbers.wav's digits into words ("five five five one two ..."), so a prompt lost on the way
    # shows.
    prompt = "one two three, four five. Numbers written as words"
    got = client.audio.transcriptions.create(model=WHISPER, file=audio("numbers.wav"), prompt=prompt)
    address = stack.whisper.decoder_address
    want = "".join(m.text for m in grpc_messages(address, "numbers.wav", prompt=prompt)).strip()
    unprompted = "".join(m.text for m in grpc_messages(address, "numbers.wav")).strip()
    assert got.text == want != unprompted


@pytest.mark.parametrize("language", ["en", "English"])
def test_english_by_code_or_name_is_the_default_transcript(client, language):
    default = client.audio.transcriptions.create(model=WHISPER, file=audio("short.wav")).text
    assert default
    assert client.audio.transcriptions.create(model=WHISPER, file=audio("short.wav"), language=language).text == (
        default
    )


@pytest.mark.parametrize("language", ["de", "german"])
def test_another_language_on_an_english_only_model_is_400_naming_language(client, language):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.transcriptions.create(model=WHISPER, file=audio("short.wav"), language=language)
    assert err.value.param == "language"
    assert "English-only" in err.value.message and "'de'" in err.value.message


def test_translation_on_an_english_only_model_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.translations.create(model=WHISPER, file=audio("short.wav"))
    assert err.value.param == "model"
    assert "translate" in err.value.message


@pytest.mark.parametrize(
    "data, param",
    [
        ({"response_format": "json", "timestamp_granularities[]": "word"}, "timestamp_granularities[]"),
        ({"response_format": "verbose_json", "timestamp_granularities[]": "sentence"}, "timestamp_granularities[]"),
        ({"response_format": "srt", "stream": "true"}, "stream"),
    ],
)
def test_options_that_do_not_go_together_are_400(http, data, param):
    response = http.post(TRANSCRIBE, files={"file": audio("short.wav")}, data={"model": WHISPER, **data})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# --- the field maps (no services) --------------------------------------------------------------------------------


def test_languages_map_between_iso_codes_and_openai_names():
    assert [language_code(x) for x in ("de", "German", " english ", "castilian", "xx")] == [
        "de",
        "de",
        "en",
        "es",
        "xx",
    ]
    assert [language_name(x) for x in ("en", "de", "zh", "xx")] == ["english", "german", "chinese", "xx"]


@pytest.mark.parametrize(
    "details, param",
    [
        ("this model is English-only: language must be 'en' or empty, got 'de'", "language"),
        ("this model is English-only: it cannot translate; use a multilingual model", "model"),
        ("prompt is 5000 characters; the limit is 4096", "prompt"),
        ("word timestamps need the checkpoint's alignment_heads, which this model lacks", "timestamp_granularities[]"),
        ("audio is 700.00 s long; this server accepts at most 600.00 s", "file"),
        ("something else entirely", None),
    ],
)
def test_a_decoder_invalid_argument_names_its_field(details, param):
    exc = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
    err = whisper_error(exc)
    assert (err.status, err.param, err.message) == (400, param, details)
    assert err.body()["error"]["type"] == "invalid_request_error"
