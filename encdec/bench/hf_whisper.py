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
from shared.models.whisper_features import special_token_ids


def _layer_count(w: dict[str, torch.Tensor], side: str) -> int:
    return sum(1 for k in w if k.startswith(f"{side}/layer_") and k.endswith("/ffn/linear_0/weight"))


def _hf_state_dict(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    d = w["decoder/embeddings/weight"].shape[1]

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
    for i in range(_layer_count(w, "encoder")):
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
    for i in range(_layer_count(w, "decoder")):
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
    """HF Whisper (float32, eval) with the CT2 weights of ``model_dir`` and a greedy generation config.

    The shape (width, layers, heads, vocab) is read from the weights. English-only
    checkpoints (vocab 51864, e.g. tiny.en) decode with prompt
    ``<|startoftranscript|><|notimestamps|>``; multilingual ones (51865, e.g. base)
    with ``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`` (``generate``
    defaults to ``language="en", task="transcribe"``).
    """
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    from transformers.initialization import no_init_weights

    model_dir = Path(model_dir)
    with open(model_dir / "config.json", encoding="utf-8") as f:
        pkg = json.load(f)
    w = load_ct2_weights(model_dir / "model.bin")
    ids = special_token_ids(model_dir)
    vocab, d_model = w["decoder/embeddings/weight"].shape
    heads, ffn = int(w["encoder/num_heads"]), w["encoder/layer_0/ffn/linear_0/weight"].shape[0]
    multilingual = vocab >= 51865
    sot, eot, no_ts = ids["<|startoftranscript|>"], ids["<|endoftext|>"], ids["<|notimestamps|>"]
    cfg = WhisperConfig(
        vocab_size=vocab,
        num_mel_bins=w["encoder/conv1/weight"].shape[1],
        d_model=d_model,
        encoder_layers=_layer_count(w, "encoder"),
        decoder_layers=_layer_count(w, "decoder"),
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_source_positions=1500,
        max_target_positions=448,
        activation_function="gelu",
        scale_embedding=False,
        tie_word_embeddings=True,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    cfg._attn_implementation = "sdpa"
    with no_init_weights():  # every weight is overwritten below; skip the slow random init
        model = WhisperForConditionalGeneration(cfg)
    missing, unexpected = model.load_state_dict(_hf_state_dict(w), strict=False)
    missing = [k for k in missing if k != "proj_out.weight"]  # tied to embed_tokens
    assert not missing and not unexpected, (missing, unexpected)
    model.eval()

    g = model.generation_config
    g.decoder_start_token_id = sot
    g.no_timestamps_token_id = no_ts
    g.eos_token_id = eot
    g.pad_token_id = eot
    g.suppress_tokens = list(pkg["suppress_ids"])
    g.begin_suppress_tokens = list(pkg["suppress_ids_begin"])
    g.is_multilingual = multilingual
    if multilingual:
        g.lang_to_id = {"<|en|>": ids["<|en|>"]}
        g.task_to_id = {"transcribe": ids["<|transcribe|>"]}
        g.language, g.task = "en", "transcribe"
    g.forced_decoder_ids = None
    g.max_length = 448
    g.do_sample = False
    g.num_beams = 1
    return model
