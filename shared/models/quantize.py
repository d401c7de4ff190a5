"""Opt-in int8 weights for the decoder side (CPU).

Decode steps on CPU are memory-bound: every step reads all decoder weights and
the output projection (Whisper tiny.en: an 80 MB fp32 ``[51864, 384]`` matrix,
~35 ms per step at batch 16 on our 2-core machines). Dynamic int8
quantization stores ``nn.Linear`` weights as int8 with one scale per output
channel and quantizes activations per call (``torch.ao`` dynamic
quantization, fbgemm kernels on x86), reading 4x fewer bytes (~4.5 ms for the
same projection). The output projection's top candidates are rescored in
fp32 (``Int8OutputProjection``), so the int8 decoder keeps every bundled
clip's greedy transcript equal to HF's; the int8 encoder flips one of the
five (``tests/test_quantize.py``). ``encdec bench whisper --int8`` counts
matches; CTranslate2's ``int8`` compute type is the comparable mode.

Int8 models keep torch's LayerNorm / RMS norm instead of the C row kernel
(``kernels.cpu_norm``): dynamic quantization rounds each activation to a
grid, so the kernel's last-bit differences from torch move values across
rounding thresholds, and on close calls that changes tokens. Measured with
``encdec bench whisper --int8`` (16 clips, one at a time): 13/16 transcripts
equal to HF's with the kernel, 16/16 with torch's norms.

Known limit: torch's dynamic quantization scales activations per tensor, so
an int8 layer's output for one sequence depends slightly on what else is in
the tensor. The encoder service therefore encodes one request per forward in
int8 mode; the decoder's flat batch still shares scales across sequences, so
int8 decoding is not guaranteed batch-invariant (fp32 is).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from shared.models.linear import Linear

SUPPORTED = ("none", "int8")


class Int8OutputProjection(nn.Module):
    """Output projection ``[N, d] -> [N, vocab]`` read as int8, with the top candidates rescored exactly.

    The int8 product ranks the vocabulary; the ``rescore_top_k`` best
    candidates of each row are then recomputed from the fp32 weight rows
    (``k * d`` reads per token, not ``vocab * d``), so greedy decoding picks
    exactly the fp32 argmax whenever it is among them. Without this, close
    calls between two tokens flip (1 of the 5 bundled clips did). The tail of
    the distribution keeps int8 precision, which only sampling sees.

    Args:
        weight: ``[vocab, d]`` fp32 projection (tied embeddings for Whisper).
        rescore_top_k: candidates recomputed exactly per row.
    """

    def __init__(self, weight: torch.Tensor, rescore_top_k: int = 32) -> None:
        super().__init__()
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        head.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=False)
        self.weight = weight  # shared with the model, not copied
        self.rescore_top_k = min(rescore_top_k, weight.shape[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.int8 = quantize_dynamic(nn.Sequential(head), {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.int8(hidden.float())  # [N, vocab], int8 weights
        top = logits.topk(self.rescore_top_k, dim=-1).indices  # [N, k]
        exact = torch.einsum("nd,nkd->nk", hidden.float(), self.weight[top].float())  # [N, k]
        return logits.scatter_(1, top, exact)


def _as_plain_linears(module: nn.Module) -> nn.Module:
    """Turns ``shared.models.linear.Linear`` modules back into ``nn.Linear``, in place.

    torch's ``quantize_dynamic`` only swaps modules whose type is exactly
    ``nn.Linear``; the parameters are the same, so only the class changes.
    """
    for m in module.modules():
        if isinstance(m, Linear):
            m.__class__ = nn.Linear
    return module


def quantize_decoder_int8(model: nn.Module) -> None:
    """Makes ``model``'s decoder layers and output projection int8, in place.

    The model must have ``decoder_layers`` (an ``nn.ModuleList``) and may
    have a tied output projection: ``set_output_projection(module)`` receives a
    quantized ``Linear`` built from its weight. Encoder weights stay as they
    are (the encoder service owns that side).

    Raises:
        ValueError: the model has no ``decoder_layers``.
        RuntimeError: this torch build has no quantized engine (not x86/ARM).
    """
    if not isinstance(getattr(model, "decoder_layers", None), nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder_layers to quantize")
    if not torch.backends.quantized.supported_engines or torch.backends.quantized.supported_engines == ["none"]:
        raise RuntimeError("this torch build has no quantized engine; run without --quantize")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():  # torch.ao announces its move to torchao on every call
        warnings.simplefilter("ignore")
        quantize_dynamic(_as_plain_linears(model.decoder_layers), {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
        weight = getattr(model, "output_projection_weight", None)
        if weight is not None:
            model.set_output_projection(Int8OutputProjection(weight))


def quantize_encoder_int8(model: nn.Module) -> None:
    """Makes ``model``'s encoder layers and cross-attention K/V projections int8, in place.

    The encoder's GEMMs are compute-bound (``M`` = 1500 positions for
    Whisper); fbgemm's int8 kernels run them ~25% faster than fp32 on AVX2.
    Convolutions and norms stay fp32.

    Raises:
        ValueError: the model has no ``encoder_layers``.
    """
    if not isinstance(getattr(model, "encoder_layers", None), nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no encoder_layers to quantize")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(_as_plain_linears(model.encoder_layers), {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
        for layer in getattr(model, "decoder_layers", []):
            if isinstance(getattr(layer, "cross_kv", None), nn.Linear):
                layer.cross_kv = quantize_dynamic(nn.Sequential(_as_plain_linears(layer.cross_kv)), {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)[0]


def apply_quantization(model: nn.Module, quantize: str, side: str) -> None:
    """``quantize`` ``none`` or ``int8``; ``side`` ``encoder`` or ``decoder``.

    Raises:
        ValueError: unknown mode, or a model without the layers to quantize.
    """
    if quantize not in SUPPORTED:
        raise ValueError(f"quantize must be one of {SUPPORTED}, got {quantize!r}")
    if quantize == "int8":
        (quantize_encoder_int8 if side == "encoder" else quantize_decoder_int8)(model)
        for module in model.modules():  # norms in torch: see the module docstring
            if hasattr(module, "use_kernel"):
                module.use_kernel = False
