"""How an encoder-only checkpoint turns token states into one vector: its
sentence-transformers config, when the directory has one.

Read from a sentence-transformers directory (``modules.json``,
``sentence_bert_config.json``, ``1_Pooling/config.json``, an optional
``Normalize`` module) or defaulted for a plain HF directory. Both the legacy
``pooling_mode_*_token(s)`` booleans and the newer ``pooling_mode`` string are
understood (sentence-transformers ``models.Pooling``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_MODES = ("cls", "mean", "last")

# sentence-transformers pooling mode -> ours; others (max, weightedmean, ...) are not served.
_ST_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_ST_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}


@dataclass(frozen=True)
class EmbeddingSpec:
    """Defaults of the Embed endpoint for one checkpoint.

    Attributes:
        transformer_dir: the HF-format directory holding ``config.json`` and
            weights (the sentence-transformers ``Transformer`` module's path).
        pooling: ``cls``, ``mean`` or ``last``: the pooling config's mode, else ``cls``.
        normalize: L2-normalise by default: true when ``modules.json`` lists a
            ``Normalize`` module or when there is no ``modules.json`` at all
            (text-embeddings-inference's default), false otherwise.
        max_seq_length: sentence-transformers' ``max_seq_length`` (tokens,
            special tokens included), or None.
        is_sentence_transformers: the directory has a ``modules.json``.
    """

    transformer_dir: Path
    pooling: str = "cls"
    normalize: bool = True
    max_seq_length: int | None = None
    is_sentence_transformers: bool = False


def _read(path: Path) -> dict | list:
    return json.loads(path.read_text(encoding="utf-8"))


def _pooling_mode(cfg: dict, where: Path) -> str:
    mode = cfg.get("pooling_mode")
    if mode is None:
        active = [m for key, m in _ST_LEGACY_KEYS.items() if cfg.get(key)]
        mode = active[0] if len(active) == 1 else active
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise ValueError(f"{where}: pooling mode {mode!r} is not supported; supported: {', '.join(_ST_MODES)}")
    return _ST_MODES[mode]


def find_transformer_dir(path: Path) -> Path:
    """The HF directory inside a sentence-transformers directory (``path`` itself otherwise)."""
    modules = path / "modules.json"
    if modules.is_file():
        for m in _read(modules):
            if m.get("type", "").endswith("Transformer") and m.get("path"):
                return path / m["path"]
    return path


def read_embedding_spec(path: str | Path) -> EmbeddingSpec:
    """Reads the pooling / normalisation / max length defaults of ``path``.

    Raises:
        ValueError: the pooling config names a mode we do not serve (max, weightedmean, ...).
    """
    path = Path(path)
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return EmbeddingSpec(transformer_dir=path)
    modules = _read(modules_file)
    transformer_dir = find_transformer_dir(path)
    pooling, normalize, max_len = "cls", False, None
    for m in modules:
        kind = m.get("type", "").rsplit(".", 1)[-1]
        if kind == "Pooling":
            pooling = _pooling_mode(_read(path / m["path"] / "config.json"), path / m["path"])
        elif kind == "Normalize":
            normalize = True
    for candidate in (transformer_dir / "sentence_bert_config.json", path / "sentence_bert_config.json"):
        if candidate.is_file():
            max_len = _read(candidate).get("max_seq_length")
            break
    return EmbeddingSpec(transformer_dir, pooling, normalize, int(max_len) if max_len else None, True)
