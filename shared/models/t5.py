"""T5 (Raffel et al. 2020; v1.0 and v1.1 / flan) with paged self- and cross-attention KV.

Pre-norm layers with RMS layer norm (no mean subtraction, no bias), no
attention scaling (folded into the weights), no position embeddings: every
self-attention adds a learned relative position bias indexed by a bucket of
``key_pos - query_pos`` (bidirectional buckets in the encoder, causal ones in
the decoder; only layer 0 stores the table, all layers reuse it). The paged
decoder turns the causal table into a per-distance bias ``[H, N]`` that
``kernels.paged_attention.paged_attention`` applies from each query's absolute
position to every cached key. Cross-attention has no bias.

v1.0: ReLU FFN, output projection tied to the embedding with hidden states
scaled by ``d_model ** -0.5``. v1.1 / flan: gated-GELU FFN (``wi_0``, ``wi_1``),
no output scaling, untied ``lm_head`` (when the checkpoint stores one).
Decoder start token = pad. Weights: HF names (``load_weights`` is the explicit map).
Over 300 lines: one model per file (encoder, decoder, position bias, weight map and
decode-step packing together).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers.activations import ACT2FN

from kernels import decode_layer
from kernels.cpu_norm import reference_rms_norm, rms_norm
from kernels.decode_layer import FusedDecodeLayer, LayerWeights
from kernels.packed_linear import ACTIVATIONS
from shared.attention_metadata import AttentionMetadata
from shared.models.encoder_attention import encoder_attention, right_padded_lengths
from shared.models.hf_checkpoint import (
    TextGenerationDefaults,
    copy_weights,
    load_hf_weights,
    max_source_positions,
    read_json,
)
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
from shared.models.quantize import Int8Parts

__all__ = ["T5Config", "T5ForConditionalGeneration", "relative_position_bucket"]


@dataclass(frozen=True)
class T5Config:
    vocab_size: int
    d_model: int
    num_heads: int
    head_dim: int
    d_ff: int
    encoder_layers: int
    decoder_layers: int
    num_buckets: int = 32
    max_distance: int = 128
    activation: str = "relu"
    gated: bool = False
    tie_word_embeddings: bool = True
    scale_decoder_outputs: bool = True
    eps: float = 1e-6
    max_source_positions: int = 512
    max_target_positions: int = 512

    @classmethod
    def from_hf(cls, c: dict, model_dir: Path) -> T5Config:
        """From an HF ``T5Config`` dict (``feed_forward_proj`` ``relu`` or ``gated-gelu``).

        transformers 4 marks v1.1 by ``tie_word_embeddings: false`` (separate
        ``lm_head``, no output scaling); transformers 5 always ties and records
        the scaling in ``scale_decoder_outputs``. Both are read.
        """
        tied = c.get("tie_word_embeddings", True)
        proj = c.get("feed_forward_proj", "relu")
        gated = proj.startswith("gated-")
        act = proj.removeprefix("gated-")
        max_pos = max_source_positions(model_dir, c, 512)
        return cls(
            vocab_size=c["vocab_size"],
            d_model=c["d_model"],
            num_heads=c["num_heads"],
            head_dim=c["d_kv"],
            d_ff=c["d_ff"],
            encoder_layers=c["num_layers"],
            decoder_layers=c.get("num_decoder_layers") or c["num_layers"],
            num_buckets=c.get("relative_attention_num_buckets", 32),
            max_distance=c.get("relative_attention_max_distance", 128),
            activation="gelu_new" if act == "gelu" else act,
            gated=gated,
            tie_word_embeddings=tied,
            scale_decoder_outputs=c.get("scale_decoder_outputs", tied),
            eps=c.get("layer_norm_epsilon", 1e-6),
            max_source_positions=max_pos,
            max_target_positions=max_pos,
        )


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of ``key_pos - query_pos`` (Mesh TensorFlow ``_relative_position_bucket``).

    Half the buckets are exact small distances, the rest logarithmic bins up to
    ``max_distance`` (farther shares the last bin). Bidirectional splits the
    buckets between positive and negative distances; causal clamps positive to 0.
    Returns int64 of the input's shape, in ``[0, num_buckets)``.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        relative_position = relative_position.abs()
    else:
        relative_position = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = (
        max_exact
        + (
            torch.log(relative_position.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, relative_position, large)


class RMSNorm(nn.Module):
    """T5 layer norm: ``w * x / sqrt(mean(x^2) + eps)`` (variance in float32; ``kernels.cpu_norm.rms_norm``)."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    use_kernel = True  # False: HF's formula in torch (shared.models.quantize sets it for int8 models)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_kernel:
            return reference_rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)  # the C kernel for float32 CPU, else HF's formula


