"""The processes and timings behind ``encdec bench transfer`` (``encdec.bench.transfer``).

One transport's measurement runs in a spawned decoder process (it owns each
payload's pool), which drives a spawned encoder process (it owns the writer):
a transport that takes its process down (an NCCL abort, say) costs its rows,
not the bench. Each timed transfer writes the whole payload into shuffled
(non-contiguous) reserved blocks; its time runs from the encoder calling
``write`` until the blocks hold the data: ``write`` returning for in-place
transports, the decoder's ``expect`` future resolving for ``torch_dist``.
``time.perf_counter`` is CLOCK_MONOTONIC on Linux, so the two processes'
stamps compare. Spawn, not fork, everywhere: CUDA cannot be used in a forked
child.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import random
import statistics
import threading
import time

import torch

from encdec.bench.transfer_payloads import TRANSPORTS, Payload
from shared.kv_transport import create_pool, create_writer

TIMEOUT_S = 60.0  # bound on every wait for the other process


def memcpy_gbps(nbytes: int, device: str, iters: int, warmup: int) -> float:
    """GB/s of ``dst.copy_(src)`` over ``nbytes`` bytes on ``device`` (median of ``iters``)."""
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


def payload_tensor(payload: Payload, seed: int, device: str) -> torch.Tensor:
    """The deterministic cross KV ``[L, 2, S, H, D]`` both processes build from ``seed``."""
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


def _recv(conn, proc, what: str = "encoder", timeout_s: float = TIMEOUT_S) -> tuple[str, object]:
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
    if device == "cuda":
        torch.cuda.synchronize()


def run_transport(name: str, payloads: list[Payload], args) -> list[dict]:
    """All payloads over one transport, in a spawned decoder process of its own: a transport that
    crashes its process (an NCCL abort, say) costs its rows, not the bench."""
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child; spawn everywhere for one code path
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decoder_main, args=(name, payloads, args, child))  # not daemonic: it has a child
    proc.start()
    child.close()  # the child's death is then an EOF here, not a silent wait
    try:
        # its own waits are bounded by TIMEOUT_S each; a broken transport stops after one
        return _recv(parent, proc, "decoder", timeout_s=TIMEOUT_S * (3 + len(payloads)))[1]
    except Exception as exc:  # noqa: BLE001 - the rows say why
        return [_row(name, p, note=_short_error(exc)) for p in payloads]
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _row(name: str, payload: Payload, **values) -> dict:
    return {
        "payload": payload.name,
        "MB": payload.nbytes / 1e6,
        "transport": name,
        "device": TRANSPORTS[name][1],
        **values,
    }


def _decoder_main(name: str, payloads: list[Payload], args, result) -> None:
    """Decoder process: owns each payload's pool, drives a spawned encoder process; sends back the rows."""
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
                rows.append(
                    _row(
                        name,
                        payload,
                        **_run_payload(transport, device, options, payload, args, conn, proc, seed=1000 + i),
                    )
                )
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
            landed = _Stamp()
            if done is not None:  # stamped by the thread that resolves it, when the blocks hold the data
                done.add_done_callback(landed)
            conn.send(("go", transfer_id))
            try:
                _, (start, write_end) = _recv(conn, proc)
            except Exception:
                pool.cancel(transfer_id)
                raise
            end = write_end
            if done is not None:
                done.result(timeout=TIMEOUT_S)
                end = max(end, landed.wait())
            if i >= args.warmup:
                times.append(end - start)
        exact = _blocks_equal(pool.tensor, block_ids, payload_tensor(payload, seed, device))
    finally:
        pool.close()
    median = statistics.median(times)
    return {"GB/s": payload.nbytes / median / 1e9, "p50 ms": median * 1000, "bit-exact": "yes" if exact else "NO"}


class _Stamp:
    """A future's done-callback keeping ``time.perf_counter()`` of the moment it resolved.

    ``Future.result`` may return before the callbacks ran, hence ``wait``.
    """

    def __init__(self) -> None:
        self.at = 0.0
        self._set = threading.Event()

    def __call__(self, _future) -> None:
        self.at = time.perf_counter()
        self._set.set()

    def wait(self) -> float:
        self._set.wait(TIMEOUT_S)
        return self.at


def _blocks_equal(pool, block_ids: list[int], expected) -> bool:
    layers, _, encoder_len, heads, head_dim = expected.shape
    got = pool[:, :, block_ids].reshape(layers, 2, -1, heads, head_dim)[:, :, :encoder_len]  # [L, 2, S, H, D]
    return bool(torch.equal(got, expected.to(pool.device)))


def _short_error(exc: BaseException) -> str:
    text = str(exc).replace("\n", " ").replace("|", "/")
    if any(m in text for m in ("Duplicate GPU", "ncclInvalidUsage", "invalid usage")):
        return (
            "unsupported: this NCCL refuses two ranks on one GPU (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 "
            f"allows it): {text[:120]}"
        )
    return f"error: {text[:200]}"
