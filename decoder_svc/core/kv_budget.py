"""Sizing the two KV cache groups (self-attention, cross-attention) from a memory budget.

Rule (``size_kv_cache``): a block holds ``num_layers * 2 (K, V) * block_size *
num_heads * head_dim * dtype bytes`` (the cross group may use a narrower
dtype, ``kv_transfer_dtype``). ONE max-length request needs
``s = ceil((max_decoder_len - 1) / block_size)`` self blocks (the last sampled
token is never fed back, as ``Scheduler.check_capacity`` counts) and
``c = ceil(max_encoder_len / block_size)`` cross blocks, i.e.
``P = s * self_block_bytes + c * cross_block_bytes``. A budget ``B`` gives the
cross group ``floor(B * c / P)`` blocks and the self group what is left, so
both groups run out at the same number of concurrent max-length requests,
the "maximum concurrency" vLLM reports for its ``--kv-cache-memory`` /
``gpu_memory_utilization`` (there for one group).

Pure Python except ``free_memory_bytes``, which asks torch for free GPU memory
when the cache lives on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from decoder_svc.core.block_manager import cdiv


@dataclass(frozen=True)
class KVCacheSizing:
    """The pool sizes chosen and how they were chosen.

    Attributes:
        num_self_blocks / num_cross_blocks: blocks per group.
        self_block_bytes / cross_block_bytes: bytes of one block of each group.
        self_blocks_per_request / cross_blocks_per_request: what one
            max-length request needs of each group.
        budget_bytes: the memory budget used, or None when sized from
            ``max_num_seqs`` or given explicitly.
        source: where the sizes came from, for the start-up log.
    """

    num_self_blocks: int
    num_cross_blocks: int
    self_block_bytes: int
    cross_block_bytes: int
    self_blocks_per_request: int
    cross_blocks_per_request: int
    budget_bytes: int | None
    source: str

    @property
    def total_bytes(self) -> int:
        return self.num_self_blocks * self.self_block_bytes + self.num_cross_blocks * self.cross_block_bytes

    @property
    def max_concurrent_requests(self) -> int:
        """Max-length requests whose self and cross KV fit at once (0 if not even one)."""
        return max_concurrent_requests(
            self.num_self_blocks, self.num_cross_blocks, self.self_blocks_per_request, self.cross_blocks_per_request
        )

    def describe(self, max_num_seqs: int) -> str:
        """One log line: blocks, bytes and max concurrency."""
        line = (
            f"KV cache ({self.source}): {self.num_self_blocks} self blocks of {format_bytes(self.self_block_bytes)} + "
            f"{self.num_cross_blocks} cross blocks of {format_bytes(self.cross_block_bytes)} = "
            f"{format_bytes(self.total_bytes)}; one max-length request needs "
            f"{self.self_blocks_per_request} self + {self.cross_blocks_per_request} cross blocks; "
            f"max concurrent max-length requests: {self.max_concurrent_requests}"
        )
        if self.max_concurrent_requests > max_num_seqs:
            line += f" (max_num_seqs={max_num_seqs} caps the running batch)"
        return line


def max_concurrent_requests(num_self: int, num_cross: int, self_per_request: int, cross_per_request: int) -> int:
    """``min(num_self // self_per_request, num_cross // cross_per_request)``."""
    return min(num_self // max(self_per_request, 1), num_cross // max(cross_per_request, 1))


def block_bytes(num_layers: int, block_size: int, num_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one KV block ``[num_layers, 2, block_size, num_heads, head_dim]``."""
    return num_layers * 2 * block_size * num_heads * head_dim * dtype_bytes


def size_kv_cache(
    *,
    self_block_bytes: int,
    cross_block_bytes: int,
    block_size: int,
    max_decoder_len: int,
    max_encoder_len: int,
    max_num_seqs: int,
    budget_bytes: int | None = None,
    num_self_blocks: int = 0,
    num_cross_blocks: int = 0,
) -> KVCacheSizing:
    """Chooses the block counts of both groups.

    Precedence: an explicit (non-zero) ``num_self_blocks`` / ``num_cross_blocks``
    wins for its group; otherwise the budget (what is left of it after an
    explicit group) is split as the module docstring says; without a budget a
    group is sized for ``max_num_seqs`` max-length requests.

    Args:
        self_block_bytes / cross_block_bytes: bytes of one block of each group (``block_bytes()``).
        block_size: tokens per block.
        max_decoder_len: most decoder tokens of one request (prompt + output).
        max_encoder_len: most encoder positions (cross-attention KV length).
        max_num_seqs: running-batch limit, used when there is no budget.
        budget_bytes: bytes for both groups together, or None.
        num_self_blocks / num_cross_blocks: explicit sizes; 0 = choose.

    Raises:
        ValueError: the budget cannot hold one max-length request (the message
            names the bytes needed).
    """
    self_per = cdiv(max(max_decoder_len - 1, 1), block_size)
    cross_per = cdiv(max_encoder_len, block_size)
    per_request_bytes = self_per * self_block_bytes + cross_per * cross_block_bytes
    sizes = (self_block_bytes, cross_block_bytes, self_per, cross_per)
    if budget_bytes is None or (num_self_blocks and num_cross_blocks):
        source = "explicit block counts" if num_self_blocks and num_cross_blocks else f"max_num_seqs={max_num_seqs}"
        return KVCacheSizing(
            num_self_blocks or max_num_seqs * self_per,
            num_cross_blocks or max_num_seqs * cross_per,
            *sizes,
            None,
            source,
        )
    if num_self_blocks:
        num_self = num_self_blocks
        num_cross = max(budget_bytes - num_self * self_block_bytes, 0) // cross_block_bytes
    elif num_cross_blocks:
        num_cross = num_cross_blocks
        num_self = max(budget_bytes - num_cross * cross_block_bytes, 0) // self_block_bytes
    else:
        num_cross = budget_bytes * cross_per // per_request_bytes
        num_self = (budget_bytes - num_cross * cross_block_bytes) // self_block_bytes
    sizing = KVCacheSizing(num_self, num_cross, *sizes, budget_bytes, f"kv_cache_memory={format_bytes(budget_bytes)}")
    if sizing.max_concurrent_requests < 1:
        raise ValueError(
            f"kv_cache_memory {format_bytes(budget_bytes)} gives {num_self} self + {num_cross} cross blocks; "
            f"one max-length request needs {self_per} self + {cross_per} cross blocks "
            f"({format_bytes(per_request_bytes)}): raise kv_cache_memory or lower block counts given explicitly"
        )
    return sizing


def free_memory_bytes(device: str = "cpu") -> int:
    """Memory free for the KV cache on ``device`` now, in bytes.

    CPU: ``MemAvailable`` of ``/proc/meminfo`` (what the kernel can hand out
    without swapping), else ``sysconf(SC_AVPHYS_PAGES) * SC_PAGE_SIZE``.
    CUDA (``"cuda"``, ``"cuda:N"``): ``torch.cuda.mem_get_info`` free bytes.
    """
    if device.startswith("cuda"):
        import torch  # only here: sizing itself stays torch-free

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file's unit is kB (KiB)
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_budget(kv_cache_memory: str, device: str = "cpu") -> int | None:
    """Bytes meant by a ``kv_cache_memory`` setting, or None when it is empty.

    A fraction (``0.3``, ``30%``) is taken of ``free_memory_bytes(device)``
    at the time of the call (after the model weights are loaded).

    Raises:
        ValueError: the setting does not parse (see ``shared.config.parse_memory_size``).
    """
    from shared.config import parse_memory_size

    parsed = parse_memory_size(kv_cache_memory)
    if parsed is None:
        return None
    value, is_fraction = parsed
    return int(value * free_memory_bytes(device)) if is_fraction else int(value)


def format_bytes(n: int) -> str:
    """``201326592`` -> ``"192.0 MiB"`` (binary units)."""
    if n < 1024:
        return f"{n} B"
    size, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.1f} {unit}"
