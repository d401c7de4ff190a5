"""Whisper timestamp rules, language detection and no-speech probability against HF transformers.

``TimestampRules`` is compared with HF ``WhisperTimeStampLogitsProcessor`` (built from a real
``GenerationConfig``) on the real tiny.en and base special tokens: named token histories, random
ones, and logits where the summed timestamp probability wins or loses. The language functions are
compared with HF ``detect_language`` / ``WhisperNoSpeechDetection`` on HF Whisper base's own
logits at ``[<|startoftranscript|>]`` for a bundled English clip and an espeak-ng German clip.
"""

from __future__ import annotations

import random
import shutil
import subprocess

import pytest
import soundfile as sf
import soxr
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import WhisperNoSpeechDetection, WhisperTimeStampLogitsProcessor

from decoder_svc.whisper.language import detect_language, language_probabilities, no_speech_probability
from decoder_svc.whisper.timestamp_rules import TimestampRules
from encdec import DATA_DIR
from encdec.bench.hf_whisper import build_hf_whisper
from shared.models.registry import resolve_model
from shared.models.whisper import WhisperForConditionalGeneration
from shared.models.whisper_features import SAMPLE_RATE, log_mel_spectrogram
from shared.models.whisper_specials import WhisperLanguageError

MODELS = ["whisper-tiny.en", "whisper-base"]
INF = float("-inf")
GERMAN = "Guten Morgen. Heute scheint die Sonne, und wir gehen zusammen in den Park spazieren."


@pytest.fixture(scope="module")
def specials():
    return {n: WhisperForConditionalGeneration.from_pretrained(resolve_model(n)[1]).generation.specials for n in MODELS}


def hf_processor(sp, begin_index, max_initial):
    kw = {"no_timestamps_token_id": sp.no_timestamps, "eos_token_id": sp.eot}
    if max_initial is not None:  # absent attribute = HF's "no cap"
        kw["max_initial_timestamp_index"] = max_initial
    return WhisperTimeStampLogitsProcessor(GenerationConfig(**kw), begin_index=begin_index)


def hf_scores(sp, begin_index, max_initial, rows, scores):
    """HF's output for rows of equal length ([N, V] in, [N, V] out)."""
    return hf_processor(sp, begin_index, max_initial)(torch.tensor(rows, dtype=torch.long).view(len(rows), -1), scores)


def make_logits(kind, sp, gen):
    x = torch.randn(sp.vocab_size, generator=gen) * 2.0  # [V]
    if kind == "timestamps_win":  # 1501 timestamps 4 nats up: their sum beats any text token
        x[sp.timestamp_begin :] += 4.0
    elif kind == "text_wins":
        x[int(torch.randint(0, sp.eot, (1,), generator=gen))] += 30.0
    return x


def prompts(sp):
    """(name, prompt); the second has a <|startofprev|> prefix holding timestamps that begin_index must skip."""
    head = [sp.sot, sp.languages["en"], sp.transcribe] if sp.multilingual else [sp.sot]
    t = sp.timestamp_begin
    return [("plain", head), ("prev", [sp.sot_prev, 440, t + 10, 1029, t + 90, *head])]


def generated(sp):
    t = sp.timestamp_begin
    return {
        "first_step": [],
        "one_timestamp": [t],
        "timestamp_text": [t, 400],
        "open_pair": [t, 400, 500, t + 25],
        "closed_pair": [t, 400, t + 25, t + 25],
        "penultimate_timestamp": [t + 3, 400, t + 20, 401],
        "after_pair_text": [t, 400, t + 25, t + 25, 600],
        "text_only": [400, 401],
        "open_pair_at_30s": [t + 10, 400, t + 1500],
        "closed_pair_at_30s": [t + 10, 400, t + 1500, t + 1500],
    }


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("max_initial", [50, None, 0])
def test_named_histories_match_hf(specials, model, max_initial):
    sp = specials[model]
    gen = torch.Generator().manual_seed(0)
    for prompt_name, prompt in prompts(sp):
        rules = TimestampRules(sp, len(prompt), max_initial)
        for case, tail in generated(sp).items():
            for kind in ("random", "timestamps_win", "text_wins"):
                row, x = prompt + tail, make_logits(kind, sp, gen)
                want = hf_scores(sp, len(prompt), max_initial, [row], x[None].clone())[0]
                got = x.clone()
                rules.apply(got, row)
                torch.testing.assert_close(
                    got, want, rtol=0, atol=0, msg=lambda m, at=f"{prompt_name}/{case}/{kind}": f"{at}: {m}"
                )


