"""mBART (Liu et al. 2020): BART with pre-norm layers and final layer norms on both sides.

Same HF parameter names as BART plus ``model.{encoder,decoder}.layer_norm``;
the module stack is ``shared.models.bart``'s with the mBART flags. The target
language is the checkpoint's ``forced_bos_token_id`` (forced as the first
generated token, as HF does), or the caller's decoder prompt.
"""

from __future__ import annotations

from shared.models.bart import BartForConditionalGeneration

__all__ = ["MBartForConditionalGeneration"]


class MBartForConditionalGeneration(BartForConditionalGeneration):
    """mBART encoder + paged decoder (``from_pretrained`` an HF directory)."""

    variant = {"pre_norm": True, "layernorm_embedding": True, "final_layer_norm": True}
