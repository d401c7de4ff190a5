"""WhisperOptions -> WhisperJob: defaults, language names and codes, the prompt cut, what long-form refuses,
the decoding rules and the options only openai-whisper's loop has."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from decoder_svc.whisper.options import DEFAULT_TEMPERATURES, LONG_FORM_REFUSED, OPENAI_ONLY, parse_whisper_options
from shared.errors import InvalidRequestError
from shared.models.registry import resolve_model
from shared.models.whisper_features import special_token_ids
from shared.models.whisper_specials import WhisperSpecials
from shared.proto import decoder_pb2 as pb

SHORT = np.zeros(16000 * 5, np.float32)
LONG = np.zeros(16000 * 40, np.float32)


def specials(name: str) -> WhisperSpecials:
    d = resolve_model(name)[1]
    cfg = json.loads((d / "config.json").read_text())
    vocab = 51865 if name == "whisper-base" else 51864
    return WhisperSpecials.from_token_ids(special_token_ids(d), vocab, cfg.get("lang_ids"), cfg.get("alignment_heads"))


@pytest.fixture(scope="module")
def base():
    return specials("whisper-base")


@pytest.fixture(scope="module")
def tiny():
    return specials("whisper-tiny.en")


def words(text: str) -> list[int]:
    return [1000 + i for i, _ in enumerate(text.split())]


def parse(sp, options=None, sampling=None, pcm=SHORT, rules="openai"):
    return parse_whisper_options(
        options or pb.WhisperOptions(), sp, words, pcm, sampling or pb.SamplingParams(), decoding_rules=rules
    )


def test_defaults_are_openai_transcribe(base, tiny):
    job = parse(base)
    assert job.language is None and job.task == "transcribe" and job.timestamps == "none"
    assert job.rules.temperatures == DEFAULT_TEMPERATURES and job.condition_on_previous_text
    assert (job.rules.compression_ratio_threshold, job.rules.logprob_threshold, job.rules.no_speech_threshold) == (
        2.4,
        -1.0,
        0.6,
    )
    assert (
        job.rules.decoding_rules == "openai" and job.rules.best_of == 5 and job.rules.prompt_reset_on_temperature == 0.5
    )
    # every request runs the window loop with its fallback; the VAD gate hears nothing in silence: no clip
    assert job.long_form and not job.token_stream and job.clips == [] and job.features is None
    assert parse(tiny).language == "en"  # English-only: nothing to detect
    assert parse(base, sampling=pb.SamplingParams(temperature=0.5)).rules.temperatures == (0.5,)
    hf = parse(base, rules="hf")  # HF generate: a short clip is one window streamed token by token
    assert hf.rules.decoding_rules == "hf" and not hf.long_form and hf.token_stream and hf.clips is None
    assert parse(base, pb.WhisperOptions(decoding_rules="HF")).rules.decoding_rules == "hf"  # the request wins
    assert parse(base, pb.WhisperOptions(decoding_rules="openai"), rules="hf").rules.decoding_rules == "openai"


def test_a_token_level_setting_keeps_a_short_clip_token_streamed(base):
    job = parse(base, sampling=pb.SamplingParams(top_k=5))
    assert job.token_stream and not job.long_form
    job = parse(base, sampling=pb.SamplingParams(repetition_penalty=1.2, no_repeat_ngram_size=3))
    assert job.long_form  # these two hold in the window loop too


def test_vad_gate_and_clip_timestamps_give_the_clips(base):
    rng = np.random.default_rng(0)
    assert parse(base, pb.WhisperOptions(vad_gate=False), pcm=LONG).clips is None
    job = parse(base, pb.WhisperOptions(vad_gate=False, clip_timestamps=[1.0, 5.5, 20]), pcm=LONG)
    assert job.clips == [(100, 550), (2000, 4000)]
    # with the gate too: the clips within the speech it finds (noise holds none)
    noise = (rng.standard_normal(len(LONG)) * 0.01).astype(np.float32)
    assert parse(base, pb.WhisperOptions(clip_timestamps=[1.0, 5.5]), pcm=noise).clips == []
    assert parse(base, pb.WhisperOptions(vad_filter=True, vad_gate=True), pcm=noise).clips is None  # joined already


def test_segment_times_are_cut_to_the_gates_speech(base):
    """A segment that closes a clip ends where the VAD heard speech end, not in the silence the gate padded the
    clip with (the bench's words in gaps); without the gate, or over no region, times are left as they are."""
    job = parse(base, pb.WhisperOptions(vad_gate=False), pcm=LONG)
    assert job.speech_span(1.0, 9.5) == (1.0, 9.5)
    job.gate_regions = [(16000, 80000), (96000, 160000), (480000, 512000)]  # 1-5 s, 6-10 s, 30-32 s
    assert job.speech_span(0.2, 9.96) == (1.0, 9.96)  # inside the regions' hull: only the lead-in is cut
    assert job.speech_span(6.5, 10.87) == (6.5, 10.0)  # ends 0.87 s into the gap after 10 s: cut at 10 s
    assert job.speech_span(29.1, 33.0) == (30.0, 32.0)
    assert job.speech_span(12.0, 20.0) == (12.0, 20.0)  # no speech under it: as it is
    assert job.speech_span(4.0, 4.0) == (4.0, 4.0)


def test_segment_messages_cut_segments_and_their_words_to_the_gates_speech(base):
    """``segment_output.segment_messages`` sends a cut segment's start and end, and each word's, inside the speech
    the gate heard: a first word timed from the window's lead-in starts where the speech does (even in a segment
    the gate left whole), a word of a cut segment that lies in the silence after the speech is clamped to the
    segment's new end, and a word within the speech keeps its times."""
    from decoder_svc.whisper.segment_output import segment_messages
    from decoder_svc.whisper.segments import Segment
    from decoder_svc.whisper.word_timing import WordTiming

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return " " + " ".join(f"w{i}" for i in ids)

    job = parse(base, pb.WhisperOptions(vad_gate=False), pcm=LONG)
    job.gate_regions = [(16000, 80000), (96000, 160000)]  # speech at 1-5 s and 6-10 s
    cut = Segment(seek=0, start=0.2, end=5.8, tokens=[440, 441, 442])  # lead-in before 1 s, silence after 5 s
    whole = Segment(seek=0, start=6.0, end=10.0, tokens=[443])  # exactly the second region: not cut
    words = [
        [
            WordTiming(" w440", [440], 0.2, 1.4, 0.9),  # from the window's start: starts at the speech
            WordTiming(" w441", [441], 2.0, 3.0, 0.8),  # within the speech: as it is
            WordTiming(" w442", [442], 5.2, 5.6, 0.7),  # in the silence after it (no region): the segment's end
        ],
        [WordTiming(" w443", [443], 5.5, 6.4, 0.6)],  # timed from before its speech: starts at 6 s
    ]
    message = segment_messages("r", job, Tokenizer(), [cut, whole], words, 0)
    first, second = message.segments
    assert (first.start, first.end) == pytest.approx((1.0, 5.0))
    assert [t for w in first.words for t in (w.start, w.end)] == pytest.approx([1.0, 1.4, 2.0, 3.0, 5.0, 5.0])
    assert (second.start, second.end) == pytest.approx((6.0, 10.0))
    assert [t for w in second.words for t in (w.start, w.end)] == pytest.approx([6.0, 6.4])
    assert message.text == " w440 w441 w442 w443"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (pb.WhisperOptions(decoding_rules="whisperx"), "decoding_rules must be one of openai, hf"),
        (pb.WhisperOptions(best_of=0), r"best_of must be in \[1, 16\]"),
        (pb.WhisperOptions(best_of=99), r"best_of must be in \[1, 16\]"),
        (pb.WhisperOptions(prompt_reset_on_temperature=2.0), r"prompt_reset_on_temperature must be in \[0, 1\]"),
        (pb.WhisperOptions(hallucination_silence_threshold=-1), "hallucination_silence_threshold must be seconds"),
        (pb.WhisperOptions(vad_gate_min_silence_s=float("nan")), "vad_gate_min_silence_s must be seconds"),
        (pb.WhisperOptions(language_detection_segments=0), r"language_detection_segments must be in \[1, 20\]"),
        (
            pb.WhisperOptions(language_detection_threshold=1.5),
            r"language_detection_threshold must be in \[0, 1\] \(a prob",
        ),
        (pb.WhisperOptions(no_speech_threshold=5), r"no_speech_threshold must be in \[0, 1\] \(a probability\), got 5"),
        (pb.WhisperOptions(clip_timestamps=[5, 2]), "clip_timestamps must be increasing"),
        (pb.WhisperOptions(clip_timestamps=[0, 5, 3, 8]), "clip_timestamps must be increasing"),
        (pb.WhisperOptions(clip_timestamps=[-1, 5]), "clip_timestamps must be seconds >= 0"),
    ],
)
def test_bad_openai_options_are_refused_with_a_message(base, options, named):
    with pytest.raises(InvalidRequestError, match=named):
        parse(base, options, pcm=LONG)


