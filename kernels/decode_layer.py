"""A decoder layer's whole decode step in one C call (``kernels/csrc/decode_layer.c``).

The reference is the model's own Python layer (``shared.models.t5`` / ``bart`` / ``whisper``
``DecoderLayer.forward``): the C function calls the same kernels (``kernels.cpu_norm``,
``kernels.packed_linear``, ``kernels.cpu_paged_attention``) in the same order with the same arguments, so
its output is the Python layer's bit for bit (tests/kernels/test_decode_layer.py); it only drops the Python time per
layer that a CPU decode step spends between those kernels (measured: docs/benchmarks.md, Measurements formerly in
docstrings).

A model layer builds a ``FusedDecodeLayer`` from its packed weights (``DecoderLayer.fused_decode_layer``)
once the weights are packed; ``FusedDecodeLayer.run`` returns None whenever the call is not a decode step
it serves (prefill, other devices or dtypes, the torch reference's backend switched off), and the Python
layer runs instead. It serves float32 activations over float32 or bfloat16 self and cross caches (each its own
dtype, ``kernels.cpu_paged_attention.CACHE_DTYPES``), as the Python layer's attention calls do.

Over 300 lines: the ctypes structs must mirror ``kernels/csrc/decode_layer.c`` field for
field, so they stay in one file with the only code that fills them (``LayerWeights``, ``FusedDecodeLayer``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels import cpu_paged_attention
from kernels._clib import CKernel
from kernels.packed_linear import ACTIVATIONS, MAX_ROWS, PackedWeight

__all__ = ["FusedDecodeLayer", "LayerWeights", "is_available"]

_f, _i64, _int = ctypes.POINTER(ctypes.c_float), ctypes.c_int64, ctypes.c_int


class _Layer(ctypes.Structure):
    _fields_ = [
        ("norm_w", _f * 3),
        ("norm_b", _f * 3),
        ("eps", ctypes.c_float),
        ("rms", _int),
        ("pre_norm", _int),
        ("qkv_wp", _f),
        ("qkv_b", _f),
        ("o_wp", _f),
        ("o_b", _f),
        ("cq_wp", _f),
        ("cq_b", _f),
        ("co_wp", _f),
        ("co_b", _f),
        ("f1_wp", _f),
        ("f1_b", _f),
        ("f2_wp", _f),
        ("f2_b", _f),
        ("activation", _int),
        ("d", _i64),
        ("heads", _i64),
        ("head_dim", _i64),
        ("ffn", _i64),
        ("scale", ctypes.c_float),
        ("weight_dtype", _int),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("t", _i64),
        ("slots", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("bt_stride", _i64),
        ("seq_lens", ctypes.c_void_p),
        ("cross_tables", ctypes.c_void_p),
        ("cross_stride", _i64),
        ("encoder_lens", ctypes.c_void_p),
        ("position_bias", ctypes.c_void_p),
        ("bias_len", _i64),
        ("num_self_blocks", _i64),
        ("num_cross_blocks", _i64),
        ("block_size", _i64),
        ("num_threads", _int),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    ptr = ctypes.c_void_p
    lib.decode_layer.argtypes = [
        ctypes.POINTER(_Layer),
        ctypes.POINTER(_Step),
        ptr,
        ptr,
        ptr,
        ptr,
        _int,
        ptr,
        ptr,
        _int,
        ptr,
    ]
    lib.decode_layer.restype = ctypes.c_int
    lib.decode_layer_scratch.argtypes = [ctypes.POINTER(_Layer), _i64]
    lib.decode_layer_scratch.restype = _i64


_KERNEL = CKernel("packed_linear", _declare)
_library = _KERNEL.library


def is_available() -> bool:
    """True if the compiled kernels are installed and this CPU has AVX2 and FMA."""
    return _library() is not None and cpu_paged_attention.is_available()


@dataclass(frozen=True)
class LayerWeights:
    """What ``FusedDecodeLayer`` needs of a layer; every tensor float32 CPU contiguous, biases None or ``[n]``; the six
    packed weights all float32 or all bfloat16 (``PackedWeight.dtype``: ``packed_linear_bf16`` then).

    Attributes:
        norms: the self-attention, cross-attention and FFN norms as ``(weight, bias)`` (``[d]`` or None).
        eps: the norms' epsilon (one for all three).
        rms: RMS norm (T5) instead of LayerNorm.
        pre_norm: ``x + f(norm(x))`` (T5, mBART, Whisper) instead of ``norm(x + f(x))`` (BART, Marian).
        qkv, o, cross_q, cross_o, fc1, fc2: packed weights with their biases: the fused ``[3 H D, d]``
            self q/k/v, ``[d, H D]`` output, ``[H D, d]`` cross q, ``[d, H D]`` cross output, ``[ffn, d]``,
            ``[d, ffn]``.
        activation: of ``fc1``: None, ``relu`` or ``gelu`` (exact): ``kernels.packed_linear.ACTIVATIONS``.
        heads, head_dim: attention shape; scale: on ``q . k``.
    """

    norms: tuple[tuple[torch.Tensor, torch.Tensor | None], ...]
    eps: float
    rms: bool
    pre_norm: bool
    qkv: tuple[PackedWeight, torch.Tensor | None]
    o: tuple[PackedWeight, torch.Tensor | None]
    cross_q: tuple[PackedWeight, torch.Tensor | None]
    cross_o: tuple[PackedWeight, torch.Tensor | None]
    fc1: tuple[PackedWeight, torch.Tensor | None]
    fc2: tuple[PackedWeight, torch.Tensor | None]
    activation: str | None
    heads: int
    head_dim: int
    scale: float


def _ptr(t: torch.Tensor | None):
    return ctypes.cast(t.data_ptr(), _f) if t is not None else None


class FusedDecodeLayer:
    """One layer's decode step through ``decode_layer`` (C); built once, after the weights are packed.

    Raises:
        ValueError: (constructor) the weights' shapes disagree, a tensor is not float32 CPU contiguous,
            or the activation is not one the packed epilogue has.
    """

    def __init__(self, w: LayerWeights) -> None:
        if w.activation not in ACTIVATIONS:
            raise ValueError(
                f"decode_layer's FFN activation must be one of {sorted(a for a in ACTIVATIONS if a)} or None, got {w.activation!r}"
            )
        d, hd = w.o[0].out_features, w.heads * w.head_dim
        ffn = w.fc1[0].out_features
        shapes = {
            "qkv": (w.qkv[0], 3 * hd, d),
            "o": (w.o[0], d, hd),
            "cross_q": (w.cross_q[0], hd, d),
            "cross_o": (w.cross_o[0], d, hd),
            "fc1": (w.fc1[0], ffn, d),
            "fc2": (w.fc2[0], d, ffn),
        }
        for name, (p, n, k) in shapes.items():
            if (p.out_features, p.in_features) != (n, k):
                raise ValueError(
                    f"decode_layer's {name} weight must be [{n}, {k}], got [{p.out_features}, {p.in_features}]"
                )
        dtypes = {p.dtype for p, _, _ in shapes.values()}
        if len(dtypes) != 1:
            raise ValueError(f"decode_layer's six weights must be packed in one dtype, got {sorted(map(str, dtypes))}")
        tensors = [t for pair in w.norms for t in pair] + [
            b for _, b in (w.qkv, w.o, w.cross_q, w.cross_o, w.fc1, w.fc2)
        ]
        for t in tensors:
            if t is not None and (t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or t.dim() != 1):
                raise ValueError(
                    f"decode_layer takes float32 CPU contiguous [n] norm weights and biases, got {t.dtype} {tuple(t.shape)}"
                )
        self.weights = w  # keeps every tensor the struct points at alive
        self.d, self.hd, self.heads_dims = d, hd, (w.heads, w.head_dim)
        s = self._layer = _Layer()
        for i, (nw, nb) in enumerate(w.norms):
            s.norm_w[i], s.norm_b[i] = _ptr(nw), _ptr(nb)
        s.eps, s.rms, s.pre_norm = w.eps, int(w.rms), int(w.pre_norm)
        for name, (p, b) in (
            ("qkv", w.qkv),
            ("o", w.o),
            ("cq", w.cross_q),
            ("co", w.cross_o),
            ("f1", w.fc1),
            ("f2", w.fc2),
        ):
            setattr(s, f"{name}_wp", _ptr(p.data))
            setattr(s, f"{name}_b", _ptr(b))
        s.weight_dtype = 1 if w.qkv[0].dtype == torch.bfloat16 else 0  # packed_linear_bf16's layout, else float32
        s.activation, s.d, s.heads, s.head_dim, s.ffn, s.scale = (
            ACTIVATIONS[w.activation],
            d,
            w.heads,
            w.head_dim,
            ffn,
            w.scale,
        )

    def run(
        self,
        x: torch.Tensor,
        md,
        self_kv: torch.Tensor,
        cross_kv: torch.Tensor,
        position_bias: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The layer's output ``[T, d]`` for a decode step, or None when this call is not one ``decode_layer`` serves.

        Args:
            x: ``[T, d]`` float32, the layer's input.
            md: the step's ``shared.attention_metadata.AttentionMetadata``.
            self_kv, cross_kv: this layer's ``[2, num_blocks, block_size, H, D]`` caches, each float32 or bfloat16
                (the new tokens' K/V are rounded to nearest even into a bfloat16 self cache).
            position_bias: T5's ``[H, N]`` decoder bias (``paged_attention``'s), or None.

        Raises:
            ValueError: a block id, length or slot outside the caches (nothing past the caches is read or written).
        """
        lib = _library()
        step = self._step(lib, x, md, self_kv, cross_kv, position_bias)
        if step is None:
            return None
        s, keep = step
        out = torch.empty_like(x)
        scratch = torch.empty(lib.decode_layer_scratch(ctypes.byref(self._layer), s.t), dtype=torch.float32)
        rc = lib.decode_layer(
            ctypes.byref(self._layer),
            ctypes.byref(s),
            x.data_ptr(),
            out.data_ptr(),
            self_kv[0].data_ptr(),
            self_kv[1].data_ptr(),
            cpu_paged_attention.CACHE_DTYPES[self_kv.dtype],
            cross_kv[0].data_ptr(),
            cross_kv[1].data_ptr(),
            cpu_paged_attention.CACHE_DTYPES[cross_kv.dtype],
            scratch.data_ptr(),
        )
        if rc < -1:
            raise ValueError(
                f"decode_layer failed (code {rc}): a block id, length or slot of this step lies outside the KV caches, "
                "or a bfloat16 product could not allocate its converted input"
            )
        return out

    def _step(self, lib, x, md, self_kv, cross_kv, position_bias):
        """The step's ``_Step`` (built once per step, kept in ``md.step_cache``) and the tensors it points at, or None."""
        if lib is None or not cpu_paged_attention.is_available():
            return None
        t = x.shape[0]
        if (
            md.attention_backend != "torch"
            or md.max_query_len != 1
            or x.dim() != 2
            or x.shape[1] != self.d
            or not 0 < t <= MAX_ROWS
            or x.dtype != torch.float32
            or not x.is_cpu
            or not x.is_contiguous()
        ):
            return None
        if (
            self_kv.dtype not in cpu_paged_attention.CACHE_DTYPES
            or cross_kv.dtype not in cpu_paged_attention.CACHE_DTYPES
            or not self_kv.is_cpu
            or not cross_kv.is_cpu
            or not self_kv.is_contiguous()
            or not cross_kv.is_contiguous()
            or self_kv.dim() != 5
            or cross_kv.dim() != 5
            or self_kv.shape[0] != 2
            or cross_kv.shape[0] != 2
            or tuple(self_kv.shape[-2:]) != self.heads_dims
            or tuple(cross_kv.shape[-2:]) != self.heads_dims
            or cross_kv.shape[2] != self_kv.shape[2]
        ):
            return None  # [2 (K, V), num_blocks, block_size, H, D] caches of this layer's heads, one block size
        cache = md.step_cache if md.step_cache is not None else {}
        key = ("decode_layer", t, id(position_bias), self_kv.shape[1], cross_kv.shape[1])
        if key in cache:
            return cache[key]
        index = [
            cpu_paged_attention._as(v, torch.int64)
            for v in (md.slot_mapping, md.block_tables, md.seq_lens, md.cross_block_tables, md.encoder_lens)
        ]
        if (
            any(not v.is_cpu for v in index)
            or index[1].dim() != 2
            or index[3].dim() != 2
            or index[1].shape[0] != t
            or index[3].shape[0] != t
            or any(index[i].shape != (t,) for i in (0, 2, 4))
        ):
            cache[key] = None
            return None
        bias = cpu_paged_attention._as(position_bias, torch.float32) if position_bias is not None else None
        if bias is not None and (
            not bias.is_cpu or bias.dim() != 2 or bias.shape[0] != self.heads_dims[0] or bias.shape[1] < 1
        ):
            cache[key] = None
            return None
        s = _Step(
            t,
            index[0].data_ptr(),
            index[1].data_ptr(),
            index[1].shape[1],
            index[2].data_ptr(),
            index[3].data_ptr(),
            index[3].shape[1],
            index[4].data_ptr(),
            bias.data_ptr() if bias is not None else None,
            bias.shape[1] if bias is not None else 0,
            self_kv.shape[1],
            cross_kv.shape[1],
            self_kv.shape[2],
            torch.get_num_threads(),
        )
        cache[key] = (s, (index, bias))
        return cache[key]
