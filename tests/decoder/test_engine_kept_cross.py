"""DecoderEngine hooks for Whisper windows, on real tiny.en weights: kept cross KV, probe logits, row rules.

A sequence added with ``keep_cross`` leaves its cross blocks reserved when it finishes; the next
sequence of the same request id added with ``reuse_cross`` reads them with no Encode and decodes
exactly what a freshly encoded one does; ``release_cross`` / ``abort`` give the blocks back. The
probe returns the raw logits of a prompt position; ``logits_rules`` edits a row's scores.
"""

from __future__ import annotations

import pytest
import torch
from decoder.test_engine_whisper import CLIPS, CROSS_PER_REQ, ENC_LEN, make_engine, write_cross

from decoder_svc.core.sampling_params import SamplingParams
from shared.models.registry import load_model
from shared.models.whisper import load_tokenizer


@pytest.fixture(scope="module")
def tiny(whisper_model_dir, whisper_features, hf_whisper_tokens):
    """tiny.en, its tokenizer, each clip's cross KV ``[L, 2, 1500, H, Dh]`` and HF's greedy tokens per clip."""
    model = load_model(whisper_model_dir)
    feats = torch.stack([whisper_features[c] for c in CLIPS])  # [B, 80, 3000]
    cross_kv = model.compute_cross_kv(model.encode(feats))  # [L, 2, B, 1500, H, Dh]
    kvs = {c: cross_kv[:, :, i] for i, c in enumerate(CLIPS)}
    return model, load_tokenizer(whisper_model_dir), kvs, hf_whisper_tokens


def run(engine, cross, kv, rid, params, prompt=None, **add):
    """Adds one sequence (``params.n`` samples), plays the encoder for it, steps until every sample finished;
    returns (tokens of all samples in output order, outputs, encoded)."""
    engine.add_request(rid, ENC_LEN, params, prompt, **add)
    tokens, outputs, encoded, done = [], [], False, set()
    for _ in range(800):
        out = engine.step()
        for r, blocks in out.to_encode:
            write_cross(cross, kv, blocks)
            engine.mark_encoded(r)
            encoded = True
        for o in out.outputs:
            tokens += o.new_token_ids
            outputs.append(o)
            done |= {o.index} if o.finished else set()
        if len(done) == params.n:
            return tokens, outputs, encoded
    raise AssertionError("did not finish")


def free_counts(engine):
    s = engine.stats()
    return s["num_free_self_blocks"], s["num_free_cross_blocks"]


def test_reuse_of_kept_cross_decodes_as_a_fresh_encode(tiny):
    model, tokenizer, kvs, ref = tiny
    clip = CLIPS[0]
    engine, cross = make_engine(model, tokenizer, 64, CROSS_PER_REQ * 2)
    baseline = free_counts(engine)
    first, _, encoded = run(engine, cross, kvs[clip], "r", SamplingParams(), keep_cross=True)
    assert encoded and first == ref[clip] + [50256]
    assert free_counts(engine) == (baseline[0], baseline[1] - CROSS_PER_REQ)  # cross kept, self freed
    engine.abort("r")
    assert free_counts(engine) == baseline

    first, _, _ = run(engine, cross, kvs[clip], "r", SamplingParams(), keep_cross=True)
    again, _, encoded = run(engine, cross, kvs[clip], "r", SamplingParams(), reuse_cross=True, keep_cross=True)
    assert not encoded and again == first
    assert engine.release_cross("r") and not engine.release_cross("r")
    assert free_counts(engine) == baseline


def test_reuse_without_kept_cross_is_refused(tiny):
    model, tokenizer, _, _ = tiny
    engine, _ = make_engine(model, tokenizer, 64, CROSS_PER_REQ)
    with pytest.raises(ValueError, match="no kept cross KV"):
        engine.add_request("x", ENC_LEN, SamplingParams(), reuse_cross=True)
    with pytest.raises(ValueError, match="num_beams = 1"):
        engine.add_request("y", ENC_LEN, SamplingParams(num_beams=2), keep_cross=True)


def run_group(engine, cross, kv, rid, params, **add):
    """``run`` for n > 1 samples: steps until every index finished; returns ({index: tokens}, encoded)."""
    _, outputs, encoded = run(engine, cross, kv, rid, params, **add)
    tokens: dict[int, list[int]] = {}
    for o in outputs:
        tokens.setdefault(o.index, []).extend(o.new_token_ids)
    return tokens, encoded


