"""The CUDA cross-KV transports: ``cuda_ipc`` and ``torch_dist`` over NCCL, two processes on one GPU.

The decoder side (the pool) lives in the test process; the encoder is a
spawned process (CUDA cannot be used in a forked child) driven through
queues. Tests that need a GPU skip without one (``scripts/gpu_check.sh`` runs
them on a GPU machine); the handle encoding, target checks and the CPU-only
error run everywhere.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import multiprocessing as mp

import pytest
import torch
from test_kv_transport import SHAPE, read_back, reference

from shared.errors import InvalidRequestError
from shared.kv_transport import KVTargetSpec, create_pool, create_writer
from shared.kv_transport.cuda_ipc import SEGMENT_PREFIX, CudaIpcHandle, check_target

NBYTES = 3 * 2 * 12 * 5 * 2 * 4 * 4
WAIT_S = 120
NCCL_WAIT_S = 40  # under gpu_check.sh's per-test limit, so a hung NCCL pairing fails as a test
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on one)"
)


def a_handle(**change) -> CudaIpcHandle:
    fields = dict(
        device_uuid="GPU-1234",
        mem_handle=bytes(range(66)),
        size_bytes=NBYTES,
        offset_bytes=512,
        ref_counter=b"/torch_123_456_0",
        ref_counter_offset=7,
        event_handle=bytes(64),
        event_sync_required=True,
    )
    return CudaIpcHandle(**{**fields, **change})


def a_spec(**change) -> KVTargetSpec:
    fields = dict(
        transport="cuda_ipc",
        segment=a_handle().to_segment(),
        shape=SHAPE,
        dtype="float32",
        instance_id="0123456789abcdef",
    )
    return KVTargetSpec(**{**fields, **change})


def _segment_of(fields) -> str:
    return SEGMENT_PREFIX + base64.urlsafe_b64encode(json.dumps(fields).encode()).decode()


# -- everywhere: encoding and checks, the CPU-only error ---------------------------------------------


def test_handle_round_trips_through_the_segment_string():
    handle = a_handle()
    segment = handle.to_segment()
    assert segment.startswith(SEGMENT_PREFIX) and segment.isascii() and len(segment) < 1000
    assert CudaIpcHandle.from_segment(segment) == handle
    assert check_target(a_spec(segment=segment)) == handle


def _fields(**change) -> dict:
    fields = json.loads(base64.urlsafe_b64decode(a_handle().to_segment()[len(SEGMENT_PREFIX) :]))
    fields.update(change)
    return fields


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(transport="shm"), "cuda_ipc writer got a 'shm' target"),
        (dict(segment="encdec-kv-0123456789abcdef"), "must start with"),
        (dict(segment=SEGMENT_PREFIX + "***"), "does not decode"),
        (dict(segment=SEGMENT_PREFIX + "x" * 9000), "at most"),
        (dict(segment=_segment_of([1, 2])), "must hold the fields"),
        (
            dict(segment=_segment_of({k: v for k, v in _fields().items() if k != "event_handle"})),
            "must hold the fields",
        ),
        (dict(segment=_segment_of(_fields(size_bytes=True))), "'size_bytes' must be int"),
        (dict(segment=_segment_of(_fields(offset_bytes=-1))), "'offset_bytes' must be >= 0"),
        (dict(segment=_segment_of(_fields(mem_handle="not base64!"))), "'mem_handle' is not base64"),
        (dict(segment=_segment_of(_fields(mem_handle=""))), "'mem_handle' must hold"),
        (dict(segment=a_handle(size_bytes=NBYTES // 2).to_segment()), "exports"),  # handle smaller than the shape says
        (dict(dtype="float16"), "exports"),  # same handle, another layout
        (dict(shape=(3, 2, 12, 0, 2, 4)), "all >= 1"),
        (dict(instance_id="../../x"), "16 hex digits"),
    ],
)
def test_malformed_targets_are_rejected_before_any_gpu_work(change, message):
    with pytest.raises(InvalidRequestError, match=message):
        check_target(a_spec(**change))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_ipc_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_transport 'cuda_ipc' needs a CUDA GPU, but .*use kv_transport 'shm'"):
        create_pool("cuda_ipc", SHAPE)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        create_writer("cuda_ipc")


# -- with a GPU: a real second process ------------------------------------------------------------


def writer_main(commands, results) -> None:
    """An encoder process: one cuda_ipc writer; commands ``(spec, block_ids, encoder_len, seed, src_device)``."""
    writer = create_writer("cuda_ipc")
    while (cmd := commands.get()) is not None:
        spec, block_ids, encoder_len, seed, src_device = cmd
        try:
            stats = writer.write(spec, block_ids, reference(encoder_len, seed).to(src_device))
            results.put(("ok", stats.nbytes, writer.open_instances))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.put((type(exc).__name__, str(exc), writer.open_instances))
    writer.close()


class Encoder:
    """A spawned cuda_ipc writer process driven through queues."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=writer_main, args=(self.commands, self.results), daemon=True)
        self.proc.start()

    def write(self, spec, block_ids, encoder_len, seed, src_device="cuda"):
        self.commands.put((spec, block_ids, encoder_len, seed, src_device))
        return self.results.get(timeout=WAIT_S)

    def stop(self) -> None:
        self.commands.put(None)
        self.proc.join(WAIT_S)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module")
