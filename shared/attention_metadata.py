"""Per-step inputs of paged attention, built by the decoder's model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.attention_backends.base import AttentionBackend
from kernels.attention_backends.torch_backend import TorchAttentionBackend


@dataclass
class AttentionMetadata:
    """Describes one decode step over a flat (varlen) batch.

    A step carries ``T`` query tokens from ``B`` sequences laid end to end:
    sequence ``b`` owns tokens ``query_start_loc[b]:query_start_loc[b+1]``
    (several for a prefill or a recompute after preemption, one for a decode
    step). KV caches have the layout
    ``[num_layers, 2, num_blocks, block_size, num_heads, head_dim]`` (index 0 = K,
    1 = V); slot ``s`` is block ``s // block_size``, offset ``s % block_size``.

    Attributes:
        query_start_loc: ``[B + 1]`` int64, cumulative query lengths (starts at 0).
        slot_mapping: ``[T]`` int64, self-attention cache slot each new token's
            K/V is written to.
        seq_lens: ``[B]`` int64, self-attention context length of each sequence
            after this step (cached tokens + this step's tokens). Query ``i`` of
            sequence ``b`` sits at position ``seq_lens[b] - q_len_b + i`` and
            attends causally to keys ``0..position``.
        block_tables: ``[B, max_num_blocks]`` int64 self-attention block ids,
            padded with 0 past each sequence's blocks.
        cross_block_tables: ``[B, max_num_cross_blocks]`` int64 cross-attention
            block ids, padded with 0.
        encoder_lens: ``[B]`` int64, cross-attention KV length of each sequence
            (every query attends to all of them; no mask inside).
        logits_indices: ``[B]`` int64, index into ``T`` of each sequence's last
            token, whose hidden state is turned into logits.
        max_query_len: longest query run in the batch.
        max_seq_len: longest ``seq_lens`` entry.
        max_encoder_len: longest ``encoder_lens`` entry.
        cross_kv_spans: host-side ``(query_start, query_end, first_slot,
            encoder_len)`` per sequence when every sequence's cross blocks are
            one ascending run of ids, so its cross K/V is the slice
            ``first_slot : first_slot + encoder_len`` of the flat cross cache
            (read in place by ``kernels.cross_attention``); None otherwise.
        attn_backend: the model runner's attention backend, which the model's
            layers call (``write_kv``, ``paged``, ``cross``); its ``prepare``
            has planned this step (``kernels.attention_backend``). Default:
            a ``torch`` backend (metadata built by hand, in tests).
        step_cache: scratch dict for this step only: the backend's ``prepare``
            and the first layer put the step's plan here (query rows, masks,
            index tensors) and every other layer reuses it
            (``kernels.paged_attention``, ``step_cache``).
    """

    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    cross_block_tables: torch.Tensor
    encoder_lens: torch.Tensor
    logits_indices: torch.Tensor
    max_query_len: int
    max_seq_len: int
    max_encoder_len: int
    cross_kv_spans: list[tuple[int, int, int, int]] | None = None
    attn_backend: AttentionBackend = field(default_factory=TorchAttentionBackend)
    step_cache: dict = field(default_factory=dict)

    @property
    def attention_backend(self) -> str:
        """The backend's name: ``torch`` or ``triton``."""
        return self.attn_backend.name

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def query_lens(self) -> torch.Tensor:
        """``[B]`` int64 number of query tokens of each sequence."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]
