"""``encdec bench transfer``: GB/s of each cross-KV transport next to a plain memcpy.

For each payload (a model's cross-attention KV, ``[num_layers, 2,
encoder_len, num_heads, head_dim]``) and each transport available here, this
process plays the decoder (it owns the pool) and one spawned process plays the
encoder (it owns the writer). Each timed transfer writes the whole payload
into non-contiguous reserved blocks; its time runs from the encoder calling
``write`` until the blocks hold the data (the write returning for in-place
transports; the decoder's ``expect`` future resolving for ``torch_dist``).
``time.perf_counter`` is CLOCK_MONOTONIC on Linux, so the two processes'
timestamps compare.

The memcpy baseline is ``dst.copy_(src)`` of the same bytes on the transport's
device (CPU for ``shm`` / gloo, the GPU for ``cuda_ipc`` / NCCL); ``x memcpy``
is transport GB/s over memcpy GB/s. GB is 1e9 bytes. After the timed
transfers the decoder compares its blocks with the payload (``bit-exact``).

Payload shapes: Whisper tiny / small / large-v3 decoders (4 / 12 / 32 layers,
6 / 12 / 20 heads of 64, 1500 encoder positions), fp32 by default: 18.4 /
110.6 / 491.5 MB.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass

from shared.bench.table import markdown_table, write_json

# torch and the transports are imported inside the functions: `encdec` builds this
# bench's flags for every command and must not pay for importing torch.

# name: (num_layers, num_heads, head_dim, encoder_len) of the decoder's cross-attention
PAYLOADS = {
    "whisper-tiny": (4, 6, 64, 1500),
    "whisper-small": (12, 12, 64, 1500),
    "whisper-large-v3": (32, 20, 64, 1500),
}
# transport row name: (kv_transport, device kind, pool/writer options)
TRANSPORTS = {
    "shm": ("shm", "cpu", {}),
    "torch_dist gloo": ("torch_dist", "cpu", {"backend": "gloo", "device": "cpu"}),
    "cuda_ipc": ("cuda_ipc", "cuda", {}),
    "torch_dist nccl": ("torch_dist", "cuda", {"backend": "nccl", "device": "cuda"}),
}
COLUMNS = ["payload", "MB", "transport", "device", "GB/s", "p50 ms", "memcpy GB/s", "x memcpy", "bit-exact", "note"]
_TIMEOUT_S = 60.0
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Payload:
    """One cross-KV payload shape. ``dims`` = ``(num_layers, num_heads, head_dim, encoder_len)``."""

    name: str
    dims: tuple[int, int, int, int]
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:  # [L, 2, S, H, D]
        layers, heads, head_dim, encoder_len = self.dims
        return (layers, 2, encoder_len, heads, head_dim)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


def parse_payloads(text: str, dtype: str) -> list[Payload]:
    """``whisper-tiny,2x3x8x13`` -> payloads; ``LxHxDxS`` = layers x heads x head_dim x encoder_len.

    Raises:
        ValueError: an unknown name or a malformed ``LxHxDxS``.
    """
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item in PAYLOADS:
            out.append(Payload(item, PAYLOADS[item], dtype))
            continue
        parts = item.split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"payload {item!r} is neither one of {sorted(PAYLOADS)} nor LxHxDxS (e.g. 4x6x64x1500)")
        out.append(Payload(item, tuple(int(p) for p in parts), dtype))
    return out


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


def payload_tensor(payload: Payload, seed: int, device: str) -> torch.Tensor:
    """The deterministic cross KV ``[L, 2, S, H, D]`` both processes build from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(payload.shape, generator=g).to(dtype=getattr(torch, payload.dtype), device=device)


def _layout(payload: Payload, block_size: int, seed: int) -> tuple[tuple[int, ...], list[int]]:
    """Pool shape with a quarter more blocks than needed, and a shuffled (non-contiguous) choice of them."""
    layers, heads, head_dim, encoder_len = payload.dims
    needed = math.ceil(encoder_len / block_size)
    num_blocks = needed + needed // 4 + 1
    block_ids = random.Random(seed).sample(range(num_blocks), needed)
    return (layers, 2, num_blocks, block_size, heads, head_dim), block_ids


