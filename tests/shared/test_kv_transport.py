"""The shm cross-KV transport: a writer in another process fills the decoder's blocks in place."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat

import pytest
import torch

from shared.errors import InvalidRequestError, UnavailableError
from shared.kv_transport import create_pool, create_writer

SHAPE = (3, 2, 12, 5, 2, 4)  # [layers, K/V, blocks, block_size, heads, head_dim]


def reference(encoder_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE[0], 2, encoder_len, SHAPE[4], SHAPE[5], generator=g)  # [L, 2, S, H, D]


def _write_in_child(spec, block_ids, encoder_len, seed, errors) -> None:
    try:
        writer = create_writer("shm")
        writer.write(spec, block_ids, reference(encoder_len, seed))
        writer.close()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        errors.put(repr(exc))


def read_back(pool: torch.Tensor, block_ids: list[int], encoder_len: int) -> torch.Tensor:
    blocks = pool[:, :, block_ids]  # [L, 2, nb, bs, H, D]
    return blocks.reshape(SHAPE[0], 2, -1, SHAPE[4], SHAPE[5])[:, :, :encoder_len]


@pytest.mark.parametrize("encoder_len,block_ids", [(13, [9, 2, 5]), (5, [11]), (1, [0]), (20, [7, 6, 5, 4])])
def test_child_process_writes_bit_exact_blocks(encoder_len, block_ids):
    pool = create_pool("shm", SHAPE)
    try:
        pool.tensor.fill_(-7.0)
        ctx = mp.get_context("fork")  # a separate process with its own mapping; fork keeps the test fast
        errors = ctx.Queue()
        proc = ctx.Process(target=_write_in_child, args=(pool.spec, block_ids, encoder_len, 3, errors))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0 and errors.empty()
        assert torch.equal(read_back(pool.tensor, block_ids, encoder_len), reference(encoder_len, 3))
        untouched = [b for b in range(SHAPE[2]) if b not in block_ids]
        assert torch.all(pool.tensor[:, :, untouched] == -7.0)
        # The tail of the last block past encoder_len is not written either.
        tail = encoder_len % SHAPE[3]
        if tail:
            assert torch.all(pool.tensor[:, :, block_ids[-1], tail:] == -7.0)
        # The segment outlives the writer process: it was not unlinked by it.
        assert os.path.exists(f"/dev/shm/{pool.spec.segment}")
    finally:
        pool.close()


def test_segment_is_private_and_unlinked_on_close(monkeypatch):
    pool = create_pool("shm", SHAPE)
    path = f"/dev/shm/{pool.spec.segment}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(pool.spec.segment) >= len("encdec-kv-") + 16
    pool.close()
    assert not os.path.exists(path)
    pool.close()  # idempotent
    # A failure after the segment exists (here building the tensor) removes it again.
    from shared.kv_transport import shm

    before = set(os.listdir("/dev/shm"))
    monkeypatch.setattr(shm, "_tensor_over", lambda *a: (_ for _ in ()).throw(MemoryError("test")))
    with pytest.raises(MemoryError):
        create_pool("shm", SHAPE)
    assert set(os.listdir("/dev/shm")) == before
    with pytest.raises(UnavailableError):
        create_writer("shm").write(pool.spec, [0], reference(3, 0))


@pytest.mark.parametrize(
    "block_ids,encoder_len,message",
    [
        ([1, 2], 13, "need 3 blocks"),
        ([1, 1, 2], 13, "repeat"),
        ([1, 2, 12], 13, "must be in"),
        ([1, 2, -1], 13, "must be in"),
    ],
)
def test_malformed_write_is_rejected_without_touching_blocks(block_ids, encoder_len, message):
    pool = create_pool("shm", SHAPE)
    writer = create_writer("shm")
    try:
        pool.tensor.fill_(1.0)
        with pytest.raises(InvalidRequestError, match=message):
            writer.write(pool.spec, block_ids, reference(encoder_len, 1))
        assert torch.all(pool.tensor == 1.0)
    finally:
        writer.close()
        pool.close()


def test_wrong_shape_is_rejected():
    pool = create_pool("shm", SHAPE)
    writer = create_writer("shm")
    try:
        with pytest.raises(InvalidRequestError, match="does not fit pool"):
            writer.write(pool.spec, [0], torch.zeros(SHAPE[0], 2, 3, SHAPE[4] + 1, SHAPE[5]))
    finally:
        writer.close()
        pool.close()


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(dtype="float16"), "holds"),  # same segment, another layout: sizes differ
        (dict(shape=(3, 2, 6, 5, 2, 4)), "holds"),  # fewer blocks than the pool
        (dict(shape=(3, 2, 6, 10, 2, 4)), "holds a"),  # the pool's byte count, other block geometry
        (dict(shape=(3, 2, 24, 5, 2, 4), dtype="float16"), "holds a"),  # the pool's byte count, half-size elements
        (dict(shape=(3, 2, 12, 0, 2, 4)), "all >= 1"),
        (dict(shape=(3, 2, -12, 5, 2, 4)), "all >= 1"),
        (dict(dtype="int8"), "dtype"),
        (dict(instance_id=""), "does not belong"),
        (dict(segment="encdec-kv-../../etc/passwd"), "does not belong"),
    ],
)
def test_target_must_describe_the_pool_exactly(change, message):
    import dataclasses

    pool = create_pool("shm", SHAPE)
    writer = create_writer("shm")
    try:
        pool.tensor.fill_(2.0)
        spec = dataclasses.replace(pool.spec, **change)
        with pytest.raises(InvalidRequestError, match=message):
            writer.write(spec, [0], reference(3, 0))
        assert torch.all(pool.tensor == 2.0)
    finally:
        writer.close()
        pool.close()


def test_mapped_segment_refuses_a_same_size_layout():
    """Once mapped, a target with the pool's byte count but another layout is refused, not written (cached path)."""
    import dataclasses

    pool = create_pool("shm", SHAPE)
    writer = create_writer("shm")
    try:
        pool.tensor.fill_(2.0)
        writer.write(pool.spec, [4], reference(3, 0))  # maps the segment
        before = pool.tensor.clone()
        for change in (dict(shape=(3, 2, 6, 10, 2, 4)), dict(shape=(3, 2, 24, 5, 2, 4), dtype="float16")):
            with pytest.raises(InvalidRequestError, match="holds a"):
                writer.write(dataclasses.replace(pool.spec, **change), [5, 1], reference(7, 1))
        assert torch.equal(pool.tensor, before)
    finally:
        writer.close()
        pool.close()


