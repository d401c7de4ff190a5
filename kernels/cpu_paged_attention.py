"""Decode-step paged attention on CPU, reading K/V blocks in place (``kernels/csrc/paged_decode_attention.c``).

The torch reference (``kernels.paged_attention.paged_attention``) gathers
every sequence's K/V blocks into a dense copy, builds a mask and calls
``F.scaled_dot_product_attention``: for a t5-small batch-32 decode step that
was a sizeable part of the step (gathers, SDPA, masks; measured:
docs/benchmarks.md, Measurements formerly in docstrings). With one query per
sequence, this C kernel reads each key and value where it lies, once, through the block table. The
``torch`` attention backend (``kernels.attention_backends.torch_backend``) sends every call with a float32 query
and float32 or bfloat16 CPU caches here; float16 caches, half-precision queries and other devices go to the
reference; tests/kernels/test_cpu_paged_attention.py (bfloat16 caches: test_cpu_paged_attention_bf16.py) compares
the two. A bfloat16 cache (half the bytes a decode step reads: Whisper's cross pool) is widened to float32 exactly
as it is read, and the math and the output are the float32 kernel's, sum for sum: its result equals the float32
kernel's on that cache upcast, bit for bit, and the reference's (which upcasts too) to float rounding. A step with several queries per sequence (a prefill, a
recompute after preemption, next to other sequences' decode rows) is run as
one kernel row per query (``query_rows``: the query's own causal length), so a
token's attention is computed the same way whether it is decoded alone, in a
batch, or recomputed in a prefill: results do not depend on the batch. ``write_kv`` is the C
scatter of the reference's ``write_kv`` (torch's ``index_copy_`` plus its
padding check cost several times the scatter per layer of such a step); into a bfloat16 cache it rounds to nearest
even, as ``Tensor.to(torch.bfloat16)``.

The C library is built by ``pip install`` (setup.py, x86-64 Linux only);
where it is missing or the CPU lacks AVX2/FMA, ``is_available()`` is False
and the reference runs. Inference only: no autograd.

Over 300 lines: one C library per file: the ctypes declarations, the argument checks and
the Python entry points of both its functions (the decode attention and ``write_kv``).
"""

from __future__ import annotations

import ctypes

import torch

from kernels._clib import CKernel
from kernels.paged_attention import token_index

__all__ = [
    "CACHE_DTYPES",
    "applies",
    "is_available",
    "paged_decode_attention",
    "query_rows",
    "write_applies",
    "write_kv",
]

# The cache dtypes the C functions take, by their ``cache_dtype`` code (``kernels/csrc/paged_decode_attention.c``).
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.paged_decode_attention.argtypes = [
        ptr,
        i64,
        ptr,
        ptr,
        ctypes.c_int,
        ptr,
        i64,
        ptr,
        ptr,
        i64,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        ctypes.c_float,
        ctypes.c_int,
    ]
    lib.paged_decode_attention.restype = ctypes.c_int
    lib.paged_write_kv.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ctypes.c_int, ptr, i64, i64, i64]
    lib.paged_write_kv.restype = ctypes.c_int


_KERNEL = CKernel("paged_decode_attention", _declare)
_library = _KERNEL.library
is_available = _KERNEL.is_available


