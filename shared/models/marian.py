"""Marian MT (Junczys-Dowmunt et al. 2018, OPUS-MT): post-norm BART layers with
sinusoidal positions, no layernorm_embedding, ``final_logits_bias``.

The sinusoid table is computed, never loaded (HF does not store it); sin
features fill the first half of each row, cos the second. The decoder starts
from the pad token, and HF's ``bad_words_ids=[[pad]]`` becomes a suppressed token.
"""

from __future__ import annotations

from shared.models.bart import BartForConditionalGeneration

__all__ = ["MarianMTModel"]


class MarianMTModel(BartForConditionalGeneration):
    """Marian encoder + paged decoder (``from_pretrained`` an HF directory)."""

    variant = {"pre_norm": False, "layernorm_embedding": False, "final_layer_norm": False, "sinusoidal_positions": True}

    @classmethod
    def hf_generation_config(cls, hf: dict) -> dict:
        return {**hf, "decoder_start_token_id": hf.get("decoder_start_token_id", hf.get("pad_token_id"))}
