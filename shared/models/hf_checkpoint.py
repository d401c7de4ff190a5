"""HuggingFace-format checkpoint directories: weights, generation defaults, tokenizer.

Shared by the text encoder-decoder models (T5, BART, mBART, Marian). A
directory holds ``config.json``, weights (``model.safetensors``,
``pytorch_model.bin``, or either sharded with an ``*.index.json``), tokenizer
files and optionally ``generation_config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_hf_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``model_dir``, by HF parameter name.

    Looks for ``model.safetensors``, ``model.safetensors.index.json``,
    ``pytorch_model.bin``, ``pytorch_model.bin.index.json`` in that order.

    Raises:
        FileNotFoundError: none of them exists.
    """
    model_dir = Path(model_dir)
    for name in WEIGHT_FILES:
        files = [model_dir / name]
        index = model_dir / f"{name}.index.json"
        if not files[0].is_file() and index.is_file():
            files = [model_dir / f for f in sorted(set(read_json(index)["weight_map"].values()))]
        if not all(f.is_file() for f in files):
            continue
        out: dict[str, torch.Tensor] = {}
        for f in files:
            if f.suffix == ".safetensors":
                from safetensors.torch import load_file

                out.update(load_file(str(f)))
            else:
                out.update(torch.load(str(f), map_location="cpu", weights_only=True))
        return out
    raise FileNotFoundError(
        f"no weights in {model_dir}: expected one of {', '.join(WEIGHT_FILES)} (or a sharded *.index.json)"
    )


def copy_weights(
    name_map: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], aliases: dict[str, list[str]] | None = None
) -> None:
    """Copies ``weights[name]`` into each destination tensor of ``name_map``, checking shapes.

    Args:
        name_map: HF parameter name -> our parameter or buffer.
        weights: the checkpoint's tensors.
        aliases: alternative names tried in order when a name is absent
            (tied embeddings saved under another name, a missing ``model.`` prefix).

    Raises:
        KeyError: a name (and all its aliases) is missing. ValueError: a shape differs.
    """
    aliases = aliases or {}
    with torch.no_grad():
        for name, dst in name_map.items():
            candidates = [name, *aliases.get(name, [])]
            candidates += [c.removeprefix("model.") for c in candidates if c.startswith("model.")]
            src = next((weights[c] for c in candidates if c in weights), None)
            if src is None:
                raise KeyError(f"checkpoint lacks parameter {name!r}")
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
            dst.copy_(src.to(dst.dtype))


def linear_names(prefix: str, mod: nn.Linear) -> dict[str, torch.Tensor]:
    out = {f"{prefix}.weight": mod.weight}
    if mod.bias is not None:
        out[f"{prefix}.bias"] = mod.bias
    return out


# generation_config fields this server does not implement (greedy / sampling only); reported, never silently dropped.
_UNSUPPORTED = {
    "num_beams": 1,
    "no_repeat_ngram_size": 0,
    "min_length": 0,
    "min_new_tokens": None,
    "repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0,
    "length_penalty": 1.0,
}