def applies(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``paged_decode_attention`` (through ``query_rows`` when a sequence has several queries) can serve
    this call of the reference: a float32 CPU query and contiguous CPU caches of one dtype in ``CACHE_DTYPES``
    (float32 or bfloat16), when the kernel is available."""
    return (
        query.dtype == torch.float32
        and k_cache.dtype in CACHE_DTYPES
        and v_cache.dtype == k_cache.dtype
        and query.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and v_cache.device.type == "cpu"
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and is_available()
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    position_bias: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:
    """One query per sequence over its paged K/V (the reference's decode case).

    Args:
        query: ``[B, H, D]`` float32 CPU, the query of sequence ``b`` in row ``b``.
        k_cache: ``[num_blocks, block_size, H, D]`` float32 or bfloat16 CPU, contiguous (a
            cache is never copied; bfloat16 elements are widened to float32 exactly as they are read).
        v_cache: same shape and dtype as ``k_cache``.
        block_tables: ``[B, M]`` integer block ids; only the first
            ``ceil(context_lens[b] / block_size)`` of row ``b`` are read.
        context_lens: ``[B]`` keys per sequence (a causal query sits at
            position ``context_lens[b] - 1``; cross-attention: the encoder length).
        scale: factor on ``q . k``.
        position_bias: optional ``[H, N]`` T5 bias by causal distance
            ``context_lens[b] - 1 - j``, clamped to ``N - 1``.
        num_threads: threads over the ``B * H`` (sequence, head) pairs
            (default ``torch.get_num_threads()``).

    Returns:
        ``[B, H, D]`` float32 (float32 math whatever the cache dtype); zeros for a sequence with no key.

    Raises:
        RuntimeError: the kernel is not available (see ``is_available``).
        ValueError: a query not float32, caches not both float32 or both bfloat16, tensors off the CPU, wrong
            shapes; a negative length or one past the block table's width; a block id outside the cache.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError(
            "the paged_decode_attention kernel is not available: kernels/_cpu_kernels*.so was "
            "not built (no C compiler when the package was installed, or not x86-64 Linux) or this CPU "
            "lacks AVX2/FMA"
        )
    b, h, d = query.shape
    if (
        query.dtype != torch.float32
        or k_cache.dtype not in CACHE_DTYPES
        or v_cache.dtype != k_cache.dtype
        or query.device.type != "cpu"
        or k_cache.device.type != "cpu"
        or v_cache.device.type != "cpu"
    ):
        raise ValueError(
            "paged_decode_attention takes a float32 CPU query and float32 or bfloat16 CPU caches (both one dtype), "
            f"got {query.dtype}/{k_cache.dtype}/{v_cache.dtype} on {query.device}/{k_cache.device}/{v_cache.device}"
        )
    if (
        k_cache.dim() != 4
        or k_cache.shape != v_cache.shape
        or tuple(k_cache.shape[2:]) != (h, d)
        or k_cache.shape[1] < 1
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
    ):
        raise ValueError(
            f"caches must both be contiguous [num_blocks, block_size >= 1, {h}, {d}], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != b or tuple(context_lens.shape) != (b,):
        raise ValueError(
            f"block_tables must be [{b}, M] and context_lens [{b}], got {tuple(block_tables.shape)} and "
            f"{tuple(context_lens.shape)}"
        )
    if not block_tables.is_cpu or not context_lens.is_cpu or (position_bias is not None and not position_bias.is_cpu):
        raise ValueError("paged_decode_attention takes CPU block_tables, context_lens and position_bias")
    if position_bias is not None and (
        position_bias.dim() != 2 or position_bias.shape[0] != h or position_bias.shape[1] < 1
    ):
        raise ValueError(f"position_bias must be [{h}, N] with N >= 1, got {tuple(position_bias.shape)}")
    k, v = k_cache, v_cache
    q = query if query.stride(2) == 1 and query.stride(1) == d else query.contiguous()  # each row's heads as they lie
    tables = _as(block_tables, torch.int64)
    lens = _as(context_lens, torch.int64)
    bias = _as(position_bias, torch.float32) if position_bias is not None else None
    out = torch.empty(b, h, d, dtype=torch.float32)
    if b == 0 or h == 0 or d == 0:
        return out.zero_()
    rc = lib.paged_decode_attention(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        CACHE_DTYPES[k.dtype],
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        bias.shape[1] if bias is not None else 0,
        out.data_ptr(),
        b,
        h,
        d,
        k.shape[0],
        k.shape[1],
        float(scale),
        num_threads or torch.get_num_threads(),
    )
    if rc == -2:
        raise ValueError(
            f"context_lens must be >= 0 and fit the block table ({tables.shape[1]} blocks of {k.shape[1]}), "
            f"got {lens.tolist()}"
        )
    if rc == -3:
        raise ValueError(f"block_tables holds a block id outside the cache's {k.shape[0]} blocks")
    return out


def query_rows(
    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query of a flat varlen batch as its own ``paged_decode_attention`` row.

    Args:
        block_tables: ``[B, M]`` block ids; context_lens: ``[B]`` keys per sequence (its queries' K/V included);
        query_start_loc: ``[B + 1]`` cumulative query counts (``T`` queries in all); causal: self-attention
        (query ``i`` of sequence ``b`` sits at ``context_lens[b] - q_len_b + i`` and sees the keys up to it) or
        cross-attention (every query sees ``context_lens[b]`` keys). As ``kernels.paged_attention.paged_attention``.

    Returns:
        ``(tables [T, M], lens [T])`` int64 CPU: each query's sequence's block table and its key count.
    """
    qsl = query_start_loc.to(torch.int64).cpu()
    seq, idx = token_index(qsl, int(qsl[-1]))  # [T] each query's sequence and its index in it
    lens = context_lens.to(torch.int64).cpu()[seq]
    if causal:
        lens = lens - (qsl[seq + 1] - qsl[seq]) + idx + 1
    return block_tables.to(torch.int64).cpu()[seq], lens


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous ``dtype`` tensor (itself when it already is one)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def write_applies(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Whether ``write_kv`` can serve this call of the reference ``kernels.paged_attention.write_kv``: contiguous
    CPU caches of one dtype in ``CACHE_DTYPES`` (float32 or bfloat16), float32 CPU keys/values and CPU slots, when
    the kernel is available."""
    return (
        k_cache.dtype in CACHE_DTYPES
        and v_cache.dtype == k_cache.dtype
        and key.dtype == torch.float32
        and value.dtype == torch.float32
        and k_cache.is_cpu
        and v_cache.is_cpu
        and key.is_cpu
        and value.is_cpu
        and slot_mapping.is_cpu
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and is_available()
    )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``kernels.paged_attention.write_kv`` (one ``memcpy``, or one row rounded to bfloat16, per token and cache
    instead of torch's ``index_copy_``).

    Args:
        k_cache: ``[num_blocks, block_size, H, D]`` float32 or bfloat16 CPU, contiguous, written in place; into
            bfloat16 each value is rounded to nearest even, bit for bit ``key.to(torch.bfloat16)`` (a NaN included).
        v_cache: same shape and dtype as ``k_cache``.
        key: ``[T, H, D]`` float32 CPU.
        value: ``[T, H, D]`` float32 CPU.
        slot_mapping: ``[T]`` integer slot of each token (``block * block_size + offset``); negative slots
            (padding tokens) are skipped.

    Raises:
        RuntimeError: the kernel is not available (see ``is_available``).
        ValueError: wrong dtypes, devices or shapes, or a slot past the cache (nothing is written then).
    """
    lib = _library()
    if lib is None:
        raise RuntimeError(
            "the paged_decode_attention kernel is not available: kernels/_cpu_kernels*.so was "
            "not built (no C compiler when the package was installed, or not x86-64 Linux) or this CPU "
            "lacks AVX2/FMA"
        )
    if not write_applies(k_cache, v_cache, key, value, slot_mapping):
        raise ValueError(
            "write_kv takes float32 CPU keys and values, contiguous float32 or bfloat16 CPU caches (both one dtype) "
            f"and CPU slots, got {key.dtype}/{value.dtype}/{k_cache.dtype}/{v_cache.dtype} on "
            f"{key.device}/{k_cache.device}/{slot_mapping.device}"
        )
    if (
        k_cache.dim() != 4
        or k_cache.shape != v_cache.shape
        or key.shape != value.shape
        or key.dim() != 3
        or tuple(key.shape[1:]) != tuple(k_cache.shape[2:])
        or tuple(slot_mapping.shape) != (key.shape[0],)
    ):
        raise ValueError(
            f"write_kv takes [T, H, D] keys and values, [num_blocks, block_size, H, D] caches and [T] slots, "
            f"got {tuple(key.shape)}, {tuple(value.shape)}, {tuple(k_cache.shape)}, {tuple(slot_mapping.shape)}"
        )
    t = key.shape[0]
    if t == 0:
        return
    row = k_cache.shape[2] * k_cache.shape[3]
    k, v = (
        x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous() for x in (key, value)
    )  # rows as they lie
    slots = _as(slot_mapping, torch.int64)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if (
        lib.paged_write_kv(
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            v.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            CACHE_DTYPES[k_cache.dtype],
            slots.data_ptr(),
            t,
            row,
            num_slots,
        )
        == -3
    ):
        raise ValueError(f"slot_mapping holds a slot past the cache's {num_slots} slots")
