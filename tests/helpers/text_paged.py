"""Test harness: a text model through its paged decoder path, without the services.

``teacher_forced_logits`` encodes a padded batch of sources, writes each one's
cross-attention KV into a pool at shuffled block ids, then runs every decoder
sequence as one flat varlen prefill (so the paged self-attention, its block
tables and the T5 position bias see several sequences of different lengths at
once). ``engine_greedy`` decodes sources in one continuous batch through the
real ``DecoderEngine``, playing the encoder service.
"""

from __future__ import annotations

import random

import torch

from decoder_svc.core.engine import DecoderEngine
from decoder_svc.core.sampling_params import SamplingParams
from shared.attention_metadata import AttentionMetadata
from shared.kv_transport import write_blocks

BLOCK = 7  # KV block size of engine_greedy (divides no source length on purpose)


def _pad(rows: list[list[int]], value: int = 0) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def encode_batch(model, sources: list[list[int]]) -> list[torch.Tensor]:
    """Padded encoder batch -> each source's cross KV ``[L, 2, S_i, H, Dh]``."""
    device = next(model.parameters()).device
    ids = _pad(sources).to(device)
    mask = _pad([[1] * len(s) for s in sources]).to(device)
    kv = model.compute_cross_kv(model.encode(ids, mask))  # [L, 2, B, S, H, Dh]
    return [kv[:, :, i, : len(s)] for i, s in enumerate(sources)]


def teacher_forced_logits(
    model, sources: list[list[int]], targets: list[list[int]], block_size: int = 5, seed: int = 0
) -> list[torch.Tensor]:
    """Logits ``[len(target_i), V]`` of every decoder position of every pair, in one paged step."""
    c = model.config
    rng = random.Random(seed)
    cross = encode_batch(model, sources)
    n_cross = [-(-len(s) // block_size) for s in sources]
    n_self = [-(-len(t) // block_size) for t in targets]
    cross_ids, self_ids = list(range(sum(n_cross))), list(range(sum(n_self)))
    rng.shuffle(cross_ids)
    rng.shuffle(self_ids)
    shape = (c.decoder_layers, 2, None, block_size, c.num_heads, c.head_dim)
    cross_cache = torch.zeros(*shape[:2], sum(n_cross), *shape[3:], dtype=model.dtype)
    self_cache = torch.zeros(*shape[:2], sum(n_self), *shape[3:], dtype=model.dtype)
    ctabs, stabs, ids, pos, slots, qsl = [], [], [], [], [], [0]
    for i, (src, tgt) in enumerate(zip(sources, targets)):
        cb = [cross_ids.pop() for _ in range(n_cross[i])]
        sb = [self_ids.pop() for _ in range(n_self[i])]
        ctabs.append(cb)
        stabs.append(sb)
        for p in range(len(src)):
            cross_cache[:, :, cb[p // block_size], p % block_size] = cross[i][:, :, p]
        ids += tgt
        pos += range(len(tgt))
        slots += [sb[p // block_size] * block_size + p % block_size for p in range(len(tgt))]
        qsl.append(qsl[-1] + len(tgt))
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl),
        slot_mapping=torch.tensor(slots),
        seq_lens=torch.tensor([len(t) for t in targets]),
        block_tables=_pad(stabs),
        cross_block_tables=_pad(ctabs),
        encoder_lens=torch.tensor([len(s) for s in sources]),
        logits_indices=torch.tensor(qsl[1:]) - 1,
        max_query_len=max(len(t) for t in targets),
        max_seq_len=max(len(t) for t in targets),
        max_encoder_len=max(len(s) for s in sources),
    )
    hidden = model(torch.tensor(ids), torch.tensor(pos), md, self_cache, cross_cache)  # [T, d]
    logits = model.compute_logits(hidden)  # [T, V]
    return [logits[a:b] for a, b in zip(qsl[:-1], qsl[1:])]


def engine_greedy(model, tokenizer, srcs: list[list[int]], max_new: int) -> list[list[int]]:
    """All sources in one continuous batch through ``DecoderEngine``; generated ids (end token included)."""
    c = model.config
    n_cross = sum(-(-len(s) // BLOCK) for s in srcs) + 3
    cross = torch.zeros(c.decoder_layers, 2, n_cross, BLOCK, c.num_heads, c.head_dim)
    engine = DecoderEngine(
        model, tokenizer, cross, num_self_blocks=len(srcs) * (-(-(max_new + 2) // BLOCK)) + 3, block_size=BLOCK
    )
    kv = dict(zip(map(str, range(len(srcs))), encode_batch(model, srcs)))
    for i, s in enumerate(srcs):
        engine.add_request(str(i), len(s), SamplingParams(max_tokens=max_new))
    out = {str(i): [] for i in range(len(srcs))}
    while engine.has_unfinished_requests():
        step = engine.step()
        for rid, blocks in step.to_encode:
            write_blocks(cross, blocks, kv[rid])
            engine.mark_encoded(rid)
        for o in step.outputs:
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(srcs))]
