"""Random-weight T5 / BART checkpoints at real model shapes, for the decode-bound bench.

Each is written with ``save_pretrained`` (config, safetensors weights,
generation config, tokenizer files) and cached by shape, so every system under
test (our services, HF ``generate``, CTranslate2's converter) loads the very same
directory. Weights are re-drawn with unit-scale variance, as
``tests/helpers/text_checkpoints.py`` does (HF's 0.02 init makes greedy output one token
repeated), so greedy outputs vary and token equality means something.

Tokenizers cover the whole vocabulary with synthetic pieces (``w<id>``): the
bench sends token ids, the tokenizer only detokenizes. No hub access.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

CACHE_VERSION = 4
DEFAULT_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "encdec-serve", "bench")
"""Where the checkpoints and their CT2 conversions are kept unless ``--cache-dir`` says otherwise."""


@dataclass(frozen=True)
class Shape:
    """Model dimensions; ``family`` is ``t5`` or ``bart``."""

    family: str
    d_model: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    max_positions: int = 512


SHAPES = {
    # t5-small: d_model 512, 6+6 layers, 8 heads (d_kv 64), d_ff 2048, ReLU, vocab 32128.
    "t5-small": Shape("t5", 512, 6, 8, 2048, 32128),
    # bart-base: d_model 768, 6+6 layers, 12 heads, ffn 3072, GELU, vocab 50265, 1024 positions.
    "bart-base": Shape("bart", 768, 6, 12, 3072, 50265, 1024),
    # Tiny shapes for tests/app/test_bench_cli.py.
    "t5-tiny": Shape("t5", 64, 2, 4, 128, 512),
    "bart-tiny": Shape("bart", 64, 2, 4, 128, 512, 128),
}


def random_init(
    model, seed: int, gain: float = 3.0, q_gain: float | None = None, final_logits_bias: bool = False
) -> None:
    """Large random weights so greedy outputs vary from token to token instead of collapsing
    (also the recipe of ``tests/helpers/text_checkpoints.py``): matrices ~ N(0, gain^2 / fan_in) (sharp
    attention), embeddings ~ N(0, 1), FFN output rows centred (so the positive mean of ReLU/GELU
    does not add the same vector at every position), norms ~ 1 +- 0.2, other vectors ~ N(0, 0.01);
    with ``final_logits_bias`` BART's logits bias buffer ~ N(0, 0.01) too.

    ``q_gain`` (None = ``gain``) is used for query projections so attention scores have std ~3 at any
    head size (T5 does not scale ``q . k``: ``q_gain = d_kv ** -0.5``; BART scales by
    ``d_kv ** -0.5``: ``q_gain = 1``). With ``gain`` on queries too, t5-small's scores
    reach std ~70: attention is one-hot and float32 rounding between two correct
    implementations flips near ties, so token equality no longer measures correctness.
    A small ``gain`` everywhere instead makes the model copy its input token forever.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                if "embed" in name or "shared" in name or "relative_attention_bias" in name:
                    std = 1.0
                else:
                    is_query = q_gain is not None and name.endswith((".q.weight", "q_proj.weight"))
                    std = (q_gain if is_query else gain) * p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
                if name.endswith(("fc2.weight", "wo.weight")):
                    p.sub_(p.mean(dim=1, keepdim=True))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        if final_logits_bias:
            for name, b in model.named_buffers():
                if name.endswith("final_logits_bias"):
                    b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _t5(shape: Shape, out: Path, seed: int) -> None:
    from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer
    from transformers.initialization import no_init_weights

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(f"\u2581w{i}", -1.0) for i in range(3, shape.vocab)]
    tok = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=shape.max_positions)
    cfg = T5Config(
        vocab_size=shape.vocab,
        d_model=shape.d_model,
        d_kv=shape.d_model // shape.heads,
        d_ff=shape.ffn,
        num_layers=shape.layers,
        num_decoder_layers=shape.layers,
        num_heads=shape.heads,
        feed_forward_proj="relu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    with no_init_weights():
        model = T5ForConditionalGeneration(cfg)
    model.tie_weights()  # no_init_weights skips post_init's tying
    random_init(model, seed, q_gain=(shape.d_model // shape.heads) ** -0.5)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _bart(shape: Shape, out: Path, seed: int) -> None:
    from transformers import BartConfig, BartForConditionalGeneration, BartTokenizer
    from transformers.initialization import no_init_weights

    out.mkdir(parents=True, exist_ok=True)
    special = ["<s>", "<pad>", "</s>", "<unk>"]
    pieces = special + [f"\u0120w{i}" for i in range(len(special), shape.vocab - 1)] + ["<mask>"]
    (out / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
    (out / "merges.txt").write_text("#version: 0.2\n")
    tok = BartTokenizer(
        vocab=str(out / "vocab.json"), merges=str(out / "merges.txt"), model_max_length=shape.max_positions
    )
    cfg = BartConfig(
        vocab_size=shape.vocab,
        d_model=shape.d_model,
        encoder_layers=shape.layers,
        decoder_layers=shape.layers,
        encoder_attention_heads=shape.heads,
        decoder_attention_heads=shape.heads,
        encoder_ffn_dim=shape.ffn,
        decoder_ffn_dim=shape.ffn,
        max_position_embeddings=shape.max_positions,
        activation_function="gelu",
        scale_embedding=False,
        forced_eos_token_id=None,
        forced_bos_token_id=None,
    )
    # CTranslate2's converter reads this attribute, absent from transformers 5's BartConfig (HF ignores it).
    cfg.normalize_before = False
    with no_init_weights():
        model = BartForConditionalGeneration(cfg)
    model.tie_weights()  # no_init_weights skips post_init's tying
    random_init(model, seed, q_gain=1.0)
    g = model.generation_config
    g.forced_eos_token_id = None  # fixed-length runs: no forced end token at the length limit
    g.forced_bos_token_id = None
    model.save_pretrained(out)
    tok.save_pretrained(out)


def build_checkpoint(name: str, cache_dir: str | Path, seed: int = 0) -> Path:
    """The HF directory of shape ``name`` (a key of ``SHAPES``), built once and cached.

    Returns ``cache_dir/<name>-<version>-<seed>`` (written atomically: a
    half-written directory from an interrupted build is never reused).

    Raises:
        KeyError: unknown shape name.
    """
    import shutil
    import tempfile

    shape = SHAPES[name]
    out = Path(cache_dir) / f"{name}-v{CACHE_VERSION}-s{seed}"
    if (out / "shape.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        (_t5 if shape.family == "t5" else _bart)(shape, tmp, seed)
        (tmp / "shape.json").write_text(json.dumps({"name": name, **asdict(shape)}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def source_ids(name: str, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` random sources of exactly ``length`` token ids, special tokens included
    (T5: ``... </s>``; BART: ``<s> ... </s>``), drawn from the non-special ids."""
    import random

    shape = SHAPES[name]
    rng = random.Random(seed)
    lo, hi = (3, shape.vocab - 1) if shape.family == "t5" else (4, shape.vocab - 2)
    if shape.family == "t5":
        return [[rng.randint(lo, hi) for _ in range(length - 1)] + [1] for _ in range(n)]
    return [[0] + [rng.randint(lo, hi) for _ in range(length - 2)] + [2] for _ in range(n)]
