"""ENCDEC_MAX_CPU_ISA (kernels/_clib.py, encdec_max_isa in kernels/csrc/parallel.h): an AVX-512 machine runs our
kernels as an AVX2 CPU would. The library reads the variable once, when it loads, so each case is a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kernels import _clib, packed_linear
from shared.device import cpu_flags

pytestmark = pytest.mark.skipif(
    not packed_linear.is_available() or "avx512f" not in cpu_flags(),
    reason="needs the compiled kernels on a CPU with AVX-512F (the cap has nothing to take away otherwise)",
)

_PROBE = """
import json
from kernels import calibration, packed_linear
import torch
from shared.device import cpu_bf16_flags
try:
    packed_linear.use_isa("avx512")
    refused = ""
except ValueError as exc:
    refused = str(exc)
weights = [packed_linear.PackedWeight.pack(torch.randn(64, 32))]
print(json.dumps({
    "isa": packed_linear.isa(), "present": packed_linear.isas_present(), "bf16": packed_linear.bf16_available(),
    "refused": refused, "calibrated": calibration.calibrate_packed_isa(weights, 1, rows=2, repeats=1),
    "bf16_flags": cpu_bf16_flags(),
}))
"""


def _probe(cap: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != _clib.MAX_CPU_ISA_ENV}
    if cap is not None:
        env[_clib.MAX_CPU_ISA_ENV] = cap
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_avx2_cap_keeps_every_kernel_at_avx2():
    native, capped = _probe(None), _probe("avx2")
    assert native["isa"] == "avx512" and native["present"] == ["avx2", "avx512"] and not native["refused"]
    assert capped["isa"] == "avx2" and capped["present"] == ["avx2"]
    assert "ENCDEC_MAX_CPU_ISA=avx2" in capped["refused"]
    assert capped["calibrated"] == {}  # one candidate: nothing timed, AVX2 stays
    assert capped["bf16"] is False and capped["bf16_flags"] == []  # bfloat16 weights and --dtype bfloat16 are off


def test_avx512_cap_turns_off_bfloat16_weights_only():
    capped = _probe("AVX512")  # any case
    assert capped["isa"] == "avx512" and capped["present"] == ["avx2", "avx512"] and capped["bf16"] is False


def test_an_unknown_cap_is_refused_where_the_kernels_load():
    env = {**os.environ, _clib.MAX_CPU_ISA_ENV: "avx3"}
    code = "from kernels import packed_linear; packed_linear.is_available()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "ENCDEC_MAX_CPU_ISA must be one of avx2, avx512" in out.stderr