def _encoder_main(transport: str, options: dict, device: str, conn, threads: int) -> None:
    """Encoder process: one writer, then ``("payload", ...)`` / ``("go", ...)`` commands until None."""
    import torch

    from shared.kv_transport import create_writer

    if threads:
        torch.set_num_threads(threads)
    try:
        writer = create_writer(transport, **options)
    except Exception as exc:  # noqa: BLE001 - reported to the decoder process
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    src = spec = block_ids = None
    while (msg := conn.recv()) is not None:
        try:
            if msg[0] == "payload":
                _, spec, block_ids, payload, seed = msg
                src = payload_tensor(payload, seed, device)
                conn.send(("ok", None))
            else:  # ("go", transfer_id)
                start = time.perf_counter()
                writer.write(spec, block_ids, src, msg[1])
                conn.send(("ok", (start, time.perf_counter())))
        except Exception as exc:  # noqa: BLE001 - reported to the decoder process, with the cause's words
            cause = f" (cause: {exc.__cause__})" if exc.__cause__ is not None else ""
            conn.send(("error", f"{type(exc).__name__}: {exc}{cause}"))
    writer.close()


def _recv(conn, proc, what: str = "encoder", timeout_s: float = _TIMEOUT_S) -> tuple[str, object]:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"{what} process gave no answer in {timeout_s:.0f} s (exit code {proc.exitcode})")
    try:
        status, value = conn.recv()
    except EOFError as exc:
        proc.join(5)
        raise RuntimeError(f"{what} process died (exit code {proc.exitcode})") from exc
    if status == "error":
        raise RuntimeError(value)
    return status, value


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def memcpy_gbps(nbytes: int, device: str, iters: int, warmup: int) -> float:
    """GB/s of ``dst.copy_(src)`` over ``nbytes`` bytes on ``device`` (median of ``iters``)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    times = []
    for i in range(warmup + iters):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def _run_transport(name: str, payloads: list[Payload], args) -> list[dict]:
    """All payloads over one transport, in a spawned decoder process of its own: a transport that
    crashes its process (an NCCL abort, say) costs its rows, not the bench."""
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child; spawn everywhere for one code path
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decoder_main, args=(name, payloads, args, child))  # not daemonic: it has a child
    proc.start()
    child.close()  # the child's death is then an EOF here, not a silent wait
    try:
        # its own waits are bounded by _TIMEOUT_S each; a broken transport stops after one
        return _recv(parent, proc, "decoder", timeout_s=_TIMEOUT_S * (3 + len(payloads)))[1]
    except Exception as exc:  # noqa: BLE001 - the rows say why
        return [_row(name, p, note=_short_error(exc)) for p in payloads]
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _row(name: str, payload: Payload, **values) -> dict:
    return {"payload": payload.name, "MB": payload.nbytes / 1e6, "transport": name, "device": TRANSPORTS[name][1], **values}


def _decoder_main(name: str, payloads: list[Payload], args, result) -> None:
    """Decoder process: owns each payload's pool, drives a spawned encoder process; sends back the rows."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    transport, device, options = TRANSPORTS[name]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_encoder_main, args=(transport, options, device, child, args.threads), daemon=True)
    proc.start()
    child.close()
    rows, failed = [], None
    try:
        _recv(conn, proc)
        for i, payload in enumerate(payloads):
            if failed is not None:  # one broken transport is not retried (and waited for) per payload
                rows.append(_row(name, payload, note=f"not run: {failed}"))
                continue
            try:
                rows.append(_row(name, payload, **_run_payload(transport, device, options, payload, args, conn, proc, seed=1000 + i)))
            except Exception as exc:  # noqa: BLE001 - one failed payload is a row, not the end of the bench
                rows.append(_row(name, payload, note=_short_error(exc)))
                failed = rows[-1]["note"]
    except Exception as exc:  # noqa: BLE001 - the writer could not start: one row per payload says why
        rows = [_row(name, p, note=_short_error(exc)) for p in payloads]
    finally:
        try:
            conn.send(None)
        except OSError:
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    result.send(("rows", rows))


