"""The attention backend interface: ``prepare`` once per step, then ``write_kv`` / ``paged`` / ``cross`` per layer.

As mini-sglang's attention backends (an abstract class, per-step metadata prepared apart from the layer calls)
and vLLM's forward context (the model reads the backend from the step's metadata): the model runner makes one
backend (``kernels.attention_backend.make_attention_backend``), puts it into every step's
``shared.attention_metadata.AttentionMetadata`` (``attn_backend``) and calls ``prepare`` on it; the models' layers
call ``md.attn_backend.write_kv`` / ``paged`` / ``cross`` and never pick a kernel themselves.

``kernels`` imports nothing of the project outside it, so the metadata is read by duck typing. The attributes
used: ``query_start_loc`` ``[B + 1]``, ``slot_mapping`` ``[T]``, ``seq_lens`` ``[B]``, ``block_tables`` ``[B, M]``,
``cross_block_tables`` ``[B, M']``, ``encoder_lens`` ``[B]`` (int64 tensors), ``max_query_len``, ``max_seq_len``,
``max_encoder_len`` (ints), ``cross_kv_spans`` (list or None), ``num_seqs`` and ``step_cache`` (a dict that lives
for one step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kernels import cpu_paged_attention
from kernels import paged_attention as reference


class AttentionBackend(ABC):
    """Runs a step's paged attention; made once per model runner.

    Args:
        device: the KV caches' device (``torch.device`` or its name), checked by ``check``; None checks the
            machine only.

    Raises:
        ValueError: this backend cannot run here (``check``).
    """

    name: ClassVar[str]

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.check(device)
        self.device = device

    @classmethod
    def check(cls, device: torch.device | str | None = None) -> None:
        """Raises ValueError when this backend cannot run on this machine (or on ``device``); the default runs
        anywhere."""
        return None

    def prepare(self, md) -> None:
        """Plans the step described by ``md`` (an ``AttentionMetadata``) once, for every layer: fills
        ``md.step_cache`` with what the layer calls would otherwise each compute. Calls without it stay correct
        (they plan on first use)."""
        return None

    # Calls of the models' layers: one layer's caches are ``kv`` ``[2 (K, V), num_blocks, block_size, H, D]``.

    def write_kv(self, kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, md) -> None:
        """Writes the step's new self-attention keys and values ``[T, H, D]`` into ``kv`` at ``md.slot_mapping``."""
        self.write_slots(kv[0], kv[1], key, value, md.slot_mapping)

    def paged(
        self, query: torch.Tensor, kv: torch.Tensor, md, *, scale: float, position_bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal self-attention of the step's queries ``[T, H, D]`` over the paged self-attention cache ``kv``
        (its new K/V written first, ``write_kv``); ``position_bias`` ``[H, N]`` is T5's relative position bias.

        Returns:
            ``[T, H, D]`` in the dtype of ``query``.
        """
        return self.paged_attention(
            query,
            kv[0],
            kv[1],
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            causal=True,
            scale=scale,
            max_query_len=md.max_query_len,
            max_context_len=md.max_seq_len,
            position_bias=position_bias,
            step_cache=md.step_cache,
        )

    def cross(self, query: torch.Tensor, kv: torch.Tensor, md, *, scale: float, in_place: bool = False) -> torch.Tensor:
        """Cross-attention of the step's queries ``[T, H, D]`` over the paged cross-attention cache ``kv``: every
        query of sequence ``b`` sees its ``md.encoder_lens[b]`` keys.

        Args:
            in_place: when every sequence's cross blocks are one run (``md.cross_kv_spans``), read each run as a
                slice of the flat cache (``contiguous_cross_attention``) unless ``paged_attention`` reads the
                blocks in place anyway (``reads_blocks_in_place``). Whisper takes it (1500 encoder positions);
                the text models keep the paged call.

        Returns:
            ``[T, H, D]`` in the dtype of ``query``.
        """
        if in_place and md.cross_kv_spans is not None and not self.reads_blocks_in_place(query, kv[0], kv[1]):
            return self.contiguous_cross_attention(query, kv[0], kv[1], md.cross_kv_spans, scale)
        return self.paged_attention(
            query,
            kv[0],
            kv[1],
            md.cross_block_tables,
            md.encoder_lens,
            md.query_start_loc,
            causal=False,
            scale=scale,
            max_query_len=md.max_query_len,
            max_context_len=md.max_encoder_len,
            step_cache=md.step_cache,
        )

    # The kernels behind them, on explicit tensors (arguments and results of the torch references).

    def write_slots(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """``kernels.paged_attention.write_kv`` (same arguments), whatever the backend: float32 or bfloat16 CPU caches
        with float32 keys / values take the C scatter (``kernels.cpu_paged_attention.write_kv``, its bfloat16
        rounding torch's); every other case (float16, half-precision keys, CUDA, the kernel not built) the torch
        reference."""
        if cpu_paged_attention.write_applies(k_cache, v_cache, key, value, slot_mapping):
            cpu_paged_attention.write_kv(k_cache, v_cache, key, value, slot_mapping)
        else:
            reference.write_kv(k_cache, v_cache, key, value, slot_mapping)

    @abstractmethod
    def paged_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        max_query_len: int | None = None,
        max_context_len: int | None = None,
        position_bias: torch.Tensor | None = None,
        step_cache: dict | None = None,
    ) -> torch.Tensor:
        """``kernels.paged_attention.paged_attention`` (same arguments, masking and result) run by this backend."""

    @abstractmethod
    def contiguous_cross_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        spans: list[tuple[int, int, int, int]],
        scale: float,
    ) -> torch.Tensor:
        """``kernels.cross_attention.contiguous_cross_attention`` (same arguments and result) run by this backend."""

    def reads_blocks_in_place(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether ``paged_attention`` reads this call's K/V blocks where they lie, one row per query (so ``cross``
        needs no contiguous run); False by default."""
        return False
