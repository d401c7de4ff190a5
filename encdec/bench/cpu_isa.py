"""``encdec bench <any> --cpu-isa avx2``: every system of a bench capped to one instruction set.

A machine with AVX-512 (and AMX) reproduces the kernel choices of an AVX2 CPU: our C kernels
(``ENCDEC_MAX_CPU_ISA``, ``kernels._clib``), torch's ATen dispatch (``ATEN_CPU_CAPABILITY``), MKL
(``MKL_ENABLE_INSTRUCTIONS``), oneDNN (``ONEDNN_MAX_CPU_ISA``) and CTranslate2 (``CT2_FORCE_CPU_ISA``) each read
their variable once, when they first run, so they must be in the environment before the bench process starts:
``cap_process`` re-executes the bench with them set (``os.execve``, same arguments), and every process the bench
starts (our services through ``encdec.launcher.Services``, the CTranslate2 / faster-whisper anchor processes,
spawned workers) inherits them. The machine line says the cap (``encdec.bench.machine.machine_line``).

What it cannot emulate (docs/benchmarks.md): how an AVX2 CPU executes the instructions (AMD Zen 1 and 2 split each
256-bit operation into two 128-bit halves), its cache sizes and its memory bandwidth.
"""

from __future__ import annotations

import os
import sys

from kernels._clib import MAX_CPU_ISAS, isa_cap_environment
from shared.device import cpu_flags

__all__ = ["MAX_CPU_ISAS", "cap_process", "capped_environ"]

# /proc/cpuinfo flags a CPU needs for a cap to mean anything (a cap above the CPU would change nothing).
_NEEDS = {"avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq")}


def capped_environ(isa: str, environ: dict[str, str]) -> dict[str, str] | None:
    """``environ`` with the variables of ``kernels._clib.isa_cap_environment(isa)`` set, or None when it already has
    them all (nothing to do).

    Raises:
        ValueError: ``isa`` is not ``avx2`` / ``avx512``.
    """
    cap = isa_cap_environment(isa)
    if all(environ.get(name) == value for name, value in cap.items()):
        return None
    return {**environ, **cap}


def cap_process(isa: str, argv: list[str], flags: set[str] | None = None) -> None:
    """Re-executes this ``encdec`` process as ``python -m encdec.cli <argv>`` with the ``isa`` cap in its
    environment, unless it is there already (then returns: the re-executed process goes on with its bench).

    Args:
        isa: ``avx2`` or ``avx512`` (AVX-512 without VNNI / BF16 / AMX).
        argv: the command line after the program name (``encdec bench ... --cpu-isa avx2``).
        flags: the CPU's flags (default: ``/proc/cpuinfo``'s).

    Raises:
        ValueError: an unknown ``isa``, or one this CPU lacks (capping to it would change nothing).
    """
    flags = cpu_flags() if flags is None else flags
    missing = [flag for flag in _NEEDS.get(isa, ()) if flag not in flags]
    if missing:
        raise ValueError(f"--cpu-isa {isa}: this CPU lacks {', '.join(missing)}, so the cap would change nothing")
    env = capped_environ(isa, dict(os.environ))
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "encdec.cli", *argv], env)
