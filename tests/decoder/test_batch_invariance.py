"""Batched must equal one-at-a-time, bit for bit, on the CPU in float32 and in ``--dtype bfloat16`` (bfloat16 packed
weights and KV; ``DecoderEngine`` over tiny random checkpoints).

A request's tokens and their log-probabilities (``TokenLogprobs``, float32 values compared with ``==``) are the same
whether it runs alone or in a continuous batch whose other members join, finish and are preempted around it, and
after its own recompute-preemption (its self KV rebuilt by a prefill of every token so far, next to other
sequences' decode rows). That holds because every product of a step is the packed kernel (a row's sums do not
depend on the other rows, ``kernels/packed_linear.py``) and every attention call runs one C kernel row per query
(``kernels.cpu_paged_attention.query_rows``). The random weights are large (``random_init``), so a last-bit
difference anywhere shows in the log-probabilities.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.text_checkpoints import sentence
from helpers.text_paged import encode_batch

from decoder_svc.core.engine import DecoderEngine
from decoder_svc.core.sampling_params import SamplingParams
from kernels.packed_linear import bf16_available
from shared.kv_transport import write_blocks
from shared.models.registry import load_model_in, load_tokenizer

BLOCK = 4
NEW = 40


def run(
    model,
    tokenizer,
    sources: dict[str, list[int]],
    kv: dict[str, torch.Tensor],
    num_self_blocks: int,
    params: SamplingParams,
    arrivals: dict[int, list[str]] | None = None,
    cross_dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, list[tuple[int, float]]], int]:
    """Drives a ``DecoderEngine`` to the end, playing the encoder with each source's cross KV ``kv[rid]``;
    ``arrivals``: step -> request ids added then (all at step 0 if None).
    Returns each request's ``(token id, logprob)`` list and the number of preemptions seen."""
    c = model.config
    n_cross = sum(-(-len(s) // BLOCK) for s in sources.values())
    cross = torch.zeros(c.decoder_layers, 2, n_cross, BLOCK, c.num_heads, c.head_dim, dtype=cross_dtype)
    engine = DecoderEngine(model, tokenizer, cross, num_self_blocks=num_self_blocks, block_size=BLOCK)
    preempted = []
    real = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), real(seq))[1]
    arrivals = arrivals or {0: list(sources)}
    out: dict[str, list[tuple[int, float]]] = {rid: [] for rid in sources}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid in arrivals.get(step, []):
            engine.add_request(rid, len(sources[rid]), params)
        result = engine.step()
        for rid, blocks in result.to_encode:
            write_blocks(cross, blocks, kv[rid])
            engine.mark_encoded(rid)
        for o in result.outputs:
            out[o.request_id] += [(t, lp.logprob) for t, lp in zip(o.new_token_ids, o.logprobs)]
        step += 1
    return out, len(preempted)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["bart", "t5"])
def test_alone_batched_and_preempted_runs_are_bit_identical(text_checkpoints, arch, dtype):
    path = text_checkpoints[arch]
    if dtype == "bfloat16" and not bf16_available():
        pytest.skip("this CPU lacks avx512_bf16: --dtype bfloat16 is refused here")
    model, tokenizer = load_model_in(path, dtype, torch.device("cpu")), load_tokenizer(path)
    model.pack_decode_weights()  # as the decoder service loads it (bfloat16: packed_linear_bf16, KV in bfloat16)
    cross_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    rng = random.Random(3)
    sources = {f"r{i}": tokenizer(sentence(rng, 3 + 7 * i))["input_ids"] for i in range(6)}
    # Each source encoded alone, the same cross KV in every run: the decoder's invariance is what is measured here
    # (the encoder's padded batches differ from a source alone in the last bits: tests/encoder/test_encode_batcher.py).
    kv = {rid: encode_batch(model, [src])[0] for rid, src in sources.items()}
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=True)
    per_request = -(-(NEW + 1) // BLOCK)
    alone = {
        rid: run(model, tokenizer, {rid: src}, kv, per_request, params, cross_dtype=cross_dtype)[0][rid]
        for rid, src in sources.items()
    }
    assert all(len(v) == NEW for v in alone.values())
    # Staggered joins in a pool large enough for all: decode rows next to other requests' prefills.
    staggered, none = run(
        model,
        tokenizer,
        sources,
        kv,
        per_request * 6,
        params,
        {2 * i: [rid] for i, rid in enumerate(sources)},
        cross_dtype,
    )
    assert none == 0 and staggered == alone
    # Half the self blocks all six need: sequences are preempted and recomputed while the others decode.
    squeezed, preemptions = run(model, tokenizer, sources, kv, per_request * 3, params, cross_dtype=cross_dtype)
    assert preemptions > 0, "the pool was large enough: no recompute happened"
    assert squeezed == alone
