"""Whisper's short-form options end to end: language, task, prompt, timestamps, detection, silence, bad input.

Redis + encoder_svc + decoder_svc as separate processes (``encdec.launcher.Services``), one stack per model
(whisper-base, multilingual; whisper-tiny.en, English-only), real gRPC with ``GenerateRequest.whisper``.
The truth is HF transformers on the same weights (``helpers.whisper_hf``): ``detect_language`` and
``generate`` with the language / task / ``prompt_ids`` / ``return_timestamps`` / ``return_token_timestamps``
the request asks for, so requests name HF's decoding rules (``pcm_request``) unless a test is about
openai-whisper's. Clips: espeak-ng weather reports in German, Spanish and French, the bundled English
``sample.wav``, and numpy-made silence, low noise and a 0.8 s cut.

Word times follow ``decoder_svc/whisper/word_timing.py`` (``helpers.whisper_hf.hf_word_times`` builds them
from HF's ``token_timestamps``).
"""

from __future__ import annotations

import io
import uuid
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
import soundfile as sf
from helpers.stacks import BASE, TINY
from helpers.whisper_hf import RATE, hf_word_times, load_hf_whisper, noise, read_clip
from test_e2e_whisper import assert_all_blocks_free, wait_state

from decoder_svc.whisper.repetition import has_loop
from shared.proto import decoder_pb2

EOT = {TINY: 50256, BASE: 50257}  # <|endoftext|>; text tokens are below it
SEGMENT, WORD = decoder_pb2.TIMESTAMP_GRANULARITY_SEGMENT, decoder_pb2.TIMESTAMP_GRANULARITY_WORD
STOP = decoder_pb2.FINISH_REASON_STOP
LANG_CLIPS = ("weather_de", "weather_es", "weather_fr")
PROMPT = "  Quarterly budget meeting of the board.  "
WORD_TOLERANCE_S = 0.02 + 1e-4  # one DTW frame, plus float32 rounding of the proto's times

# Check 1's requests on whisper-base: name -> (clip, WhisperOptions fields). test_e2e_whisper_longform.py sends
# them all at once beside its long-form requests.
BASE_CASES = {
    "detect_de": ("weather_de", {}),
    "detect_es": ("weather_es", {}),
    "detect_fr": ("weather_fr", {}),
    "translate_de": ("weather_de", {"task": "translate", "language": "de"}),
    "translate_detected": ("weather_de", {"task": "translate"}),
    "prompt": ("sample", {"prompt": PROMPT}),
    "segments": ("sample", {"language": "en", "timestamps": SEGMENT}),
    "words": ("sample", {"language": "en", "timestamps": WORD}),
    "words_late_start": ("late:meeting", {"language": "en", "timestamps": WORD}),
    # openai-whisper's rules (the service default): a translation that loops at temperature 0 (fallback, best_of 5
    # samples over the kept cross KV), and word timing that moves the seek
    "openai_translate_fr": ("weather_fr", {"task": "translate", "decoding_rules": "openai"}),
    "openai_words": ("late:meeting", {"language": "en", "timestamps": WORD, "decoding_rules": "openai"}),
    # words timed for hallucination_silence_threshold though the request asks for none
    "openai_hallucination_silence": (
        "late:meeting",
        {"language": "en", "hallucination_silence_threshold": 2.0, "decoding_rules": "openai"},
    ),
}
LEAD_IN_S = 1.2  # "late:<clip>": this much digital silence before the clip (speech starts past HF's 0.0)


def case_audio(clip: str) -> np.ndarray:
    """A case's ``[N]`` float32 samples: ``helpers.whisper_hf.read_clip(clip)``, or for ``"late:<clip>"`` that clip
    after ``LEAD_IN_S`` seconds of zeros."""
    if clip.startswith("late:"):
        return np.concatenate([np.zeros(int(LEAD_IN_S * RATE), np.float32), read_clip(clip.removeprefix("late:"))])
    return read_clip(clip)


