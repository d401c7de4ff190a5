"""BART (Lewis et al. 2019) with paged self- and cross-attention KV; the base of mBART and Marian.

One layer stack covers the family, switched by ``BartConfig`` flags:

=========  ========  ===================  ==================  =================
variant    norm      positions            layernorm_embedding final layer norms
=========  ========  ===================  ==================  =================
BART       post      learned, offset 2    yes                 no
mBART      pre       learned, offset 2    yes                 yes
Marian     post      sinusoidal (stored)  no                  no
=========  ========  ===================  ==================  =================

Token embeddings are multiplied by ``sqrt(d_model)`` when ``scale_embedding``;
logits are ``lm_head(x) + final_logits_bias``; ``lm_head`` is the decoder
embedding unless the checkpoint unties it. Attention is scaled by
``head_dim ** -0.5``. Weights: HF names (``load_weights`` is the explicit map).
Over 300 lines: one model per file (the family's encoder, decoder, weight map and
decode-step packing together).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from transformers.activations import ACT2FN

from kernels import decode_layer
from kernels.decode_layer import FusedDecodeLayer, LayerWeights
from kernels.packed_linear import ACTIVATIONS
from shared.attention_metadata import AttentionMetadata
from shared.models.encoder_attention import encoder_attention, right_padded_lengths
from shared.models.hf_checkpoint import TextGenerationDefaults, copy_weights, linear_names, load_hf_weights, read_json
from shared.models.linear import (
    FusedPacked,
    Linear,
    PackedDecodeWeights,
    fused_products,
    linear_act,
    linear_add,
    pack_fused,
    packed_product,
)
from shared.models.norm import LayerNorm
from shared.models.quantize import Int8Parts

__all__ = ["BartConfig", "BartForConditionalGeneration", "sinusoidal_positions"]

POSITION_OFFSET = 2  # BART/mBART learned positions start at row 2 (fairseq legacy)


@dataclass(frozen=True)
class BartConfig:
    vocab_size: int
    d_model: int
    num_heads: int  # decoder heads (the cross-attention KV layout)
    encoder_heads: int
    encoder_layers: int
    decoder_layers: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    max_source_positions: int
    max_target_positions: int
    activation: str = "gelu"
    scale_embedding: bool = False
    pre_norm: bool = False
    layernorm_embedding: bool = True
    final_layer_norm: bool = False
    sinusoidal_positions: bool = False
    share_embeddings: bool = True
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @classmethod
    def from_hf(cls, c: dict, **variant) -> BartConfig:
        """From an HF Bart/MBart/Marian config dict; ``variant`` sets the family flags."""
        max_pos = c.get("max_position_embeddings", 1024)
        base = cls(
            vocab_size=c["vocab_size"],
            d_model=c["d_model"],
            num_heads=c["decoder_attention_heads"],
            encoder_heads=c["encoder_attention_heads"],
            encoder_layers=c["encoder_layers"],
            decoder_layers=c["decoder_layers"],
            encoder_ffn_dim=c["encoder_ffn_dim"],
            decoder_ffn_dim=c["decoder_ffn_dim"],
            max_source_positions=max_pos,
            max_target_positions=max_pos,
            activation=c.get("activation_function", "gelu"),
            scale_embedding=bool(c.get("scale_embedding", False)),
            share_embeddings=c.get("share_encoder_decoder_embeddings", True),
            tie_word_embeddings=c.get("tie_word_embeddings", True),
        )
        return replace(base, **variant)


def sinusoidal_positions(n_pos: int, dim: int) -> torch.Tensor:
    """Marian's table ``[n_pos, dim]``: sin features in the first half, cos in the second (not interleaved)."""
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    j = torch.arange(dim, dtype=torch.float64)[None, :]
    angle = pos / torch.pow(10000.0, 2 * torch.div(j, 2, rounding_mode="floor") / dim)  # [n_pos, dim]
    sentinel = (dim + 1) // 2
    out = torch.empty(n_pos, dim, dtype=torch.float64)
    out[:, :sentinel] = torch.sin(angle[:, 0::2])
    out[:, sentinel:] = torch.cos(angle[:, 1::2])
    return out.float()


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (Linear(d, d) for _ in range(4))

    packed_qkv: FusedPacked | None = None  # set by DecoderLayer.pack_decode_weights (self-attention)

    def names(self, p: str) -> dict[str, torch.Tensor]:
        return {
            k: v
            for n in ("q_proj", "k_proj", "v_proj", "out_proj")
            for k, v in linear_names(f"{p}.{n}", getattr(self, n)).items()
        }

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, d] -> 3 x [T, d]``: q, k, v (one packed product on decode steps once packed)."""
        return fused_products(h, (self.q_proj, self.k_proj, self.v_proj), self.packed_qkv)


class Block(nn.Module):
    """Residual wrapper: pre-norm ``x + f(ln(x))`` or post-norm ``ln(x + f(x))``; ``f(h, residual)`` returns
    ``residual + f(h)`` (its last projection adds it: ``linear_add``)."""

    def __init__(self, d: int, pre_norm: bool) -> None:
        super().__init__()
        self.norm, self.pre_norm = LayerNorm(d), pre_norm

    def __call__(self, x: torch.Tensor, f) -> torch.Tensor:
        return f(self.norm(x), x) if self.pre_norm else self.norm(f(x, x))


class _FeedForward(nn.Module):
    """What BART's encoder and decoder layers share: ``fc1``, ``fc2``, ``act`` / ``act_name`` (set by the layer)."""

    def _ffn(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + fc2(act(fc1(h)))`` (the FFN block's ``f``)."""
        return linear_add(self.fc2, linear_act(self.fc1, h, self.act_name, self.act), residual)


class EncoderLayer(_FeedForward):
    def __init__(self, c: BartConfig) -> None:
        super().__init__()
        self.self_attn, self.attn_block = Attention(c.d_model, c.encoder_heads), Block(c.d_model, c.pre_norm)
        self.fc1, self.fc2 = Linear(c.d_model, c.encoder_ffn_dim), Linear(c.encoder_ffn_dim, c.d_model)
        self.ffn_block, self.act, self.act_name = Block(c.d_model, c.pre_norm), ACT2FN[c.activation], c.activation

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, lengths: list[int] | None = None) -> torch.Tensor:
        """``x`` ``[B, S, d]``; ``mask`` ``[B, 1, 1, S]`` bool (True = real key) or None; ``lengths``: attend one
        sequence at a time (``shared.models.encoder_attention``)."""
        b, s, d = x.shape
        a = self.self_attn

        def attend(h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            q, k, v = (
                p(h).view(b, s, a.h, a.dh).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj)
            )  # [B, H, S, Dh]
            out = encoder_attention(q, k, v, mask, lengths=lengths).transpose(1, 2).reshape(b, s, d)
            return linear_add(a.out_proj, out, residual)

        x = self.attn_block(x, attend)
        return self.ffn_block(x, self._ffn)


class DecoderLayer(_FeedForward):
    def __init__(self, c: BartConfig) -> None:
        super().__init__()
        self.self_attn, self.self_block = Attention(c.d_model, c.num_heads), Block(c.d_model, c.pre_norm)
        self.encoder_attn, self.cross_block = Attention(c.d_model, c.num_heads), Block(c.d_model, c.pre_norm)
        self.fc1, self.fc2 = Linear(c.d_model, c.decoder_ffn_dim), Linear(c.decoder_ffn_dim, c.d_model)
        self.ffn_block, self.act, self.act_name = Block(c.d_model, c.pre_norm), ACT2FN[c.activation], c.activation

    fused: FusedDecodeLayer | None = None  # set by pack_decode_weights where kernels.decode_layer serves this layer

    def forward(
        self, x: torch.Tensor, md: AttentionMetadata, self_kv: torch.Tensor, cross_kv: torch.Tensor
    ) -> torch.Tensor:
        if self.fused is not None and (y := self.fused.run(x, md, self_kv, cross_kv)) is not None:
            return y  # a CPU decode step in one C call, equal to the rest of this method bit for bit
        t, d = x.shape

        def self_attend(h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            a = self.self_attn
            q, k, v = (p.view(t, a.h, a.dh) for p in a.qkv(h))  # [T, H, Dh]
            md.attn_backend.write_kv(self_kv, k, v, md)
            out = md.attn_backend.paged(q, self_kv, md, scale=a.dh**-0.5)
            return linear_add(a.out_proj, out.reshape(t, d), residual)

        def cross_attend(h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            a = self.encoder_attn
            out = md.attn_backend.cross(a.q_proj(h).view(t, a.h, a.dh), cross_kv, md, scale=a.dh**-0.5)
            return linear_add(a.out_proj, out.reshape(t, d), residual)

        x = self.self_block(x, self_attend)
        x = self.cross_block(x, cross_attend)
        return self.ffn_block(x, self._ffn)

    def pack_decode_weights(self) -> int:
        """Packs this layer's decode-step products (self q/k/v fused); returns the bytes added."""
        a, c = self.self_attn, self.encoder_attn
        a.packed_qkv = pack_fused((a.q_proj, a.k_proj, a.v_proj))
        fused = a.packed_qkv.weight.data.nbytes if a.packed_qkv is not None else 0
        added = fused + sum(m.pack() for m in (a.out_proj, c.q_proj, c.out_proj, self.fc1, self.fc2))
        self.fused = self._fused_decode_layer()
        return added

    def _fused_decode_layer(self) -> FusedDecodeLayer | None:
        """The C decode layer for this layer, or None (unpacked or int8 layers, an activation the kernel lacks)."""
        a, c = self.self_attn, self.encoder_attn
        blocks = (self.self_block, self.cross_block, self.ffn_block)
        o, cross_q, cross_o, fc1, fc2 = products = [
            packed_product(m) for m in (a.out_proj, c.q_proj, c.out_proj, self.fc1, self.fc2)
        ]
        if (
            self.act_name not in ACTIVATIONS
            or a.packed_qkv is None
            or None in products
            or not all(b.norm.use_kernel and b.norm.weight is not None for b in blocks)
            or len({b.norm.eps for b in blocks}) != 1
            or len({b.pre_norm for b in blocks}) != 1
            or not decode_layer.is_available()
        ):
            return None
        return FusedDecodeLayer(
            LayerWeights(
                norms=tuple(
                    (b.norm.weight.detach(), b.norm.bias.detach() if b.norm.bias is not None else None) for b in blocks
                ),
                eps=blocks[0].norm.eps,
                rms=False,
                pre_norm=blocks[0].pre_norm,
                qkv=(a.packed_qkv.weight, a.packed_qkv.bias),
                o=o,
                cross_q=cross_q,
                cross_o=cross_o,
                fc1=fc1,
                fc2=fc2,
                activation=self.act_name,
                heads=a.h,
                head_dim=a.dh,
                scale=a.dh**-0.5,
            )
        )


class Stack(nn.Module):
    """Embeddings, optional layernorm_embedding, layers, optional final layer norm of one side."""

    def __init__(self, c: BartConfig, layer_cls, n_layers: int, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.embed_scale = math.sqrt(c.d_model) if c.scale_embedding else 1.0
        if c.sinusoidal_positions:
            self.register_buffer(
                "embed_positions", sinusoidal_positions(c.max_source_positions, c.d_model), persistent=False
            )
            self.offset = 0
        else:
            self.embed_positions = nn.Parameter(torch.zeros(c.max_source_positions + POSITION_OFFSET, c.d_model))
            self.offset = POSITION_OFFSET
        self.layernorm_embedding = LayerNorm(c.d_model) if c.layernorm_embedding else None
        self.layers = nn.ModuleList(layer_cls(c) for _ in range(n_layers))
        self.layer_norm = LayerNorm(c.d_model) if c.final_layer_norm else None

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids) * self.embed_scale + self.embed_positions[positions + self.offset]
        return self.layernorm_embedding(x) if self.layernorm_embedding is not None else x

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(x) if self.layer_norm is not None else x

    def names(self, p: str) -> dict[str, torch.Tensor]:
        m: dict[str, torch.Tensor] = {}
        if isinstance(self.embed_positions, nn.Parameter):
            m[f"{p}.embed_positions.weight"] = self.embed_positions
        for ln in ("layernorm_embedding", "layer_norm"):
            if getattr(self, ln) is not None:
                m[f"{p}.{ln}.weight"], m[f"{p}.{ln}.bias"] = getattr(self, ln).weight, getattr(self, ln).bias
        return m


def _norm_names(p: str, block: Block) -> dict[str, torch.Tensor]:
    return {f"{p}.weight": block.norm.weight, f"{p}.bias": block.norm.bias}


class BartForConditionalGeneration(PackedDecodeWeights, nn.Module):
    """BART-family encoder + paged decoder. Build with ``from_pretrained`` (an HF directory)."""

    input_modality = "text"
    batch_invariant_attention = False  # True: encoder attention one sequence at a time (set for int8: quantize)
    variant: dict = {}  # BartConfig flags of the architecture (subclasses override)

    def __init__(self, config: BartConfig, generation: TextGenerationDefaults | None = None) -> None:
        super().__init__()
        c = self.config = config
        self.generation = generation
        dec_embed = nn.Embedding(c.vocab_size, c.d_model)
        enc_embed = dec_embed if c.share_embeddings else nn.Embedding(c.vocab_size, c.d_model)
        self.encoder = Stack(c, EncoderLayer, c.encoder_layers, enc_embed)
        self.decoder = Stack(c, DecoderLayer, c.decoder_layers, dec_embed)
        self.lm_head = None if c.tie_word_embeddings else Linear(c.d_model, c.vocab_size, bias=False)
        self.register_buffer("final_logits_bias", torch.zeros(1, c.vocab_size))
        self.output_projection: nn.Module | None = None  # int8: set_output_projection (shared.models.quantize)

    @classmethod
    def hf_generation_config(cls, hf: dict) -> dict:
        """Hook: fill generation fields the architecture implies (Marian: start = pad)."""
        return hf

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> BartForConditionalGeneration:
        """Loads an HF directory of this architecture; returns the model in eval mode with weights in ``dtype``."""
        model_dir = Path(model_dir)
        hf = read_json(model_dir / "config.json")
        config = BartConfig.from_hf(hf, **cls.variant)
        model = cls(
            config,
            TextGenerationDefaults.from_model_dir(model_dir, cls.hf_generation_config(hf), config.max_target_positions),
        )
        model.load_weights(load_hf_weights(model_dir))
        return model.to(dtype).eval()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copies HF parameters (``model.encoder.layers.{i}.self_attn.q_proj.weight`` ...) into the modules.

        Raises:
            KeyError: a parameter is missing. ValueError: a shape does not match.
        """
        m: dict[str, torch.Tensor] = {"model.decoder.embed_tokens.weight": self.decoder.embed_tokens.weight}
        aliases = {
            "model.decoder.embed_tokens.weight": ["model.shared.weight"],
            "model.encoder.embed_tokens.weight": ["model.shared.weight"],
            "lm_head.weight": ["model.shared.weight", "model.decoder.embed_tokens.weight"],
        }
        if self.encoder.embed_tokens is not self.decoder.embed_tokens:
            m["model.encoder.embed_tokens.weight"] = self.encoder.embed_tokens.weight
        if self.lm_head is not None:
            m["lm_head.weight"] = self.lm_head.weight
        m.update(self.encoder.names("model.encoder"))
        m.update(self.decoder.names("model.decoder"))
        for i, layer in enumerate(self.encoder.layers):
            p = f"model.encoder.layers.{i}"
            m.update(layer.self_attn.names(f"{p}.self_attn"))
            m.update(_norm_names(f"{p}.self_attn_layer_norm", layer.attn_block))
            m.update(linear_names(f"{p}.fc1", layer.fc1) | linear_names(f"{p}.fc2", layer.fc2))
            m.update(_norm_names(f"{p}.final_layer_norm", layer.ffn_block))
        for i, layer in enumerate(self.decoder.layers):
            p = f"model.decoder.layers.{i}"
            m.update(layer.self_attn.names(f"{p}.self_attn"))
            m.update(_norm_names(f"{p}.self_attn_layer_norm", layer.self_block))
            m.update(layer.encoder_attn.names(f"{p}.encoder_attn"))
            m.update(_norm_names(f"{p}.encoder_attn_layer_norm", layer.cross_block))
            m.update(linear_names(f"{p}.fc1", layer.fc1) | linear_names(f"{p}.fc2", layer.fc2))
            m.update(_norm_names(f"{p}.final_layer_norm", layer.ffn_block))
        if "final_logits_bias" in weights:
            m["final_logits_bias"] = self.final_logits_bias
        copy_weights(m, weights, aliases)

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    @torch.inference_mode()
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder forward: ``[B, S]`` token ids (+ ``[B, S]`` 1/0 mask) -> ``[B, S, d_model]``."""
        b, s = input_ids.shape
        x = self.encoder.embed(input_ids, torch.arange(s, device=input_ids.device))  # [B, S, d]
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()  # [B, 1, 1, S]
        lengths = right_padded_lengths(attention_mask) if self.batch_invariant_attention else None
        for layer in self.encoder.layers:
            x = layer(x, mask, lengths)
        return self.encoder.finish(x)

    @torch.inference_mode()
    def compute_cross_kv(self, encoder_out: torch.Tensor) -> torch.Tensor:
        """``[B, S, d_model]`` -> ``[num_decoder_layers, 2, B, S, num_heads, head_dim]`` (0 = K, 1 = V)."""
        b, s, _ = encoder_out.shape
        c = self.config
        x = encoder_out.to(self.dtype)
        kv = torch.stack(
            [torch.stack([layer.encoder_attn.k_proj(x), layer.encoder_attn.v_proj(x)]) for layer in self.decoder.layers]
        )
        return kv.view(c.decoder_layers, 2, b, s, c.num_heads, c.head_dim).contiguous()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        self_kv_cache: torch.Tensor,
        cross_kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Decoder over a flat varlen batch: ``input_ids``/``positions`` ``[T]`` -> ``[T, d_model]``.

        Caches: ``[num_decoder_layers, 2, num_blocks, block_size, H, Dh]``; this
        step's K/V are written at ``slot_mapping`` before attending.
        """
        x = self.decoder.embed(input_ids, positions)  # [T, d]
        for i, layer in enumerate(self.decoder.layers):
            x = layer(x, attn_metadata, self_kv_cache[i], cross_kv_cache[i])
        return self.decoder.finish(x)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, d_model]`` -> ``[N, vocab_size]`` float32: ``lm_head(hidden) + final_logits_bias``."""
        if self.output_projection is not None:  # int8, the bias included (shared.models.quantize)
            return self.output_projection(hidden).float()
        return self._vocab_projection(hidden, self.final_logits_bias[0]).float()

    def _projection_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.lm_head is not None else self.decoder.embed_tokens.weight

    def int8_parts(self) -> Int8Parts:
        """What ``--quantize int8`` converts (``shared.models.quantize``): each decoder layer's cross-attention
        ``k_proj`` and ``v_proj`` are the cross-KV projections; the output projection is ``lm_head`` (or the tied
        decoder embedding) with ``final_logits_bias``."""
        return Int8Parts(
            encoder_layers=self.encoder.layers,
            decoder_layers=self.decoder.layers,
            cross_kv=tuple((layer.encoder_attn, n) for layer in self.decoder.layers for n in ("k_proj", "v_proj")),
            output_weight=self._projection_weight(),
            output_bias=self.final_logits_bias[0],
        )

    def _decoder_layers(self) -> nn.ModuleList:
        return self.decoder.layers