def encoder():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (scripts/gpu_check.sh runs these on one)")
    enc = Encoder()
    yield enc
    enc.stop()


@pytest.fixture
def pool():
    p = create_pool("cuda_ipc", SHAPE)
    p.tensor.fill_(-7.0)
    torch.cuda.synchronize()  # the fill is the test's own write: done before the encoder's
    yield p
    p.close()


@needs_cuda
@pytest.mark.parametrize(
    "encoder_len,block_ids,src_device",
    [
        (13, [9, 2, 5], "cuda"),  # non-contiguous ids, 13 not a multiple of 5
        (13, [9, 2, 5], "cpu"),  # encoder ran on CPU: host-to-device copy
        (1, [0], "cuda"),
        (20, [7, 6, 5, 4], "cuda"),  # exact multiple, descending ids
        (60, list(range(12)), "cuda"),  # the whole pool
    ],
)
def test_blocks_arrive_bit_exact_in_the_right_ids(pool, encoder, encoder_len, block_ids, src_device):
    kind, nbytes, _ = encoder.write(pool.spec, block_ids, encoder_len, 3, src_device)
    assert (kind, nbytes) == ("ok", SHAPE[0] * 2 * encoder_len * SHAPE[4] * SHAPE[5] * 4)
    # No synchronisation here: the reply alone must order the write before this read, as for a decode step.
    assert torch.equal(read_back(pool.tensor, block_ids, encoder_len).cpu(), reference(encoder_len, 3))
    untouched = [b for b in range(SHAPE[2]) if b not in block_ids]
    assert torch.all(pool.tensor[:, :, untouched] == -7.0)
    tail = encoder_len % SHAPE[3]
    if tail:  # positions past encoder_len in the last block are not written
        assert torch.all(pool.tensor[:, :, block_ids[-1], tail:] == -7.0)


@needs_cuda
def test_float16_pool_receives_float16(encoder):
    pool = create_pool("cuda_ipc", SHAPE, "float16")
    try:
        assert encoder.write(pool.spec, [4, 8], 7, 5)[:2] == ("ok", SHAPE[0] * 2 * 7 * SHAPE[4] * SHAPE[5] * 2)
        assert torch.equal(read_back(pool.tensor, [4, 8], 7).cpu(), reference(7, 5).half())
    finally:
        pool.close()


@needs_cuda
def test_restarted_decoder_is_reopened_and_the_stale_mapping_dropped(encoder):
    first = create_pool("cuda_ipc", SHAPE)
    try:
        assert encoder.write(first.spec, [0], 4, 1)[::2] == ("ok", [first.spec.instance_id])
        assert encoder.write(first.spec, [1], 4, 2)[::2] == (
            "ok",
            [first.spec.instance_id],
        )  # cached: still one mapping
    finally:
        first.close()
    second = create_pool("cuda_ipc", SHAPE)  # the decoder restarted: a new instance on the same GPU
    try:
        second.tensor.fill_(-7.0)
        torch.cuda.synchronize()
        assert encoder.write(second.spec, [3, 1], 9, 4)[::2] == ("ok", [second.spec.instance_id])
        assert torch.equal(read_back(second.tensor, [3, 1], 9).cpu(), reference(9, 4))
        # A target that keeps the instance id but swaps in another pool's handle is refused.
        other = create_pool("cuda_ipc", SHAPE)
        try:
            swapped = dataclasses.replace(second.spec, segment=other.spec.segment)
            kind, text, _ = encoder.write(swapped, [0], 4, 5)
            assert kind == "InvalidRequestError" and "another pool" in text
        finally:
            other.close()
    finally:
        second.close()


