"""Whisper long-form algorithm (decoder_svc/whisper/{quality,segments,longform}.py) against HF transformers.

These run the loop under HF's decoding rules (``decoding_rules="hf"``), the mode whose reference HF is; the
openai-whisper rules are tested in tests/decoder/test_whisper_openai_rules.py.

The pieces are compared with HF's own ``WhisperGenerationMixin`` methods called on the same inputs
(``_retrieve_compression_ratio``, ``_retrieve_avg_logprobs``, ``_need_fallback``, ``_retrieve_segment``,
``_prepare_segments`` + ``_prepare_decoder_input_ids``); the whole loop with an HF-backed engine against
HF's long-form ``generate`` on tiny.en over a 67 s clip (the bundled clips twice, 1.5 s of silence between).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch
import torch.nn.functional as F
from transformers import LogitsProcessorList, WhisperFeatureExtractor
from transformers.generation.logits_process import (
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    WhisperNoSpeechDetection,
    WhisperTimeStampLogitsProcessor,
)
from transformers.generation.utils import GenerationMixin
from transformers.models.whisper.generation_whisper import WhisperGenerationMixin as HF

from decoder_svc.whisper.longform import LongFormOptions, LongFormState
from decoder_svc.whisper.quality import FallbackRules, Verdict, avg_logprob, compression_ratio, judge
from decoder_svc.whisper.segments import split_window
from encdec import DATA_DIR
from shared.models.whisper_features import special_token_ids
from shared.models.whisper_specials import WhisperSpecials

TEMPS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
HF_RULES = FallbackRules(decoding_rules="hf")
VOCAB = 51864  # tiny.en


@pytest.fixture(scope="module")
def specials(whisper_model_dir):
    return WhisperSpecials.from_token_ids(special_token_ids(whisper_model_dir), VOCAB)


def test_compression_ratio_matches_hf():
    rng = random.Random(0)
    cases = [[], [50363], [7] * 80, [rng.randrange(50256) for _ in range(120)], [50363, 11, 50400, 50400, 50256]]
    cases.append([1, 2, 3, 4] * 30 + [50256])
    for toks in cases:
        assert compression_ratio(toks, VOCAB) == HF._retrieve_compression_ratio(
            torch.tensor(toks, dtype=torch.long), VOCAB
        )
    assert compression_ratio([7] * 80, VOCAB) > 2.4 > compression_ratio(cases[3], VOCAB)


@pytest.mark.parametrize("temperature", [0.0, 0.6])
def test_avg_logprob_matches_hf(temperature):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(23, 5000, generator=g) * 4  # [N, V] what generate returns: processed / temperature
    tokens = torch.randint(0, 5000, (23,), generator=g)
    tokens[-1] = 50 % 5000  # stands for <|endoftext|>: HF counts it
    hf = HF._retrieve_avg_logprobs(tuple(scores), tokens, temperature)
    scale = temperature if temperature > 0 else 1
    lps = torch.log_softmax(scores * scale, -1).gather(-1, tokens[:, None])[:, 0].tolist()
    assert avg_logprob(lps) == hf.item()
    with pytest.raises(ValueError):
        avg_logprob([])


def _scores_for(tokens, logprob, vocab=VOCAB):
    """``[N, V]`` noisy scores whose softmax gives each chosen token about ``exp(logprob)``."""
    g = torch.Generator().manual_seed(len(tokens))
    p = float(np.exp(logprob))
    scores = torch.randn(len(tokens), vocab, generator=g) * 0.1
    scores[torch.arange(len(tokens)), torch.tensor(tokens)] = float(np.log(p * (vocab - 1) / (1 - p)))
    return scores


@pytest.mark.parametrize("repetitive", [False, True])
@pytest.mark.parametrize("logprob", [-0.2, -6.0])
@pytest.mark.parametrize("no_speech", [0.1, 0.9])
@pytest.mark.parametrize("temperature", [0.0, 0.4])
def test_judge_matches_hf_need_fallback(repetitive, logprob, no_speech, temperature):
    rng = random.Random(2)
    toks = [5, 6, 7, 8] * 15 if repetitive else [rng.randrange(50256) for _ in range(60)]
    toks = [50363, *toks, 50600, 50256]
    scores = _scores_for(toks, logprob)
    rules = FallbackRules(TEMPS, 2.4, -1.0, 0.6, decoding_rules="hf")
    cfg = SimpleNamespace(compression_ratio_threshold=2.4, logprob_threshold=-1.0, no_speech_threshold=0.6)
    detector = WhisperNoSpeechDetection(no_speech_token=50361, begin_index=1)
    detector._no_speech_prob = torch.tensor([no_speech])
    hf_scores = scores / temperature if temperature > 0 else scores
    seq = torch.tensor(toks)
    need, skip = HF._need_fallback(HF, seq, [{"scores": tuple(hf_scores)}], 0, [detector], cfg, VOCAB, temperature)
    lps = torch.log_softmax(scores, -1).gather(-1, seq[:, None])[:, 0].tolist()
    attempt = TEMPS.index(temperature)
    j = judge(toks, lps, no_speech, attempt, rules, VOCAB)
    assert (j.needs_fallback, j.verdict is Verdict.SKIP) == (need, skip)
    assert j.verdict is (Verdict.SKIP if skip else Verdict.RETRY if need else Verdict.ACCEPT)
    # at the last temperature a failing window is taken as it is (generate_with_fallback's loop ends)
    last = judge(toks, lps, no_speech, len(TEMPS) - 1, rules, VOCAB)
    assert last.verdict is (Verdict.SKIP if skip else Verdict.ACCEPT) and last.needs_fallback == need


def test_rules_validation():
    with pytest.raises(ValueError):
        FallbackRules(logprob_threshold=None, decoding_rules="hf")  # no_speech_threshold 0.6 needs it (HF fails there)
    with pytest.raises(ValueError):
        FallbackRules(temperatures=(), decoding_rules="hf")
    with pytest.raises(ValueError):
        LongFormOptions(timestamps=False, rules=HF_RULES)
    with pytest.raises(ValueError):
        LongFormOptions(condition_on_previous_text=False, prompt_condition_type="all-segments", rules=HF_RULES)


T0 = 50363  # <|0.00|> of tiny.en
EOT = 50256
WINDOWS = {
    "pairs_single_ending": [T0, 11, 12, T0 + 250, T0 + 250, 13, T0 + 400, EOT],
    "text_after_last_pair": [T0, 11, T0 + 100, T0 + 120, 12, 13, T0 + 300, T0 + 300, 14, 15],
    "double_timestamp_ending": [T0 + 3, 11, T0 + 100, T0 + 130, 12, T0 + 900, T0 + 910, EOT],
    "three_timestamps": [T0, 11, T0 + 5, T0 + 6, T0 + 7, 12, T0 + 9, EOT],
    "single_ending_only": [T0, 11, 12, T0 + 50, EOT],
    "start_timestamp_only": [T0, 11, 12, EOT],
    "late_start_only": [T0 + 20, 11, 12],
    "no_timestamps": [11, 12, 13, EOT],
    "past_short_window": [T0, 11, T0 + 1200, T0 + 1300, 12],
    "empty": [EOT],
}


@pytest.mark.parametrize("name", sorted(WINDOWS))
@pytest.mark.parametrize(("seek", "num_frames"), [(0, 3000), (2744, 3000), (5272, 1412), (6010, 30)])
def test_split_window_matches_hf(specials, name, seek, num_frames):
    generated = WINDOWS[name]
    seq = generated[:-1] if generated[-1] == EOT else generated  # HF strips the end token first
    hf_segments, hf_advance = HF._retrieve_segment(
        seek_sequence=torch.tensor(seq, dtype=torch.long),
        seek_outputs=[None],
        time_offset=torch.tensor([seek]).to(torch.float64) * 0.02 / 2,
        timestamp_begin=T0,
        seek_num_frames=torch.tensor([num_frames]),
        time_precision=0.02,
        time_precision_features=0.01,
        input_stride=2,
        prev_idx=0,
        idx=0,
        return_token_timestamps=False,
        decoder_input_ids=torch.zeros(1, 1, dtype=torch.long),
    )
    segments, advance = split_window(generated, specials, seek, num_frames)
    assert advance == int(hf_advance)
    got = [(s.seek, s.start, s.end, s.tokens) for s in segments]
    want = [(seek, float(h["start"]), float(h["end"]), h["tokens"].tolist()) for h in hf_segments]
    assert got == want


def test_window_end_of_text_only_window_matches_hf_float32(specials):
    # HF computes int(seek_num_frames * 0.01 / 0.02) in float32: 30 frames give 15 steps, not 14
    for n in range(1, 3001):
        (hf,), _ = HF._retrieve_segment(
            torch.tensor([11, 12]), [None], torch.zeros(1, dtype=torch.float64), T0, torch.tensor([n]),
            0.02, 0.01, 2, 0, 0, False, torch.zeros(1, 1, dtype=torch.long),
        )  # fmt: skip
        (ours,), _ = split_window([11, 12], specials, 0, n)
        assert ours.end == float(hf["end"]), n


def _window(rng, n_text, ending):
    """Synthetic window ids: two segments of text, then a single-timestamp or double-timestamp ending."""
    text = [rng.randrange(50256) for _ in range(n_text)]
    half = n_text // 2
    if ending == "single":
        return [T0, *text[:half], T0 + 600, T0 + 600, *text[half:], T0 + 1200, EOT]
    return [T0, *text[:half], T0 + 600, T0 + 610, *text[half:], T0 + 1200, T0 + 1210, EOT]


def _hf_prompt(specials, segments, initial, condition_type, condition):
    gc = SimpleNamespace(
        prompt_condition_type=condition_type,
        prev_sot_token_id=specials.sot_prev,
        cache_implementation=None,
        pad_token_id=EOT,
    )
    prompt_ids = torch.tensor([specials.sot_prev, *initial]) if initial else None
    current = HF._prepare_segments(prompt_ids, 1, gc)
    current[0] += [{"tokens": torch.tensor(s.tokens)} for s in segments]
    ids, _ = HF._prepare_decoder_input_ids(
        1, torch.tensor([specials.decoder_prompt(timestamps=True)]), current, [0], [condition], prompt_ids, gc,
        SimpleNamespace(max_target_positions=448), "cpu", None, T0, {},
    )  # fmt: skip
    return ids[0].tolist()


@pytest.mark.parametrize(
    ("initial", "condition_type", "condition"),
    [((), "first-segment", True), ((), "first-segment", False), ((300, 301, 302), "first-segment", True),
     ((300, 301, 302), "first-segment", False), ((300, 301, 302), "all-segments", True)],
)  # fmt: skip
def test_prompts_and_fallback_flow_match_hf(specials, initial, condition_type, condition):
    rng = random.Random(3)
    options = LongFormOptions(
        condition_on_previous_text=condition,
        initial_prompt_ids=initial,
        prompt_condition_type=condition_type,
        rules=FallbackRules(
            keep_best_attempt=False, decoding_rules="hf"
        ),  # HF's flow: the last attempt is taken when all fail
    )
    st = LongFormState(specials, 16000 * 200, options)
    # window k is accepted at attempt accept_at[k]; attempt 3 (0.6) leaves the next window unconditioned
    accept_at = [0, 0, 3, 0, 5, 0]
    cond = condition
    for k, attempt in enumerate(accept_at):
        plan = st.next_window()
        assert list(plan.prompt_ids) == _hf_prompt(specials, st.segments, initial, condition_type, cond)
        assert plan.sot_index == len(plan.prompt_ids) - 1 and plan.max_new_tokens == 448 - len(plan.prompt_ids)
        gen = _window(rng, 90, "double" if k % 2 else "single")
        for a in range(attempt):
            r = st.on_result(gen, [-3.0] * len(gen), 0.1)  # avg logprob < -1.0: retry
            assert r.verdict is Verdict.RETRY and r.seek_advance == 0
            retry = st.next_window()
            assert (retry.seek, retry.prompt_ids, retry.attempt, retry.temperature) == (
                plan.seek, plan.prompt_ids, a + 1, TEMPS[a + 1]
            )  # fmt: skip
        lps = [-3.0 if attempt == 5 else -0.1] * len(gen)  # attempt 5 still fails: taken anyway
        r = st.on_result(gen, lps, 0.1)
        assert r.verdict is Verdict.ACCEPT and r.judgement.needs_fallback == (attempt == 5)
        assert r.seek_advance == (3000 if k % 2 == 0 else 2400)  # to the last pair (1200 steps)
        assert all(s.temperature == TEMPS[attempt] for s in r.segments)
        cond = condition and TEMPS[attempt] < 0.5
    assert len(st.next_window().prompt_ids) <= 1 + len(initial) + 223 + 1


def test_skip_and_last_window(specials):
    st = LongFormState(specials, 16000 * 40 + 100, LongFormOptions(rules=HF_RULES))
    plan = st.next_window()
    assert (plan.seek, plan.num_frames, plan.start_sample, plan.num_samples) == (0, 3000, 0, 480000)
    r = st.on_result([T0, 11, EOT], [-2.0] * 3, 0.7)  # low logprob + likely silence
    assert r.verdict is Verdict.SKIP and r.seek_advance == 3000 and not st.segments
    plan = st.next_window()
    assert (plan.seek, plan.num_frames, plan.start_sample, plan.num_samples) == (3000, 1000, 480000, 160100)
    assert plan.time_offset == 30.0
    st.on_result([T0, 11, 12, T0 + 100, EOT], [-0.1] * 5, 0.7)
    assert st.done and st.next_window() is None
    assert [(s.seek, s.start, s.end) for s in st.segments] == [(3000, 30.0, 32.0)]
    with pytest.raises(RuntimeError):
        st.on_result([EOT], [-0.1], 0.0)


# --- end to end against HF long-form generate --------------------------------------------------


@pytest.fixture(scope="module")
def long_clip():
    """``(pcm, features [1, 80, frames])`` of the five clips twice with 1.5 s of silence after each (66.8 s)."""
    gap = np.zeros(24000, np.float32)
    names = ["sample", "meeting", "weather", "numbers", "short"] * 2
    pcm = np.concatenate([x for n in names for x in (sf.read(DATA_DIR / f"{n}.wav", dtype="float32")[0], gap)])
    feats = WhisperFeatureExtractor(feature_size=80)(
        pcm, sampling_rate=16000, return_tensors="pt", truncation=False, padding="longest"
    ).input_features
    return pcm, feats


def _hf_longform(model, feats, rules):
    gc = copy.deepcopy(model.generation_config)
    gc.max_initial_timestamp_index = 50
    torch.manual_seed(0)
    out = model.generate(
        feats, generation_config=gc, return_timestamps=True, return_segments=True, condition_on_prev_tokens=True,
        temperature=rules.temperatures, compression_ratio_threshold=rules.compression_ratio_threshold,
        logprob_threshold=rules.logprob_threshold, no_speech_threshold=rules.no_speech_threshold,
    )  # fmt: skip
    segments = []
    for s in out["segments"][0]:
        start, first = float(s["start"]), int(s["tokens"][0]) if len(s["tokens"]) else 0
        offset = start - (first - T0) * 0.02 if first >= T0 else start  # the window's time_offset
        segments.append((round(offset * 100), start, float(s["end"]), s["tokens"].tolist()))
    return segments, out["sequences"][0].tolist()


def _hf_engine(model, feats, specials, plan):
    """Decodes one WindowPlan as HF's generate_with_fallback does one attempt."""
    seg = F.pad(feats[:, :, plan.seek : plan.seek + plan.num_frames], (0, 3000 - plan.num_frames))  # [1, 80, 3000]
    base = model.generation_config
    gc = copy.deepcopy(base)
    gc.max_initial_timestamp_index = 50
    gc.suppress_tokens = gc.begin_suppress_tokens = None
    gc.do_sample, gc.temperature = plan.temperature > 0, plan.temperature if plan.temperature > 0 else 1.0
    gc.return_dict_in_generate = gc.output_scores = gc.output_logits = True
    gc.max_new_tokens, gc.max_length = plan.max_new_tokens, None
    begin = len(plan.prompt_ids)
    processors = LogitsProcessorList([
        SuppressTokensAtBeginLogitsProcessor(base.begin_suppress_tokens, begin),
        SuppressTokensLogitsProcessor(base.suppress_tokens),
        WhisperTimeStampLogitsProcessor(gc, begin_index=begin),
    ])  # fmt: skip
    ids = torch.tensor([plan.prompt_ids])
    extra = {"decoder_attention_mask": torch.ones_like(ids, dtype=torch.bool)} if ids[0, 0] == specials.sot_prev else {}
    with torch.inference_mode():
        out = GenerationMixin.generate(
            model, seg, generation_config=gc, logits_processor=processors, decoder_input_ids=ids,
            suppress_tokens=None, begin_suppress_tokens=None, **extra,
        )  # fmt: skip
    generated = out.sequences[0, begin:].tolist()
    scale = plan.temperature if plan.temperature > 0 else 1.0
    logprobs = [torch.log_softmax(out.scores[i][0] * scale, -1)[t].item() for i, t in enumerate(generated)]
    assert plan.sot_index == begin - 1  # English-only: the first step's raw logits are at <|startoftranscript|>
    no_speech = torch.softmax(out.logits[0][0].float(), -1)[specials.no_speech].item()
    return generated, logprobs, no_speech


