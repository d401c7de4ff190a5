"""WhisperOptions -> WhisperJob: defaults, language names and codes, the prompt cut, what long-form refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest

from decoder_svc.whisper.options import DEFAULT_TEMPERATURES, LONG_FORM_REFUSED, parse_whisper_options
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


def parse(sp, options=None, sampling=None, pcm=SHORT):
    return parse_whisper_options(options or pb.WhisperOptions(), sp, words, pcm, sampling or pb.SamplingParams())


def test_defaults_are_openai_transcribe(base, tiny):
    job = parse(base)
    assert job.language is None and job.task == "transcribe" and job.timestamps == "none"
    assert job.rules.temperatures == DEFAULT_TEMPERATURES and job.condition_on_previous_text
    assert (job.rules.compression_ratio_threshold, job.rules.logprob_threshold, job.rules.no_speech_threshold) == (
        2.4,
        -1.0,
        0.6,
    )
    assert not job.long_form and job.features is None
    assert parse(tiny).language == "en"  # English-only: nothing to detect
    assert parse(base, sampling=pb.SamplingParams(temperature=0.5)).rules.temperatures == (0.5,)


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
        (pb.WhisperOptions(prompt="x" * 5000), "prompt is 5000 characters"),
    ],
)
def test_bad_options_are_refused_with_a_message(base, options, named):
    with pytest.raises(InvalidRequestError, match=named.replace("[", r"\[").replace("]", r"\]")):
        parse(base, options)


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
    if name in ("top_p", "min_p", "repetition_penalty"):
        value = 0.5
    if name == "include_stop_str_in_output":
        value = True
    sampling = pb.SamplingParams(**{name: value})
    with pytest.raises(InvalidRequestError, match=f"sampling.{name} is not supported with long-form"):
        parse(base, sampling=sampling, pcm=LONG)
    parse(base, sampling=sampling)  # short-form takes it
