"""Transport-independent parts: the target description and the block write."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class KVTargetSpec:
    """Where a request's cross-attention KV goes (mirrors proto ``KVTarget``).

    Attributes:
        transport: transport name (``shm``, ``torch_dist``).
        segment: transport-specific pool handle (shm: segment name;
            torch_dist: ``host:port`` of the decoder's rendezvous store).
        shape: pool shape ``[num_layers, 2, num_blocks, block_size, num_heads, head_dim]``.
        dtype: pool dtype name (``float32``); also the dtype that travels.
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


@dataclass(frozen=True)
class TransferStats:
    """What one cross-KV transfer cost.

    Attributes:
        nbytes: payload bytes written into the pool (or put on the wire), in the pool dtype.
        ms: wall time of the write or transfer, milliseconds.
    """

    nbytes: int
    ms: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.ms / 1e6 if self.ms > 0 else 0.0


class CrossKVPool(ABC):
    """Decoder side: owns the cross-attention KV pool tensor.

    ``tensor`` has shape ``[num_layers, 2, num_blocks, block_size, num_heads,
    head_dim]`` and is what the decoder's attention reads through cross block
    tables.
    """

    tensor: torch.Tensor
    spec: KVTargetSpec

    def expect(self, transfer_id: int, block_ids: list[int]) -> Future | None:
        """Announces a transfer before the decoder sends Encode.

        Returns:
            None when the encoder writes in place and Encode answering means
            the blocks are written (shm); else a future resolving to
            ``TransferStats`` once ``block_ids`` hold the data, or raising
            ``UnavailableError`` / ``InvalidRequestError``.
        """
        return None

    def cancel(self, transfer_id: int) -> None:  # noqa: B027 - optional hook: pools without transfer ids keep this no-op
        """Forgets ``transfer_id``; once this returns no write for it lands in the pool."""

    @abstractmethod
    def close(self) -> None:
        """Releases the pool (and, for shm, unlinks the segment)."""


class CrossKVWriter(ABC):
    """Encoder side: writes one request's cross KV into the decoder's blocks."""

    def connected(self, spec: KVTargetSpec) -> bool:
        """Whether a write to ``spec`` can start without first reaching the decoder (in-place transports: always)."""
        return True

    def connect(self, spec: KVTargetSpec) -> None:  # noqa: B027 - optional hook: in-place transports need none
        """Reaches the decoder behind ``spec`` so that later writes find it connected; called off the batcher
        thread, so a target that does not answer delays only its own request.

        Raises:
            UnavailableError: the decoder cannot be reached, or did not answer in time.
        """

    @abstractmethod
    def write(
        self, spec: KVTargetSpec, block_ids: list[int], cross_kv: torch.Tensor, transfer_id: int = 0
    ) -> TransferStats:
        """Writes ``cross_kv`` ``[num_layers, 2, encoder_len, num_heads, head_dim]`` into ``block_ids``.

        ``cross_kv`` is cast to ``spec.dtype``. ``transfer_id`` names the
        transfer the decoder announced with ``CrossKVPool.expect`` (unused by
        in-place transports). Returns the bytes and time of the write.

        Raises:
            InvalidRequestError: malformed target, block ids or shapes; nothing
                is written then.
            UnavailableError: the target pool cannot be opened (decoder gone).
        """

    @abstractmethod
    def close(self) -> None:
        """Drops every cached mapping."""


def check_write(pool_shape: tuple[int, ...], block_ids: list[int], cross_kv_shape: tuple[int, ...]) -> int:
    """Checks that ``cross_kv_shape`` fits ``block_ids`` of a pool of ``pool_shape``; returns ``encoder_len``.

    Args:
        pool_shape: ``[num_layers, 2, num_blocks, block_size, num_heads, head_dim]``.
        block_ids: the reserved blocks, in token order.
        cross_kv_shape: ``[num_layers, 2, encoder_len, num_heads, head_dim]``.

    Raises:
        ValueError: shapes disagree, wrong number of blocks, an id out of
            range or repeated.
    """
    num_layers, _, num_blocks, block_size, num_heads, head_dim = (int(s) for s in pool_shape)
    if (
        len(cross_kv_shape) != 5
        or tuple(cross_kv_shape[:2]) != (num_layers, 2)
        or tuple(cross_kv_shape[3:]) != (num_heads, head_dim)
    ):
        raise ValueError(
            f"cross KV shape {tuple(cross_kv_shape)} does not fit pool {tuple(pool_shape)}: expected "
            f"[{num_layers}, 2, encoder_len, {num_heads}, {head_dim}]"
        )
    encoder_len = int(cross_kv_shape[2])
    needed = math.ceil(encoder_len / block_size)
    if encoder_len < 1 or len(block_ids) != needed:
        raise ValueError(
            f"{encoder_len} positions need {needed} blocks of {block_size}, got {len(block_ids)} block ids"
        )
    if len(set(block_ids)) != len(block_ids):
        raise ValueError("block ids repeat")
    if any(b < 0 or b >= num_blocks for b in block_ids):
        raise ValueError(f"block ids must be in [0, {num_blocks}), got {min(block_ids)}..{max(block_ids)}")
    return encoder_len


def write_blocks(pool: torch.Tensor, block_ids: list[int], cross_kv: torch.Tensor) -> None:
    """Copies ``cross_kv`` into ``pool`` at ``block_ids`` (token ``t`` -> block ``t // block_size``).

    Args:
        pool: ``[num_layers, 2, num_blocks, block_size, num_heads, head_dim]``.
        block_ids: ``ceil(encoder_len / block_size)`` distinct block ids, in
            token order; they need not be contiguous.
        cross_kv: ``[num_layers, 2, encoder_len, num_heads, head_dim]``; cast
            to the pool's dtype and device.

    Raises:
        ValueError: see ``check_write``. Checked before any write, so a
            malformed request never touches other requests' blocks.
    """
    encoder_len = check_write(tuple(pool.shape), block_ids, tuple(cross_kv.shape))
    num_layers, _, _, block_size, num_heads, head_dim = pool.shape
    full, rem = divmod(encoder_len, block_size)
    src = cross_kv.to(device=pool.device, dtype=pool.dtype)
    if full:
        idx = torch.tensor(block_ids[:full], dtype=torch.long, device=pool.device)
        # [L, 2, full*bs, H, D] -> [L, 2, full, bs, H, D], scattered along the block axis
        pool[:, :, idx] = src[:, :, : full * block_size].reshape(num_layers, 2, full, block_size, num_heads, head_dim)
    if rem:
        pool[:, :, block_ids[full], :rem] = src[:, :, full * block_size :]