@pytest.mark.parametrize(
    ("temperatures", "logprob_threshold", "no_speech_threshold", "expect"),
    [(TEMPS, -1.0, 0.6, "plain"), ((0.0, 0.6), -0.3, 0.6, "retry"), (TEMPS, -0.34, 0.07, "skip")],
)
def test_longform_matches_hf_generate(
    hf_whisper, long_clip, specials, temperatures, logprob_threshold, no_speech_threshold, expect
):
    """OpenAI's thresholds; a stricter logprob one (a sampled retry, taken at the last temperature 0.6,
    then a window without previous text); one that skips windows as silence."""
    pcm, feats = long_clip
    # HF takes the last attempt when every temperature fails (keep_best_attempt=False; tested on its own below)
    rules = FallbackRules(
        temperatures, 2.4, logprob_threshold, no_speech_threshold, keep_best_attempt=False, decoding_rules="hf"
    )
    want, want_sequence = _hf_longform(hf_whisper, feats, rules)

    st = LongFormState(specials, len(pcm), LongFormOptions(rules=rules))
    assert st.total_frames == feats.shape[-1]
    torch.manual_seed(0)  # the sampled attempts draw the same random numbers as HF's loop
    while (plan := st.next_window()) is not None:
        st.on_result(*_hf_engine(hf_whisper, feats, specials, plan))
    got = [(s.seek, s.start, s.end, s.tokens) for s in st.segments]
    assert got == want
    assert st.tokens == want_sequence

    verdicts = [(r.verdict, r.plan.temperature) for r in st.results]
    if expect == "plain":
        assert all(v is Verdict.ACCEPT for v, _ in verdicts) and len(verdicts) >= 3
    elif expect == "retry":  # a window retried up to a temperature >= 0.5 and the next prompt has no history
        accepted_hot = [i for i, (v, t) in enumerate(verdicts) if v is Verdict.ACCEPT and t >= 0.5]
        assert accepted_hot and st.results[accepted_hot[0] + 1].plan.prompt_ids[0] == specials.sot
    else:
        assert any(v is Verdict.SKIP for v, _ in verdicts) and st.segments