def test_rules_semantics(specials):
    """What the rules mean, checked without HF (so a shared misreading of the inputs cannot pass)."""
    sp = specials["whisper-base"]
    t, v = sp.timestamp_begin, sp.vocab_size
    _, prompt = prompts(sp)[0]
    rules, gen = TimestampRules(sp, len(prompt)), torch.Generator().manual_seed(1)
    tails = generated(sp)

    def run(tail, kind="random", boost=None):
        x = make_logits(kind, sp, gen)
        if boost is not None:
            x[boost] += 30.0
        rules.apply(x, prompt + tail)
        return torch.isfinite(x)

    ok = run(tails["first_step"])
    assert not ok[:t].any() and ok[t : t + 51].all() and not ok[t + 51 :].any()
    ok = run(tails["one_timestamp"], "text_wins")
    assert not ok[t:].any() and ok[: sp.eot].all() and not ok[sp.no_timestamps]
    ok = run(tails["open_pair"], boost=sp.eot)  # text banned; <|endoftext|> and the specials above it kept
    assert not ok[: sp.eot].any() and ok[sp.eot : sp.no_timestamps].all() and not ok[sp.no_timestamps]
    assert not ok[t : t + 25].any() and ok[t + 25 :].all()
    ok = run(tails["closed_pair"], "text_wins")
    assert not ok[t:].any() and ok[: sp.eot].all()
    ok = run(tails["penultimate_timestamp"], "text_wins")
    assert not ok[t : t + 21].any() and ok[t + 21 :].all() and ok[: sp.eot].all()
    ok = run(tails["timestamp_text"], "timestamps_win")  # summed timestamp probability wins
    assert not ok[:t].any() and ok[t + 1 :].all()
    ok = run(tails["closed_pair_at_30s"], "text_wins")
    assert not ok[t:].any() and ok[:10].all()
    ok = run(tails["open_pair_at_30s"], boost=v - 1)  # only <|30.00|> may close the pair
    assert not ok[t : v - 1].any() and ok[v - 1]
    x = make_logits("random", sp, gen)
    TimestampRules(sp, len(prompt), None).apply(x, prompt)
    assert torch.isfinite(x[t:]).all() and not torch.isfinite(x[:t]).any()


def random_history(sp, rng, n):
    t, out = sp.timestamp_begin, []
    for _ in range(n):
        r = rng.random()
        if r < 0.45:
            out.append(rng.randrange(0, sp.eot))
        elif r < 0.5:
            out.append(rng.randrange(sp.eot, t))  # specials, <|endoftext|> included
        else:
            last = max((x for x in out if x >= t), default=t)
            out.append(
                min(sp.vocab_size - 1, last + rng.choice([0, 0, 1, 7, 60]))
                if rng.random() < 0.8
                else rng.randrange(t, sp.vocab_size)
            )
    return out