def _run_payload(transport, device, options, payload: Payload, args, conn, proc, seed: int) -> dict:
    from shared.kv_transport import create_pool

    shape, block_ids = _layout(payload, args.block_size, seed)
    pool = create_pool(transport, shape, payload.dtype, **options)
    try:
        pool.tensor.fill_(-1.0)
        _sync(device)  # this process's own write, done before the encoder's
        conn.send(("payload", pool.spec, block_ids, payload, seed))
        _recv(conn, proc)
        times = []
        for i in range(args.warmup + args.iters):
            transfer_id = seed * 1000 + i + 1
            done = pool.expect(transfer_id, block_ids)  # None: the write is in place
            landed: list[float] = []
            if done is not None:  # stamped by the thread that resolves it, when the blocks hold the data
                done.add_done_callback(lambda _f: landed.append(time.perf_counter()))
            conn.send(("go", transfer_id))
            try:
                _, (start, write_end) = _recv(conn, proc)
            except Exception:
                pool.cancel(transfer_id)
                raise
            if done is not None:
                done.result(timeout=_TIMEOUT_S)
            if i >= args.warmup:
                times.append(max([write_end, *landed]) - start)
        exact = _blocks_equal(pool.tensor, block_ids, payload_tensor(payload, seed, device))
    finally:
        pool.close()
    median = statistics.median(times)
    return {"GB/s": payload.nbytes / median / 1e9, "p50 ms": median * 1000, "bit-exact": "yes" if exact else "NO"}


def _blocks_equal(pool, block_ids: list[int], expected) -> bool:
    import torch

    layers, _, encoder_len, heads, head_dim = expected.shape
    got = pool[:, :, block_ids].reshape(layers, 2, -1, heads, head_dim)[:, :, :encoder_len]  # [L, 2, S, H, D]
    return bool(torch.equal(got, expected.to(pool.device)))


def _short_error(exc: BaseException) -> str:
    text = str(exc).replace("\n", " ").replace("|", "/")
    if any(m in text for m in ("Duplicate GPU", "ncclInvalidUsage", "invalid usage")):
        return ("unsupported: this NCCL refuses two ranks on one GPU (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 "
                f"allows it): {text[:120]}")
    return f"error: {text[:200]}"


def _environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        if torch.distributed.is_available() and torch.distributed.is_nccl_available():
            env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    return env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``encdec bench transfer`` flags."""
    parser.add_argument("--payloads", default="whisper-tiny,whisper-small,whisper-large-v3",
                        help=f"comma-separated: {', '.join(PAYLOADS)} or LxHxDxS (layers x heads x head_dim x encoder_len)")
    parser.add_argument("--transports", default="auto",
                        help=f"comma-separated rows among {', '.join(TRANSPORTS)}; auto = every one available here")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="pool and payload dtype")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--iters", type=int, default=10, help="timed transfers per payload (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed transfers first (mapping, connection set-up)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads in both processes; 0 keeps torch's default")
    parser.add_argument("--json", default=None, help="also write the results here")


def run(args: argparse.Namespace) -> int:
    """Runs the bench; prints the Markdown table. Returns 0, or 1 when a transport failed
    (a row whose note says ``error``; ``unsupported`` rows do not count)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.iters < 1 or args.warmup < 0 or args.block_size < 1:
        raise ValueError("--iters and --block-size must be >= 1, --warmup >= 0")
    payloads = parse_payloads(args.payloads, args.dtype)
    names = available_transports() if args.transports == "auto" else [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = [n for n in names if n not in TRANSPORTS]
    if unknown:
        raise ValueError(f"unknown transports {unknown}; known: {list(TRANSPORTS)}")
    memcpy = {}
    rows = []
    for name in names:
        device = TRANSPORTS[name][1]
        for row in _run_transport(name, payloads, args):
            key = (device, row["payload"])
            if key not in memcpy and not (device == "cuda" and not torch.cuda.is_available()):
                nbytes = next(p.nbytes for p in payloads if p.name == row["payload"])
                memcpy[key] = memcpy_gbps(nbytes, device, args.iters, args.warmup)
            row["memcpy GB/s"] = memcpy.get(key)
            if row.get("GB/s") and row["memcpy GB/s"]:
                row["x memcpy"] = row["GB/s"] / row["memcpy GB/s"]
            rows.append(row)
    env = _environment()
    print(f"cross-KV transfer, {args.dtype}, block size {args.block_size}, median of {args.iters}: "
          + ", ".join(f"{k} {v}" for k, v in env.items()), file=sys.stderr)
    print(markdown_table(rows, COLUMNS))
    if args.json:
        write_json(args.json, {"bench": "transfer", "dtype": args.dtype, "block_size": args.block_size,
                               "iters": args.iters, "environment": env, "rows": rows})
    failed = [r for r in rows if str(r.get("note", "")).startswith("error") or r.get("bit-exact") == "NO"]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.bench.transfer", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