def test_when_every_temperature_fails_the_best_attempt_is_kept(specials):
    """faster-whisper's choice: the highest average logprob among attempts within the compression threshold."""
    rules = FallbackRules((0.0, 0.5, 1.0), 2.4, logprob_threshold=-0.1, no_speech_threshold=None, decoding_rules="hf")
    st = LongFormState(specials, 16000 * 10, LongFormOptions(rules=rules))
    ts = specials.timestamp_begin
    attempts = [
        ([ts, 100, 101, ts + 50, specials.eot], [-0.5] * 5),  # avg -0.5: the best
        ([ts, 200, 201, ts + 50, specials.eot], [-2.0] * 5),
        ([ts, 300, 301, ts + 50, specials.eot], [-3.0] * 5),  # the last: HF would keep this one
    ]
    for i, (ids, lps) in enumerate(attempts):
        plan = st.next_window()
        assert plan.attempt == i and plan.temperature == rules.temperatures[i]
        result = st.on_result(ids, lps, 0.0)
    assert result.verdict is Verdict.ACCEPT and result.generated == attempts[0][0]
    assert result.judgement.temperature == 0.0 and [s.tokens[1:3] for s in st.segments] == [[100, 101]]
    last = LongFormState(
        specials, 16000 * 10, LongFormOptions(rules=dataclasses.replace(rules, keep_best_attempt=False))
    )
    for ids, lps in attempts:
        last.next_window()
        result = last.on_result(ids, lps, 0.0)
    assert result.generated == attempts[2][0] and [s.tokens[1:3] for s in last.segments] == [[300, 301]]