@pytest.mark.parametrize("name", [*OPENAI_ONLY, "clip_timestamps"])
def test_hf_rules_refuse_what_only_openai_whisper_has(base, name):
    value = {"best_of": 2, "vad_gate": True, "language_detection_segments": 2, "clip_timestamps": [1.0]}.get(name, 0.5)
    with pytest.raises(InvalidRequestError, match=f"{name} is an option of openai-whisper's decoding rules"):
        parse(base, pb.WhisperOptions(decoding_rules="hf", **{name: value}))
    parse(base, pb.WhisperOptions(decoding_rules="hf", vad_gate=False))  # turning the gate off is no option at all


@pytest.mark.parametrize(("given", "code"), [("de", "de"), (" DE ", "de"), ("German", "de"), ("english", "en")])
def test_language_codes_and_names(base, given, code):
    assert parse(base, pb.WhisperOptions(language=given)).language == code


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (pb.WhisperOptions(language="xx"), "unknown language 'xx'"),
        (pb.WhisperOptions(language="x" * 300), "300 characters"),
        (pb.WhisperOptions(task="summarize"), "task must be"),
        (pb.WhisperOptions(temperatures=[1.5]), "temperature must be in [0, 1]"),
        (pb.WhisperOptions(temperatures=[float("nan")]), "temperature must be in [0, 1]"),
        (pb.WhisperOptions(logprob_threshold=float("inf")), "logprob_threshold must be a finite number"),
        (pb.WhisperOptions(no_speech_threshold=5), "no_speech_threshold must be in [0, 1] (a probability), got 5"),
        (pb.WhisperOptions(no_speech_threshold=-0.25), "no_speech_threshold must be in [0, 1] (a probability)"),
        (pb.WhisperOptions(no_speech_threshold=float("nan")), "no_speech_threshold must be in [0, 1]"),
        (pb.WhisperOptions(decoding_rules="hf", no_speech_threshold=1.5), "no_speech_threshold must be in [0, 1]"),
        (pb.WhisperOptions(prompt="x" * 5000), "prompt is 5000 characters"),
    ],
)
def test_bad_options_are_refused_with_a_message(base, options, named):
    with pytest.raises(InvalidRequestError, match=re.escape(named)):
        parse(base, options)


