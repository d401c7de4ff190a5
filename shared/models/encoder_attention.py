"""Text encoders' self-attention over a right-padded batch, optionally one sequence at a time.

``F.scaled_dot_product_attention`` over a padded batch gives a sequence
results that differ in the last bits from the same sequence encoded alone (the
kernel's blocking follows the padded length). fp32 tolerates that; int8
(``shared.models.quantize``) rounds every activation to a grid, so such a
difference can cross a rounding threshold and change a token. With
``lengths``, each sequence attends over its own positions in a call of the
very shape it gets alone, so a source's encoder output does not depend on the
sources batched with it (the encoder service right-pads: ``encoder_svc.batcher``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["encoder_attention", "right_padded_lengths"]


def right_padded_lengths(attention_mask: torch.Tensor | None) -> list[int] | None:
    """Each row's length when ``attention_mask`` (``[B, S]``, 1 = real token) is right-padded (ones then zeros),
    else None (no mask, or padding elsewhere: the batched attention then applies)."""
    if attention_mask is None:
        return None
    lengths = attention_mask.ne(0).sum(1)  # [B]
    expected = torch.arange(attention_mask.shape[1], device=attention_mask.device)[None, :] < lengths[:, None]
    return lengths.tolist() if torch.equal(attention_mask.ne(0), expected) else None


def encoder_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    lengths: list[int] | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)``: ``[B, H, S, Dh]`` each.

    ``mask``: broadcastable to ``[B, H, S, S]`` (bool, True = attend; or an additive float bias), or None.
    ``lengths``: None (one batched call), or each sequence's real length (``right_padded_lengths``): sequence ``i``
    then attends over its first ``lengths[i]`` positions alone (``mask`` sliced to them) and its padded query
    positions get zeros.
    """
    if lengths is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = q.new_zeros(q.shape)  # [B, H, S, Dh]
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        m = None if mask is None else mask[i : i + 1, ..., :n, :n]  # a size-1 query dim stays 1
        out[i : i + 1, :, :n] = F.scaled_dot_product_attention(
            q[i : i + 1, :, :n], k[i : i + 1, :, :n], v[i : i + 1, :, :n], attn_mask=m, scale=scale
        )
    return out