def test_samples_share_and_keep_the_kept_cross(tiny):
    """Whisper's best_of: n samples over a window's kept cross KV (one Encode), again over the same KV; the
    samples equal those of a fresh encode with the same seed, and every block comes back at the end."""
    model, tokenizer, kvs, ref = tiny
    clip = CLIPS[0]
    engine, cross = make_engine(model, tokenizer, 64, CROSS_PER_REQ * 2)
    baseline = free_counts(engine)
    first, _, _ = run(engine, cross, kvs[clip], "s", SamplingParams(), keep_cross=True)
    assert first == ref[clip] + [50256]
    hot = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=24)
    kept, encoded = run_group(engine, cross, kvs[clip], "s", hot, reuse_cross=True, keep_cross=True)
    assert not encoded and sorted(kept) == [0, 1, 2]
    assert len({tuple(t) for t in kept.values()}) > 1  # three samples, not three copies
    assert free_counts(engine) == (baseline[0], baseline[1] - CROSS_PER_REQ)  # the cross KV kept once more
    again, encoded = run_group(engine, cross, kvs[clip], "s", hot, reuse_cross=True, keep_cross=True)
    assert not encoded and again == kept
    assert engine.release_cross("s")
    fresh, encoded = run_group(engine, cross, kvs[clip], "f", hot)
    assert encoded and fresh == kept
    assert free_counts(engine) == baseline


def test_probe_logits_are_the_raw_logits_of_that_prompt_position(tiny):
    model, tokenizer, kvs, _ = tiny
    clip = CLIPS[1]
    engine, cross = make_engine(model, tokenizer, 64, CROSS_PER_REQ)
    prompt = list(model.generation.decoder_prompt_ids)  # [sot, notimestamps]
    _, outputs, _ = run(engine, cross, kvs[clip], "p", SamplingParams(max_tokens=2, probe_position=0), prompt)
    probes = [o.probe_logits for o in outputs if o.probe_logits is not None]
    assert len(probes) == 1 and probes[0].shape == (model.config.vocab_size,)
    # Reference: a one-token prompt [sot]: its only position's logits (before any processor).
    _, ref_out, _ = run(engine, cross, kvs[clip], "q", SamplingParams(max_tokens=1, probe_position=0), prompt[:1])
    torch.testing.assert_close(probes[0], ref_out[0].probe_logits, atol=1e-4, rtol=1e-4)


class BanToken:
    """Row rule of the test: bans one token on every step and records the token histories it saw."""

    def __init__(self, token: int) -> None:
        self.token, self.seen = token, []

    def apply(self, scores, token_ids):
        self.seen.append(list(token_ids))
        scores[self.token] = float("-inf")


def test_logits_rules_and_logprobs_before_warpers(tiny):
    model, tokenizer, kvs, ref = tiny
    clip = CLIPS[0]
    engine, cross = make_engine(model, tokenizer, 64, CROSS_PER_REQ)
    banned = ref[clip][0]  # greedy's first token
    rule = BanToken(banned)
    tokens, _, _ = run(engine, cross, kvs[clip], "b", SamplingParams(max_tokens=3, logits_rules=rule))
    assert tokens[0] != banned
    prompt = list(model.generation.decoder_prompt_ids)
    assert rule.seen[0] == prompt and rule.seen[1] == prompt + tokens[:1]
    # Sampling at temperature 2 with a fixed seed: the two logprob modes pick the same tokens (same seed), and
    # the logprob before the warpers is the greedy-scale log_softmax (larger for the top token).
    hot = dict(temperature=2.0, seed=3, max_tokens=4, logprobs=True)
    _, warped, _ = run(engine, cross, kvs[clip], "w", SamplingParams(**hot))
    _, raw, _ = run(engine, cross, kvs[clip], "v", SamplingParams(**hot, logprobs_before_warpers=True))
    assert [o.new_token_ids for o in warped] == [o.new_token_ids for o in raw]
    assert any(abs(a.logprobs[0].logprob - b.logprobs[0].logprob) > 1e-3 for a, b in zip(warped, raw))