@dataclass
class Result:
    """One Generate stream: its messages, the final one, and what they add up to."""

    messages: list[decoder_pb2.GenerateResponse]
    final: decoder_pb2.GenerateResponse = field(init=False)
    tokens: list[int] = field(init=False)
    text: str = field(init=False)
    segments: list[decoder_pb2.Segment] = field(init=False)

    def __post_init__(self) -> None:
        self.final = self.messages[-1]
        self.tokens = [t for m in self.messages for t in m.token_ids]
        self.text = "".join(m.text for m in self.messages)
        self.segments = [s for m in self.messages for s in m.segments]


def pcm_request(pcm: np.ndarray, request_id: str = "", **options) -> decoder_pb2.GenerateRequest:
    """A Generate request for ``[N]`` float32 16 kHz samples with ``WhisperOptions(**options)``, under HF's
    decoding rules unless ``decoding_rules`` says otherwise (HF is these tests' reference)."""
    options.setdefault("decoding_rules", "hf")
    return decoder_pb2.GenerateRequest(
        request_id=request_id,
        pcm=decoder_pb2.PcmAudio(samples=np.asarray(pcm, "<f4").tobytes(), sample_rate=RATE),
        whisper=decoder_pb2.WhisperOptions(**options),
    )


def transcribe(stub, pcm: np.ndarray, request_id: str = "", **options) -> Result:
    return Result(list(stub.Generate(pcm_request(pcm, request_id, **options), timeout=300)))


def run_case(stub, name: str) -> Result:
    clip, options = BASE_CASES[name]
    return transcribe(stub, case_audio(clip), **options)


@pytest.fixture(scope="module")
def hf_base():
    return load_hf_whisper(BASE)


@pytest.fixture(scope="module")
def hf_tiny():
    return load_hf_whisper(TINY)


def stub_of(request, model: str):
    return request.getfixturevalue("base_stub" if model == BASE else "tiny_stub")


def without_end(tokens: list[int], eot: int) -> list[int]:
    assert tokens and tokens[-1] == eot, tokens  # the stream reports the end token, HF strips it
    return tokens[:-1]


# --- 1. whisper-base against HF ------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", LANG_CLIPS)
def test_detected_language_and_transcript_match_hf(base_case, base_stub, hf_base, clip):
    """(a) language = HF detect_language, probability = softmax over the language tokens; (b) the transcript
    = HF generate(language=<detected>, task="transcribe")."""
    pcm = read_clip(clip)
    want_language, want_probability = hf_base.detect(pcm)
    got = base_case(f"detect_{clip[-2:]}")
    assert got.final.finish_reason == STOP
    assert got.final.language == want_language
    assert got.final.language_probability == pytest.approx(want_probability, abs=1e-3)
    assert got.final.duration == pytest.approx(len(pcm) / RATE, abs=1e-6)
    want = hf_base.short_form(pcm, language=want_language, task="transcribe")
    assert without_end(got.tokens, hf_base.specials.eot) == want
    assert got.text == hf_base.tokenizer.decode(want, skip_special_tokens=True) and got.text.strip()
    assert not got.segments
    assert_all_blocks_free(base_stub)


def test_translate_matches_hf(base_case, base_stub, hf_base):
    """(c) task="translate" on the German clip, language given and detected: HF generate(task="translate",
    language="de")."""
    pcm = read_clip("weather_de")
    want = hf_base.short_form(pcm, language="de", task="translate")
    assert want != hf_base.short_form(pcm, language="de", task="transcribe")  # the task token took effect
    for name in ("translate_de", "translate_detected"):
        got = base_case(name)
        assert (got.final.finish_reason, got.final.language) == (STOP, "de"), name
        assert without_end(got.tokens, hf_base.specials.eot) == want, name
    assert_all_blocks_free(base_stub)