@needs_cuda
@pytest.mark.parametrize(
    "change,block_ids,encoder_len,message",
    [
        (dict(), [1, 1, 2], 13, "repeat"),
        (dict(), [1, 2, 12], 13, "must be in"),
        (dict(), [1, 2], 13, "need 3 blocks"),
        (dict(shape=(3, 2, 24, 5, 2, 4)), [0], 3, "exports"),  # a pool twice the exported size: never written
        (dict(dtype="bfloat16"), [0], 3, "exports"),
    ],
)
def test_malformed_write_is_rejected_without_touching_blocks(pool, encoder, change, block_ids, encoder_len, message):
    kind, text, _ = encoder.write(dataclasses.replace(pool.spec, **change), block_ids, encoder_len, 1)
    assert kind == "InvalidRequestError" and message in text, text
    assert torch.all(pool.tensor == -7.0)


@needs_cuda
def test_writer_in_the_decoder_process_uses_the_pool_directly(pool):
    """CUDA cannot open an IPC handle in the process that exported it; the writer finds the pool itself."""
    writer = create_writer("cuda_ipc")
    try:
        writer.write(pool.spec, [5, 3], reference(8, 9).cuda())  # [L, 2, 8, H, D] into blocks 5, 3
        assert torch.equal(read_back(pool.tensor, [5, 3], 8).cpu(), reference(8, 9))
    finally:
        writer.close()


# -- torch_dist over NCCL: two processes on one GPU -----------------------------------------------


def nccl_writer_main(spec, block_ids, encoder_len, seed, transfer_id, results) -> None:
    try:
        writer = create_writer("torch_dist", backend="nccl", device="cuda", timeout_s=NCCL_WAIT_S)
        stats = writer.write(spec, block_ids, reference(encoder_len, seed).cuda(), transfer_id)
        results.put(("ok", stats.nbytes))
        writer.close()
    except Exception as exc:  # noqa: BLE001 - reported to the test, with NCCL's own words from the cause
        results.put((type(exc).__name__, f"{exc} (cause: {exc.__cause__})"))


@needs_cuda
def test_nccl_two_processes_on_one_gpu_deliver_bit_exact_blocks():
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    pool = create_pool("torch_dist", SHAPE, address="127.0.0.1:0", backend="nccl", device="cuda", timeout_s=NCCL_WAIT_S)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=nccl_writer_main, args=(pool.spec, [9, 2, 5], 13, 3, 11, results), daemon=True)
    try:
        pool.tensor.fill_(-7.0)
        torch.cuda.synchronize()
        waiter = pool.expect(11, [9, 2, 5])
        proc.start()
        kind, detail = results.get(timeout=NCCL_WAIT_S)
        if kind != "ok" and any(m in detail for m in ("Duplicate GPU", "ncclInvalidUsage", "invalid usage")):
            pytest.skip(
                f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} refuses two ranks on one GPU "
                f"(NCCL >= 2.30 allows it with NCCL_MULTI_RANK_GPU_ENABLE=1): {detail[:200]}"
            )
        assert kind == "ok", detail
        waiter.result(timeout=NCCL_WAIT_S)
        assert torch.equal(read_back(pool.tensor, [9, 2, 5], 13).cpu(), reference(13, 3))
        assert torch.all(pool.tensor[:, :, [b for b in range(SHAPE[2]) if b not in (9, 2, 5)]] == -7.0)
    finally:
        if proc.pid is not None:
            proc.join(NCCL_WAIT_S)
            if proc.is_alive():
                proc.kill()
        pool.close()
