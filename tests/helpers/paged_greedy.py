"""A small greedy-decoding harness that drives the paged Whisper decoder.

Test-only stand-in for the decoder engine: it allocates self- and
cross-attention blocks itself (from shuffled free lists, so block ids are not
contiguous), builds ``AttentionMetadata`` for one flat varlen batch per step,
and picks tokens by argmax with the suppress lists applied as HF does
(``suppress_tokens`` always, ``begin_suppress_tokens`` on the first generated
token).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from shared.attention_metadata import AttentionMetadata


@dataclass
class _Seq:
    tokens: list[int]
    prompt_len: int
    cross_blocks: list[int]
    start_step: int
    self_blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    done: bool = False


def _pad(rows: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)


def build_metadata(
    seqs: list[_Seq], new_tokens: list[int], encoder_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flat ``input_ids``/``positions`` and metadata for ``new_tokens[b]`` new tokens of each seq."""
    ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
    for s, n in zip(seqs, new_tokens):
        start = s.num_computed
        for p in range(start, start + n):
            ids.append(s.tokens[p])
            pos.append(p)
            slots.append(s.self_blocks[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
    q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long),
        block_tables=_pad([s.self_blocks for s in seqs]),
        cross_block_tables=_pad([s.cross_blocks for s in seqs]),
        encoder_lens=torch.full((len(seqs),), encoder_len, dtype=torch.long),
        logits_indices=torch.tensor([e - 1 for e in qsl[1:]], dtype=torch.long),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        max_encoder_len=encoder_len,
    )
    return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), md


def paged_greedy_decode(
    model,
    input_features: torch.Tensor,
    block_size: int = 16,
    max_new_tokens: int | None = None,
    stagger: int = 0,
    seed: int = 0,
    scores: list[list[torch.Tensor]] | None = None,
) -> list[list[int]]:
    """Greedy-decode a batch of clips together through the paged decoder.

    Args:
        model: ``WhisperForConditionalGeneration``.
        input_features: ``[B, num_mel_bins, 3000]``.
        block_size: tokens per KV block (deliberately not a divisor of 1500).
        max_new_tokens: cap on generated tokens (end token included); default
            fills the decoder up to ``max_length``.
        stagger: sequence ``b`` joins at step ``b * stagger``, so prefill and
            decode steps mix in one batch.
        seed: shuffles the block free lists.
        scores: if given, filled with each clip's logits rows (``[V]``
            float32, suppressed tokens at ``-inf``), one per generated token.

    Returns:
        Generated ids of each clip, without the prompt and without the end token
        (as transformers 5 ``generate`` returns them).
    """
    c, g = model.config, model.generation
    rng = random.Random(seed)
    b = input_features.shape[0]
    prompt = list(g.decoder_prompt_ids)
    max_new = max_new_tokens or (g.max_length - len(prompt))

    enc = model.encode(input_features)  # [B, S, d]
    enc_len = enc.shape[1]
    cross_kv = model.compute_cross_kv(enc)  # [L, 2, B, S, H, Dh]
    n_cross = -(-enc_len // block_size)
    cross_ids = list(range(b * n_cross))
    rng.shuffle(cross_ids)
    cross_cache = torch.zeros(c.decoder_layers, 2, b * n_cross, block_size, c.num_heads, c.head_dim, dtype=model.dtype)
    seqs = []
    for i in range(b):
        blocks = cross_ids[i * n_cross : (i + 1) * n_cross]
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(enc_len)])
        flat = cross_cache.view(c.decoder_layers, 2, -1, c.num_heads, c.head_dim)
        flat[:, :, slots] = cross_kv[:, :, i]
        seqs.append(_Seq(tokens=list(prompt), prompt_len=len(prompt), cross_blocks=blocks, start_step=i * stagger))

    n_self = b * -(-(len(prompt) + max_new) // block_size)
    free = list(range(n_self))
    rng.shuffle(free)
    self_cache = torch.zeros(c.decoder_layers, 2, n_self, block_size, c.num_heads, c.head_dim, dtype=model.dtype)
    suppress = torch.tensor(g.suppress_tokens, dtype=torch.long)
    begin_suppress = torch.tensor(g.begin_suppress_tokens, dtype=torch.long)

    if scores is not None:
        scores[:] = [[] for _ in seqs]
    step = 0
    while not all(s.done for s in seqs):
        running = [s for s in seqs if not s.done and s.start_step <= step]
        step += 1
        if not running:
            continue
        new = [len(s.tokens) - s.num_computed for s in running]
        for s in running:
            while len(s.self_blocks) * block_size < len(s.tokens):
                s.self_blocks.append(free.pop())
        input_ids, positions, md = build_metadata(running, new, enc_len, block_size)
        hidden = model(input_ids, positions, md, self_cache, cross_cache)
        logits = model.compute_logits(hidden[md.logits_indices])  # [B_run, V]
        logits[:, suppress] = -float("inf")
        for row, s in enumerate(running):
            s.num_computed = len(s.tokens)
            if len(s.tokens) == s.prompt_len:
                logits[row, begin_suppress] = -float("inf")
            tok = int(logits[row].argmax())
            if scores is not None:
                scores[seqs.index(s)].append(logits[row].clone())
            s.tokens.append(tok)
            n_gen = len(s.tokens) - s.prompt_len
            if tok == g.eos_token_id or n_gen >= max_new:
                s.done = True
                free.extend(s.self_blocks)
                s.self_blocks = []
    out = []
    for s in seqs:
        gen = s.tokens[s.prompt_len :]
        if gen and gen[-1] == g.eos_token_id:
            gen = gen[:-1]
        out.append(gen)
    return out
