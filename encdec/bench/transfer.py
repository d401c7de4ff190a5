"""``encdec bench transfer``: GB/s of each cross-KV transport next to a plain memcpy.

For each payload (a model's cross-attention KV, ``[num_layers, 2,
encoder_len, num_heads, head_dim]``) and each transport available here, a
decoder process owns the pool and an encoder process writes the whole payload
into shuffled (non-contiguous) reserved blocks; the time runs from ``write``
starting until the blocks hold the data (``encdec.bench.transfer_runs`` says
how). The memcpy baseline is ``dst.copy_(src)`` of the same bytes on the
transport's device (CPU for ``shm`` / gloo, the GPU for ``cuda_ipc`` / NCCL);
``x memcpy`` is transport GB/s over memcpy GB/s. GB is 1e9 bytes; times are
medians. After the timed transfers the decoder compares its blocks with the
payload (``bit-exact``).

Payload shapes: Whisper tiny / small / large-v3 decoders (4 / 12 / 32 layers,
6 / 12 / 20 heads of 64, 1500 encoder positions), fp32 by default: 18.4 /
110.6 / 491.5 MB.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

from encdec.bench.machine import machine_line
from encdec.bench.table import markdown_table, write_json
from encdec.bench.transfer_payloads import PAYLOADS, TRANSPORTS, parse_payloads  # noqa: F401 - PAYLOADS: re-exported

# torch, the transports and encdec.bench.transfer_runs are imported inside the functions, when the bench runs:
# importing this module (`encdec bench all` reads COLUMNS; `--help`) must not pay for importing torch.

COLUMNS = ["payload", "MB", "transport", "device", "GB/s", "p50 ms", "memcpy GB/s", "x memcpy", "bit-exact", "note"]


def available_transports() -> list[str]:
    """Transport rows this machine can run: CPU ones always, CUDA ones with a GPU."""
    import torch

    names = ["shm"]
    if _has_torch_dist():
        names.append("torch_dist gloo")
    if torch.cuda.is_available():
        names.append("cuda_ipc")
        if _has_torch_dist() and torch.distributed.is_nccl_available():
            names.append("torch_dist nccl")
    return names


def _has_torch_dist() -> bool:
    import torch

    from shared.kv_transport import POOLS

    return "torch_dist" in POOLS and torch.distributed.is_available()


def _environment() -> dict:
    import torch

    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        if torch.distributed.is_available() and torch.distributed.is_nccl_available():
            env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    return env


def run(args: argparse.Namespace) -> int:
    """Runs the bench; prints the Markdown table. Returns 0, or 1 when a transport failed
    (a row whose note says ``error``; ``unsupported`` and the ``not run`` rows after a failure do not count again).

    Raises:
        ValueError: bad ``--payloads``, ``--transports``, ``--iters``, ``--warmup`` or ``--block-size``.
    """
    import torch

    from encdec.bench.transfer_runs import memcpy_gbps, run_transport

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.iters < 1 or args.warmup < 0 or args.block_size < 1:
        raise ValueError("--iters and --block-size must be >= 1, --warmup >= 0")
    payloads = parse_payloads(args.payloads, args.dtype)
    names = (
        available_transports()
        if args.transports == "auto"
        else [t.strip() for t in args.transports.split(",") if t.strip()]
    )
    unknown = [n for n in names if n not in TRANSPORTS]
    if unknown:
        raise ValueError(f"unknown transports {unknown}; known: {list(TRANSPORTS)}")
    memcpy = {}
    rows = []
    for name in names:
        device = TRANSPORTS[name][1]
        for row in run_transport(name, payloads, args):
            key = (device, row["payload"])
            if key not in memcpy and not (device == "cuda" and not torch.cuda.is_available()):
                nbytes = next(p.nbytes for p in payloads if p.name == row["payload"])
                memcpy[key] = memcpy_gbps(nbytes, device, args.iters, args.warmup)
            row["memcpy GB/s"] = memcpy.get(key)
            if row.get("GB/s") and row["memcpy GB/s"]:
                row["x memcpy"] = row["GB/s"] / row["memcpy GB/s"]
            rows.append(row)
    env = _environment()
    print(
        f"cross-KV transfer, {args.dtype}, block size {args.block_size}, median of {args.iters}: "
        + ", ".join(f"{k} {v}" for k, v in env.items()),
        file=sys.stderr,
    )
    print(f"Machine: {machine_line()}\n")
    print(markdown_table(rows, COLUMNS))
    if args.json:
        write_json(
            args.json,
            {
                "bench": "transfer",
                "dtype": args.dtype,
                "block_size": args.block_size,
                "iters": args.iters,
                "environment": env,
                "rows": rows,
            },
        )
    failed = [r for r in rows if str(r.get("note", "")).startswith("error") or r.get("bit-exact") == "NO"]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    from encdec.parser import add_transfer_arguments

    parser = argparse.ArgumentParser(prog="python -m encdec.bench.transfer", description=__doc__.splitlines()[0])
    add_transfer_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
