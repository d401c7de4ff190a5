"""Beam search and n > 1 parallel samples through the real ``DecoderEngine``, against HF ``generate``.

The test plays the encoder service (cross KV written at the reserved blocks,
then ``mark_encoded``) as tests/models/test_text_parity.py and
tests/decoder/test_engine_whisper.py do. Every run ends with all self and cross blocks
free.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.text_checkpoints import sentence
from helpers.text_paged import encode_batch

from decoder_svc.core.engine import CapacityError, DecoderEngine
from decoder_svc.core.sampling_params import SamplingParams
from shared.kv_transport import write_blocks
from shared.models.registry import load_model, load_tokenizer

BLOCK = 5
SCORE_ATOL = 1e-4


def run_engine(
    model,
    tokenizer,
    requests: dict[str, tuple[torch.Tensor, int, SamplingParams]],
    *,
    block_size=BLOCK,
    num_self_blocks=None,
    max_num_seqs=64,
    steps_between=0,
    record=None,
):
    """Runs every request in one engine; ``requests``: id -> (cross KV ``[L, 2, S, H, Dh]``, encoder_len, params).

    ``steps_between``: requests join this many steps apart. Returns id -> index -> {tokens, text, reason, score}
    and asserts every block is free at the end; ``record`` (a dict) gets the engine's ``preemptions``.
    """
    c = model.config
    n_cross = sum(-(-s // block_size) for _, s, _ in requests.values()) + 2
    cross = torch.zeros(c.decoder_layers, 2, n_cross, block_size, c.num_heads, c.head_dim)
    if num_self_blocks is None:
        num_self_blocks = (
            sum(max(p.n, p.num_beams) * -(-(p.max_tokens + 8) // block_size) for _, _, p in requests.values()) + 4
        )
    engine = DecoderEngine(
        model, tokenizer, cross, num_self_blocks=num_self_blocks, block_size=block_size, max_num_seqs=max_num_seqs
    )
    out: dict[str, dict[int, dict]] = {rid: {} for rid in requests}
    queue = list(requests.items())
    step = 0
    while queue or engine.has_unfinished_requests():
        if queue and step % (steps_between + 1) == 0:
            rid, (_, enc_len, params) = queue.pop(0)
            engine.add_request(rid, enc_len, params)
        so = engine.step()
        for rid, blocks in so.to_encode:
            write_blocks(cross, blocks, requests[rid][0])
            engine.mark_encoded(rid)
        for o in so.outputs:
            r = out[o.request_id].setdefault(o.index, {"tokens": [], "text": "", "reason": None, "score": None})
            assert r["reason"] is None, "output after finish"
            r["tokens"] += o.new_token_ids
            r["text"] += o.text
            if o.finished:
                r["reason"], r["score"] = o.finish_reason, o.score
        step += 1
        assert step < 3000
    s = engine.stats()
    assert s["num_free_self_blocks"] == s["num_self_blocks"] and s["num_free_cross_blocks"] == s["num_cross_blocks"]
    assert s["num_running"] == 0 and s["num_waiting"] == 0 and not engine.groups
    if record is not None:
        record["preemptions"] = engine.scheduler.num_preemptions
    return out


def strip_hf(ids: list[int], eos: int, pad: int) -> list[int]:
    """HF output ids after the decoder prompt -> generated ids up to and including the end token."""
    out = []
    for t in ids:
        out.append(t)
        if t == eos:
            break
    while out and out[-1] == pad and pad != eos:
        out.pop()
    return out


# --- BART-shaped text model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bart(text_checkpoints):
    from transformers import AutoModelForSeq2SeqLM

    path = text_checkpoints["bart"]
    model, tokenizer = load_model(path), load_tokenizer(path)
    hf = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    rng = random.Random(5)
    srcs = [tokenizer(sentence(rng, k))["input_ids"] for k in (2, 7, 15)]
    kv = dict(zip(map(str, range(len(srcs))), encode_batch(model, srcs)))
    return model, tokenizer, hf, srcs, kv


def hf_beams(hf, src, max_new, **kw):
    with torch.inference_mode():
        g = hf.generate(
            torch.tensor([src]),
            max_new_tokens=max_new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            **kw,
        )
    cfg = hf.generation_config
    seqs = [strip_hf(s[1:], cfg.eos_token_id, cfg.pad_token_id) for s in g.sequences.tolist()]
    return seqs, g.sequences_scores.tolist()


CASES = [  # (num_beams, n returned, length_penalty, early_stopping, max_new)
    (4, 2, 1.0, False, 12),
    (4, 4, 2.0, True, 10),
    (3, 1, 0.5, False, 14),
]


@pytest.mark.parametrize("num_beams,n,lp,es,max_new", CASES)
def test_bart_beam_search_equals_hf(bart, num_beams, n, lp, es, max_new):
    model, tokenizer, hf, srcs, kv = bart
    params = SamplingParams(max_tokens=max_new, num_beams=num_beams, n=n, length_penalty=lp, early_stopping=es)
    got = run_engine(model, tokenizer, {rid: (kv[rid], len(srcs[int(rid)]), params) for rid in kv}, steps_between=1)
    for rid, src in enumerate(srcs):
        ids, scores = hf_beams(
            hf, src, max_new, num_beams=num_beams, num_return_sequences=n, length_penalty=lp, early_stopping=es
        )
        mine = got[str(rid)]
        assert sorted(mine) == list(range(n))
        assert [mine[i]["tokens"] for i in range(n)] == ids, rid
        for i in range(n):
            assert mine[i]["score"] == pytest.approx(scores[i], abs=SCORE_ATOL)
            stopped = ids[i][-1] == tokenizer.eos_token_id
            assert mine[i]["reason"] == ("stop" if stopped else "length")
            assert mine[i]["text"] == tokenizer.decode(ids[i], skip_special_tokens=True)


def test_bart_beam_search_under_seat_and_block_pressure_equals_hf(bart):
    """Three 4-beam requests on 4 seats and barely one group's worth of self blocks: beams wait for
    seats, get preempted (recompute), and groups drop steps where not all beams ran; the results
    are still HF's."""
    model, tokenizer, hf, srcs, kv = bart
    num_beams, n, lp, es, max_new = CASES[0]
    params = SamplingParams(max_tokens=max_new, num_beams=num_beams, n=n, length_penalty=lp, early_stopping=es)
    per_group = num_beams * -(-max_new // BLOCK)
    record = {}
    got = run_engine(
        model,
        tokenizer,
        {rid: (kv[rid], len(srcs[int(rid)]), params) for rid in kv},
        num_self_blocks=per_group + 2,
        max_num_seqs=num_beams,
        record=record,
    )
    assert record["preemptions"] > 0
    for rid, src in enumerate(srcs):
        ids, scores = hf_beams(
            hf, src, max_new, num_beams=num_beams, num_return_sequences=n, length_penalty=lp, early_stopping=es
        )
        assert [got[str(rid)][i]["tokens"] for i in range(n)] == ids
        assert [got[str(rid)][i]["score"] for i in range(n)] == pytest.approx(scores, abs=SCORE_ATOL)


def test_group_capacity_refused(bart):
    model, tokenizer, _, srcs, _ = bart
    c = model.config
    cross = torch.zeros(c.decoder_layers, 2, 8, BLOCK, c.num_heads, c.head_dim)
    engine = DecoderEngine(model, tokenizer, cross, num_self_blocks=12, block_size=BLOCK, max_num_seqs=4)
    with pytest.raises(CapacityError, match="max_num_seqs"):
        engine.add_request("wide", len(srcs[0]), SamplingParams(num_beams=5, max_tokens=4))
    with pytest.raises(CapacityError, match="self blocks"):
        engine.add_request("long", len(srcs[0]), SamplingParams(temperature=1.0, n=4, max_tokens=40))
    assert not engine.has_unfinished_requests() and not engine.groups


# --- n > 1 parallel samples ----------------------------------------------------------------------


def test_seeded_n_samples_reproducible_alone_and_beside_traffic(bart):
    """Seeded n=3: the same three samples run alone, again, and beside other (unseeded, n > 1, beam)
    requests with a tight seat limit (so forks wait and prefill later); blocks back to baseline each time."""
    model, tokenizer, _, srcs, kv = bart
    seeded = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=12)
    alone = run_engine(model, tokenizer, {"0": (kv["0"], len(srcs[0]), seeded)})["0"]
    assert sorted(alone) == [0, 1, 2] and all(r["reason"] in ("stop", "length") for r in alone.values())
    samples = [alone[i]["tokens"] for i in range(3)]
    assert len({tuple(s) for s in samples}) > 1  # independent generators, not one stream copied
    assert run_engine(model, tokenizer, {"0": (kv["0"], len(srcs[0]), seeded)})["0"] == alone
    mixed = {
        "other": (kv["1"], len(srcs[1]), SamplingParams(temperature=1.3, n=2, max_tokens=10)),
        "beam": (kv["2"], len(srcs[2]), SamplingParams(num_beams=3, max_tokens=8)),
        "0": (kv["0"], len(srcs[0]), seeded),
    }
    for max_num_seqs in (64, 4):
        assert run_engine(model, tokenizer, mixed, max_num_seqs=max_num_seqs)["0"] == alone
    # Sample 0 of a seeded n=3 request is the n=1 request with the same seed.
    one = run_engine(
        model, tokenizer, {"0": (kv["0"], len(srcs[0]), SamplingParams(temperature=1.0, seed=11, max_tokens=12))}
    )["0"]
    assert one[0] == alone[0]