def test_prompt_matches_hf_prompt_ids(base_case, base_stub, hf_base):
    """(d) prompt: HF generate(prompt_ids=get_prompt_ids(prompt)), which strips the prompt from its output."""
    pcm = read_clip("sample")
    prompt_ids = hf_base.prompt_ids(PROMPT).tolist()
    assert prompt_ids[0] == hf_base.specials.sot_prev and len(prompt_ids) > 3
    language, _ = hf_base.detect(pcm)
    want = hf_base.short_form(pcm, language=language, prompt=PROMPT)
    assert want[0] != hf_base.specials.sot_prev and want[: len(prompt_ids) - 1] != prompt_ids[1:]
    got = base_case("prompt")
    assert (got.final.finish_reason, got.final.language) == (STOP, language)
    assert without_end(got.tokens, hf_base.specials.eot) == want
    unprompted = base_case("segments")  # the same clip without a prompt reads differently
    assert got.text != unprompted.text
    assert_all_blocks_free(base_stub)


def test_segment_timestamps_match_hf(base_case, base_stub, hf_base):
    """(e) timestamps=SEGMENT on a 7.3 s clip: HF generate(return_timestamps=True, return_segments=True)
    segments; an end HF puts past the audio (a window of 3000 frames) is clipped to its length."""
    pcm = read_clip("sample")
    duration = len(pcm) / RATE
    want = hf_base.segments(pcm, language="en")
    got = base_case("segments")
    assert got.final.finish_reason == STOP and len(want) >= 2
    assert [s.id for s in got.segments] == list(range(len(want)))
    for ours, theirs in zip(got.segments, want, strict=True):
        assert list(ours.tokens) == theirs.tokens
        assert ours.seek == theirs.seek == 0
        assert ours.start == pytest.approx(min(theirs.start, duration), abs=1e-5)
        assert ours.end == pytest.approx(min(theirs.end, duration), abs=1e-5)
        assert ours.text == hf_base.tokenizer.decode(hf_base.specials.text_tokens(theirs.tokens))
        assert ours.temperature == 0.0 and not ours.words
    assert got.text == "".join(s.text for s in got.segments)
    # the window's ids are streamed whole: here (a lone closing timestamp) its segments' ids, then the end token
    assert without_end(got.tokens, hf_base.specials.eot) == [t for s in want for t in s.tokens]
    assert_all_blocks_free(base_stub)


@pytest.mark.parametrize("case", ["words", "words_late_start"])
def test_word_timestamps_match_hf_token_timestamps(base_case, base_stub, hf_base, case):
    """(f) timestamps=WORD: the segments equal HF's; each word's start / end is within one DTW frame (0.02 s) of
    HF's return_token_timestamps time of the token before its first token / of its last token.

    The window's first word starts at its first generated token's time, which HF's return_token_timestamps always
    sets to 0.0 (it runs the DTW from that token's row); the server runs it from the last prompt token's row, as
    openai-whisper does (word_timing.py), so that one start is compared with HF's same DTW over those rows.
    ``words_late_start`` (speech from 1.2 s) is where the two differ."""
    clip, options = BASE_CASES[case]
    pcm = case_audio(clip)
    want = hf_base.segments(pcm, language=options["language"], words=True)
    got = base_case(case)
    assert got.final.finish_reason == STOP
    assert [list(s.tokens) for s in got.segments] == [s.tokens for s in want]
    checked = 0
    for i, (ours, theirs) in enumerate(zip(got.segments, want, strict=True)):
        assert "".join(w.word for w in ours.words) == ours.text
        expected = hf_word_times(hf_base, theirs, [w.word for w in ours.words], window_first=i == 0)
        for w, (start, end) in zip(ours.words, expected, strict=True):
            assert w.start == pytest.approx(start, abs=WORD_TOLERANCE_S), (w, theirs)
            assert w.end == pytest.approx(end, abs=WORD_TOLERANCE_S), (w, theirs)
            assert 0.0 <= w.start <= w.end <= got.final.duration, w
            assert 0.0 < w.probability <= 1.0
            checked += 1
    assert checked >= 10
    if case == "words_late_start":  # the first word starts in the speech, not at HF's 0.0
        assert got.segments[0].words[0].start >= LEAD_IN_S - 0.3, got.segments[0].words[0]
    assert_all_blocks_free(base_stub)


