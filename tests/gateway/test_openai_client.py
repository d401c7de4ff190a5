"""The official ``openai`` client against the gateway (``stack``): every answer equals what the gRPC services give
for the same input (Generate on the decoders, Embed / Rerank on the embed services), and the options the gateway
cannot honour are refused with a 400 naming them.
"""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest
import soundfile

from encdec import DATA_DIR
from shared.proto import decoder_pb2, decoder_pb2_grpc, embed_pb2, embed_pb2_grpc

WHISPER = "whisper-tiny.en"
EMBED = "all-MiniLM-L6-v2"
CLIPS = sorted(p.name for p in DATA_DIR.glob("*.wav"))
FINISH = {decoder_pb2.FINISH_REASON_STOP: "stop", decoder_pb2.FINISH_REASON_LENGTH: "length"}
SOURCES = ["the quick dog runs over the bridge.", "a small bird near the river!", "old friend, open the door?"]
SENTENCES = ["the cat sleeps on the mat", "a quick brown fox", "", "rain in the valley tonight"]
DOCUMENTS = ["the cat is on the table", "stock markets fell today", "a dog and a cat", "green tea"]


@dataclass
class Sample:
    """One sample (``GenerateResponse.index``) of a gRPC Generate stream."""

    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None


def grpc_generate(address: str, request: decoder_pb2.GenerateRequest) -> tuple[dict[int, Sample], decoder_pb2.Usage]:
    samples: dict[int, Sample] = defaultdict(Sample)
    usage = None
    with grpc.insecure_channel(address) as channel:
        for message in decoder_pb2_grpc.DecoderServiceStub(channel).Generate(request, timeout=120):
            sample = samples[message.index]
            sample.text += message.text
            sample.logprobs += message.logprobs
            if message.finish_reason:
                sample.finish_reason = FINISH.get(message.finish_reason)
            if message.HasField("usage"):
                usage = message.usage
    return dict(samples), usage


def grpc_text(address: str, prompt: str, **sampling) -> tuple[Sample, decoder_pb2.Usage]:
    samples, usage = grpc_generate(
        address, decoder_pb2.GenerateRequest(text=prompt, sampling=decoder_pb2.SamplingParams(**sampling))
    )
    return samples[0], usage


def grpc_embed(address: str, **fields) -> embed_pb2.EmbedResponse:
    with grpc.insecure_channel(address) as channel:
        return embed_pb2_grpc.EmbedServiceStub(channel).Embed(embed_pb2.EmbedRequest(**fields), timeout=60)


def grpc_rerank(address: str, **fields) -> embed_pb2.RerankResponse:
    with grpc.insecure_channel(address) as channel:
        return embed_pb2_grpc.EmbedServiceStub(channel).Rerank(embed_pb2.RerankRequest(**fields), timeout=60)


def audio(name: str) -> tuple[str, bytes, str]:
    return name, (DATA_DIR / name).read_bytes(), "audio/wav"


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def transcripts(stack) -> dict[str, tuple[str, decoder_pb2.Usage]]:
    """Each clip's gRPC Generate transcript (joined, stripped) and usage."""
    out = {}
    for name in CLIPS:
        samples, usage = grpc_generate(
            stack.whisper.decoder_address, decoder_pb2.GenerateRequest(audio=(DATA_DIR / name).read_bytes())
        )
        out[name] = samples[0].text.strip(), usage
    return out


@pytest.fixture(scope="module")
def t5(stack) -> str:
    return str(stack.t5_path)


# --- /v1/audio -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", ["sample.wav", "meeting.wav"])
def test_transcription_formats_equal_grpc_and_cli(stack, client, transcripts, clip):
    expected = transcripts[clip][0]
    assert expected
    as_json = client.audio.transcriptions.create(model=WHISPER, file=audio(clip))
    assert as_json.text == expected
    as_text = client.audio.transcriptions.create(model=WHISPER, file=audio(clip), response_format="text")
    assert as_text == expected
    verbose = client.audio.transcriptions.create(model=WHISPER, file=audio(clip), response_format="verbose_json")
    assert (verbose.task, verbose.language, verbose.text) == ("transcribe", "english", expected)
    assert verbose.duration == pytest.approx(soundfile.info(DATA_DIR / clip).duration, abs=1e-3)
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "encdec.cli",
            "transcribe",
            "--address",
            stack.whisper.decoder_address,
            str(DATA_DIR / clip),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == expected


