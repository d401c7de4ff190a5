"""Whisper (Radford et al. 2022) with paged self- and cross-attention KV.

Encoder: conv1 + GELU, conv2 (stride 2) + GELU, stored sinusoid positions,
pre-norm layers with ``F.scaled_dot_product_attention``, final layer norm.
Decoder: token + learned positions, pre-norm layers of self-attention over the
paged self-attention KV cache, cross-attention over the paged cross-attention
KV cache (written by the encoder service from ``compute_cross_kv``), FFN; the
output projection is tied to the token embedding.

Weights come from a CTranslate2 ``model.bin`` (``WhisperSpec``), or from an HF
directory renamed to those names (``shared.models.whisper_hf``); ``load_weights``
is the explicit name map. Over 300 lines: one model per file (encoder, decoder,
cross-KV projection, weight map and decode-step packing together).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels import decode_layer
from kernels.decode_layer import FusedDecodeLayer, LayerWeights
from shared.attention_metadata import AttentionMetadata
from shared.models.bfloat16 import bfloat16_attention
from shared.models.ct2_reader import load_ct2_weights
from shared.models.linear import Linear, PackedDecodeWeights, linear_act, linear_add, packed_product
from shared.models.norm import LayerNorm
from shared.models.quantize import Int8Parts
from shared.models.whisper_features import load_tokenizer, log_mel_spectrogram, special_token_ids
from shared.models.whisper_specials import WhisperSpecials

__all__ = [
    "WhisperConfig",
    "WhisperGenerationDefaults",
    "WhisperForConditionalGeneration",
    "load_tokenizer",
    "log_mel_spectrogram",
]


@dataclass(frozen=True)
class WhisperConfig:
    d_model: int = 384
    num_heads: int = 6
    head_dim: int = 64
    encoder_layers: int = 4
    decoder_layers: int = 4
    ffn_dim: int = 1536
    vocab_size: int = 51864
    num_mel_bins: int = 80
    max_source_positions: int = 1500
    max_target_positions: int = 448

    @classmethod
    def from_ct2_weights(cls, w: dict[str, torch.Tensor]) -> WhisperConfig:
        """Infer the shape of the model from its CTranslate2 variables."""
        vocab, d_model = w["decoder/embeddings/weight"].shape
        heads = int(w["encoder/num_heads"])
        count = lambda side: sum(1 for k in w if k.startswith(f"{side}/layer_") and k.endswith("ffn/linear_0/weight"))
        return cls(
            d_model=d_model,
            num_heads=heads,
            head_dim=d_model // heads,
            encoder_layers=count("encoder"),
            decoder_layers=count("decoder"),
            ffn_dim=w["encoder/layer_0/ffn/linear_0/weight"].shape[0],
            vocab_size=vocab,
            num_mel_bins=w["encoder/conv1/weight"].shape[1],
            max_source_positions=w["encoder/position_encodings/encodings"].shape[0],
            max_target_positions=w["decoder/position_encodings/encodings"].shape[0],
        )


@dataclass(frozen=True)
class WhisperGenerationDefaults:
    decoder_prompt_ids: list[int]
    eos_token_id: int
    suppress_tokens: list[int]
    begin_suppress_tokens: list[int]
    max_length: int = 448
    specials: WhisperSpecials | None = None  # language / task / timestamp tokens, alignment heads

    @classmethod
    def from_model_dir(cls, model_dir: Path, config: WhisperConfig) -> WhisperGenerationDefaults:
        """Read ``config.json`` (suppress lists) and ``tokenizer.json`` (special ids).

        English-only checkpoints (vocab 51864) are prompted with
        ``<|startoftranscript|><|notimestamps|>``; multilingual ones with
        ``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``.
        """
        with open(model_dir / "config.json", encoding="utf-8") as f:
            cfg = json.load(f)
        ids = special_token_ids(model_dir)
        prompt = ["<|startoftranscript|>", "<|notimestamps|>"]
        if config.vocab_size >= 51865:
            prompt[1:1] = ["<|en|>", "<|transcribe|>"]
        return cls(
            decoder_prompt_ids=[ids[t] for t in prompt],
            eos_token_id=ids["<|endoftext|>"],
            suppress_tokens=list(cfg.get("suppress_ids", [])),
            begin_suppress_tokens=list(cfg.get("suppress_ids_begin", [])),
            max_length=config.max_target_positions,
            specials=WhisperSpecials.from_token_ids(
                ids,
                config.vocab_size,
                cfg.get("lang_ids"),
                cfg.get("alignment_heads", ()),
                config.max_target_positions,
            ),
        )


class EncoderLayer(nn.Module):
    def __init__(self, c: WhisperConfig) -> None:
        super().__init__()
        self.h, self.dh = c.num_heads, c.head_dim
        self.attn_norm = LayerNorm(c.d_model)
        self.qkv = Linear(c.d_model, 3 * c.d_model)  # rows q, k, v
        self.attn_out = Linear(c.d_model, c.d_model)
        self.ffn_norm = LayerNorm(c.d_model)
        self.fc1 = Linear(c.d_model, c.ffn_dim)
        self.fc2 = Linear(c.ffn_dim, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.qkv, "mixed_bfloat16", False):  # --dtype bfloat16 on the CPU (shared.models.bfloat16)
            return self._forward_bfloat16(x)
        b, s, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, s, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)  # [3, B, H, S, Dh]
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [B, H, S, Dh]
        x = linear_add(self.attn_out, a.transpose(1, 2).reshape(b, s, d), x)
        return linear_add(self.fc2, linear_act(self.fc1, self.ffn_norm(x), "gelu", F.gelu), x)

    def _forward_bfloat16(self, x: torch.Tensor) -> torch.Tensor:
        """The same layer with bfloat16 products: q/k/v, attention and the FFN's hidden stay bfloat16 between
        products; the residual stream ``x`` and the norms are float32."""
        b, s, d = x.shape
        qkv = self.qkv.bfloat16_product(self.attn_norm(x)).view(b, s, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        a = bfloat16_attention(qkv[0], qkv[1], qkv[2])  # [B, H, S, Dh] bfloat16
        x = self.attn_out(a.transpose(1, 2).reshape(b, s, d), residual=x)
        return self.fc2(self.fc1.bfloat16_product(self.ffn_norm(x), "gelu"), residual=x)


class DecoderLayer(nn.Module):
    def __init__(self, c: WhisperConfig) -> None:
        super().__init__()
        self.h, self.dh = c.num_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.self_attn_norm = LayerNorm(c.d_model)
        self.self_qkv = Linear(c.d_model, 3 * c.d_model)  # rows q, k, v
        self.self_out = Linear(c.d_model, c.d_model)
        self.cross_attn_norm = LayerNorm(c.d_model)
        self.cross_q = Linear(c.d_model, c.d_model)
        self.cross_kv = Linear(c.d_model, 2 * c.d_model)  # rows k, v; applied to the encoder output
        self.cross_out = Linear(c.d_model, c.d_model)
        self.ffn_norm = LayerNorm(c.d_model)
        self.fc1 = Linear(c.d_model, c.ffn_dim)
        self.fc2 = Linear(c.ffn_dim, c.d_model)

    fused: FusedDecodeLayer | None = None  # set by pack_decode_weights where kernels.decode_layer serves this layer

    def forward(
        self, x: torch.Tensor, md: AttentionMetadata, self_kv: torch.Tensor, cross_kv: torch.Tensor
    ) -> torch.Tensor:
        if self.fused is not None and (y := self.fused.run(x, md, self_kv, cross_kv)) is not None:
            return y  # a CPU decode step in one C call, equal to the rest of this method bit for bit
        t, d = x.shape
        q, k, v = self.self_qkv(self.self_attn_norm(x)).view(t, 3, self.h, self.dh).unbind(1)  # [T, H, Dh] each
        attn = md.attn_backend
        attn.write_kv(self_kv, k, v, md)
        a = attn.paged(q, self_kv, md, scale=self.scale)
        x = linear_add(self.self_out, a.reshape(t, d), x)
        q = self.cross_q(self.cross_attn_norm(x)).view(t, self.h, self.dh)
        a = attn.cross(q, cross_kv, md, scale=self.scale, in_place=True)  # 1500 keys: read one-run blocks as a slice
        x = linear_add(self.cross_out, a.reshape(t, d), x)
        return linear_add(self.fc2, linear_act(self.fc1, self.ffn_norm(x), "gelu", F.gelu), x)

    def pack_decode_weights(self) -> int:
        """Packs this layer's decode-step products (not ``cross_kv``: the encoder side) and sets ``fused``; returns the bytes added."""
        added = sum(m.pack() for m in (self.self_qkv, self.self_out, self.cross_q, self.cross_out, self.fc1, self.fc2))
        self.fused = self._fused_decode_layer()
        return added

    def _fused_decode_layer(self) -> FusedDecodeLayer | None:
        """The C decode layer for this layer, or None (unpacked or int8 layers)."""
        qkv, o, cross_q, cross_o, fc1, fc2 = products = [
            packed_product(m) for m in (self.self_qkv, self.self_out, self.cross_q, self.cross_out, self.fc1, self.fc2)
        ]
        norms = (self.self_attn_norm, self.cross_attn_norm, self.ffn_norm)
        if (
            None in products
            or not all(n.use_kernel for n in norms)
            or len({n.eps for n in norms}) != 1
            or not decode_layer.is_available()
        ):
            return None
        return FusedDecodeLayer(
            LayerWeights(
                norms=tuple((n.weight.detach(), n.bias.detach()) for n in norms),
                eps=norms[0].eps,
                rms=False,
                pre_norm=True,
                qkv=qkv,
                o=o,
                cross_q=cross_q,
                cross_o=cross_o,
                fc1=fc1,
                fc2=fc2,
                activation="gelu",
                heads=self.h,
                head_dim=self.dh,
                scale=self.scale,
            )
        )