@pytest.mark.parametrize("value", [0.0, 0.6, 1.0])
def test_no_speech_threshold_takes_every_probability(base, value):
    options = pb.WhisperOptions(no_speech_threshold=value, timestamps=pb.TIMESTAMP_GRANULARITY_SEGMENT)
    assert parse(base, options).rules.no_speech_threshold == pytest.approx(value)


def test_english_only_model_refuses_other_languages_and_translate(tiny):
    with pytest.raises(InvalidRequestError, match="English-only"):
        parse(tiny, pb.WhisperOptions(language="de"))
    with pytest.raises(InvalidRequestError, match="cannot translate"):
        parse(tiny, pb.WhisperOptions(task="translate"))


def test_prompt_keeps_its_last_223_ids_in_every_mode(base):
    prompt = " ".join(f"w{i}" for i in range(500))
    for pcm, options in ((SHORT, {}), (LONG, {}), (SHORT, {"timestamps": pb.TIMESTAMP_GRANULARITY_SEGMENT})):
        job = parse(base, pb.WhisperOptions(prompt=prompt, **options), pcm=pcm)
        assert job.prompt_ids == words(prompt)[-223:]


def test_long_form_takes_the_whole_clips_features(base):
    job = parse(base, pcm=LONG)
    assert job.long_form and job.features.shape == (80, len(LONG) // 160)


@pytest.mark.parametrize("name", [*LONG_FORM_REFUSED, "stop", "stop_token_ids"])
def test_long_form_refuses_token_level_sampling(base, name):
    value = {"stop": ["x"], "stop_token_ids": [5], "logprobs": True, "ignore_eos": True}.get(name, 1)
    if name in ("top_p", "min_p"):
        value = 0.5
    if name == "include_stop_str_in_output":
        value = True
    sampling = pb.SamplingParams(**{name: value})
    with pytest.raises(InvalidRequestError, match=f"sampling.{name} is not supported with long-form"):
        parse(base, sampling=sampling, pcm=LONG)
    parse(base, sampling=sampling)  # short-form takes it


def test_words_are_aligned_over_openai_whispers_sequence_under_its_rules(base):
    """openai rules: words are timed over openai-whisper's ``find_alignment`` sequence (sot sequence,
    ``<|notimestamps|>``, the text tokens, ``<|endoftext|>``: no previous text, no timestamps); hf rules: over the
    window's whole decode, as HF's token timestamps."""
    from decoder_svc.whisper.segment_output import alignment_sequence

    sp = base
    prompt = [sp.sot_prev, 1000, 1001, sp.sot, sp.languages["en"], sp.transcribe]
    generated = [sp.timestamp_begin, 2000, 2001, sp.timestamp_begin + 50, sp.timestamp_begin + 50, 2002,
                 sp.timestamp_begin + 90, sp.eot]  # fmt: skip
    want = ([sp.sot, sp.languages["en"], sp.transcribe, sp.no_timestamps], [2000, 2001, 2002, sp.eot])
    assert alignment_sequence(parse(base), prompt, 3, generated) == want
    cut = generated[:3]  # a window cut by max_tokens: no <|endoftext|> decoded
    assert alignment_sequence(parse(base), prompt, 3, cut) == (want[0], [2000, 2001, sp.eot])
    untimed = [*prompt, sp.no_timestamps]  # a window decoded without timestamps: <|notimestamps|> once
    assert alignment_sequence(parse(base), untimed, 3, [2000, sp.eot]) == (want[0], [2000, sp.eot])
    assert alignment_sequence(parse(base, rules="hf"), prompt, 3, generated) == (prompt, generated)
