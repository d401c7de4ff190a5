"""Where the services run their models: the ``device`` / ``kv_device`` / ``dtype`` settings.

``device`` is ``cpu`` (default), ``cuda`` (the current CUDA device, ``cuda:0``
unless ``CUDA_VISIBLE_DEVICES`` or ``torch.cuda.set_device`` says otherwise) or
``cuda:N``. Names are checked as strings when the config is built (no torch
import, so a GPU-less machine can still validate a GPU deployment's settings);
``resolve_device`` checks at service startup that the device exists.
"""

from __future__ import annotations

import re

DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")
MODEL_DTYPES = ("float32", "float16", "bfloat16")  # weight dtypes (``dtype``); float16 on CUDA only
# /proc/cpuinfo flags of the instructions that make bfloat16 matmuls fast on the CPU (oneDNN uses them): AVX-512 BF16
# (Intel Cooper Lake and later, AMD Zen 4 and later) or AMX (Intel Sapphire Rapids and later).
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_info() -> dict[str, str]:
    """The first processor's ``key: value`` lines of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info[key.strip()] = value.strip()
    return info


def cpu_flags(info: dict[str, str] | None = None) -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo`` ``flags``, ``Features`` on Arm; empty where unknown), from
    ``info`` (a ``cpu_info()`` already read) or read now."""
    info = cpu_info() if info is None else info
    return set(info.get("flags", info.get("Features", "")).split())


def cpu_bf16_flags() -> list[str]:
    """The ``CPU_BF16_FLAGS`` this CPU has (``/proc/cpuinfo``; empty where it cannot be read or lacks them, and under
    an ``ENCDEC_MAX_CPU_ISA`` cap, which emulates a CPU without them: ``kernels._clib``)."""
    from kernels._clib import max_cpu_isa

    if max_cpu_isa() is not None:
        return []
    present = cpu_flags()
    return [flag for flag in CPU_BF16_FLAGS if flag in present]


def check_device_name(name: str, field: str = "device") -> None:
    """Checks the spelling of a device setting (``cpu``, ``cuda``, ``cuda:N``).

    Raises:
        ValueError: anything else, naming ``field`` and the accepted forms.
    """
    if not DEVICE_PATTERN.fullmatch(name):
        raise ValueError(f"{field} must be cpu, cuda or cuda:N (N = GPU index), got {name!r}")


def is_cuda(name: str) -> bool:
    return name.startswith("cuda")


def same_device(a: str, b: str) -> bool:
    """True when two valid device names denote one device (``cuda`` is taken as ``cuda:0``)."""

    def norm(name: str) -> str:
        return "cuda:0" if name == "cuda" else name

    return norm(a) == norm(b)


def resolve_device(name: str):
    """The ``torch.device`` for a device setting, after checking it exists here (service startup).

    A CUDA device also becomes torch's current device, so code that uses "the
    current CUDA device" (CUDA IPC pools, events, generators) agrees with it,
    and TF32 is turned off for float32 convolutions and matmuls: cuDNN's
    default TF32 convolutions (10-bit mantissa) moved Whisper's encoder output
    enough to change greedy tokens against the CPU (seen on an H200), and
    float32 weights promise float32 arithmetic. Half dtypes are unaffected.

    Raises:
        ValueError: a bad name; ``cuda`` requested but torch sees no CUDA
            device (a CPU-only torch build, no driver, or ``CUDA_VISIBLE_DEVICES``
            hides them); an index past the visible devices. Each message says
            what to change.
    """
    import torch

    check_device_name(name)
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        build = (
            f"torch {torch.__version__} has no CUDA support"
            if torch.version.cuda is None
            else "torch sees no CUDA device"
        )
        raise ValueError(
            f"device {name!r} requested but {build} (check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES, "
            "and that torch is a CUDA build); set device cpu (ENCDEC_DEVICE=cpu / --device cpu) to run on the CPU"
        )
    count = torch.cuda.device_count()
    index = 0 if device.index is None else device.index
    if index >= count:
        raise ValueError(
            f"device {name!r} requested but only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})"
        )
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    torch.backends.cudnn.allow_tf32 = False  # torch's default is True for cuDNN convolutions
    torch.backends.cuda.matmul.allow_tf32 = False  # already torch's default; kept explicit
    return device


def torch_dtype(name: str):
    """``float32`` / ``float16`` / ``bfloat16`` -> the ``torch.dtype``.

    Raises:
        ValueError: another name.
    """
    import torch

    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of: {', '.join(MODEL_DTYPES)}; got {name!r}")
    return getattr(torch, name)


def model_device(model):
    """The device of a model's weights (its first parameter's)."""
    return next(model.parameters()).device


__all__ = [
    "DEVICE_PATTERN",
    "MODEL_DTYPES",
    "check_device_name",
    "is_cuda",
    "model_device",
    "resolve_device",
    "same_device",
    "torch_dtype",
]