def test_short_translation_loop_falls_back_under_openai_rules(base_stub):
    """The short translation loop (tests/data/speech/README.md): under HF's rules (the decoder's behaviour before
    openai-whisper's rules were its default) greedy decoding repeats a phrase to the token limit; the default rules
    decode the window again hotter (best_of 5 samples) and keep an attempt without a loop, its numbers in the
    segment."""
    pcm = read_clip("museum_fr")
    looped = transcribe(base_stub, pcm, task="translate")
    assert has_loop(looped.text) and looped.final.usage.completion_tokens > 200, looped.text[:200]
    got = transcribe(base_stub, pcm, task="translate", decoding_rules="openai")
    assert got.final.finish_reason == STOP and got.text.strip() and not has_loop(got.text), got.text
    assert got.final.usage.completion_tokens < looped.final.usage.completion_tokens * 4
    for s in got.segments:  # the window's judgement travels with its segments
        assert s.temperature > 0 and 0 < s.compression_ratio <= 2.4 and s.avg_logprob < 0, s
    assert_all_blocks_free(base_stub)


def test_hallucination_silence_threshold_times_words_it_does_not_send(base_case, base_stub):
    """openai rules' hallucination_silence_threshold times every window's words (over the kept cross KV) to find
    hallucinations after silence; speech without a long silence keeps all its text, and no words are sent."""
    got = base_case("openai_hallucination_silence")
    plain = transcribe(base_stub, case_audio("late:meeting"), language="en", decoding_rules="openai")
    assert got.final.finish_reason == STOP and got.text.strip() and got.text == plain.text
    assert got.segments and not any(s.words for s in got.segments)
    assert_all_blocks_free(base_stub)


# --- 1'. English-only refusals and unknown languages --------------------------------------------------------


def test_english_only_model_speaks_english_only(tiny_stub, hf_tiny):
    """(a') tiny.en: no language = "en" with probability 1 (the transcript = HF's); "de" and translate are refused."""
    pcm = read_clip("sample")
    got = transcribe(tiny_stub, pcm)
    assert (got.final.finish_reason, got.final.language, got.final.language_probability) == (STOP, "en", 1.0)
    assert without_end(got.tokens, hf_tiny.specials.eot) == hf_tiny.short_form(pcm)
    for options, needle in (({"language": "de"}, "'de'"), ({"task": "translate"}, "translate")):
        assert_refused(tiny_stub, pcm, needle, **options)
    assert_all_blocks_free(tiny_stub)


def test_unknown_language_is_refused(base_stub):
    assert_refused(base_stub, read_clip("short"), "'xx'", language="xx")
    assert_refused(base_stub, read_clip("short"), "'summarize'", task="summarize")
    assert_all_blocks_free(base_stub)


def test_probability_options_out_of_range_are_invalid_argument(tiny_stub):
    """no_speech_threshold 5 was taken (a probability never above 5: nothing ever skipped); now refused by name."""
    pcm = read_clip("short")
    needle = "no_speech_threshold must be in [0, 1] (a probability), got 5"
    for rules in ("hf", "openai"):
        assert_refused(tiny_stub, pcm, needle, no_speech_threshold=5, decoding_rules=rules)
    needle = "language_detection_threshold must be in [0, 1] (a probability), got -1"
    assert_refused(tiny_stub, pcm, needle, language_detection_threshold=-1, decoding_rules="openai")
    assert_all_blocks_free(tiny_stub)


