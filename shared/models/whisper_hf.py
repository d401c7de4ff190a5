"""HF-format Whisper directories (``WhisperForConditionalGeneration``, e.g. a downloaded ``openai/whisper-*``).

A directory holds ``config.json`` (``architectures: ["WhisperForConditionalGeneration"]``),
``model.safetensors`` or ``pytorch_model.bin`` (sharded too), ``generation_config.json``
(``lang_to_id``, ``task_to_id``, ``alignment_heads``, suppress lists ...), the tokenizer
(``tokenizer.json`` or ``vocab.json`` + ``merges.txt`` + ``added_tokens.json``) and
optionally ``preprocessor_config.json``. Any size, tiny to large-v3 / turbo.

``read_hf_whisper`` turns such a directory into what ``WhisperForConditionalGeneration``
builds from: the fields of its ``WhisperConfig`` and ``WhisperGenerationDefaults`` and the
weights renamed to the CTranslate2 ``WhisperSpec`` names its ``load_weights`` maps (fused
``q,k,v`` and cross ``k,v`` rows, as CTranslate2's ``converters/transformers.py`` packs them).
Fields, not the dataclasses: ``shared.models.whisper.from_pretrained`` imports this module, and
the project allows no import circle (``tests/test_import_rules.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.models.hf_checkpoint import load_hf_weights, read_json
from shared.models.whisper_features import preprocessor_num_mel_bins, special_token_ids
from shared.models.whisper_specials import WhisperSpecials

__all__ = [
    "HF_WHISPER_ARCHITECTURE",
    "ct2_weights_from_hf",
    "generation_fields",
    "is_hf_whisper_dir",
    "read_hf_whisper",
    "whisper_config_fields",
]

HF_WHISPER_ARCHITECTURE = "WhisperForConditionalGeneration"


def is_hf_whisper_dir(model_dir: str | Path) -> bool:
    """True when ``model_dir/config.json`` names ``WhisperForConditionalGeneration`` (never raises)."""
    path = Path(model_dir) / "config.json"
    try:
        return path.is_file() and HF_WHISPER_ARCHITECTURE in (read_json(path).get("architectures") or [])
    except (ValueError, OSError):
        return False


def whisper_config_fields(hf_config: dict) -> dict[str, int]:
    """``shared.models.whisper.WhisperConfig`` keyword arguments from an HF Whisper ``config.json`` dict.

    ``decoder_layers`` may differ from ``encoder_layers`` (large-v3-turbo: 32 / 4).

    Raises:
        ValueError: a variant our model does not compute: different encoder and decoder head
            counts or FFN widths, ``scale_embedding`` true, or an activation other than GELU.
    """
    c = hf_config
    heads, dec_heads = int(c["encoder_attention_heads"]), int(c["decoder_attention_heads"])
    ffn, dec_ffn = int(c["encoder_ffn_dim"]), int(c["decoder_ffn_dim"])
    if heads != dec_heads or ffn != dec_ffn:
        raise ValueError(
            f"encoder and decoder must share head count and FFN width; got heads {heads}/{dec_heads}, ffn {ffn}/{dec_ffn}"
        )
    if c.get("scale_embedding", False):
        raise ValueError("scale_embedding=true is not supported (every openai/whisper-* checkpoint has false)")
    if c.get("activation_function", "gelu") != "gelu":
        raise ValueError(f"activation_function {c['activation_function']!r} is not supported (gelu only)")
    d_model = int(c["d_model"])
    return dict(
        d_model=d_model,
        num_heads=heads,
        head_dim=d_model // heads,
        encoder_layers=int(c["encoder_layers"]),
        decoder_layers=int(c["decoder_layers"]),
        ffn_dim=ffn,
        vocab_size=int(c["vocab_size"]),
        num_mel_bins=int(c["num_mel_bins"]),
        max_source_positions=int(c.get("max_source_positions", 1500)),
        max_target_positions=int(c.get("max_target_positions", 448)),
    )


def generation_fields(model_dir: str | Path, hf_config: dict, vocab_size: int, max_target_positions: int = 448) -> dict:
    """``shared.models.whisper.WhisperGenerationDefaults`` keyword arguments: ``generation_config.json``
    (else the same fields of ``config.json``) as HF ``generate`` reads it.

    Special ids come from the tokenizer's added tokens, overridden by the ids HF ``generate``
    uses when the generation config sets them (``decoder_start_token_id``, ``eos_token_id``,
    ``no_timestamps_token_id``, ``prev_sot_token_id``, ``task_to_id``); languages are
    ``lang_to_id`` (none when ``is_multilingual`` is false). The default prompt is
    ``specials.decoder_prompt("en")`` (``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``
    multilingual, ``<|startoftranscript|><|notimestamps|>`` English-only), as for CTranslate2 dirs.
    ``max_length`` is the file's, capped at ``max_target_positions``.

    Raises:
        FileNotFoundError: no tokenizer files. KeyError: a required special token is missing.
    """
    model_dir = Path(model_dir)
    path = model_dir / "generation_config.json"
    g = read_json(path) if path.is_file() else {}
    get = lambda key: g.get(key, hf_config.get(key))  # noqa: E731
    ids = dict(special_token_ids(model_dir))
    for name, key in (
        ("<|startoftranscript|>", "decoder_start_token_id"),
        ("<|endoftext|>", "eos_token_id"),
        ("<|notimestamps|>", "no_timestamps_token_id"),
        ("<|startofprev|>", "prev_sot_token_id"),
    ):
        value = get(key)
        if isinstance(value, list):  # eos_token_id may be a list; Whisper's first entry is <|endoftext|>
            value = value[0] if value else None
        if value is not None:
            ids[name] = int(value)
    for task, token_id in (get("task_to_id") or {}).items():
        ids[f"<|{task}|>"] = int(token_id)
    lang_to_id = get("lang_to_id")
    language_ids = None if lang_to_id is None else [int(i) for i in lang_to_id.values()]
    if get("is_multilingual") is False:
        language_ids = []
    specials = WhisperSpecials.from_token_ids(
        ids, vocab_size, language_ids, get("alignment_heads") or (), max_target_positions
    )
    language = "en" if "en" in specials.languages or not specials.multilingual else next(iter(specials.languages))
    max_length = get("max_length")
    return dict(
        decoder_prompt_ids=specials.decoder_prompt(language),
        eos_token_id=specials.eot,
        suppress_tokens=list(get("suppress_tokens") or []),
        begin_suppress_tokens=list(get("begin_suppress_tokens") or []),
        max_length=min(int(max_length), max_target_positions) if max_length else max_target_positions,
        specials=specials,
    )


def ct2_weights_from_hf(
    weights: dict[str, torch.Tensor], encoder_layers: int, decoder_layers: int
) -> dict[str, torch.Tensor]:
    """HF parameter names -> CTranslate2 ``WhisperSpec`` names (what ``load_weights`` maps).

    Self-attention ``q_proj``, ``k_proj``, ``v_proj`` become one ``linear_0`` (rows q, k, v) and
    cross-attention ``k_proj``, ``v_proj`` one ``linear_1`` (rows k, v). HF's ``k_proj`` has no bias:
    its rows get zeros (a key bias would add the same ``q . b`` to every score of a query, which
    softmax ignores). Names may lack the ``model.`` prefix (a saved ``WhisperModel``).

    Args:
        weights: the checkpoint's tensors (``shared.models.hf_checkpoint.load_hf_weights``).
        encoder_layers / decoder_layers: how many layers of each to map (``config.json``).

    Raises:
        KeyError: a parameter is missing. ValueError: ``proj_out.weight`` differs from the
            token embedding (our output projection is tied to it).
    """

    def get(name: str) -> torch.Tensor:
        for key in (f"model.{name}", name):
            if key in weights:
                return weights[key]
        raise KeyError(f"HF Whisper checkpoint lacks parameter 'model.{name}'")

    out: dict[str, torch.Tensor] = {}

    def linear(ct2: str, hf: str) -> None:
        out[f"{ct2}/weight"], out[f"{ct2}/bias"] = get(f"{hf}.weight"), get(f"{hf}.bias")

    def norm(ct2: str, hf: str) -> None:
        out[f"{ct2}/gamma"], out[f"{ct2}/beta"] = get(f"{hf}.weight"), get(f"{hf}.bias")

    def fused(ct2: str, hf: str, parts: tuple[str, ...]) -> None:
        rows = [get(f"{hf}.{p}_proj.weight") for p in parts]  # each [d, d]
        out[f"{ct2}/weight"] = torch.cat(rows)  # [len(parts) * d, d]
        out[f"{ct2}/bias"] = torch.cat(
            [
                torch.zeros(w.shape[0], dtype=w.dtype) if p == "k" else get(f"{hf}.{p}_proj.bias")
                for p, w in zip(parts, rows)
            ]
        )

    def ffn(ct2: str, hf: str) -> None:
        norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")
        linear(f"{ct2}/ffn/linear_0", f"{hf}.fc1")
        linear(f"{ct2}/ffn/linear_1", f"{hf}.fc2")

    linear("encoder/conv1", "encoder.conv1")
    linear("encoder/conv2", "encoder.conv2")
    out["encoder/position_encodings/encodings"] = get("encoder.embed_positions.weight")
    for i in range(encoder_layers):
        ct2, hf = f"encoder/layer_{i}", f"encoder.layers.{i}"
        norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        fused(f"{ct2}/self_attention/linear_0", f"{hf}.self_attn", ("q", "k", "v"))
        linear(f"{ct2}/self_attention/linear_1", f"{hf}.self_attn.out_proj")
        ffn(ct2, hf)
    norm("encoder/layer_norm", "encoder.layer_norm")

    out["decoder/embeddings/weight"] = embed = get("decoder.embed_tokens.weight")
    out["decoder/position_encodings/encodings"] = get("decoder.embed_positions.weight")
    for i in range(decoder_layers):
        ct2, hf = f"decoder/layer_{i}", f"decoder.layers.{i}"
        norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        fused(f"{ct2}/self_attention/linear_0", f"{hf}.self_attn", ("q", "k", "v"))
        linear(f"{ct2}/self_attention/linear_1", f"{hf}.self_attn.out_proj")
        norm(f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
        linear(f"{ct2}/attention/linear_0", f"{hf}.encoder_attn.q_proj")
        fused(f"{ct2}/attention/linear_1", f"{hf}.encoder_attn", ("k", "v"))
        linear(f"{ct2}/attention/linear_2", f"{hf}.encoder_attn.out_proj")
        ffn(ct2, hf)
    norm("decoder/layer_norm", "decoder.layer_norm")

    proj = weights.get("proj_out.weight")  # absent when saved tied (safetensors drops the duplicate)
    if proj is not None and proj.data_ptr() != embed.data_ptr() and not torch.equal(proj, embed):
        raise ValueError(
            "proj_out.weight differs from model.decoder.embed_tokens.weight: untied output projections are not supported"
        )
    return out


def read_hf_whisper(model_dir: str | Path) -> tuple[dict[str, int], dict, dict[str, torch.Tensor]]:
    """Reads an HF Whisper directory: ``(WhisperConfig fields, WhisperGenerationDefaults fields, weights)``.

    The weights are keyed by CTranslate2 name (``ct2_weights_from_hf``) and keep their dtype on
    disk (float32 / float16 / bfloat16); ``load_weights`` casts them.

    Raises:
        FileNotFoundError: no ``config.json``, weights or tokenizer.
        ValueError: an unsupported variant (``whisper_config_fields``), untied ``proj_out``, or
            ``preprocessor_config.json`` disagreeing with ``num_mel_bins`` or our STFT settings.
        KeyError: a parameter or special token is missing.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    hf_config = read_json(model_dir / "config.json")
    config = whisper_config_fields(hf_config)
    mel_bins = preprocessor_num_mel_bins(model_dir)
    if mel_bins is not None and mel_bins != config["num_mel_bins"]:
        raise ValueError(
            f"{model_dir}: preprocessor_config.json feature_size {mel_bins} != "
            f"config.json num_mel_bins {config['num_mel_bins']}"
        )
    generation = generation_fields(model_dir, hf_config, config["vocab_size"], config["max_target_positions"])
    weights = ct2_weights_from_hf(load_hf_weights(model_dir), config["encoder_layers"], config["decoder_layers"])
    return config, generation, weights
