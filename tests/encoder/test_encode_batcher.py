"""EncodeBatcher (encoder_svc/batcher.py) on a tiny random T5: batches stay within max_batch_size
requests and max_batch_tokens padded positions; a request that would overflow opens the next batch."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers.text_checkpoints import build_t5
from helpers.text_paged import encode_batch

from encoder_svc.batcher import EncodeBatcher, EncodeItem
from shared.kv_transport import create_pool, create_writer
from shared.models.registry import load_model


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    return load_model(build_t5(tmp_path_factory.mktemp("t5") / "t5", v1_1=False))


def _run(model, sources: list[list[int]], **batching) -> tuple[list[int], torch.Tensor, list[list[int]]]:
    """Submits every source at once; returns each one's batch size, the pool and each one's block ids."""
    c = model.config
    per = [-(-len(s) // 4) for s in sources]
    pool = create_pool("shm", (c.decoder_layers, 2, sum(per), 4, c.num_heads, c.head_dim))
    writer = create_writer("shm")
    batcher = EncodeBatcher(model, None, writer, **batching)
    starts = [sum(per[:i]) for i in range(len(sources))]
    blocks = [list(range(s, s + n)) for s, n in zip(starts, per)]
    try:
        futures = [
            batcher.submit(EncodeItem(f"r{i}", None, pool.spec, blocks[i], input_ids=s)) for i, s in enumerate(sources)
        ]
        sizes = [f.result(timeout=60)[2] for f in futures]
        return sizes, pool.tensor.clone(), blocks
    finally:
        batcher.stop()
        writer.close()
        pool.close()


def test_token_budget_splits_batches_and_results_do_not_depend_on_it(t5):
    sources = [[5, 6, 7, 8, 9, 1], [10, 11, 12, 13, 14, 1], [15, 16, 1], [17, 18, 19, 20, 21, 1], [22] * 20 + [1]]
    # 2 x 6 = 12 fits 14 padded positions, a third 6-token source does not; the 21-token one runs alone.
    sizes, pool, blocks = _run(t5, sources, max_batch_size=8, batch_wait_ms=300, max_batch_tokens=14)
    assert sizes == [2, 2, 2, 2, 1]
    sizes_one, pool_one, _ = _run(t5, sources, max_batch_size=1, batch_wait_ms=0)
    assert sizes_one == [1] * 5
    expected = [encode_batch(t5, [s])[0] for s in sources]  # each alone, unpadded
    for i, s in enumerate(sources):
        got = pool[:, :, blocks[i]].flatten(2, 3)[:, :, : len(s)]  # [L, 2, S, H, Dh]
        torch.testing.assert_close(got, expected[i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(
            pool_one[:, :, blocks[i]].flatten(2, 3)[:, :, : len(s)], expected[i], rtol=1e-4, atol=1e-4
        )


def test_max_batch_size_still_caps_a_batch(t5):
    sources = [[5, 6, 1]] * 5
    sizes, _, _ = _run(t5, sources, max_batch_size=2, batch_wait_ms=300, max_batch_tokens=1000)
    assert sizes == [2, 2, 2, 2, 1]


def test_each_arrival_extends_the_window_up_to_max_batch_wait(t5):
    """Arrivals 0.3 s apart keep a 0.4 s window open; the 0.7 s cap closes the batch before the fourth."""
    import threading
    import time

    c = t5.config
    pool = create_pool("shm", (c.decoder_layers, 2, 8, 4, c.num_heads, c.head_dim))
    writer = create_writer("shm")
    batcher = EncodeBatcher(t5, None, writer, max_batch_size=8, batch_wait_ms=400, max_batch_wait_ms=700)
    futures = []

    def arrive() -> None:
        for i in range(4):
            if i:
                time.sleep(0.3)
            futures.append(batcher.submit(EncodeItem(f"r{i}", None, pool.spec, [i], input_ids=[5, 6, 1])))

    try:
        sender = threading.Thread(target=arrive)
        sender.start()
        sender.join()
        assert [f.result(timeout=60)[2] for f in futures] == [3, 3, 3, 1]
    finally:
        batcher.stop()
        writer.close()
        pool.close()


def test_every_future_is_answered_when_delivery_breaks_mid_batch(t5):
    """Answers are held while the batch's writes run; an error outside a write (here a writer returning junk for the
    second item) must still answer every request: the first with its result, the rest with the error; and the
    batcher keeps serving."""
    c = t5.config
    pool = create_pool("shm", (c.decoder_layers, 2, 6, 4, c.num_heads, c.head_dim))
    real = create_writer("shm")

    class Flaky:
        calls = 0

        def write(self, *args):
            Flaky.calls += 1
            return real.write(*args) if Flaky.calls != 2 else None  # None has no .nbytes

        def close(self):
            real.close()

    batcher = EncodeBatcher(t5, None, Flaky(), max_batch_size=8, batch_wait_ms=300)
    try:
        futures = [batcher.submit(EncodeItem(f"r{i}", None, pool.spec, [i], input_ids=[5, 6, 1])) for i in range(3)]
        assert futures[0].result(timeout=60)[0] == 3
        for f in futures[1:]:
            with pytest.raises(AttributeError):
                f.result(timeout=60)
        again = batcher.submit(EncodeItem("r3", None, pool.spec, [0], input_ids=[5, 1]))
        assert again.result(timeout=60)[0] == 2
    finally:
        batcher.stop()
        real.close()
        pool.close()


def test_pending_encodes_are_taken_by_priority_then_arrival(t5):
    """Items waiting behind a running batch: the lowest ``order`` (priority, then the Generate request's arrival)
    goes first, whatever the submission order, so a long-form request's later windows keep its place."""
    c = t5.config
    pool = create_pool("shm", (c.decoder_layers, 2, 8, 4, c.num_heads, c.head_dim))
    writer = create_writer("shm")
    started, release = [], threading.Event()
    batcher = EncodeBatcher(t5, None, writer, max_batch_size=1, batch_wait_ms=0)
    run = batcher._run

    def hold_first(batch):  # the first batch runs until every other item is queued
        started.append(batch[0].request_id)
        release.wait(timeout=30)
        run(batch)

    batcher._run = hold_first
    try:
        orders = {"first": (0, 0.0), "late": (0, 30.0), "urgent": (-1, 50.0), "early": (0, 10.0)}
        items = {name: EncodeItem(name, None, pool.spec, [i], input_ids=[5, 6, 1], order=o)
                 for i, (name, o) in enumerate(orders.items())}  # fmt: skip
        futures = [batcher.submit(items["first"])]
        while not started:
            time.sleep(0.01)
        futures += [batcher.submit(items[name]) for name in ("late", "urgent", "early")]  # queued behind it
        release.set()
        for f in futures:
            f.result(timeout=60)
        assert started == ["first", "urgent", "early", "late"]
    finally:
        batcher.stop()
        writer.close()
        pool.close()
