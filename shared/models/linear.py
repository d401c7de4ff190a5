"""Linear layers that compute few-row products as ``(W @ x^T)^T`` on CPU.

A decode step multiplies a handful of rows (one per running sequence) by
every weight matrix. For that shape MKL's fp32 GEMM (torch 2.13's MKL 2024.2)
is far slower in ``F.linear``'s layout, ``x @ W^T``, than in ``W @ x^T``
(measured per weight shape: docs/benchmarks.md, Measurements formerly in
docstrings).

Large outputs are computed ``CHUNK`` output features at a time, each chunk
transposed back while it is still in cache (a whole ``[32, 32128]`` transpose
is a cost of its own). From about 64 rows on (encoders, long prefills) ``F.linear`` is as fast or
faster, so those keep it; so do other devices and dtypes. The math is the
same; only the order of the float32 sums differs (about 1e-7 relative).

Faster still, where the C kernel is built: the decoder service packs the
weights a decode step multiplies (``PackedDecodeWeights.pack_decode_weights``:
the vocabulary projection, each decoder layer's ``Linear.pack`` and its
self-attention q/k/v as one ``pack_fused`` product), and every float32 CPU
input (``packed_rows``) then runs ``kernels.packed_linear`` (measured: docs/benchmarks.md),
prefills included: its rows' results do not depend on the other rows, so a
token recomputed in a prefill (after a preemption) or batched with others gets
the numbers it gets decoded alone. Long prefills run somewhat slower than
MKL would; they are rare in a decoder (prompts of 1-4 tokens).

Over 300 lines: the ``Linear`` layer with every form of its product (small-row, packed, fused, oneDNN,
bfloat16 mixed precision) and the packing of a model's decode-step weights, which choose among them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.onednn_linear import linear as onednn_linear
from kernels.onednn_linear import pack as onednn_pack
from kernels.onednn_linear import prefer_onednn
from kernels.packed_linear import (
    ACTIVATIONS,
    DTYPES,
    PackedWeight,
    activate,
    bf16_available,
    is_available,
    packed_linear,
)

__all__ = [
    "FusedPacked",
    "products_dtype",
    "use_bfloat16_products",
    "Linear",
    "PackedDecodeWeights",
    "SMALL_ROWS",
    "packed_rows",
    "fused_products",
    "linear",
    "linear_act",
    "linear_add",
    "pack_fused",
    "packed_product",
    "pack_projection",
    "vocab_projection",
]

SMALL_ROWS = 64
CHUNK = 2048  # output features per product when transposing a large output back (fits in L2)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``[..., in]`` x ``[out, in]`` (+ ``[out]``) -> ``[..., out]``, contiguous.

    float32 CPU inputs with at most ``SMALL_ROWS`` rows run as
    ``(weight @ x^T)^T`` (see the module docstring); everything else is
    ``F.linear``. Raises what ``F.linear`` raises on mismatched shapes.
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (
        not 0 < rows <= SMALL_ROWS
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
    ):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1]).t()  # [in, rows]
    n = weight.shape[0]
    # Chunk by chunk of output features (one chunk unless a vocabulary projection): each [chunk, rows]
    # product is transposed into the output while it is still in cache.
    out = x.new_empty(rows, n)
    for i in range(0, n, CHUNK):
        w = weight[i : i + CHUNK]
        out[:, i : i + CHUNK] = (
            torch.mm(w, x2) if bias is None else torch.addmm(bias[i : i + CHUNK].unsqueeze(1), w, x2)
        ).t()
    return out.view(*x.shape[:-1], n)


def packed_rows(x: torch.Tensor) -> bool:
    """Whether ``x`` (``[..., in]``) is a non-empty float32 CPU input: the packed kernel's case."""
    return x.numel() > 0 and x.dtype == torch.float32 and x.device.type == "cpu"


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``linear`` (same parameters, names and state dict).

    ``pack()`` adds a packed copy of the weight (``kernels.packed_linear``)
    that float32 CPU inputs (``packed_rows``) then use. ``--quantize int8``
    replaces these with ``shared.models.quantize.Int8Linear``.
    """

    packed: PackedWeight | None = None  # set by pack()
    onednn: torch.Tensor | None = None  # set by use_onednn(): oneDNN's packed weight for many-row inputs
    mixed_bfloat16 = False  # set by use_bfloat16_products: bfloat16 weight, float32 in and out

    def use_onednn(self, rows: int) -> bool:
        """Packs the weight for oneDNN when it beats ``F.linear`` on ``rows``-row products here
        (``kernels.onednn_linear.prefer_onednn``: measured once per shape); inputs of more than
        ``SMALL_ROWS`` float32 CPU rows then use it. Returns whether it does."""
        if prefer_onednn(self.weight, self.bias, rows):
            self.onednn = onednn_pack(self.weight, rows)
        return self.onednn is not None

    def pack(self) -> int:
        """Packs the weight for decode steps (``pack_projection``); returns the bytes that added (0: not packed)."""
        self.packed = pack_projection(self.weight)
        return self.packed.data.nbytes if self.packed is not None else 0

    def forward(
        self, x: torch.Tensor, activation: str | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``residual + act(x W^T + b)``; ``activation``: None, ``relu`` or ``gelu`` (exact); ``residual``: None or
        a tensor of the output's shape. Both go into the packed kernel's epilogue for float32 CPU inputs once
        packed (``kernels.packed_linear``); the result is the same bit for bit either way."""
        if (
            self.packed is not None
            and packed_rows(x)
            and (residual is None or residual.shape == (*x.shape[:-1], self.out_features))
        ):
            return packed_linear(x, self.packed, self.bias, activation=activation, residual=residual)
        if self.onednn is not None and x.numel() > SMALL_ROWS * x.shape[-1] and packed_rows(x):
            y = activate(onednn_linear(x, self.onednn, self.bias, self.out_features), activation)
            return y if residual is None else residual + y
        if self.mixed_bfloat16:
            return self._bfloat16_product(x, activation, residual)
        y = activate(linear(x, self.weight, self.bias), activation)  # a residual of another shape broadcasts here
        return y if residual is None else residual + y

    def bfloat16_product(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """``act(x W^T + b)`` as bfloat16, for a ``mixed_bfloat16`` layer whose output feeds another bfloat16
        product (attention, the FFN's second linear): ``x`` rounded to bfloat16, the bias (rounded to bfloat16)
        added inside the oneDNN product (float32 accumulation, one rounding of the sum), the activation applied to
        the bfloat16 result (torch computes it in float32). ``[..., in]`` -> ``[..., out]`` bfloat16.

        Raises:
            ValueError: the layer is not ``mixed_bfloat16``.
        """
        if not self.mixed_bfloat16:
            raise ValueError("bfloat16_product needs a mixed_bfloat16 layer (use_bfloat16_products)")
        bias = self.bias.to(torch.bfloat16) if self.bias is not None else None
        return activate(F.linear(x.to(torch.bfloat16), self.weight, bias), activation)

    def _bfloat16_product(self, x: torch.Tensor, activation: str | None, residual: torch.Tensor | None) -> torch.Tensor:
        """A bfloat16 weight (``shared.models.bfloat16``) times a float32 (or bfloat16) input: ``x`` rounded to
        bfloat16, one oneDNN bfloat16 product (float32 accumulation), then the bias, the activation and the residual
        in float32; returns float32."""
        y = F.linear(x.to(torch.bfloat16), self.weight).float()
        if self.bias is not None:
            y.add_(self.bias)
        y = activate(y, activation)
        return y if residual is None else residual + y


def linear_act(layer: nn.Module, x: torch.Tensor, name: str, act) -> torch.Tensor:
    """``act(layer(x))`` where ``act`` is HF's ``ACT2FN[name]``; ``relu`` and ``gelu`` (the exact one) go
    into a ``Linear``'s packed epilogue (float32 CPU inputs). Any other activation, or a layer that is no
    longer our ``Linear`` (``shared.models.quantize`` swaps in its Int8Linear), applies ``act`` after."""
    if name in ACTIVATIONS and isinstance(layer, Linear):
        return layer(x, activation=name)
    return act(layer(x))


def linear_add(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + layer(x)`` (a residual connection); a ``Linear`` adds it in the packed kernel's epilogue on
    float32 CPU inputs (no separate add: one op less per connection). Any other layer (the Int8Linear swapped in by
    ``shared.models.quantize``) adds after."""
    if isinstance(layer, Linear):
        return layer(x, residual=residual)
    return residual + layer(x)


def packed_product(layer: nn.Module) -> tuple[PackedWeight, torch.Tensor | None] | None:
    """``(packed weight, bias or None)`` of a packed ``Linear`` (what ``kernels.decode_layer.LayerWeights`` takes), or
    None: not packed, or no longer our ``Linear`` (``shared.models.quantize`` swaps in its Int8Linear)."""
    if not isinstance(layer, Linear) or layer.packed is None:
        return None
    return layer.packed, layer.bias.detach() if layer.bias is not None else None


@dataclass(frozen=True)
class FusedPacked:
    """Several ``Linear`` layers on the same input packed as one ``[sum(sizes), in]`` weight (e.g. q, k, v).

    Attributes:
        weight: the packed concatenation of their weights, in order.
        bias: ``[sum(sizes)]`` float32, their biases concatenated (zeros for
            a layer without one), or None when none has a bias.
        sizes: each layer's ``out_features``.
    """

    weight: PackedWeight
    bias: torch.Tensor | None
    sizes: tuple[int, ...]


def pack_fused(linears: Iterable[nn.Linear]) -> FusedPacked | None:
    """The layers' weights (all ``[*, in]``, same ``in``) packed as one product, or None where ``pack_projection`` is.

    Raises:
        ValueError: the layers' input sizes differ.
    """
    linears = list(linears)
    if len({m.in_features for m in linears}) != 1:
        raise ValueError(f"pack_fused needs layers of one input size, got {[m.in_features for m in linears]}")
    packed = pack_projection(torch.cat([m.weight for m in linears]))
    if packed is None:
        return None
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat(
            [m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]
        ).detach()
    return FusedPacked(packed, bias, tuple(m.out_features for m in linears))


def fused_products(
    x: torch.Tensor, linears: Iterable[nn.Linear], fused: FusedPacked | None
) -> tuple[torch.Tensor, ...]:
    """``tuple(m(x) for m in linears)``; one packed product (``[..., size]`` views of it) for decode-step inputs.

    ``fused`` must be ``pack_fused(linears)`` or None (then each layer runs on its own).
    """
    if fused is not None and packed_rows(x):
        return packed_linear(x, fused.weight, fused.bias).split(fused.sizes, dim=-1)
    return tuple(m(x) for m in linears)


def pack_projection(weight: torch.Tensor, dtype: torch.dtype | None = None) -> PackedWeight | None:
    """``weight`` (``[out, in]``: the vocabulary projection, a decoder linear) packed for ``kernels.packed_linear``.

    ``dtype``: the packed copy's, float32 or bfloat16 (default: the weight's own). None unless the weight is a
    float32 or bfloat16 CPU tensor and the kernel for that layout is built for this CPU (x86-64 with AVX2/FMA;
    bfloat16 also needs AVX-512 BF16: ``kernels.packed_linear.bf16_available``). The packed copy costs as much
    memory as the weight in ``dtype``.
    """
    dtype = dtype or weight.dtype
    if weight.device.type != "cpu" or weight.dtype not in DTYPES or dtype not in DTYPES or not is_available():
        return None
    if dtype == torch.bfloat16 and not bf16_available():
        return None
    return PackedWeight.pack(weight, dtype=dtype)


def vocab_projection(
    hidden: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``[N, d] -> [N, vocab]``: ``linear(hidden, weight, bias)``, through ``packed_linear`` when it applies.

    ``packed`` must be ``pack_projection(weight)`` (or None). It is used for
    float32 CPU inputs (decode steps, where it runs faster than MKL: measured in
    docs/benchmarks.md, Measurements formerly in docstrings; and prefills, for batch
    invariance); other devices and dtypes keep ``linear``.
    ``bias`` (``[vocab]``, e.g. BART's ``final_logits_bias``) is added inside
    the product: no second pass over the logits.
    """
    if packed is not None and packed_rows(hidden) and (bias is None or bias.dtype == torch.float32):
        return packed_linear(hidden, packed, bias)
    return linear(hidden, weight, bias)


class PackedDecodeWeights:
    """Mixin of the encoder-decoder models: the weights of decode steps packed for the CPU kernel, on request.

    The model defines ``_projection_weight()`` (its ``[vocab, d]`` output
    projection weight) and ``_decoder_layers()``, whose layers each define
    ``pack_decode_weights() -> int`` (pack what a decode step multiplies:
    ``Linear.pack``, ``pack_fused``; bytes added). It computes logits with
    ``_vocab_projection(hidden)``, or with its ``output_projection`` once one
    is set (``set_output_projection``: the int8 one of ``shared.models.quantize``).
    The decoder service calls ``pack_decode_weights()`` once the weights are on
    their device.
    """

    packed_projection: PackedWeight | None = None  # set by pack_decode_weights()

    def set_output_projection(self, module: nn.Module) -> None:
        """Replaces the output projection in ``compute_logits`` by ``module`` (``[N, d] -> [N, vocab]``, any logits
        bias included). The model's ``__init__`` sets ``output_projection = None`` (an instance attribute: a class
        one would hide the submodule registered here)."""
        self.output_projection = module

    def _projection_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def _decoder_layers(self) -> Iterable[nn.Module]:
        raise NotImplementedError

    def pack_decode_weights(self) -> int:
        """Packs the output projection and the decoder layers' products for ``kernels.packed_linear``.

        Returns the bytes the packed copies take (they sit beside the weights,
        which prefills and encoders keep using); 0 when nothing was packed:
        ``pack_projection`` says when (float32 or bfloat16 CPU weights, kernel built for
        this CPU). Call after the weights reached their device.
        """
        # bfloat16 products (shared.models.bfloat16): the projection (a float32 embedding when tied) in bfloat16 too
        self.packed_projection = pack_projection(self._projection_weight(), products_dtype(self))
        if self.packed_projection is None:
            return 0
        return self.packed_projection.data.nbytes + sum(layer.pack_decode_weights() for layer in self._decoder_layers())

    def packed_weights(self) -> list[PackedWeight]:
        """One packed weight of each shape a decode step multiplies (the projection, then the packed ``Linear``
        layers'), for ``kernels.calibration``; empty before ``pack_decode_weights`` or when nothing was packed."""
        found = [self.packed_projection] if self.packed_projection is not None else []
        found += [m.packed for m in self.modules() if isinstance(m, Linear) and m.packed is not None]
        shapes: dict[tuple, PackedWeight] = {}
        for w in found:
            shapes.setdefault((w.out_features, w.in_features, w.dtype), w)
        return list(shapes.values())

    def _vocab_projection(self, hidden: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, d] -> [N, vocab]`` (+ ``bias`` ``[vocab]``) through ``vocab_projection`` (the packed copy where there is one)."""
        return vocab_projection(hidden, self._projection_weight(), self.packed_projection, bias)


def use_bfloat16_products(model: nn.Module) -> int:
    """Stores the weight of every ``Linear`` (``shared.models.linear``) of ``model`` in bfloat16 and marks it
    ``mixed_bfloat16`` (biases stay float32); returns how many. Call on a float32 CPU model before
    ``pack_decode_weights``. Convolutions (Whisper's two, 2% of its encoder's time) keep float32 weights: they see
    the unrounded log-mel features."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.float32:
            module.weight = nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
            module.mixed_bfloat16 = True
            count += 1
    return count


def products_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s product weights: its first ``Linear``'s (bfloat16 after ``use_bfloat16_products``),
    else its first parameter's."""
    for module in model.modules():
        if isinstance(module, Linear):
            return module.weight.dtype
    return next(model.parameters()).dtype
