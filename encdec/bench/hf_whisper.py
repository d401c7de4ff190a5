"""Reference: HF ``transformers.WhisperForConditionalGeneration`` built from CT2 weights.

The CT2 -> HF name map here is written independently of
``shared.models.whisper.load_weights`` (it follows CTranslate2's
``converters/transformers.py`` in reverse) so the parity tests compare two
separate paths from the same ``model.bin``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shared.models.ct2_reader import load_ct2_weights

D_MODEL, HEADS, LAYERS, FFN, VOCAB, MELS = 384, 6, 4, 1536, 51864, 80


def _hf_state_dict(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    d = D_MODEL

    def lin(hf: str, ct2: str, bias: bool = True, rows: slice = slice(None)) -> None:
        sd[f"{hf}.weight"] = w[f"{ct2}/weight"][rows]
        if bias:
            sd[f"{hf}.bias"] = w[f"{ct2}/bias"][rows]

    def ln(hf: str, ct2: str) -> None:
        sd[f"{hf}.weight"], sd[f"{hf}.bias"] = w[f"{ct2}/gamma"], w[f"{ct2}/beta"]

    def fused_qkv(hf: str, ct2: str) -> None:
        lin(f"{hf}.q_proj", ct2, rows=slice(0, d))
        lin(f"{hf}.k_proj", ct2, bias=False, rows=slice(d, 2 * d))
        lin(f"{hf}.v_proj", ct2, rows=slice(2 * d, 3 * d))

    e, dd = "model.encoder", "model.decoder"
    lin(f"{e}.conv1", "encoder/conv1")
    lin(f"{e}.conv2", "encoder/conv2")
    sd[f"{e}.embed_positions.weight"] = w["encoder/position_encodings/encodings"]
    for i in range(LAYERS):
        h, c = f"{e}.layers.{i}", f"encoder/layer_{i}"
        fused_qkv(f"{h}.self_attn", f"{c}/self_attention/linear_0")
        lin(f"{h}.self_attn.out_proj", f"{c}/self_attention/linear_1")
        ln(f"{h}.self_attn_layer_norm", f"{c}/self_attention/layer_norm")
        lin(f"{h}.fc1", f"{c}/ffn/linear_0")
        lin(f"{h}.fc2", f"{c}/ffn/linear_1")
        ln(f"{h}.final_layer_norm", f"{c}/ffn/layer_norm")
    ln(f"{e}.layer_norm", "encoder/layer_norm")

    sd[f"{dd}.embed_tokens.weight"] = w["decoder/embeddings/weight"]
    sd[f"{dd}.embed_positions.weight"] = w["decoder/position_encodings/encodings"]
    for i in range(LAYERS):
        h, c = f"{dd}.layers.{i}", f"decoder/layer_{i}"
        fused_qkv(f"{h}.self_attn", f"{c}/self_attention/linear_0")
        lin(f"{h}.self_attn.out_proj", f"{c}/self_attention/linear_1")
        ln(f"{h}.self_attn_layer_norm", f"{c}/self_attention/layer_norm")
        lin(f"{h}.encoder_attn.q_proj", f"{c}/attention/linear_0")
        lin(f"{h}.encoder_attn.k_proj", f"{c}/attention/linear_1", bias=False, rows=slice(0, d))
        lin(f"{h}.encoder_attn.v_proj", f"{c}/attention/linear_1", rows=slice(d, 2 * d))
        lin(f"{h}.encoder_attn.out_proj", f"{c}/attention/linear_2")
        ln(f"{h}.encoder_attn_layer_norm", f"{c}/attention/layer_norm")
        lin(f"{h}.fc1", f"{c}/ffn/linear_0")
        lin(f"{h}.fc2", f"{c}/ffn/linear_1")
        ln(f"{h}.final_layer_norm", f"{c}/ffn/layer_norm")
    ln(f"{dd}.layer_norm", "decoder/layer_norm")
    sd["proj_out.weight"] = w["decoder/projection/weight"]
    return {k: v.float() for k, v in sd.items()}


def build_hf_whisper(model_dir: str | Path):
    """HF Whisper tiny.en (float32, eval) with the CT2 weights and a generation
    config that greedy-decodes with prompt ``[50257, 50362]``."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    from transformers.initialization import no_init_weights

    model_dir = Path(model_dir)
    with open(model_dir / "config.json", encoding="utf-8") as f:
        pkg = json.load(f)
    cfg = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=MELS,
        d_model=D_MODEL,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        max_source_positions=1500,
        max_target_positions=448,
        activation_function="gelu",
        scale_embedding=False,
        tie_word_embeddings=True,
        pad_token_id=50256,
        bos_token_id=50257,
        eos_token_id=50256,
        decoder_start_token_id=50257,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    cfg._attn_implementation = "sdpa"
    with no_init_weights():  # every weight is overwritten below; skip the slow random init
        model = WhisperForConditionalGeneration(cfg)
    missing, unexpected = model.load_state_dict(_hf_state_dict(load_ct2_weights(model_dir / "model.bin")), strict=False)
    missing = [k for k in missing if k != "proj_out.weight"]  # tied to embed_tokens
    assert not missing and not unexpected, (missing, unexpected)
    model.eval()

    g = model.generation_config
    g.decoder_start_token_id = 50257
    g.no_timestamps_token_id = 50362
    g.eos_token_id = 50256
    g.pad_token_id = 50256
    g.suppress_tokens = list(pkg["suppress_ids"])
    g.begin_suppress_tokens = list(pkg["suppress_ids_begin"])
    g.is_multilingual = False
    g.forced_decoder_ids = None
    g.max_length = 448
    g.do_sample = False
    g.num_beams = 1
    return model
