"""kernels/_clib.py: a C library built from other kernel sources is refused (torch runs), never called."""

from __future__ import annotations

import logging
import shutil
import subprocess

import pytest

from kernels import _clib

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the stand-in libraries")


def _build(tmp_path, name: str, source: str) -> str:
    (tmp_path / f"{name}.c").write_text(source)
    out = str(tmp_path / f"{name}.so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", out, str(tmp_path / f"{name}.c")], check=True)
    return out


def test_libraries_of_other_signatures_are_refused(tmp_path, caplog):
    unversioned = _build(
        tmp_path, "old", "int packed_linear_supported(void) { return 1; }\n"
    )  # before the version existed
    other = _build(tmp_path, "other", "int encdec_kernels_abi(void) { return 1; }\n")
    current = _build(tmp_path, "current", f"int encdec_kernels_abi(void) {{ return {_clib.ABI_VERSION}; }}\n")
    with caplog.at_level(logging.WARNING, logger="kernels._clib"):
        assert _clib.open_first([unversioned]) is None
        assert _clib.open_first([other]) is None
    assert sum("rebuild it" in r.getMessage() for r in caplog.records) == 2
    assert _clib.open_first([other, current])._name == current
    assert _clib.open_first([str(tmp_path / "missing.so")]) is None


def test_the_installed_library_matches_the_wrappers():
    """The library setup.py built from these sources (if any) is the one the wrappers load."""
    if not _clib.glob.glob(_clib.os.path.join(_clib.os.path.dirname(_clib.__file__), "_cpu_kernels*.so")):
        pytest.skip("no compiled kernels in this install")
    assert _clib._open() is not None and _clib._open().encdec_kernels_abi() == _clib.ABI_VERSION