# --- Whisper tiny.en -------------------------------------------------------------------------------

WHISPER_CLIPS = ["short.wav", "weather.wav"]


def test_whisper_beam_search_equals_hf(whisper_model_dir, whisper_features, hf_whisper):
    """num_beams=2 on two bundled clips, both in one engine, equals HF Whisper ``generate(num_beams=2)``.

    HF's Whisper ``generate`` repeats the input ``num_return_sequences`` times and returns each
    copy's best beam, so only the best beam (n=1) is comparable there; the n-best list is
    checked against HF on BART above.
    """
    model, tokenizer = load_model(whisper_model_dir), load_tokenizer(whisper_model_dir)
    feats = torch.stack([whisper_features[c] for c in WHISPER_CLIPS])
    with torch.inference_mode():
        cross = model.compute_cross_kv(model.encode(feats))  # [L, 2, B, 1500, H, Dh]
    params = SamplingParams(num_beams=2, length_penalty=1.0)
    got = run_engine(
        model,
        tokenizer,
        {c: (cross[:, :, i], 1500, params) for i, c in enumerate(WHISPER_CLIPS)},
        block_size=16,
        num_self_blocks=2 * 2 * 28 + 4,
    )
    for clip in WHISPER_CLIPS:
        with torch.inference_mode():
            g = hf_whisper.generate(
                whisper_features[clip][None],
                num_beams=2,
                length_penalty=1.0,
                return_dict_in_generate=True,
                output_scores=True,
            )
        expected = strip_hf(g.sequences[0, 2:].tolist(), 50256, 50256)
        mine = got[clip][0]
        assert mine["tokens"] == expected, clip
        assert mine["reason"] == "stop" and mine["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert mine["score"] == pytest.approx(float(g.sequences_scores[0]), abs=SCORE_ATOL)