@pytest.mark.parametrize(
    "name, filename, media",
    [
        ("mp3-44k-stereo", "podcast.mp3", "audio/mpeg"),
        ("m4a-aac-48k-mono", "memo.m4a", "audio/mp4"),
        ("webm-opus-48k-mono", "browser.webm", "audio/webm"),
        ("ogg-vorbis-44k-stereo", "song.ogg", "audio/ogg"),
        ("mp4-video-aac-44k-stereo", "call.mp4", "video/mp4"),
        ("mp4-video-aac-44k-stereo", "call.mov", "video/quicktime"),
    ],
)
def test_every_openai_upload_format_transcribes_as_over_grpc(stack, client, name, filename, media):
    """The formats OpenAI's API takes, as the official client uploads them: the text of the same bytes sent
    over gRPC, and verbose_json's duration the decoder's."""
    from helpers.audio_files import encode_file

    from decoder_svc.session.audio import decode_audio

    data = encode_file(decode_audio((DATA_DIR / "sample.wav").read_bytes()), name)
    samples, _ = grpc_generate(stack.whisper.decoder_address, decoder_pb2.GenerateRequest(audio=data))
    got = client.audio.transcriptions.create(
        model=WHISPER, file=(filename, data, media), response_format="verbose_json"
    )
    assert got.text == samples[0].text.strip() and got.text
    assert got.duration == pytest.approx(len(decode_audio(data)) / 16_000, abs=1e-3)


