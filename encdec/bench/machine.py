"""The machine a benchmark ran on: every bench's table header and JSON name it.

A speed lead measured on one CPU family may not hold on another (AMD Zen's and
Intel's AVX-512 / AMX differ, and MKL takes other paths on each), so a result
without its machine cannot be compared. ``machine_info`` reads ``/proc/cpuinfo``
(Linux; other systems get what ``platform`` knows), torch's build and its
kernel libraries' versions (``torch.__config__.show()``).
"""

from __future__ import annotations

import os
import platform
import re

from shared.device import cpu_flags, cpu_info

# The /proc/cpuinfo flags that choose kernels here (torch / oneDNN / MKL and kernels/csrc), in the order shown.
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)


def _library_versions() -> dict[str, str]:
    """``{"torch", "mkl", "onednn", "cpu_capability"}`` from the installed torch ("" where torch does not say)."""
    try:
        import torch
    except ImportError:
        return {"torch": "", "mkl": "", "onednn": "", "cpu_capability": ""}
    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([\d.]+)", config)
    onednn = re.search(r"(?:MKL-DNN|oneDNN) v([\d.]+)", config)
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        capability = ""
    return {
        "torch": torch.__version__,
        "mkl": mkl.group(1) if mkl else "",
        "onednn": onednn.group(1) if onednn else "",
        "cpu_capability": capability,
    }


def best_isa(flags: set[str]) -> str:
    """The widest vector ISA in ``flags`` with the int8 / bfloat16 extensions beside it (``AVX-512 (VNNI, BF16)``)."""
    if "avx512f" in flags:
        extras = [
            name
            for flag, name in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"), ("amx_tile", "AMX"))
            if flag in flags
        ]
        return "AVX-512" + (f" ({', '.join(extras)})" if extras else "")
    if "avx2" in flags:
        return "AVX2" + (" + FMA" if "fma" in flags else "") + (" + AVX-VNNI" if "avx_vnni" in flags else "")
    if "sve" in flags:
        return "SVE"
    if "asimd" in flags:
        return "NEON"
    return "baseline " + platform.machine()


def machine_info() -> dict:
    """What names this machine for a benchmark.

    Returns:
        ``cpu`` (model name), ``vendor``, ``family`` / ``model`` (``/proc/cpuinfo``'s numbers, "" elsewhere),
        ``cpus`` (logical CPUs), ``threads_per_core`` (0 when unknown), ``isa`` (``best_isa``), ``flags`` (the
        ``ISA_FLAGS`` present), ``isa_cap`` (``ENCDEC_MAX_CPU_ISA``: ``encdec bench --cpu-isa``; "" for none), and
        ``torch`` / ``mkl`` / ``onednn`` versions and torch's ``cpu_capability``.
    """
    info = cpu_info()
    flags = cpu_flags(info)
    try:
        threads_per_core = int(info["siblings"]) // int(info["cpu cores"])
    except (KeyError, ValueError, ZeroDivisionError):
        threads_per_core = 0
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "vendor": info.get("vendor_id", ""),
        "family": info.get("cpu family", ""),
        "model": info.get("model", ""),
        "cpus": os.cpu_count(),
        "threads_per_core": threads_per_core,
        "isa": best_isa(flags),
        "flags": [f for f in ISA_FLAGS if f in flags],
        "isa_cap": _isa_cap(),
        **_library_versions(),
    }


CAP_NAMES = {"avx2": "AVX2", "avx512": "AVX-512 without VNNI / BF16 / AMX"}  # ENCDEC_MAX_CPU_ISA's values


def _isa_cap() -> str:
    """``ENCDEC_MAX_CPU_ISA`` (``encdec bench --cpu-isa``), "" when unset; a bad value is shown as it is."""
    from kernels._clib import MAX_CPU_ISA_ENV, max_cpu_isa

    try:
        return max_cpu_isa() or ""
    except ValueError:
        return os.environ[MAX_CPU_ISA_ENV]


def machine_line(info: dict | None = None) -> str:
    """One line for a table header: CPU (family / model), ISA (and its cap: ``capped to AVX2 (torch ATen: AVX2)``),
    CPUs, threads per core, torch / MKL / oneDNN."""
    info = info or machine_info()
    name = info["cpu"] + (f" (family {info['family']}, model {info['model']})" if info["family"] else "")
    per_core = (
        f"{info['threads_per_core']} thread(s) per core" if info["threads_per_core"] else "threads per core unknown"
    )
    libs = ", ".join(f"{k} {info[k]}" for k in ("torch", "mkl", "onednn") if info.get(k))
    isa = info["isa"]
    if info.get("isa_cap"):  # so no capped result is taken for the native one; torch's dispatch shows it took
        aten = f" (torch ATen: {info['cpu_capability']})" if info.get("cpu_capability") else ""
        isa += f", capped to {CAP_NAMES.get(info['isa_cap'], info['isa_cap'])}{aten}"
    return f"{name}, {isa}, {info['cpus']} CPUs, {per_core}; {libs}"
