"""Cross-attention weights of Whisper's alignment heads, for word timestamps.

Word timestamps (openai-whisper ``timing.find_alignment``, HF
``WhisperGenerationMixin._extract_token_timestamps``) read the softmaxed
cross-attention probabilities of a few ``(layer, head)`` pairs (the
checkpoint's ``alignment_heads``) for every token of a decoded sequence. The
paged decoder never materialises those probabilities (its attention kernels
return only the attended values), so ``alignment_weights`` recomputes the
decoder forward of one finished sequence densely: causal self-attention over
its ``T`` tokens, cross-attention over the sequence's cross KV, stopping after
the last layer that holds an alignment head. It runs only for requests that
ask for word timestamps, once their window has decoded.

Supported weights: every form the decoder service loads. The layers are
called through their own modules (``Linear``, ``LayerNorm``), so packed
float32 weights (``pack_decode_weights``: ``kernels.packed_linear``, equal to
the unpacked product up to float32 summation order) and ``--quantize int8``
(``shared.models.quantize.Int8Linear``) take their usual path; only the fused C
decode layer (``DecoderLayer.fused``, a paged single-step kernel) is bypassed.
Half-precision models compute the alignment heads' softmax in float32. The
parity test against HF eager ``cross_attentions`` runs on unpacked float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from shared.models.linear import linear_act, linear_add
from shared.models.whisper import DecoderLayer, WhisperForConditionalGeneration

__all__ = ["alignment_weights"]


def _cross_attention(
    layer: DecoderLayer, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pre-norm cross-attention block of ``layer`` on ``x`` ``[T, d]`` with ``k``, ``v`` ``[S, H, Dh]``.

    Returns the block's output (residual included) and, when ``heads`` is not
    empty, those heads' probabilities ``[len(heads), T, S]`` float32.
    """
    t, d = x.shape
    q = layer.cross_q(layer.cross_attn_norm(x)).view(t, layer.h, layer.dh).transpose(0, 1)  # [H, T, Dh]
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [H, S, Dh]
    if heads:
        # Explicit softmax (HF eager_attention_forward, openai qkv_attention): float32 whatever the model dtype.
        probs = torch.softmax((q.float() * layer.scale) @ k.float().transpose(1, 2), dim=-1)  # [H, T, S]
        a = (probs.to(v.dtype) @ v).transpose(0, 1)  # [T, H, Dh]
        picked = probs[list(heads)]
    else:
        a = F.scaled_dot_product_attention(q, k, v, scale=layer.scale).transpose(0, 1)  # [T, H, Dh]
        picked = None
    return linear_add(layer.cross_out, a.reshape(t, d), x), picked


@torch.inference_mode()
def alignment_weights(
    model: WhisperForConditionalGeneration,
    token_ids: Sequence[int],
    cross_kv: torch.Tensor,
    heads: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """Cross-attention probabilities of ``heads`` for every token of one sequence (dense recompute, no paged cache).

    Args:
        model: the Whisper model (any of the weight forms in the module docstring).
        token_ids: the sequence, ``T`` ids from position 0: for word timestamps, openai-whisper's
            ``find_alignment`` sequence, or under HF rules the decoder prompt followed by every generated token
            (``decoder_svc.whisper.word_timing`` says which).
        cross_kv: ``[num_decoder_layers, 2, S, H, Dh]`` (index 0 = K, 1 = V): one
            sequence's slice ``[:, :, b]`` of ``model.compute_cross_kv(encoder_out)``,
            on the model's device.
        heads: ``(layer, head)`` pairs, e.g. ``model.generation.specials.alignment_heads``.

    Returns:
        ``[len(heads), T, S]`` float32: row ``i`` is the softmax over the ``S`` encoder
        positions of the query at position ``i`` (the token that predicts ``token_ids[i + 1]``),
        as HF's ``output_attentions=True`` ``cross_attentions[layer][0, head]``.

    Raises:
        ValueError: no tokens, more than ``max_target_positions`` of them, no heads,
            a head outside the model, or ``cross_kv`` not of the layout above.
    """
    c = model.config
    t = len(token_ids)
    if not 0 < t <= c.max_target_positions:
        raise ValueError(f"alignment_weights needs 1..{c.max_target_positions} tokens, got {t}")
    if not heads:
        raise ValueError("alignment_weights needs at least one (layer, head) pair")
    for layer_idx, head in heads:
        if not (0 <= layer_idx < c.decoder_layers and 0 <= head < c.num_heads):
            raise ValueError(
                f"alignment head {(layer_idx, head)} is outside {c.decoder_layers} layers x {c.num_heads} heads"
            )
    expected = (c.decoder_layers, 2, c.num_heads, c.head_dim)
    if cross_kv.dim() != 5 or (*cross_kv.shape[:2], *cross_kv.shape[3:]) != expected:
        raise ValueError(
            f"cross_kv must be [{c.decoder_layers}, 2, S, {c.num_heads}, {c.head_dim}], got {list(cross_kv.shape)}"
        )
    device = model.embed_tokens.weight.device
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device)
    x = model.embed_tokens(ids) + model.decoder_positions[:t]  # [T, d]
    cross_kv = cross_kv.to(device=device, dtype=model.dtype)
    picked: dict[tuple[int, int], torch.Tensor] = {}
    last = max(layer_idx for layer_idx, _ in heads)  # the layers after it cannot change its weights
    for i, layer in enumerate(model.decoder_layers[: last + 1]):
        q, k, v = layer.self_qkv(layer.self_attn_norm(x)).view(t, 3, layer.h, layer.dh).unbind(1)  # [T, H, Dh] each
        a = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=layer.scale
        )  # [H, T, Dh]
        x = linear_add(layer.self_out, a.transpose(0, 1).reshape(t, -1), x)
        layer_heads = sorted({h for layer_idx, h in heads if layer_idx == i})
        x, probs = _cross_attention(layer, x, cross_kv[i, 0], cross_kv[i, 1], layer_heads)
        if probs is not None:
            picked.update({(i, h): p for h, p in zip(layer_heads, probs)})
        if i < last:
            x = linear_add(layer.fc2, linear_act(layer.fc1, layer.ffn_norm(x), "gelu", F.gelu), x)
    return torch.stack([picked[(int(layer_idx), int(h))] for layer_idx, h in heads])  # [len(heads), T, S]