@pytest.mark.parametrize(
    "data, words",
    [
        (b"these are meeting notes, not a recording\n" * 20, "audio cannot be decoded"),
        (b"", "file is empty"),
        (
            b"RIFF\x24\x00\x10\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00\x80>\x00\x00\x00}\x00\x00\x02\x00\x10\x00"
            b"data\x00\x00\x10\x00" + bytes(1000),
            "WAV file is truncated",
        ),
    ],
)
def test_a_file_that_is_not_audio_is_a_400_naming_the_file(client, data, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.transcriptions.create(model=WHISPER, file=("notes.mp3", data, "audio/mpeg"))
    assert err.value.status_code == 400 and words in err.value.message and err.value.param == "file"


def test_transcription_options_an_english_only_model_cannot_do_are_400(client):
    # tiny.en: another language or a translation is refused by the decoder with a message naming the option
    # (the accepted options, formats and timestamps: tests/gateway/test_http_whisper.py).
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.transcriptions.create(model=WHISPER, file=audio("short.wav"), language="de")
    assert err.value.status_code == 400 and "English-only" in err.value.message and err.value.param == "language"


def test_transcription_stream_equals_non_streamed(client, transcripts):
    events = list(client.audio.transcriptions.create(model=WHISPER, file=audio("sample.wav"), stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    # openai rules stream each window once it is accepted (a rejected attempt is never sent): one window, one delta
    assert len(done) == 1 and events[-1] is done[0] and len(deltas) == 1
    expected, usage = transcripts["sample.wav"]
    assert "".join(deltas) == done[0].text == expected
    assert done[0].text == client.audio.transcriptions.create(model=WHISPER, file=audio("sample.wav")).text
    tokens = done[0].usage
    assert (tokens.input_tokens, tokens.output_tokens) == (usage.encoder_tokens, usage.completion_tokens)
    assert tokens.total_tokens == usage.encoder_tokens + usage.completion_tokens > 0


def test_concurrent_transcriptions_each_equal_its_single_result(client, transcripts):
    clips = CLIPS * 2
    with ThreadPoolExecutor(len(clips)) as pool:
        texts = list(pool.map(lambda c: client.audio.transcriptions.create(model=WHISPER, file=audio(c)).text, clips))
    assert texts == [transcripts[c][0] for c in clips]


def test_translation_on_an_english_only_model_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.translations.create(model=WHISPER, file=audio("short.wav"))
    assert err.value.status_code == 400 and "cannot translate" in err.value.message


def test_unknown_audio_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.audio.transcriptions.create(model="whisper-huge-nope", file=audio("short.wav"))
    assert "whisper-huge-nope" in err.value.message


# --- /v1/embeddings --------------------------------------------------------------------------------------------


def _token_ids(texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    from shared.models.registry import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(EMBED)[1])
    return [tokenizer(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("dimensions", [None, 64])
@pytest.mark.parametrize("encoding_format", [None, "float"])
@pytest.mark.parametrize("kind", ["string", "strings", "ids", "id_lists"])
def test_embeddings_equal_grpc(stack, client, kind, encoding_format, dimensions):
    ids = _token_ids(SENTENCES)
    given = {"string": SENTENCES[0], "strings": SENTENCES, "ids": ids[1], "id_lists": ids}[kind]
    grpc_input = {"string": {"inputs": SENTENCES[:1]}, "strings": {"inputs": SENTENCES}}.get(kind)
    if grpc_input is None:
        grpc_input = {"input_ids": [embed_pb2.EmbedTokenIds(ids=i) for i in ([ids[1]] if kind == "ids" else ids)]}
    options = {k: v for k, v in (("encoding_format", encoding_format), ("dimensions", dimensions)) if v}
    got = client.embeddings.create(model=EMBED, input=given, **options)
    want = grpc_embed(stack.embed_address, model=EMBED, dimensions=dimensions or 0, **grpc_input)
    assert [d.index for d in got.data] == list(range(len(want.embeddings)))
    for d, w in zip(got.data, want.embeddings):
        assert len(d.embedding) == (dimensions or 384)
        np.testing.assert_array_equal(np.asarray(d.embedding, np.float32), np.asarray(w.values, np.float32))
    assert got.usage.prompt_tokens == got.usage.total_tokens == want.usage.prompt_tokens > 0
    assert got.model == want.model


# --- /v1/completions -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [5, 24])
def test_greedy_completion_equals_grpc(stack, client, t5, max_tokens):
    for source in SOURCES:
        got = client.completions.create(model=t5, prompt=source, max_tokens=max_tokens, temperature=0)
        want, usage = grpc_text(stack.t5.decoder_address, source, temperature=0, max_tokens=max_tokens)
        assert got.object == "text_completion" and len(got.choices) == 1
        assert got.choices[0].text == want.text and want.text
        assert got.choices[0].finish_reason == want.finish_reason
        assert got.usage.prompt_tokens == usage.encoder_tokens
        assert got.usage.completion_tokens == usage.completion_tokens


def test_streamed_completion_joins_to_the_same_text(stack, client, t5):
    chunks = list(
        client.completions.create(
            model=t5,
            prompt=SOURCES[0],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *texts, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in texts) and len(texts) > 1
    want, usage = grpc_text(stack.t5.decoder_address, SOURCES[0], temperature=0, max_tokens=20)
    assert "".join(c.choices[0].text for c in texts) == want.text
    assert [c.choices[0].finish_reason for c in texts if c.choices[0].finish_reason] == [want.finish_reason]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (usage.encoder_tokens, usage.completion_tokens)


def test_seeded_samples_are_indexed_prompt_times_n_plus_sample(stack, client, t5):
    got = client.completions.create(model=t5, prompt=SOURCES, n=2, temperature=1, seed=1234, max_tokens=16)
    assert [c.index for c in got.choices] == list(range(6))
    for p, source in enumerate(SOURCES):
        want, _ = grpc_generate(
            stack.t5.decoder_address,
            decoder_pb2.GenerateRequest(
                text=source, sampling=decoder_pb2.SamplingParams(temperature=1, seed=1234, n=2, max_tokens=16)
            ),
        )
        for j in range(2):
            assert got.choices[p * 2 + j].text == want[j].text
            assert got.choices[p * 2 + j].finish_reason == want[j].finish_reason
    assert len({c.text for c in got.choices}) > 1  # sampled, not one greedy answer repeated


def test_completion_logprobs_equal_grpc(stack, client, t5):
    for source in SOURCES:
        got = client.completions.create(model=t5, prompt=source, max_tokens=12, temperature=0, logprobs=2)
        want, _ = grpc_text(
            stack.t5.decoder_address, source, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2
        )
        lp = got.choices[0].logprobs

        def at_text_start(token: str, i: int, text: str = want.text) -> str:
            """The text drops its first word's space; so does the token at its start."""
            return token[1:] if i == 0 and token.startswith(" ") and not text.startswith(" ") else token

        assert lp.tokens == [at_text_start(x.token, i) for i, x in enumerate(want.logprobs)] and lp.tokens
        assert lp.token_logprobs == [x.logprob for x in want.logprobs]
        assert lp.top_logprobs == [
            {at_text_start(t.token, i): t.logprob for t in x.top} for i, x in enumerate(want.logprobs)
        ]
        assert all(len(top) == 2 for top in lp.top_logprobs)
        assert got.choices[0].text == want.text


def test_completion_logprob_tokens_join_to_the_text(client, t5):
    """OpenAI's contract (``echo`` off): the tokens, special tokens left out, spell the text, and ``text_offset[i]``
    is where token ``i`` starts in it."""
    from transformers import AutoTokenizer

    special = set(AutoTokenizer.from_pretrained(t5).all_special_tokens)
    for source in SOURCES:
        choice = client.completions.create(model=t5, prompt=source, max_tokens=12, temperature=0, logprobs=0).choices[0]
        tokens = choice.logprobs.tokens
        assert "".join(t for t in tokens if t not in special) == choice.text
        for token, offset in zip(tokens, choice.logprobs.text_offset):
            if token not in special:
                assert choice.text[offset : offset + len(token)] == token


def test_stop_and_length_finish_reasons_equal_grpc(stack, client, t5):
    full, _ = grpc_text(stack.t5.decoder_address, SOURCES[1], temperature=0, max_tokens=24)
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip()
    cases = [({"stop": [stop, "\u2603"]}, "stop"), ({"max_tokens": 3}, "length")]
    for options, reason in cases:
        request = {"temperature": 0, "max_tokens": 24, **options}
        got = client.completions.create(model=t5, prompt=SOURCES[1], **request)
        want, _ = grpc_text(stack.t5.decoder_address, SOURCES[1], **request)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, want.finish_reason)
        assert want.finish_reason == reason
        assert len(got.choices[0].text) < len(full.text) and full.text.startswith(got.choices[0].text)


def test_completion_refusals(client, t5):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=WHISPER, prompt="hello", max_tokens=4)
    assert "/v1/completions" in err.value.message and WHISPER in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=t5, prompt="hello", max_tokens=4, presence_penalty=0.5)
    assert "presence_penalty" in err.value.message and err.value.param == "presence_penalty"


# --- /v1/models, /v1/rerank ------------------------------------------------------------------------------------


def test_models_list_and_retrieve(stack, client, t5):
    served = {WHISPER, t5, EMBED, str(stack.rerank_path)}
    models = client.models.list().data
    assert {m.id for m in models} == served and len(models) == 4
    for m in models:
        card = client.models.retrieve(m.id)
        assert (card.id, card.object, card.created) == (m.id, "model", m.created)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("top_n", [None, 2])
def test_rerank_equals_grpc(stack, top_n):
    model = str(stack.rerank_path)
    query = "where is the cat?"
    body = {"model": model, "query": query, "documents": DOCUMENTS}
    if top_n is not None:
        body["top_n"] = top_n
    got = httpx.post(stack.url + "/v1/rerank", json=body, timeout=60)
    assert got.status_code == 200, got.text
    results = got.json()["results"]
    want = grpc_rerank(stack.rerank_address, model=model, query=query, documents=DOCUMENTS, top_n=top_n or 0)
    assert len(results) == (top_n or len(DOCUMENTS))
    assert [(r["index"], r["relevance_score"]) for r in results] == [(w.index, w.score) for w in want.results]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[r["index"]] for r in results]
    assert got.json()["usage"]["total_tokens"] == want.usage.prompt_tokens > 0
    bare = httpx.post(stack.url + "/v1/rerank", json={**body, "return_documents": False}, timeout=60).json()
    assert [r["index"] for r in bare["results"]] == [r["index"] for r in results]
    assert all("document" not in r for r in bare["results"])


def test_rerank_without_classification_head_is_400(stack):
    got = httpx.post(stack.url + "/v1/rerank", json={"model": EMBED, "query": "q", "documents": ["a", "b"]}, timeout=60)
    assert got.status_code == 400, got.text
    with pytest.raises(grpc.RpcError) as err:
        grpc_rerank(stack.embed_address, model=EMBED, query="q", documents=["a", "b"])
    assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    assert got.json()["error"]["message"] == err.value.details()