class Attention(nn.Module):
    def __init__(self, c: T5Config) -> None:
        super().__init__()
        inner = c.num_heads * c.head_dim
        self.h, self.dh = c.num_heads, c.head_dim
        self.q, self.k, self.v = (Linear(c.d_model, inner, bias=False) for _ in range(3))
        self.o = Linear(inner, c.d_model, bias=False)

    packed_qkv: FusedPacked | None = None  # set by DecoderLayer.pack_decode_weights (self-attention)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, d] -> 3 x [T, inner]``: q, k, v (one packed product on decode steps once packed)."""
        return fused_products(h, (self.q, self.k, self.v), self.packed_qkv)


class FeedForward(nn.Module):
    def __init__(self, c: T5Config) -> None:
        super().__init__()
        self.gated = c.gated
        self.act_name, self.act = c.activation, ACT2FN[c.activation]
        self.wi_0 = Linear(c.d_model, c.d_ff, bias=False)  # "wi" when not gated
        self.wi_1 = Linear(c.d_model, c.d_ff, bias=False) if c.gated else None
        self.wo = Linear(c.d_ff, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + FFN(x)``."""
        h = linear_act(self.wi_0, x, self.act_name, self.act)
        return linear_add(self.wo, h * self.wi_1(x) if self.gated else h, residual)


class EncoderLayer(nn.Module):
    def __init__(self, c: T5Config) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(c.d_model, c.eps), Attention(c)
        self.ffn_norm, self.ffn = RMSNorm(c.d_model, c.eps), FeedForward(c)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
        """``x`` ``[B, S, d]``; ``bias`` ``[B, H, S, S]`` position bias with -inf on padded keys; ``lengths``: attend
        one sequence at a time (``shared.models.encoder_attention``)."""
        b, s, _ = x.shape
        a, h = self.attn, self.attn_norm(x)
        q, k, v = (p(h).view(b, s, a.h, a.dh).transpose(1, 2) for p in (a.q, a.k, a.v))  # [B, H, S, Dh]
        out = encoder_attention(q, k, v, bias, scale=1.0, lengths=lengths)  # [B, H, S, Dh]
        x = linear_add(a.o, out.transpose(1, 2).reshape(b, s, a.h * a.dh), x)
        return self.ffn(self.ffn_norm(x), x)


class DecoderLayer(nn.Module):
    def __init__(self, c: T5Config) -> None:
        super().__init__()
        self.self_norm, self.self_attn = RMSNorm(c.d_model, c.eps), Attention(c)
        self.cross_norm, self.cross_attn = RMSNorm(c.d_model, c.eps), Attention(c)
        self.ffn_norm, self.ffn = RMSNorm(c.d_model, c.eps), FeedForward(c)

    fused: FusedDecodeLayer | None = None  # set by pack_decode_weights where kernels.decode_layer serves this layer

    def forward(
        self, x: torch.Tensor, md: AttentionMetadata, self_kv: torch.Tensor, cross_kv: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        if self.fused is not None and (y := self.fused.run(x, md, self_kv, cross_kv, bias)) is not None:
            return y  # a CPU decode step in one C call, equal to the rest of this method bit for bit
        t = x.shape[0]
        a, h = self.self_attn, self.self_norm(x)
        q, k, v = (p.view(t, a.h, a.dh) for p in a.qkv(h))  # [T, H, Dh]
        attn = md.attn_backend
        attn.write_kv(self_kv, k, v, md)
        out = attn.paged(q, self_kv, md, scale=1.0, position_bias=bias)
        x = linear_add(a.o, out.reshape(t, -1), x)
        a = self.cross_attn
        q = a.q(self.cross_norm(x)).view(t, a.h, a.dh)
        out = attn.cross(q, cross_kv, md, scale=1.0)
        x = linear_add(a.o, out.reshape(t, -1), x)
        return self.ffn(self.ffn_norm(x), x)

    def pack_decode_weights(self) -> int:
        """Packs this layer's decode-step products (self q/k/v fused) and sets ``fused``; returns the bytes added."""
        a, c, f = self.self_attn, self.cross_attn, self.ffn
        a.packed_qkv = pack_fused((a.q, a.k, a.v))
        fused = a.packed_qkv.weight.data.nbytes if a.packed_qkv is not None else 0
        added = fused + sum(m.pack() for m in (a.o, c.q, c.o, f.wi_0, f.wi_1, f.wo) if m is not None)
        self.fused = self._fused_decode_layer()
        return added

    def _fused_decode_layer(self) -> FusedDecodeLayer | None:
        """The C decode layer for this layer, or None: gated FFNs (T5 v1.1) and unpacked or int8 layers stay in Python."""
        a, c, f = self.self_attn, self.cross_attn, self.ffn
        norms = (self.self_norm, self.cross_norm, self.ffn_norm)
        o, cross_q, cross_o, fc1, fc2 = products = [packed_product(m) for m in (a.o, c.q, c.o, f.wi_0, f.wo)]
        if (
            f.gated
            or f.act_name not in ACTIVATIONS
            or a.packed_qkv is None
            or None in products
            or not all(n.use_kernel for n in norms)
            or len({n.eps for n in norms}) != 1
            or not decode_layer.is_available()
        ):
            return None
        return FusedDecodeLayer(
            LayerWeights(
                norms=tuple((n.weight.detach(), None) for n in norms),
                eps=norms[0].eps,
                rms=True,
                pre_norm=True,
                qkv=(a.packed_qkv.weight, a.packed_qkv.bias),
                o=o,
                cross_q=cross_q,
                cross_o=cross_o,
                fc1=fc1,
                fc2=fc2,
                activation=f.act_name,
                heads=a.h,
                head_dim=a.dh,
                scale=1.0,
            )
        )


class T5ForConditionalGeneration(PackedDecodeWeights, nn.Module):
    """T5 encoder + paged decoder. Build with ``from_pretrained`` (an HF directory)."""

    input_modality = "text"
    batch_invariant_attention = False  # True: encoder attention one sequence at a time (set for int8: quantize)

    def __init__(self, config: T5Config, generation: TextGenerationDefaults | None = None) -> None:
        super().__init__()
        c = self.config = config
        self.generation = generation
        self.shared = nn.Embedding(c.vocab_size, c.d_model)
        self.encoder_bias = nn.Embedding(c.num_buckets, c.num_heads)  # encoder.block.0...relative_attention_bias
        self.encoder_layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.encoder_layers))
        self.encoder_norm = RMSNorm(c.d_model, c.eps)
        self.decoder_bias = nn.Embedding(c.num_buckets, c.num_heads)
        self.decoder_layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.decoder_layers))
        self.decoder_norm = RMSNorm(c.d_model, c.eps)
        self.lm_head = None if c.tie_word_embeddings else Linear(c.d_model, c.vocab_size, bias=False)
        self.output_projection: nn.Module | None = None  # int8: set_output_projection (shared.models.quantize)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> T5ForConditionalGeneration:
        """Loads an HF T5 directory; returns the model in eval mode with weights in ``dtype``."""
        model_dir = Path(model_dir)
        hf = read_json(model_dir / "config.json")
        config = T5Config.from_hf(hf, model_dir)
        hf.setdefault("decoder_start_token_id", hf.get("pad_token_id", 0))  # T5 starts decoding from pad
        model = cls(config, TextGenerationDefaults.from_model_dir(model_dir, hf, config.max_target_positions))
        model.load_weights(load_hf_weights(model_dir))
        return model.to(dtype).eval()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copies HF T5 parameters into the modules (explicit name map).

        Raises:
            KeyError: a parameter is missing. ValueError: a shape does not match.
        """
        m: dict[str, torch.Tensor] = {"shared.weight": self.shared.weight}

        def attn(p: str, a: Attention) -> None:
            for n in "qkvo":
                m[f"{p}.{n}.weight"] = getattr(a, n).weight

        def ffn(p: str, f: FeedForward) -> None:
            m[f"{p}.wi_0.weight" if f.gated else f"{p}.wi.weight"] = f.wi_0.weight
            if f.gated:
                m[f"{p}.wi_1.weight"] = f.wi_1.weight
            m[f"{p}.wo.weight"] = f.wo.weight

        for i, layer in enumerate(self.encoder_layers):
            p = f"encoder.block.{i}.layer"
            attn(f"{p}.0.SelfAttention", layer.attn)
            m[f"{p}.0.layer_norm.weight"] = layer.attn_norm.weight
            ffn(f"{p}.1.DenseReluDense", layer.ffn)
            m[f"{p}.1.layer_norm.weight"] = layer.ffn_norm.weight
        m["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = self.encoder_bias.weight
        m["encoder.final_layer_norm.weight"] = self.encoder_norm.weight
        for i, layer in enumerate(self.decoder_layers):
            p = f"decoder.block.{i}.layer"
            attn(f"{p}.0.SelfAttention", layer.self_attn)
            m[f"{p}.0.layer_norm.weight"] = layer.self_norm.weight
            attn(f"{p}.1.EncDecAttention", layer.cross_attn)
            m[f"{p}.1.layer_norm.weight"] = layer.cross_norm.weight
            ffn(f"{p}.2.DenseReluDense", layer.ffn)
            m[f"{p}.2.layer_norm.weight"] = layer.ffn_norm.weight
        m["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = self.decoder_bias.weight
        m["decoder.final_layer_norm.weight"] = self.decoder_norm.weight
        if self.lm_head is not None:
            m["lm_head.weight"] = self.lm_head.weight
        copy_weights(m, weights, {"shared.weight": ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"]})

    @property
    def dtype(self) -> torch.dtype:
        return self.shared.weight.dtype

    @torch.inference_mode()
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder forward: ``[B, S]`` token ids (+ ``[B, S]`` 1/0 mask) -> ``[B, S, d_model]``."""
        c = self.config
        b, s = input_ids.shape
        pos = torch.arange(s, device=input_ids.device)
        buckets = relative_position_bucket(
            pos[None, :] - pos[:, None], True, c.num_buckets, c.max_distance
        )  # [S(q), S(k)]
        bias = self.encoder_bias(buckets).permute(2, 0, 1)[None].float()  # [1, H, S, S]
        if attention_mask is not None:
            bias = bias.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))  # [B, H, S, S]
        bias = bias.expand(b, -1, -1, -1).to(self.dtype)
        lengths = right_padded_lengths(attention_mask) if self.batch_invariant_attention else None
        x = self.shared(input_ids)  # [B, S, d]
        for layer in self.encoder_layers:
            x = layer(x, bias, lengths)
        return self.encoder_norm(x)

    @torch.inference_mode()
    def compute_cross_kv(self, encoder_out: torch.Tensor) -> torch.Tensor:
        """``[B, S, d_model]`` -> ``[num_decoder_layers, 2, B, S, num_heads, head_dim]`` (0 = K, 1 = V)."""
        b, s, _ = encoder_out.shape
        c = self.config
        x = encoder_out.to(self.dtype)
        kv = torch.stack(
            [torch.stack([layer.cross_attn.k(x), layer.cross_attn.v(x)]) for layer in self.decoder_layers]
        )  # [L, 2, B, S, H*Dh]
        return kv.view(c.decoder_layers, 2, b, s, c.num_heads, c.head_dim).contiguous()

    def decoder_position_bias(self, max_seq_len: int) -> torch.Tensor:
        """``[H, max_seq_len]``: causal bias by distance ``query_pos - key_pos`` (for ``paged_attention``)."""
        c = self.config
        dist = torch.arange(max(max_seq_len, 1), device=self.shared.weight.device)
        buckets = relative_position_bucket(-dist, False, c.num_buckets, c.max_distance)  # key - query = -dist
        return self.decoder_bias(buckets).t()  # [H, N]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        self_kv_cache: torch.Tensor,
        cross_kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Decoder over a flat varlen batch: ``input_ids`` ``[T]`` -> ``[T, d_model]`` (after the final norm).

        Positions enter only through the relative bias (each query's position is
        ``seq_lens[b] - q_len_b + i``); ``positions`` is accepted for the common API.
        Caches: ``[num_decoder_layers, 2, num_blocks, block_size, H, Dh]``.
        """
        bias = self.decoder_position_bias(attn_metadata.max_seq_len)
        x = self.shared(input_ids)  # [T, d]
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, attn_metadata, self_kv_cache[i], cross_kv_cache[i], bias)
        return self.decoder_norm(x)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, d_model]`` -> ``[N, vocab_size]`` float32 (v1.0: hidden scaled by ``d_model ** -0.5``)."""
        if self.config.scale_decoder_outputs:
            hidden = hidden * self.config.d_model**-0.5
        if self.output_projection is not None:  # int8 (shared.models.quantize)
            return self.output_projection(hidden).float()
        return self._vocab_projection(hidden).float()

    def _projection_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.lm_head is not None else self.shared.weight

    def int8_parts(self) -> Int8Parts:
        """What ``--quantize int8`` converts (``shared.models.quantize``): each decoder layer's cross-attention ``k`` and
        ``v`` are the cross-KV projections; the output projection is ``lm_head`` or the tied ``shared`` embedding (the
        v1.0 output scaling stays in ``compute_logits``)."""
        return Int8Parts(
            encoder_layers=self.encoder_layers,
            decoder_layers=self.decoder_layers,
            cross_kv=tuple((layer.cross_attn, n) for layer in self.decoder_layers for n in ("k", "v")),
            output_weight=self._projection_weight(),
        )

    def _decoder_layers(self) -> nn.ModuleList:
        return self.decoder_layers