class WhisperForConditionalGeneration(PackedDecodeWeights, nn.Module):
    """Whisper encoder + paged decoder. Build with ``from_pretrained``."""

    def __init__(self, config: WhisperConfig, generation: WhisperGenerationDefaults | None = None) -> None:
        super().__init__()
        c = self.config = config
        self.generation = generation
        self.conv1 = nn.Conv1d(c.num_mel_bins, c.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        self.register_buffer("encoder_positions", torch.zeros(c.max_source_positions, c.d_model))
        self.encoder_layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.encoder_layers))
        self.encoder_norm = LayerNorm(c.d_model)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.decoder_positions = nn.Parameter(torch.zeros(c.max_target_positions, c.d_model))
        self.decoder_layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.decoder_layers))
        self.decoder_norm = LayerNorm(c.d_model)
        self.output_projection: nn.Module | None = None  # None: vocab_projection() with embed_tokens (tied)

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, dtype: torch.dtype = torch.float32
    ) -> WhisperForConditionalGeneration:
        """Load a CTranslate2 Whisper directory (``model.bin``, ``config.json``, ``tokenizer.json``)
        or an HF-format one (``config.json`` naming ``WhisperForConditionalGeneration``: ``shared.models.whisper_hf``).

        Weights (float16 on disk for CTranslate2) are cast to ``dtype``. Returns the model in eval mode.

        Raises:
            FileNotFoundError: a file is missing. ValueError: not a WhisperSpec model.bin, or an
                unsupported HF variant (``shared.models.whisper_hf.read_hf_whisper``).
        """
        model_dir = Path(model_dir)
        from shared.models import whisper_hf

        if not (model_dir / "model.bin").is_file() and whisper_hf.is_hf_whisper_dir(model_dir):
            config_fields, generation_fields, weights = whisper_hf.read_hf_whisper(model_dir)
            config, generation = WhisperConfig(**config_fields), WhisperGenerationDefaults(**generation_fields)
        else:
            weights = load_ct2_weights(model_dir / "model.bin", expected_spec="WhisperSpec")
            config = WhisperConfig.from_ct2_weights(weights)
            generation = WhisperGenerationDefaults.from_model_dir(model_dir, config)
        model = cls(config, generation)
        model.load_weights(weights)
        return model.to(dtype).eval()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy CTranslate2 ``WhisperSpec`` variables into the modules (explicit name map).

        Raises:
            KeyError: a variable is missing. ValueError: a shape does not match.
        """
        name_map: dict[str, torch.Tensor] = {}

        def copy_linear(prefix: str, mod: nn.Linear) -> None:
            name_map[f"{prefix}/weight"], name_map[f"{prefix}/bias"] = mod.weight, mod.bias

        def norm(prefix: str, mod: nn.LayerNorm) -> None:
            name_map[f"{prefix}/gamma"], name_map[f"{prefix}/beta"] = mod.weight, mod.bias

        copy_linear("encoder/conv1", self.conv1)
        copy_linear("encoder/conv2", self.conv2)
        name_map["encoder/position_encodings/encodings"] = self.encoder_positions
        for i, layer in enumerate(self.encoder_layers):
            p = f"encoder/layer_{i}"
            norm(f"{p}/self_attention/layer_norm", layer.attn_norm)
            copy_linear(f"{p}/self_attention/linear_0", layer.qkv)
            copy_linear(f"{p}/self_attention/linear_1", layer.attn_out)
            norm(f"{p}/ffn/layer_norm", layer.ffn_norm)
            copy_linear(f"{p}/ffn/linear_0", layer.fc1)
            copy_linear(f"{p}/ffn/linear_1", layer.fc2)
        norm("encoder/layer_norm", self.encoder_norm)
        name_map["decoder/embeddings/weight"] = self.embed_tokens.weight  # also the output projection
        name_map["decoder/position_encodings/encodings"] = self.decoder_positions
        for i, layer in enumerate(self.decoder_layers):
            p = f"decoder/layer_{i}"
            norm(f"{p}/self_attention/layer_norm", layer.self_attn_norm)
            copy_linear(f"{p}/self_attention/linear_0", layer.self_qkv)
            copy_linear(f"{p}/self_attention/linear_1", layer.self_out)
            norm(f"{p}/attention/layer_norm", layer.cross_attn_norm)
            copy_linear(f"{p}/attention/linear_0", layer.cross_q)
            copy_linear(f"{p}/attention/linear_1", layer.cross_kv)
            copy_linear(f"{p}/attention/linear_2", layer.cross_out)
            norm(f"{p}/ffn/layer_norm", layer.ffn_norm)
            copy_linear(f"{p}/ffn/linear_0", layer.fc1)
            copy_linear(f"{p}/ffn/linear_1", layer.fc2)
        norm("decoder/layer_norm", self.decoder_norm)

        if (
            "decoder/projection/weight" in weights
            and weights["decoder/projection/weight"].shape != self.embed_tokens.weight.shape
        ):
            raise ValueError("decoder/projection/weight is not tied to decoder/embeddings/weight")
        with torch.no_grad():
            for name, dst in name_map.items():
                if name not in weights:
                    raise KeyError(f"CTranslate2 Whisper weights lack variable {name!r}")
                src = weights[name]
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
                dst.copy_(src.to(dst.dtype))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def encode(self, input_features: torch.Tensor) -> torch.Tensor:
        """Encoder forward: ``[B, num_mel_bins, 3000]`` log-mel -> ``[B, 1500, d_model]``.

        Raises:
            ValueError: the features are not ``[B, num_mel_bins, 2 * max_source_positions]``.
        """
        c = self.config
        if input_features.dim() != 3 or tuple(input_features.shape[1:]) != (c.num_mel_bins, 2 * c.max_source_positions):
            raise ValueError(
                f"encoder expects [B, {c.num_mel_bins}, {2 * c.max_source_positions}] features, got {list(input_features.shape)}"
            )
        x = F.gelu(self.conv1(input_features.to(self.dtype)))  # [B, d, 3000]
        # Contiguous once here: a transposed x would keep its layout through every residual add, and each
        # layer norm and linear would copy it again (measured: docs/benchmarks.md, Measurements formerly in docstrings).
        x = F.gelu(self.conv2(x)).transpose(1, 2).contiguous()  # [B, 1500, d]
        x = x + self.encoder_positions
        for layer in self.encoder_layers:
            x = layer(x)
        return self.encoder_norm(x)

    @torch.inference_mode()
    def compute_cross_kv(self, encoder_out: torch.Tensor) -> torch.Tensor:
        """Every decoder layer's cross-attention K/V of an encoder output.

        ``[B, S, d_model]`` -> ``[num_decoder_layers, 2, B, S, num_heads, head_dim]``
        (index 0 = K, 1 = V), in the dtype of the ``cross_kv`` weights (the model dtype; bfloat16 with
        ``shared.models.linear.use_bfloat16_products``, bias rounded to bfloat16 too).
        """
        b, s, d = encoder_out.shape
        c = self.config
        mixed = c.decoder_layers and getattr(self.decoder_layers[0].cross_kv, "mixed_bfloat16", False)
        dtype = torch.bfloat16 if mixed else self.dtype
        x = encoder_out.to(dtype).reshape(b * s, d)  # [B*S, d]
        out = torch.empty(c.decoder_layers, 2, b, s, c.num_heads, c.head_dim, dtype=dtype, device=x.device)
        # Each K / V product lands in its final place (no stacked [L, B, S, 2d] copy permuted afterwards; bit-identical,
        # and faster: docs/benchmarks.md, Measurements formerly in docstrings).
        for layer_out, layer in zip(out, self.decoder_layers):
            proj = layer.cross_kv
            # int8 (shared.models.quantize), or oneDNN's packed weight where it won (use_onednn_encoder): one product,
            # copied into place
            if not isinstance(proj, nn.Linear) or getattr(proj, "onednn", None) is not None:
                layer_out.copy_(proj(x).view(b, s, 2, c.num_heads, c.head_dim).permute(2, 0, 1, 3, 4))
                continue
            for i in range(2):  # weight rows: k, then v
                torch.addmm(
                    proj.bias[i * d : (i + 1) * d].to(dtype),
                    x,
                    proj.weight[i * d : (i + 1) * d].t(),
                    out=layer_out[i].view(b * s, d),
                )
        return out

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        self_kv_cache: torch.Tensor,
        cross_kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Decoder forward over a flat varlen batch.

        Args:
            input_ids: ``[T]`` int64. positions: ``[T]`` int64 decoder positions.
            attn_metadata: slot mapping, block tables and lengths of this step.
            self_kv_cache: ``[num_decoder_layers, 2, num_blocks, block_size, H, Dh]``;
                this step's K/V are written at ``slot_mapping`` before attending.
            cross_kv_cache: same layout, already holding each sequence's cross-attention KV.

        Returns:
            ``[T, d_model]`` final hidden states (after the decoder layer norm).
        """
        x = self.embed_tokens(input_ids) + self.decoder_positions[positions]  # [T, d]
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, attn_metadata, self_kv_cache[i], cross_kv_cache[i])
        return self.decoder_norm(x)

    def use_onednn_encoder(self) -> int:
        """The encoder layers' linears and the decoder layers' ``cross_kv`` (``compute_cross_kv``) use oneDNN's
        packed product where it beats ``F.linear`` on a window's ``max_source_positions`` rows here
        (``Linear.use_onednn``; float32 CPU only). Returns how many do."""
        rows = self.config.max_source_positions
        linears = [lin for layer in self.encoder_layers for lin in (layer.qkv, layer.attn_out, layer.fc1, layer.fc2)]
        linears += [layer.cross_kv for layer in self.decoder_layers]
        return sum(lin.use_onednn(rows) for lin in linears if isinstance(lin, Linear))

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, d_model]`` -> ``[N, vocab_size]`` float32 (tied output projection).

        Runs under ``no_grad`` (not inference mode) so samplers may edit the
        logits in place.
        """
        if self.output_projection is not None:  # e.g. int8 (shared.models.quantize)
            return self.output_projection(hidden).float()
        return self._vocab_projection(hidden).float()

    def _projection_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight

    def _decoder_layers(self) -> nn.ModuleList:
        return self.decoder_layers

    def int8_parts(self) -> Int8Parts:
        """What ``--quantize int8`` converts (``shared.models.quantize``): the fused ``cross_kv`` of each decoder layer
        is the cross-attention K/V projection; the output projection is the tied embedding."""
        return Int8Parts(
            encoder_layers=self.encoder_layers,
            decoder_layers=self.decoder_layers,
            cross_kv=tuple((layer, "cross_kv") for layer in self.decoder_layers),
            output_weight=self._projection_weight(),
        )
