"""DecoderEngine on real Whisper tiny.en weights: batching, staggered joins, preemption, HF parity.

The test plays the encoder service: when a step lists a request in
``to_encode`` it writes that clip's cross-attention KV (from the model's own
``compute_cross_kv``) into a plain cross pool tensor at the reserved block ids,
then calls ``mark_encoded`` (some clips one step late, so ENCODING is seen).
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from decoder_svc.core.engine import CapacityError, DecoderEngine
from decoder_svc.core.sampling_params import SamplingParams
from encdec import DATA_DIR
from shared.models.registry import load_model
from shared.models.whisper import load_tokenizer

DATA = DATA_DIR
CLIPS = sorted(p.name for p in DATA.glob("*.wav"))
BLOCK = 16
ENC_LEN = 1500
CROSS_PER_REQ = -(-ENC_LEN // BLOCK)  # 94


def read_wav(path: Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2, path
        return np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0


@pytest.fixture(scope="module")
def setup(whisper_model_dir, whisper_features, hf_whisper_tokens):
    assert CLIPS, "no clips in encdec/data"
    model = load_model(whisper_model_dir)
    tokenizer = load_tokenizer(whisper_model_dir)
    feats = torch.stack([whisper_features[c] for c in CLIPS])  # [B, 80, 3000]
    cross_kv = model.compute_cross_kv(model.encode(feats))  # [L, 2, B, 1500, H, Dh]
    return model, tokenizer, {c: cross_kv[:, :, i] for i, c in enumerate(CLIPS)}, hf_whisper_tokens


def make_engine(model, tokenizer, num_self_blocks, num_cross_blocks, block_size=BLOCK, **kw):
    c = model.config
    cross = torch.zeros(c.decoder_layers, 2, num_cross_blocks, block_size, c.num_heads, c.head_dim)
    return DecoderEngine(model, tokenizer, cross, num_self_blocks, block_size, **kw), cross


def write_cross(cross, kv, block_ids):
    """Encoder-service stand-in: ``kv`` ``[L, 2, S, H, Dh]`` into the pool at ``block_ids``."""
    bs = cross.shape[3]
    for j, b in enumerate(block_ids):
        seg = kv[:, :, j * bs : (j + 1) * bs]
        cross[:, :, b, : seg.shape[2]] = seg


def drive(engine, cross, kvs, arrivals, late_encode=()):
    """Runs the engine; ``arrivals``: step -> [(request_id, clip, params)]. Returns per-request results."""
    clip_of, results, pending, step = {}, {}, [], 0
    while engine.has_unfinished_requests() or any(s >= step for s in arrivals):
        for rid, clip, params in arrivals.get(step, []):
            engine.add_request(rid, ENC_LEN, params)
            clip_of[rid] = clip
            results[rid] = {"tokens": [], "text": ""}
        for rid in pending:
            engine.mark_encoded(rid)
        pending = []
        out = engine.step()
        for rid, blocks in out.to_encode:
            assert len(blocks) == -(-ENC_LEN // cross.shape[3])
            write_cross(cross, kvs[clip_of[rid]], blocks)
            if rid in late_encode:
                pending.append(rid)
            else:
                engine.mark_encoded(rid)
        for o in out.outputs:
            r = results[o.request_id]
            assert not r.get("finished")
            r["tokens"] += o.new_token_ids
            r["text"] += o.text
            assert o.completion_tokens == len(r["tokens"]) and o.prompt_tokens == 2
            if o.finished:
                r.update(finished=True, reason=o.finish_reason)
        step += 1
        assert step < 2000
    s = engine.stats()
    assert s["num_free_self_blocks"] == s["num_self_blocks"] and s["num_free_cross_blocks"] == s["num_cross_blocks"]
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    return results


def check_against_hf(results, ref, tokenizer, clip_of):
    for rid, r in results.items():
        expected = ref[clip_of[rid]]
        assert r["tokens"] == expected + [50256], rid
        assert r["reason"] == "stop"
        assert r["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert "\ufffd" not in r["text"]


def test_alone_and_staggered_batch_equal_hf(setup):
    model, tokenizer, kvs, ref = setup
    greedy = SamplingParams()
    for clip in (CLIPS[0], CLIPS[-1]):  # alone (HF's reference is per clip too)
        engine, cross = make_engine(model, tokenizer, 64, CROSS_PER_REQ)
        res = drive(engine, cross, kvs, {0: [(clip, clip, greedy)]})
        check_against_hf(res, ref, tokenizer, {clip: clip})
    # All together, joining at different steps, one encoded a step late.
    engine, cross = make_engine(model, tokenizer, 128, CROSS_PER_REQ * len(CLIPS))
    arrivals = {3 * i: [(f"b{i}", c, greedy)] for i, c in enumerate(CLIPS)}
    res = drive(engine, cross, kvs, arrivals, late_encode={"b1"})
    check_against_hf(res, ref, tokenizer, {f"b{i}": c for i, c in enumerate(CLIPS)})


def test_tiny_self_pool_preempts_and_tokens_stay_exact(setup):
    model, tokenizer, kvs, ref = setup
    bs = 8
    max_tokens = max(len(t) for t in ref.values()) + 2  # no clip is cut by it
    need = -(-(2 + max_tokens - 1) // bs)
    params = SamplingParams(max_tokens=max_tokens)
    # Just enough self blocks for the longest request, so sequences preempt each
    # other; the cross pool holds 4 requests, so the fifth waits for cross blocks.
    engine, cross = make_engine(model, tokenizer, need, -(-ENC_LEN // bs) * 4, block_size=bs)
    preempted = []
    orig = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), orig(seq))
    arrivals = {0: [(f"p{i}", c, params) for i, c in enumerate(CLIPS)]}
    res = drive(engine, cross, kvs, arrivals)
    assert preempted, "the tiny pool should have forced preemption"
    check_against_hf(res, ref, tokenizer, {f"p{i}": c for i, c in enumerate(CLIPS)})


def test_seeded_sampling_same_alone_and_batched(setup):
    model, tokenizer, kvs, _ = setup
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7, max_tokens=16)
    engine, cross = make_engine(model, tokenizer, 64, CROSS_PER_REQ)
    alone = drive(engine, cross, kvs, {0: [("s", CLIPS[0], params)]})["s"]
    engine, cross = make_engine(model, tokenizer, 64, CROSS_PER_REQ * len(CLIPS))
    others = SamplingParams(temperature=1.0, max_tokens=12)
    arrivals = {0: [(f"o{i}", c, others) for i, c in enumerate(CLIPS[1:3])], 2: [("s", CLIPS[0], params)]}
    batched = drive(engine, cross, kvs, arrivals)["s"]
    assert batched["tokens"] == alone["tokens"] and batched["text"] == alone["text"]


def test_abort_capacity_and_validation(setup):
    model, tokenizer, kvs, _ = setup
    engine, cross = make_engine(model, tokenizer, 8, CROSS_PER_REQ * 2, max_num_batched_tokens=512)
    with pytest.raises(CapacityError, match="self blocks"):
        engine.add_request("long", ENC_LEN)  # 447 slots need 28 blocks of 16
    with pytest.raises(CapacityError, match="cross blocks"):
        DecoderEngine(model, tokenizer, cross[:, :, :10], 64, BLOCK).add_request("x", ENC_LEN)
    params = SamplingParams(max_tokens=50)
    engine.add_request("a", ENC_LEN, params)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("a", ENC_LEN, params)
    with pytest.raises(ValueError, match="encoder_len"):
        engine.add_request("b", 0, params)
    engine.add_request("b", ENC_LEN, params, prompt_token_ids=[50257, 50362])
    out = engine.step()
    assert [r for r, _ in out.to_encode] == ["a", "b"]
    for rid, blocks in out.to_encode:
        write_cross(cross, kvs[CLIPS[0]], blocks)
        engine.mark_encoded(rid)
    engine.step()
    assert engine.stats()["num_running"] == 2
    assert engine.abort("a") and not engine.abort("a") and not engine.abort("nope")
    assert engine.abort("b")
    assert not engine.mark_encoded("b")  # a late encoder reply for an aborted request
    s = engine.stats()
    assert s == {
        "block_size": BLOCK,
        "num_self_blocks": 8,
        "num_free_self_blocks": 8,
        "num_cross_blocks": 2 * CROSS_PER_REQ,
        "num_free_cross_blocks": 2 * CROSS_PER_REQ,
        "num_running": 0,
        "num_waiting": 0,
        "num_model_steps": 1,
        "num_step_sequences": 2,
    }  # the step that only handed out to_encode ran no model
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="cross_kv_cache shape"):
        DecoderEngine(model, tokenizer, cross[..., :32], 8, BLOCK)