def assert_refused(stub, pcm: np.ndarray, needle: str, **options) -> None:
    """INVALID_ARGUMENT whose message holds ``needle``, and no Redis record left behind."""
    request_id = f"refused-{uuid.uuid4().hex[:8]}"
    with pytest.raises(grpc.RpcError) as info:
        transcribe(stub, pcm, request_id, **options)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert needle in info.value.details(), info.value.details()
    with pytest.raises(grpc.RpcError) as missing:
        stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


# --- 2. silence, near silence, short and empty audio ---------------------------------------------------------

SILENCE = {"zeros": lambda: np.zeros(20 * RATE, np.float32), "noise_-60dBFS": lambda: noise(20.0, -60.0, seed=1)}


@pytest.mark.parametrize("rules", ["hf", "openai"])
@pytest.mark.parametrize("vad_filter", [False, True])
@pytest.mark.parametrize("clip", sorted(SILENCE))
@pytest.mark.parametrize("model", [TINY, BASE])
def test_silence_gives_no_text(request, model, clip, vad_filter, rules):
    """HF's rules (with the VAD's check of a window rated silent), vad_filter, and openai's with the VAD gate."""
    stub = stub_of(request, model)
    request_id = f"silence-{uuid.uuid4().hex[:8]}"
    got = transcribe(stub, SILENCE[clip](), request_id, vad_filter=vad_filter, decoding_rules=rules)
    assert got.final.finish_reason == STOP
    # With the VAD nothing is decoded at all: the record still ends FINISHED (QUEUED -> DECODING -> FINISHED).
    assert wait_state(stub, request_id, decoder_pb2.REQUEST_STATE_FINISHED).finish_reason == "stop"
    assert got.text == "" and not got.segments, (got.text, got.segments)
    assert not [t for t in got.tokens if t < EOT[model]], got.tokens  # no text token
    assert got.final.no_speech_prob > 0.6, got.final.no_speech_prob
    assert got.final.duration == pytest.approx(20.0)
    assert_all_blocks_free(stub)


@pytest.mark.parametrize("vad_filter", [False, True])
@pytest.mark.parametrize("model", [TINY, BASE])
def test_short_clip_has_a_defined_result(request, model, vad_filter):
    """The first 0.8 s of sample.wav: STOP; without the VAD the tokens are HF short-form's (language detected)."""
    stub, hf = stub_of(request, model), request.getfixturevalue("hf_base" if model == BASE else "hf_tiny")
    pcm = read_clip("sample")[: int(0.8 * RATE)]
    got = transcribe(stub, pcm, vad_filter=vad_filter)
    assert got.final.finish_reason == STOP and got.final.duration == pytest.approx(0.8)
    if not vad_filter:
        language = hf.detect(pcm)[0] if model == BASE else "en"
        assert got.final.language == language
        assert without_end(got.tokens, hf.specials.eot) == hf.short_form(pcm, language=language)
    for s in got.segments:
        assert 0.0 <= s.start <= s.end <= 0.8 + 1e-6
    assert_all_blocks_free(stub)


def _empty_wav() -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(0, np.float32), RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


EMPTY = {
    "0 bytes": dict(audio=b""),
    "0 PCM samples": dict(pcm=decoder_pb2.PcmAudio(samples=b"", sample_rate=RATE)),
    "WAV of 0 frames": dict(audio=_empty_wav()),
}


@pytest.mark.parametrize("options", [{}, {"vad_filter": True, "timestamps": SEGMENT}], ids=["plain", "vad"])
@pytest.mark.parametrize("case", sorted(EMPTY))
@pytest.mark.parametrize("model", [TINY, BASE])
def test_empty_audio_is_invalid_argument(request, model, case, options):
    stub = stub_of(request, model)
    request_id = f"empty-{uuid.uuid4().hex[:8]}"
    req = decoder_pb2.GenerateRequest(
        request_id=request_id, whisper=decoder_pb2.WhisperOptions(**options), **EMPTY[case]
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "empty" in info.value.details() or "no samples" in info.value.details(), info.value.details()
    assert_all_blocks_free(stub)
