"""Opt-in int8 weights (CPU): decoder layers and output projection, encoder layers and cross-KV projections.

For every encoder-decoder model (Whisper, T5, BART, mBART, Marian): each
declares what is converted with ``int8_parts()`` (an ``Int8Parts``) and takes
the int8 output projection with ``set_output_projection``.

Decode steps on CPU are memory-bound: every step reads all decoder weights and
the output projection (Whisper tiny.en: an 80 MB fp32 ``[51864, 384]`` matrix,
read on every step). ``Int8Linear`` stores
``nn.Linear`` weights as int8 with one scale per output channel and quantizes
activations per call with one scale per row (per token), reading 4x fewer
weight bytes; the encoder's compute-bound products also run faster (measured:
docs/benchmarks.md, Measurements formerly in docstrings). The
output projection's top candidates are rescored in fp32
(``Int8OutputProjection``). ``encdec bench whisper --int8`` counts
transcripts equal to HF's, ``encdec bench seq2seq --int8`` outputs equal to
HF's fp32 ones; CTranslate2's ``int8`` compute type is the comparable mode.

Per-row scales, not torch's dynamic quantization (``torch.ao``, fbgemm), whose
activation scale spans the whole tensor, for two reasons:

- Batch invariance. A row's int8 product is a sum of integers over that row
  only, so a sequence's tokens do not depend on its step-mates (decoder) or
  on the clips encoded with it (encoder): int8 is batch-invariant like fp32
  (``tests/models/test_quantize.py``), and the encoder service batches int8 requests
  as it does fp32 ones. With per-tensor scales, 16 clips at concurrency 16
  gave 10 to 16 transcripts equal to HF's depending on how steps were batched.
  Text encoders also attend one source at a time under int8
  (``batch_invariant_attention``, ``shared.models.encoder_attention``): the
  batched attention over right-padded sources differs from a source's own in
  the last bits, which int8's rounding can turn into another token.
- Accuracy. Whisper's encoder activations vary in size across positions; one
  scale for all 1500 positions rounds the small ones coarsely. With per-tensor
  scales the int8 encoder flipped one of the five bundled clips' greedy
  transcripts; with per-row scales none flips (``tests/models/test_quantize.py``).

Int8 models decode through the layers' torch path: the fused C decode layer
(``kernels.decode_layer``) and the packed fp32 weights take our fp32
``Linear`` only (``packed_product`` is None for an ``Int8Linear``), and the
decoder service packs no weights under int8.

Int8 models keep torch's LayerNorm / RMS norm instead of the C row kernel
(``kernels.cpu_norm``): quantization rounds each activation to a grid, so
the kernel's last-bit differences from torch move values across rounding
thresholds, and on close calls that changes tokens (measured with per-tensor
scales: 13/16 transcripts equal to HF's with the kernel, 16/16 with torch's
norms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED = ("none", "int8")


class Int8Linear(nn.Module):
    """``nn.Linear`` read as int8: per-channel weight scales, per-row (per-token) activation scales.

    ``y = (q(x) @ W_q^T) * s_x * s_w + b`` with ``W_q = round(W / s_w)``,
    ``s_w = max|W[o, :]| / 127`` per output channel, ``q(x) = round(x / s_x)``,
    ``s_x = max|x[r, :]| / 127`` per input row, and int32 sums
    (``torch._int_mm``). The per-token activation scales are ZeroQuant's
    (Yao et al., 2022, "token-wise quantization") and CTranslate2's int8 GEMM
    input scales. A row's output depends on that row only, bit for bit (its
    sums are exact integers), unlike torch's dynamic quantization, whose
    activation scale spans the whole tensor. Its speed next to fbgemm's
    per-tensor product and fp32: docs/benchmarks.md, Measurements formerly in
    docstrings.

    Args:
        weight: ``[out, in]`` float weight (quantized into a new tensor).
        bias: ``[out]`` or None (copied as float32).

    Input ``[..., in]`` float32 -> output ``[..., out]`` float32 (CPU).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        weight = weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127  # [out]
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).to(torch.int8))  # [out, in]
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """An ``Int8Linear`` of ``linear``'s weight and bias."""
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = torch.maximum(
            rows.amax(dim=1, keepdim=True), rows.amin(dim=1, keepdim=True).neg_()
        )  # [rows, 1]: max |x|
        scale = scale.clamp_min_(torch.finfo(torch.float32).tiny).div_(127)
        acc = torch._int_mm(rows.div(scale).round_().to(torch.int8), self.weight_int8.t())  # [rows, out] int32
        y = acc.to(torch.float32).mul_(scale).mul_(self.weight_scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _to_int8_linears(module: nn.Module) -> None:
    """Replaces every ``nn.Linear`` (ours included) under ``module`` with an ``Int8Linear``, in place."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear.from_linear(child))
        else:
            _to_int8_linears(child)


class Int8OutputProjection(nn.Module):
    """Output projection ``[N, d] -> [N, vocab]`` read as int8, with the top candidates rescored exactly.

    The int8 product (``Int8Linear``: per-row scales, so each row's ranking
    is its own) ranks the vocabulary; the ``rescore_top_k`` best
    candidates of each row are then recomputed from the fp32 weight rows
    (``k * d`` reads per token, not ``vocab * d``), so greedy decoding picks
    exactly the fp32 argmax whenever it is among them. Without this, close
    calls between two tokens flip (1 of the 5 bundled clips did). The tail of
    the distribution keeps int8 precision, which only sampling sees.

    Args:
        weight: ``[vocab, d]`` fp32 projection (tied embeddings for Whisper).
        bias: ``[vocab]`` float logits bias (BART's ``final_logits_bias``) or None; added to the int8 logits and to
            the rescored ones.
        rescore_top_k: candidates recomputed exactly per row.

    Input ``[N, d]`` float -> ``[N, vocab]`` float32.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rescore_top_k: int = 32) -> None:
        super().__init__()
        self.weight = weight  # shared with the model, not copied
        self.logits_bias = None if bias is None else bias.detach().float()  # [vocab]
        self.rescore_top_k = min(rescore_top_k, weight.shape[0])
        self.int8 = Int8Linear(weight, bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.int8(hidden.float())  # [N, vocab], int8 weights
        top = logits.topk(self.rescore_top_k, dim=-1).indices  # [N, k]
        exact = torch.einsum("nd,nkd->nk", hidden.float(), self.weight[top].float())  # [N, k]
        if self.logits_bias is not None:
            exact += self.logits_bias[top]
        return logits.scatter_(1, top, exact)


@dataclass(frozen=True)
class Int8Parts:
    """What ``--quantize int8`` converts in an encoder-decoder model (its ``int8_parts()``).

    Attributes:
        encoder_layers: the encoder's layers; every ``nn.Linear`` in them becomes an ``Int8Linear`` (encoder side).
        decoder_layers: the decoder's layers; every ``nn.Linear`` in them becomes an ``Int8Linear`` (decoder side).
        cross_kv: ``(owner, attribute name)`` of each cross-attention K/V projection, applied to the encoder output
            by ``compute_cross_kv`` (encoder side): Whisper's fused ``cross_kv``, T5's ``k`` / ``v``, BART's
            ``k_proj`` / ``v_proj``.
        output_weight: ``[vocab, d]`` output projection weight (the tied embedding where tied).
        output_bias: ``[vocab]`` logits bias added after the projection (BART's ``final_logits_bias``) or None.
    """

    encoder_layers: nn.ModuleList
    decoder_layers: nn.ModuleList
    cross_kv: tuple[tuple[nn.Module, str], ...]
    output_weight: torch.Tensor
    output_bias: torch.Tensor | None = None


def quantize_decoder_int8(model: nn.Module) -> None:
    """Makes ``model``'s decoder layers and output projection int8, in place.

    Every ``nn.Linear`` in ``model.int8_parts().decoder_layers`` becomes an
    ``Int8Linear``; ``model.set_output_projection`` receives an
    ``Int8OutputProjection`` of the output weight (and logits bias). Encoder
    weights stay as they are (the encoder service owns that side).

    Raises:
        ValueError: the model has no ``int8_parts`` (``check_int8``).
    """
    parts = check_int8(model).int8_parts()
    _to_int8_linears(parts.decoder_layers)
    model.set_output_projection(Int8OutputProjection(parts.output_weight, parts.output_bias))


def quantize_encoder_int8(model: nn.Module) -> None:
    """Makes ``model``'s encoder layers and cross-attention K/V projections int8 (``Int8Linear``), in place.

    The encoder's GEMMs are compute-bound (``M`` = 1500 positions for
    Whisper, the padded source positions of a text batch); int8 runs them faster than fp32 (the encoder's
    attention stays fp32; measured: docs/benchmarks.md, Measurements formerly in docstrings).
    Convolutions, embeddings and norms stay fp32.

    Raises:
        ValueError: the model has no ``int8_parts`` (``check_int8``).
    """
    parts = check_int8(model).int8_parts()
    _to_int8_linears(parts.encoder_layers)
    if hasattr(model, "batch_invariant_attention"):  # text encoders: padded batches (shared.models.encoder_attention)
        model.batch_invariant_attention = True
    for owner, name in parts.cross_kv:
        if isinstance(getattr(owner, name), nn.Linear):  # the decoder side may have converted it already
            setattr(owner, name, Int8Linear.from_linear(getattr(owner, name)))


def check_int8(model: nn.Module) -> nn.Module:
    """``model`` when it declares its int8 parts (``int8_parts()``: the encoder-decoder models).

    Raises:
        ValueError: it does not (e.g. the encoder-only BERT family, served by the Embed service in its dtype).
    """
    if not callable(getattr(model, "int8_parts", None)):
        raise ValueError(
            f"quantize int8 is for encoder-decoder models (Whisper, T5, BART, mBART, Marian), "
            f"not {type(model).__name__}: use quantize none"
        )
    return model


def apply_quantization(model: nn.Module, quantize: str, side: str) -> None:
    """``quantize`` ``none`` or ``int8``; ``side`` ``encoder`` or ``decoder``.

    int8 converts that side's parts (``quantize_encoder_int8`` / ``quantize_decoder_int8``) and sets every norm of
    the model to torch's own (``use_kernel = False``: see the module docstring).

    Raises:
        ValueError: unknown mode, or int8 on a model without ``int8_parts`` (``check_int8``).
    """
    if quantize not in SUPPORTED:
        raise ValueError(f"quantize must be one of {SUPPORTED}, got {quantize!r}")
    if quantize == "int8":
        (quantize_encoder_int8 if side == "encoder" else quantize_decoder_int8)(model)
        for module in model.modules():  # norms in torch: see the module docstring
            if hasattr(module, "use_kernel"):
                module.use_kernel = False
