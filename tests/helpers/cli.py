"""The ``encdec`` command line as the tests run it: a child process of this interpreter."""

from __future__ import annotations

import sys


def encdec(*args: str, log_level: str = "WARNING") -> list[str]:
    """``python -m encdec.cli --log-level <log_level> <args>`` as an argv list."""
    return [sys.executable, "-m", "encdec.cli", "--log-level", log_level, *args]
