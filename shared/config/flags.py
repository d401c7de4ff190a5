"""Mapping a config dataclass onto CLI flags and ``ENCDEC_*`` environment variables.

Every field maps onto a CLI flag (``--max-num-seqs``) and an environment
variable (``ENCDEC_MAX_NUM_SEQS``); the flag wins over the variable, the
variable over the dataclass default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, TypeVar

C = TypeVar("C")


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one ``--field-name`` flag per dataclass field, defaulting to None."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(
            flag,
            dest=f.name,
            type=_field_type(f),
            default=None,
            help=f"(env ENCDEC_{f.name.upper()}, default {f.default!r})",
        )


def _field_type(f: dataclasses.Field) -> Any:
    return {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]


def config_from(cls: type[C], args: argparse.Namespace | None = None, env: dict[str, str] | None = None) -> C:
    """Builds ``cls`` from CLI args over ``ENCDEC_*`` environment variables over defaults.

    Raises:
        ValueError: a value does not parse or fails validation.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        convert = _field_type(f)
        raw = getattr(args, f.name, None) if args is not None else None
        source = f"--{f.name.replace('_', '-')}"
        for var in (f"ENCDEC_{f.name.upper()}",) + (("REDIS_URL",) if f.name == "redis_url" else ()):
            if raw is None and var in env:
                raw, source = env[var], var
        if raw is not None:
            try:
                values[f.name] = convert(raw)
            except ValueError as exc:
                raise ValueError(f"{f.name}: cannot parse {raw!r} (from {source}) as {convert.__name__}") from exc
    return cls(**values)