def test_encoder_writes_nothing_past_the_callers_deadline(tmp_path):
    """An Encode whose decoder already gave up (deadline passed, blocks released) must not write in place.

    The decoder frees a timed-out request's cross blocks; were the late write to
    land, it would overwrite whichever request owns those blocks by then.
    """
    import time

    from helpers.text_checkpoints import build_t5

    from encoder_svc.batcher import EncodeBatcher, EncodeItem
    from shared.models.registry import load_model

    model = load_model(build_t5(tmp_path / "t5", v1_1=False))
    c = model.config
    pool = create_pool("shm", (c.decoder_layers, 2, 4, 4, c.num_heads, c.head_dim))
    writer = create_writer("shm")
    batcher = EncodeBatcher(model, None, writer, max_batch_size=2, batch_wait_ms=0)
    source = [5, 6, 7, 8, 9, 1]  # 6 positions: 2 blocks of 4
    try:
        late = EncodeItem("late", None, pool.spec, [0, 1], input_ids=source, write_deadline=time.monotonic() - 1.0)
        with pytest.raises(UnavailableError, match="deadline"):
            batcher.submit(late).result(timeout=60)
        on_time = EncodeItem(
            "on-time", None, pool.spec, [2, 3], input_ids=source, write_deadline=time.monotonic() + 60.0
        )
        assert batcher.submit(on_time).result(timeout=60)[0] == len(source)
        assert pool.tensor[:, :, [0, 1]].abs().sum().item() == 0.0  # the late request's blocks untouched
        assert pool.tensor[:, :, 2].abs().sum().item() > 0.0
    finally:
        batcher.stop()
        writer.close()
        pool.close()


def _views_outlive_close(kind: str) -> None:
    """Child process: a view taken before the close is read and written after it, under fresh mappings."""
    import mmap

    pool = create_pool("shm", SHAPE)
    pool.tensor.fill_(3.0)
    if kind == "pool":
        view = pool.tensor[1]
        expected = view.clone()
        pool.close()
    else:  # the encoder drops a mapping (decoder restarted: segment unlinked) while a write still holds its tensor
        writer = create_writer("shm")
        writer.write(pool.spec, [0], reference(3, 0))
        view = writer._maps[pool.spec.segment][1][1]  # what a concurrent write holds
        expected = view.clone()
        pool.close()
        writer.close()
    others = [mmap.mmap(-1, view.numel() * 4 + 4096) for _ in range(64)]  # would land at the unmapped address
    assert torch.equal(view, expected)
    view.fill_(5.0)  # into the segment's own pages, not into anyone else's mapping
    assert all(m[:8] == b"\0" * 8 and m.find(b"\0\0\xa0\x40") == -1 for m in others)


@pytest.mark.parametrize("kind", ["pool", "writer"])
def test_views_stay_valid_after_close(kind):
    """Closing a pool (or the encoder dropping a mapping) while a tensor view lives must not unmap its pages:
    torch.frombuffer would let mmap.close() unmap them (a later read segfaults, a later mapping gets the writes)."""
    proc = mp.get_context("spawn").Process(target=_views_outlive_close, args=(kind,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0, f"the child died with exit code {proc.exitcode} (negative: a signal, e.g. -11 SIGSEGV)"