@dataclass(frozen=True)
class TextGenerationDefaults:
    """A checkpoint's ``generation_config.json`` as HF ``generate`` applies it (greedy path).

    Attributes:
        decoder_start_token_id: first decoder token (``bos_token_id`` when unset, as HF).
        eos_token_id: stops a sequence (the first one when the config lists several).
        forced_bos_token_id: forced as the first generated token (HF ``ForcedBOSTokenLogitsProcessor``).
        forced_eos_token_id: forced when one slot is left (HF ``ForcedEOSTokenLogitsProcessor``).
        suppress_tokens: never generated (``suppress_tokens`` plus single-token ``bad_words_ids``).
        begin_suppress_tokens: not generated as the first token.
        max_length: most decoder tokens, start token included.
        ignored: ``name=value`` of settings found but not implemented (beam search, penalties).
    """

    decoder_start_token_id: int
    eos_token_id: int
    max_length: int
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None
    suppress_tokens: list[int] = field(default_factory=list)
    begin_suppress_tokens: list[int] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    @property
    def decoder_prompt_ids(self) -> list[int]:
        return [self.decoder_start_token_id]

    @classmethod
    def from_model_dir(cls, model_dir: Path, hf_config: dict, max_target_positions: int) -> TextGenerationDefaults:
        """Reads ``generation_config.json`` (else the generation fields of ``config.json``).

        ``max_length`` is the file's own value when it sets one, capped at
        ``max_target_positions`` (HF's implicit default of 20 is not used).

        Raises:
            ValueError: no decoder start / bos token or no eos token is defined.
        """
        path = Path(model_dir) / "generation_config.json"
        g = read_json(path) if path.is_file() else hf_config
        get = lambda k: g.get(k, hf_config.get(k))  # noqa: E731
        start = get("decoder_start_token_id")
        if start is None:
            start = get("bos_token_id")
        eos = get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if start is None or eos is None:
            raise ValueError(
                f"{model_dir}: generation config defines no decoder_start_token_id/bos_token_id or eos_token_id"
            )
        suppress = list(g.get("suppress_tokens") or [])
        suppress += [w[0] for w in (g.get("bad_words_ids") or []) if len(w) == 1]
        ignored = [f"{k}={g[k]}" for k, default in _UNSUPPORTED.items() if g.get(k, default) not in (default, None)]
        max_length = min(int(g["max_length"]), max_target_positions) if "max_length" in g else max_target_positions
        return cls(
            decoder_start_token_id=int(start),
            eos_token_id=int(eos),
            max_length=max_length,
            forced_bos_token_id=g.get("forced_bos_token_id"),
            forced_eos_token_id=g.get("forced_eos_token_id"),
            suppress_tokens=sorted(set(suppress)),
            begin_suppress_tokens=list(g.get("begin_suppress_tokens") or []),
            ignored=ignored,
        )

    def applied(self) -> list[str]:
        """``name=value`` of every default in effect, then ``ignored:`` ones (reported per request)."""
        out = [f"decoder_start_token_id={self.decoder_start_token_id}", f"eos_token_id={self.eos_token_id}"]
        for name in ("forced_bos_token_id", "forced_eos_token_id"):
            if getattr(self, name) is not None:
                out.append(f"{name}={getattr(self, name)}")
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            if getattr(self, name):
                out.append(f"{name}={getattr(self, name)}")
        return out + [f"ignored:{s}" for s in self.ignored]


# A tokenizer's vocabulary: fast (tokenizer.json), sentencepiece (T5, mBART, Marian), BPE / WordPiece files.
TOKENIZER_VOCAB_FILES = (
    "tokenizer.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "source.spm",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)


def load_hf_tokenizer(model_dir: str | Path):
    """The checkpoint's own tokenizer (``AutoTokenizer`` over the directory, offline).

    Raises:
        FileNotFoundError: the directory holds no tokenizer vocabulary file (AutoTokenizer would
            otherwise build an empty tokenizer from ``config.json`` alone and every text would
            silently become a couple of special tokens).
    """
    from transformers import AutoTokenizer

    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_VOCAB_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {model_dir}: expected one of {', '.join(TOKENIZER_VOCAB_FILES)} "
            "(save it beside the weights with tokenizer.save_pretrained(DIR))"
        )
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def max_source_positions(model_dir: Path, hf_config: dict, default: int) -> int:
    """Longest source the model accepts: ``max_position_embeddings`` / ``n_positions``,
    else the tokenizer's ``model_max_length`` when finite, else ``default``."""
    for key in ("max_position_embeddings", "n_positions"):
        if hf_config.get(key):
            return int(hf_config[key])
    tok_cfg = Path(model_dir) / "tokenizer_config.json"
    if tok_cfg.is_file():
        n = read_json(tok_cfg).get("model_max_length")
        if isinstance(n, int) and 0 < n < 1_000_000:
            return n
    return default