@pytest.mark.parametrize("model", MODELS)
def test_random_histories_match_hf_row_and_batch(specials, model):
    """300 random histories (lengths 0..9 after the prompt); ``apply``, mixed-length ``apply_batch`` and its
    masked (GPU) form vs HF, bit for bit."""
    sp, rng, gen = specials[model], random.Random(7), torch.Generator().manual_seed(7)
    kinds = ("random", "timestamps_win", "text_wins")
    for prompt_name, prompt in prompts(sp):
        rules = TimestampRules(sp, len(prompt))
        rows = [prompt + random_history(sp, rng, rng.randrange(0, 10)) for _ in range(150)]
        x = torch.stack([make_logits(kinds[i % 3], sp, gen) for i in range(len(rows))])  # [N, V]
        want = torch.empty_like(x)
        for length in {len(r) for r in rows}:  # HF takes one length per call
            idx = [i for i, r in enumerate(rows) if len(r) == length]
            want[idx] = hf_scores(sp, len(prompt), 50, [rows[i] for i in idx], x[idx].clone())
        got = x.clone()
        rules.apply_batch(got, rows)  # on the CPU: row by row (slice fills)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, at=prompt_name: f"{at} batch: {m}")
        masks = x.clone()
        rules._apply_batched(masks, rows)  # what a GPU runs: [N, V] masks, no per-row op
        torch.testing.assert_close(masks, want, rtol=0, atol=0, msg=lambda m, at=prompt_name: f"{at} masks: {m}")
        for i in range(0, len(rows), 10):
            one = x[i].clone()
            rules.apply(one, rows[i])
            torch.testing.assert_close(one, want[i], rtol=0, atol=0)
        banned_text = torch.isinf(got[:, : sp.timestamp_begin]).all(-1)
        assert banned_text.any() and not banned_text.all()  # both sides of the summed-probability rule seen


@pytest.mark.parametrize("model", MODELS)
def test_summed_timestamp_rule_near_a_tie_matches_hf(specials, model):
    """Rule 5 on a CPU float32 row is first decided in float64 and left to HF's float32 ops only within
    ``RULE5_MARGIN`` of a tie: rows whose summed timestamp probability sits from 1e-2 down to 1e-8 nats (and
    exactly 0) either side of the likeliest text token, on both paths, against HF bit for bit."""
    from decoder_svc.whisper.timestamp_rules import RULE5_MARGIN

    sp, gen = specials[model], torch.Generator().manual_seed(11)
    prompt = prompts(sp)[0][1]
    t = sp.timestamp_begin
    history = prompt + [t, 400]  # after '<|0.00|> text': every timestamp from <|0.02|> on is allowed
    rules = TimestampRules(sp, len(prompt))
    allowed = sp.vocab_size - (t + 1)
    deltas = [0.0] + [
        sign * d for d in (1e-2, 2 * RULE5_MARGIN, 5e-4, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8) for sign in (1, -1)
    ]
    decisions = set()
    for delta in deltas:
        x = torch.randn(sp.vocab_size, generator=gen)  # text scores well below 10
        x[400] = 10.0
        x[t:] = 10.0 - torch.log(torch.tensor(float(allowed), dtype=torch.float64)).item() + delta
        want = hf_scores(sp, len(prompt), 50, [history], x[None].clone())[0]
        got = x.clone()
        rules.apply(got, history)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, d=delta: f"delta {d}: {m}")
        decisions.add(bool(torch.isinf(got[:t]).all()))
    assert decisions == {True, False}


def test_rules_reject_bad_shapes(specials):
    sp = specials["whisper-tiny.en"]
    rules = TimestampRules(sp, 1)
    with pytest.raises(ValueError, match=r"\[V\]"):
        rules.apply(torch.zeros(2, sp.vocab_size), [sp.sot])
    with pytest.raises(ValueError, match="no timestamp tokens"):
        rules.apply(torch.zeros(sp.timestamp_begin), [sp.sot])
    with pytest.raises(ValueError, match=r"\[1, V\]"):
        rules.apply_batch(torch.zeros(2, sp.vocab_size), [[sp.sot]])
    with pytest.raises(ValueError, match="begin_index"):
        TimestampRules(sp, -1)


# --- language detection and no-speech probability on HF Whisper base ---------------------------


