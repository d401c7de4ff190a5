"""Linear layers that compute few-row products as ``(W @ x^T)^T`` on CPU.

A decode step multiplies a handful of rows (one per running sequence) by
every weight matrix. For that shape MKL's fp32 GEMM on our CPU machines (2-core
AMD EPYC, AVX2; torch 2.13's MKL 2024.2) is far slower in ``F.linear``'s
layout, ``x @ W^T``, than in ``W @ x^T``. Measured with 2 threads, 32 rows
(16 for whisper), ms per product:

============================  ==========  ===============
weight ``[out, in]``          F.linear    ``(W @ x^T)^T``
============================  ==========  ===============
``[32128, 512]`` (t5 logits)  29.5        16.4
``[51864, 384]`` (whisper)    38.9 (16)   23.0 (16 rows)
``[2048, 512]``               0.79        0.51
``[512, 2048]``               0.99        0.64
============================  ==========  ===============

Large outputs are computed ``CHUNK`` output features at a time, each chunk
transposed back while it is still in cache (a ``[32, 32128]`` transpose
alone cost 3-4 ms). From about 64 rows on (encoders, long prefills) ``F.linear`` is as fast or
faster, so those keep it; so do other devices and dtypes. The math is the
same; only the order of the float32 sums differs (about 1e-7 relative).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.packed_linear import MAX_ROWS, PackedWeight, is_available, packed_linear

__all__ = ["Linear", "PackedOutputProjection", "SMALL_ROWS", "linear", "pack_projection", "vocab_projection"]

SMALL_ROWS = 64
CHUNK = 2048  # output features per product when transposing a large output back (fits in L2)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``[..., in]`` x ``[out, in]`` (+ ``[out]``) -> ``[..., out]``, contiguous.

    float32 CPU inputs with at most ``SMALL_ROWS`` rows run as
    ``(weight @ x^T)^T`` (see the module docstring); everything else is
    ``F.linear``. Raises what ``F.linear`` raises on mismatched shapes.
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= SMALL_ROWS or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1]).t()  # [in, rows]
    n = weight.shape[0]
    # Chunk by chunk of output features (one chunk unless a vocabulary projection): each [chunk, rows]
    # product is transposed into the output while it is still in cache.
    out = x.new_empty(rows, n)
    for i in range(0, n, CHUNK):
        w = weight[i : i + CHUNK]
        out[:, i : i + CHUNK] = (torch.mm(w, x2) if bias is None else torch.addmm(bias[i : i + CHUNK].unsqueeze(1), w, x2)).t()
    return out.view(*x.shape[:-1], n)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``linear`` (same parameters, names and state dict).

    ``shared.models.quantize`` turns these back into plain ``nn.Linear``
    before torch's dynamic int8 quantization, which matches exact types.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def pack_projection(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` (``[vocab, d]``) packed for ``kernels.packed_linear``, or None where that kernel cannot serve it.

    None unless the weight is a float32 CPU tensor and the kernel is built for
    this CPU (x86-64 with AVX2/FMA). The packed copy costs as much memory as
    the weight.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not is_available():
        return None
    return PackedWeight.pack(weight)


def vocab_projection(hidden: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None = None) -> torch.Tensor:
    """``[N, d] -> [N, vocab]``: ``linear(hidden, weight)``, through ``packed_linear`` when it applies.

    ``packed`` must be ``pack_projection(weight)`` (or None). It is used for
    float32 CPU inputs of at most ``kernels.packed_linear.MAX_ROWS`` rows
    (decode steps), where it runs ~1.3-2x faster than MKL (table in
    ``kernels/packed_linear.py``); prefills and other devices keep ``linear``.
    """
    rows = hidden.numel() // hidden.shape[-1] if hidden.shape[-1] else 0
    if packed is not None and 0 < rows <= MAX_ROWS and hidden.dtype == torch.float32 and hidden.device.type == "cpu":
        return packed_linear(hidden, packed)
    return linear(hidden, weight)


class PackedOutputProjection:
    """Mixin of the encoder-decoder models: their vocabulary projection, packed on request.

    The model defines ``_projection_weight()`` (its ``[vocab, d]`` output
    projection weight) and computes logits with ``_vocab_projection(hidden)``;
    the decoder service calls ``pack_output_projection()`` once the weights are
    on their device.
    """

    packed_projection: PackedWeight | None = None  # set by pack_output_projection()

    def _projection_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def pack_output_projection(self) -> bool:
        """Packs the output projection for ``kernels.packed_linear`` (CPU float32 decode steps).

        Returns whether it was packed (``pack_projection`` says when it is not).
        Call after the weights reached their device.
        """
        self.packed_projection = pack_projection(self._projection_weight())
        return self.packed_projection is not None

    def _vocab_projection(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, d] -> [N, vocab]`` through ``vocab_projection`` (the packed copy where there is one)."""
        return vocab_projection(hidden, self._projection_weight(), self.packed_projection)
