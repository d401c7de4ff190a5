"""``encdec transcribe``: a file that fails is named in its error line (real CLI process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_file_that_cannot_be_read_is_named(tmp_path):
    missing = tmp_path / "missing.wav"
    result = subprocess.run(
        [sys.executable, "-m", "encdec.cli", "transcribe", "--address", "127.0.0.1:1", str(missing)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert f"error: {missing}: cannot read the file: No such file or directory" in result.stderr, result.stderr
