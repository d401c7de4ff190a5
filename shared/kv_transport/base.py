"""Transport-independent parts: the target description and the block write."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class KVTargetSpec:
    """Where a request's cross-attention KV goes (mirrors proto ``KVTarget``).

    Attributes:
        transport: transport name (``shm``).
        segment: transport-specific pool handle (shm: segment name).
        shape: pool shape ``[num_layers, 2, num_blocks, block_size, num_heads, head_dim]``.
        dtype: pool dtype name (``float32``).
        instance_id: the owning decoder's instance; a new one after a restart.
    """

    transport: str
    segment: str
    shape: tuple[int, ...]
    dtype: str
    instance_id: str

    def validate(self) -> None:
        """Checks the description itself (not the pool behind it).

        Raises:
            ValueError: unknown dtype, not 6 dimensions, or a dimension < 1.
        """
        if self.dtype not in DTYPES:
            raise ValueError(f"KV target dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if len(self.shape) != 6 or any(int(s) < 1 for s in self.shape) or self.shape[1] != 2:
            raise ValueError(
                f"KV target shape {list(self.shape)} must be [num_layers, 2, num_blocks, block_size, num_heads, head_dim], all >= 1"
            )

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


class CrossKVPool(ABC):
    """Decoder side: owns the cross-attention KV pool tensor.

    ``tensor`` has shape ``[num_layers, 2, num_blocks, block_size, num_heads,
    head_dim]`` and is what the decoder's attention reads through cross block
    tables.
    """

    tensor: torch.Tensor
    spec: KVTargetSpec

    @abstractmethod
    def close(self) -> None:
        """Releases the pool (and, for shm, unlinks the segment)."""


class CrossKVWriter(ABC):
    """Encoder side: writes one request's cross KV into the decoder's blocks."""

    @abstractmethod
    def write(self, spec: KVTargetSpec, block_ids: list[int], cross_kv: torch.Tensor) -> None:
        """Writes ``cross_kv`` ``[num_layers, 2, encoder_len, num_heads, head_dim]`` into ``block_ids``.

        Raises:
            InvalidRequestError: malformed target, block ids or shapes; nothing
                is written then.
            UnavailableError: the target pool cannot be opened (decoder gone).
        """

    @abstractmethod
    def close(self) -> None:
        """Drops every cached mapping."""


def write_blocks(pool: torch.Tensor, block_ids: list[int], cross_kv: torch.Tensor) -> None:
    """Copies ``cross_kv`` into ``pool`` at ``block_ids`` (token ``t`` -> block ``t // block_size``).

    Args:
        pool: ``[num_layers, 2, num_blocks, block_size, num_heads, head_dim]``.
        block_ids: ``ceil(encoder_len / block_size)`` distinct block ids, in
            token order; they need not be contiguous.
        cross_kv: ``[num_layers, 2, encoder_len, num_heads, head_dim]``; cast
            to the pool's dtype.

    Raises:
        ValueError: shapes disagree, wrong number of blocks, an id out of
            range or repeated. Checked before any write, so a malformed
            request never touches other requests' blocks.
    """
    num_layers, two, num_blocks, block_size, num_heads, head_dim = pool.shape
    if cross_kv.dim() != 5 or cross_kv.shape[:2] != (num_layers, 2) or cross_kv.shape[3:] != (num_heads, head_dim):
        raise ValueError(
            f"cross KV shape {tuple(cross_kv.shape)} does not fit pool {tuple(pool.shape)}: expected "
            f"[{num_layers}, 2, encoder_len, {num_heads}, {head_dim}]"
        )
    encoder_len = cross_kv.shape[2]
    needed = math.ceil(encoder_len / block_size)
    if len(block_ids) != needed:
        raise ValueError(f"{encoder_len} positions need {needed} blocks of {block_size}, got {len(block_ids)} block ids")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError("block ids repeat")
    if any(b < 0 or b >= num_blocks for b in block_ids):
        raise ValueError(f"block ids must be in [0, {num_blocks}), got {min(block_ids)}..{max(block_ids)}")
    full, rem = divmod(encoder_len, block_size)
    src = cross_kv.to(pool.dtype)
    if full:
        idx = torch.tensor(block_ids[:full], dtype=torch.long)
        # [L, 2, full*bs, H, D] -> [L, 2, full, bs, H, D], scattered along the block axis
        pool[:, :, idx] = src[:, :, : full * block_size].reshape(num_layers, 2, full, block_size, num_heads, head_dim)
    if rem:
        pool[:, :, block_ids[full], :rem] = src[:, :, full * block_size :]
