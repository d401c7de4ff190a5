"""``parse_memory_size``: the ``kv_cache_memory`` setting's forms (bytes with a unit, or a fraction of free memory)."""

from __future__ import annotations

_MEMORY_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory_size(text: str) -> tuple[float, bool] | None:
    """Parses a memory setting: ``(bytes, False)``, ``(fraction, True)`` or None when empty.

    Bytes: a number with an optional unit, decimal (``KB``, ``MB``, ``GB``,
    ``TB``; ``K``/``M``/``G``/``T`` alike) or binary (``KiB``, ``MiB``, ``GiB``,
    ``TiB``), case-insensitive: ``2GiB``, ``512MB``, ``1073741824``. Fraction
    of free memory: a bare number below 1 (``0.3``) or a percentage (``30%``),
    in (0, 1].

    Raises:
        ValueError: anything else, with the accepted forms.
    """
    s = text.strip().lower().replace(" ", "")
    if not s:
        return None
    forms = "bytes with an optional unit (2GiB, 512MB, 1073741824) or a fraction of free memory (0.3, 30%)"
    try:
        if s.endswith("%"):
            fraction = float(s[:-1]) / 100
            if not 0 < fraction <= 1:
                raise ValueError
            return fraction, True
        number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        value, unit = float(number), s[len(number) :]
        if unit not in _MEMORY_UNITS or value <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"memory size {text!r} must be {forms}") from None
    if not unit and value < 1:
        return value, True
    return value * _MEMORY_UNITS[unit], False
