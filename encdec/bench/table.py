"""Result rows and their Markdown table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def format_number(v: float) -> str:
    """3 significant digits below 100, whole numbers from 100 on (no exponent: 1107, not 1.11e+03)."""
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """Rows (dicts) as a Markdown table; floats through ``format_number``."""

    def fmt(v) -> str:
        if isinstance(v, float):
            return format_number(v)
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def positive_int(text: str) -> int:
    """argparse type of a count that must be >= 1 (``--repeats``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type of a finite number that must be >= 0 (``--lone-gap-s``, seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def median_run(runs: list[tuple]) -> tuple:
    """The run (a tuple whose first item is its wall time) of median wall time; the lower middle one of an even count."""
    return sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]


def write_json(path: str | Path, payload: dict) -> None:
    """Writes ``payload`` as JSON, with ``machine`` (``encdec.bench.machine.machine_info``) unless it has one."""
    from encdec.bench.machine import machine_info

    payload.setdefault("machine", machine_info())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2))