@pytest.fixture(scope="module")
def hf_base(specials):
    model = build_hf_whisper(resolve_model("whisper-base")[1])
    model.generation_config.lang_to_id = {f"<|{c}|>": i for c, i in specials["whisper-base"].languages.items()}
    return model


def _clip(name, tmp_path_factory):
    if name != "german":
        pcm, sr = sf.read(str(DATA_DIR / name), dtype="float32")
        assert sr == SAMPLE_RATE
        return pcm
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed: no German clip to detect")
    path = tmp_path_factory.mktemp("german") / "de.wav"
    subprocess.run(["espeak-ng", "-v", "de", "-w", str(path), GERMAN], check=True, capture_output=True)
    pcm, sr = sf.read(str(path), dtype="float32")
    pcm = pcm.mean(axis=1) if pcm.ndim == 2 else pcm
    return soxr.resample(pcm, sr, SAMPLE_RATE, quality="HQ").astype("float32")


@pytest.mark.parametrize(("clip", "expected"), [("sample.wav", "en"), ("german", "de")])
def test_language_and_no_speech_match_hf(specials, hf_base, tmp_path_factory, clip, expected):
    sp = specials["whisper-base"]
    feats = log_mel_spectrogram(_clip(clip, tmp_path_factory))[None]  # [1, 80, 3000]
    with torch.inference_mode():
        enc = hf_base.get_encoder()(feats)
        hf_id = int(hf_base.detect_language(encoder_outputs=enc)[0])
        logits = hf_base(encoder_outputs=enc, decoder_input_ids=torch.tensor([[sp.sot]])).logits[0, -1]  # [V]

    code, prob = detect_language(logits, sp)
    assert sp.languages[code] == hf_id and code == expected
    probs = language_probabilities(logits, sp)
    assert probs.keys() == sp.languages.keys() and max(probs, key=probs.get) == code
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-5) and probs[code] == pytest.approx(prob, abs=1e-7)
    other = "fr" if code != "fr" else "es"  # ratios are those of the raw logits: softmax over languages only
    want = torch.exp(logits[sp.languages[other]] - logits[hf_id]).item()
    assert probs[other] / probs[code] == pytest.approx(want, rel=1e-4, abs=1e-30)

    proc = WhisperNoSpeechDetection(no_speech_token=sp.no_speech, begin_index=1)
    proc(torch.tensor([[sp.sot]]), logits[None].clone())
    assert no_speech_probability(logits, sp) == pytest.approx(float(proc.no_speech_prob[0]), rel=1e-6, abs=1e-9)
    assert no_speech_probability(logits, sp) < 0.5  # speech


@pytest.mark.parametrize("model", MODELS)
def test_no_speech_matches_hf_on_random_logits(specials, model):
    sp, gen = specials[model], torch.Generator().manual_seed(3)
    for scale in (1.0, 5.0):
        x = torch.randn(sp.vocab_size, generator=gen) * scale
        x[sp.no_speech] += 8.0
        proc = WhisperNoSpeechDetection(no_speech_token=sp.no_speech, begin_index=1)
        proc(torch.tensor([[sp.sot]]), x[None].clone())
        assert no_speech_probability(x, sp) == pytest.approx(float(proc.no_speech_prob[0]), rel=1e-6)
        assert no_speech_probability(x, sp) == pytest.approx(float(torch.softmax(x, 0)[sp.no_speech]), rel=1e-6)


def test_language_errors(specials):
    tiny, base = specials["whisper-tiny.en"], specials["whisper-base"]
    for fn in (detect_language, language_probabilities):
        with pytest.raises(WhisperLanguageError, match="English-only"):
            fn(torch.zeros(tiny.vocab_size), tiny)
        with pytest.raises(ValueError, match=r"\[V\]"):
            fn(torch.zeros(1, base.vocab_size), base)
    with pytest.raises(ValueError, match="out of range"):
        no_speech_probability(torch.zeros(10), base)
