"""Matrix-product FLOPs of an encoder-decoder transformer, counted from its shapes (issue 35).

Convention: 2 FLOPs per multiply-add of every matrix product (the weight products, attention's ``q k^T`` and
``p v``, Whisper's two convolutions), as in the compute accounting of Kaplan et al. 2020 ("Scaling Laws for
Neural Language Models", section 2.1) and the model-FLOPs utilisation of Chowdhery et al. 2022 (PaLM,
appendix B). Norms, softmax, activations, biases, position terms and sampling are left out: O(d_model) per token
against the products' O(d_model^2). No torch: pure arithmetic over ``Dims``.

What each side counts (our services split the work the same way, encoder service / decoder service):

- encoder: every encoder layer over ``encoder_len`` positions, Whisper's convolution stem, and the cross-attention
  K/V projection of the encoder output for every decoder layer (the encoder service computes it: DESIGN.md);
- decoder: every decoder layer at each position it runs (self-attention over the positions so far, cross-attention
  over ``encoder_len``), and the output projection once per generated token.
"""

from __future__ import annotations

from dataclasses import dataclass

WHISPER_WINDOW = 1500
"""Encoder positions of one Whisper window: 30 s of audio, 3000 log-mel frames halved by the stride-2 second
convolution (Radford et al. 2022, section 2.2)."""


@dataclass(frozen=True)
class Dims:
    """The shapes that set the FLOPs. ``attn = heads * head_dim``; ``gated_ffn``: T5 v1.1 / flan (``wi_0``,
    ``wi_1``, ``wo``: three FFN matrices, two otherwise); ``mel_bins`` > 0: Whisper's convolution stem (kernel 3,
    over ``2 * encoder_len`` frames then ``encoder_len`` positions)."""

    d_model: int
    heads: int
    head_dim: int
    encoder_layers: int
    decoder_layers: int
    ffn: int
    vocab: int
    gated_ffn: bool = False
    mel_bins: int = 0

    @property
    def attn(self) -> int:
        return self.heads * self.head_dim


def seq2seq_dims(shape) -> Dims:
    """``Dims`` of an ``encdec.bench.seq2seq_checkpoints.Shape`` (T5 / BART; ReLU / GELU FFN, d_kv = d_model / heads)."""
    return Dims(
        shape.d_model, shape.heads, shape.d_model // shape.heads, shape.layers, shape.layers, shape.ffn, shape.vocab
    )


def whisper_dims(config) -> Dims:
    """``Dims`` of a ``shared.models.whisper.WhisperConfig``."""
    c = config
    return Dims(
        c.d_model, c.num_heads, c.head_dim, c.encoder_layers, c.decoder_layers, c.ffn_dim, c.vocab_size,
        mel_bins=c.num_mel_bins,
    )  # fmt: skip


def _ffn_macs(d: Dims) -> int:
    return (3 if d.gated_ffn else 2) * d.d_model * d.ffn


def encoder_flops(d: Dims, encoder_len: int) -> int:
    """FLOPs of one encoder forward over ``encoder_len`` positions, with the cross-attention K/V projection of its
    output for every decoder layer (and Whisper's convolution stem when ``d.mel_bins``)."""
    n = encoder_len
    per_layer = 4 * n * d.d_model * d.attn + 2 * n * n * d.attn + n * _ffn_macs(d)  # q,k,v,o; q k^T, p v; FFN
    conv = 2 * n * d.d_model * d.mel_bins * 3 + n * d.d_model * d.d_model * 3 if d.mel_bins else 0
    cross_kv = d.decoder_layers * 2 * n * d.d_model * d.attn
    return 2 * (d.encoder_layers * per_layer + conv + cross_kv)


def decoder_flops(d: Dims, encoder_len: int, positions: int, logits: int) -> int:
    """FLOPs of a decoder running ``positions`` positions (position t attends over t self-attention keys and
    ``encoder_len`` cross-attention keys) and projecting ``logits`` of them onto the vocabulary."""
    p = positions
    weights = (4 + 2) * d.d_model * d.attn + _ffn_macs(d)  # self q,k,v,o; cross q,o; FFN: per position
    self_attention = 2 * d.attn * p * (p + 1) // 2  # sum over t = 1..p of 2 t attn
    cross_attention = 2 * d.attn * encoder_len * p
    return 2 * (d.decoder_layers * (p * weights + self_attention + cross_attention) + logits * d.d_model * d.vocab)


def seq2seq_request_flops(d: Dims, source_len: int, new_tokens: int) -> tuple[int, int]:
    """``(encoder, decoder)`` FLOPs of one T5 / BART request: ``source_len`` source tokens, ``new_tokens`` generated
    greedily (the decoder runs the start token and the first ``new_tokens - 1`` tokens: ``new_tokens`` positions,
    each projected onto the vocabulary)."""
    return encoder_flops(d, source_len), decoder_flops(d, source_len, new_tokens, new_tokens)


def whisper_request_flops(d: Dims, new_tokens: int, prompt_len: int) -> tuple[int, int]:
    """``(encoder, decoder)`` FLOPs of one short-form Whisper transcription: one 30 s window (``WHISPER_WINDOW``
    positions, whatever the audio's length: every system pads to it), ``prompt_len`` prompt tokens
    (``whisper_prompt_len``) then ``new_tokens`` generated tokens, the end token included: the decoder runs
    ``prompt_len + new_tokens - 1`` positions, ``new_tokens`` of them projected onto the vocabulary."""
    return encoder_flops(d, WHISPER_WINDOW), decoder_flops(d, WHISPER_WINDOW, prompt_len + new_tokens - 1, new_tokens)


def whisper_prompt_len(d: Dims) -> int:
    """Prompt tokens of a transcription without timestamps in a given language: ``<|startoftranscript|>
    <|en|> <|transcribe|> <|notimestamps|>`` for a multilingual model, ``<|startoftranscript|> <|notimestamps|>``
    for an English-only one (multilingual: ``vocab >= 51865``, the rule of openai/whisper's ``model.py``)."""
    return 4 if d.vocab >= 51865 else 2
