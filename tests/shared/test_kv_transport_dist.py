"""The torch_dist cross-KV transport with Gloo: a writer in another process sends blocks to the decoder's pool.

The decoder side (``TorchDistCrossKVPool``) lives in the test process; each
encoder is a separate spawned process talking Gloo over 127.0.0.1, paired
through the pool's TCPStore exactly as the services do.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import threading
import time

import pytest
import torch
import torch.distributed as dist
from test_kv_transport import SHAPE, read_back, reference

from shared.errors import InvalidRequestError, UnavailableError
from shared.internal_auth import InternalAuth
from shared.kv_transport import create_pool, create_writer
from shared.kv_transport.torch_dist import MAX_PAIRS

CTX = mp.get_context("spawn")  # a clean process: no forked Gloo/store threads
WAIT_S = 60


def writer_main(commands, results, pair_key=None) -> None:
    """An encoder process: one writer, one write per command ``(spec, block_ids, encoder_len, seed, transfer_id)``."""
    torch.set_num_threads(1)
    writer = create_writer("torch_dist", backend="gloo", device="cpu", timeout_s=20, pair_key=pair_key)
    while (cmd := commands.get()) is not None:
        spec, block_ids, encoder_len, seed, transfer_id = cmd
        try:
            stats = writer.write(spec, block_ids, reference(encoder_len, seed), transfer_id)
            results.put(("ok", stats.nbytes))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.put((type(exc).__name__, str(exc)))
    writer.close()


def stalling_writer_main(spec, block_ids, encoder_len, seed, transfer_id, acked, go, die) -> None:
    """An encoder that pairs, sends the header, gets the ack, then either dies (SIGKILL) or waits for ``go``."""
    import os
    import signal

    from shared.kv_transport import torch_dist as td

    torch.set_num_threads(1)
    writer = create_writer("torch_dist", backend="gloo", device="cpu", timeout_s=20)
    link = writer._link(spec)
    payload = reference(encoder_len, seed)
    header = torch.tensor([td.MAGIC, transfer_id, encoder_len, 0, SHAPE[0], SHAPE[4], SHAPE[5], payload.numel() * 4])
    link.group.send([header], 0, td.TAG_HEADER).wait()
    reply = torch.zeros(2, dtype=torch.int64)
    link.group.recv([reply], 0, td.TAG_ACK).wait()
    acked.put(int(reply[0]))
    if die:
        acked.close()
        acked.join_thread()  # flush the queue's feeder thread before dying
        os.kill(os.getpid(), signal.SIGKILL)
    go.get(timeout=WAIT_S)
    link.group.send([payload], 0, td.TAG_PAYLOAD).wait()
    link.group.recv([reply], 0, td.TAG_DONE).wait()
    acked.put(int(reply[0]))


class Encoder:
    """A spawned writer process driven through queues."""

    def __init__(self, pair_key: bytes | None = None) -> None:
        self.commands, self.results = CTX.Queue(), CTX.Queue()
        self.proc = CTX.Process(target=writer_main, args=(self.commands, self.results, pair_key), daemon=True)
        self.proc.start()

    def write(self, spec, block_ids, encoder_len, seed, transfer_id):
        self.commands.put((spec, block_ids, encoder_len, seed, transfer_id))
        return self.results.get(timeout=WAIT_S)

    def stop(self) -> None:
        self.commands.put(None)
        self.proc.join(WAIT_S)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture
def pool():
    p = create_pool("torch_dist", SHAPE, address="127.0.0.1:0", backend="gloo", device="cpu", timeout_s=20)
    p.tensor.fill_(-7.0)
    yield p
    p.close()


@pytest.fixture(scope="module")
def encoder():
    enc = Encoder()
    yield enc
    enc.stop()


@pytest.mark.parametrize(
    "encoder_len,block_ids", [(13, [9, 2, 5]), (5, [11]), (1, [0]), (20, [7, 6, 5, 4]), (60, list(range(12)))]
)
def test_blocks_arrive_bit_exact_in_the_right_ids(pool, encoder, encoder_len, block_ids):
    waiter = pool.expect(41, block_ids)
    assert encoder.write(pool.spec, block_ids, encoder_len, 3, 41) == (
        "ok",
        SHAPE[0] * 2 * encoder_len * SHAPE[4] * SHAPE[5] * 4,
    )
    stats = waiter.result(timeout=WAIT_S)
    assert stats.nbytes == reference(encoder_len, 3).numel() * 4 and stats.ms > 0
    assert torch.equal(read_back(pool.tensor, block_ids, encoder_len), reference(encoder_len, 3))
    untouched = [b for b in range(SHAPE[2]) if b not in block_ids]
    assert torch.all(pool.tensor[:, :, untouched] == -7.0)
    tail = encoder_len % SHAPE[3]
    if tail:  # positions past encoder_len in the last block are not written
        assert torch.all(pool.tensor[:, :, block_ids[-1], tail:] == -7.0)


def test_float16_pool_receives_float16(encoder):
    pool = create_pool("torch_dist", SHAPE, "float16", address="127.0.0.1:0")
    try:
        waiter = pool.expect(1, [4, 8])
        assert encoder.write(pool.spec, [4, 8], 7, 5, 1) == ("ok", SHAPE[0] * 2 * 7 * SHAPE[4] * SHAPE[5] * 2)
        waiter.result(timeout=WAIT_S)
        assert torch.equal(read_back(pool.tensor, [4, 8], 7), reference(7, 5).half())
    finally:
        pool.close()


def test_two_encoders_serve_one_decoder_without_mixing(pool, encoder):
    other = Encoder()
    try:
        waiters = {7: pool.expect(7, [1, 3]), 8: pool.expect(8, [0, 2])}
        other.commands.put((pool.spec, [0, 2], 10, 22, 8))
        encoder.commands.put((pool.spec, [1, 3], 9, 11, 7))
        assert encoder.results.get(timeout=WAIT_S)[0] == "ok" and other.results.get(timeout=WAIT_S)[0] == "ok"
        for w in waiters.values():
            w.result(timeout=WAIT_S)
        assert torch.equal(read_back(pool.tensor, [1, 3], 9), reference(9, 11))
        assert torch.equal(read_back(pool.tensor, [0, 2], 10), reference(10, 22))
        assert pool.num_pairs == 2
    finally:
        other.stop()


@pytest.mark.parametrize(
    "announced,sent,encoder_len,transfer_id,message",
    [
        ([3], [3, 4], 8, 5, "does not fit the blocks"),  # oversized: more positions than reserved
        ([3, 4], [3, 4], 8, 99, "expects no transfer"),  # an id the decoder never announced
    ],
)
def test_refused_transfer_touches_no_block(pool, encoder, announced, sent, encoder_len, transfer_id, message):
    bystander = pool.expect(6, [10, 11])  # another request's transfer stays pending and intact
    waiter = pool.expect(5, announced)
    kind, text = encoder.write(pool.spec, sent, encoder_len, 1, transfer_id)
    assert kind == "InvalidRequestError" and message in text
    if transfer_id == 5:
        with pytest.raises(InvalidRequestError, match=message):
            waiter.result(timeout=WAIT_S)
    assert torch.all(pool.tensor == -7.0)
    assert encoder.write(pool.spec, [10, 11], 6, 2, 6)[0] == "ok"  # the pair still works
    bystander.result(timeout=WAIT_S)
    assert torch.equal(read_back(pool.tensor, [10, 11], 6), reference(6, 2))


def test_writer_rejects_malformed_targets_before_sending(pool, encoder):
    cases = [
        (dataclasses.replace(pool.spec, segment="no-port"), [0], 3, "host:port"),
        (dataclasses.replace(pool.spec, shape=(3, 2, 12, 0, 2, 4)), [0], 3, "all >= 1"),
        (pool.spec, [0, 0], 6, "repeat"),
        (pool.spec, [0, 12], 6, "must be in"),
    ]
    for spec, block_ids, encoder_len, message in cases:
        kind, text = encoder.write(spec, block_ids, encoder_len, 0, 1)
        assert kind == "InvalidRequestError" and message in text, text
    assert torch.all(pool.tensor == -7.0)


def test_encoder_killed_mid_transfer_fails_it_and_a_new_encoder_pairs_again(pool):
    acked, go = CTX.Queue(), CTX.Queue()
    waiter = pool.expect(3, [2, 5, 9])
    proc = CTX.Process(target=stalling_writer_main, args=(pool.spec, [2, 5, 9], 13, 4, 3, acked, go, True))
    proc.start()
    assert acked.get(timeout=WAIT_S) == 0  # header accepted; the decoder now waits for the payload
    proc.join(WAIT_S)
    assert proc.exitcode == -9
    with pytest.raises(UnavailableError, match="encoder lost"):
        waiter.result(timeout=WAIT_S)
    pool.cancel(3)
    assert torch.all(pool.tensor == -7.0)
    fresh = Encoder()  # the replacement encoder re-rendezvouses with the same decoder
    try:
        waiter = pool.expect(4, [2, 5, 9])
        assert fresh.write(pool.spec, [2, 5, 9], 13, 4, 4)[0] == "ok"
        waiter.result(timeout=WAIT_S)
        assert torch.equal(read_back(pool.tensor, [2, 5, 9], 13), reference(13, 4))
    finally:
        fresh.stop()


def test_cancelled_transfer_never_lands_late(pool):
    """A payload that arrives after the decoder gave up on the request stays in staging."""
    acked, go = CTX.Queue(), CTX.Queue()
    waiter = pool.expect(8, [0, 1])
    proc = CTX.Process(target=stalling_writer_main, args=(pool.spec, [0, 1], 10, 6, 8, acked, go, False))
    proc.start()
    try:
        assert acked.get(timeout=WAIT_S) == 0
        pool.cancel(8)  # e.g. the request timed out and its blocks went back to the pool
        assert waiter.cancelled()
        go.put(True)
        from shared.kv_transport.torch_dist import CANCELLED

        assert acked.get(timeout=WAIT_S) == CANCELLED
        assert torch.all(pool.tensor == -7.0)
    finally:
        proc.join(WAIT_S)


def test_restarted_decoder_is_re_attached_and_stale_targets_refused(encoder):
    first = create_pool("torch_dist", SHAPE, address="127.0.0.1:0")
    second = create_pool("torch_dist", SHAPE, address="127.0.0.1:0")
    try:
        for transfer_id, pool in enumerate((first, second), start=1):
            waiter = pool.expect(transfer_id, [0])
            assert encoder.write(pool.spec, [0], 4, transfer_id, transfer_id)[0] == "ok"
            waiter.result(timeout=WAIT_S)
            assert torch.equal(read_back(pool.tensor, [0], 4), reference(4, transfer_id))
        stale = dataclasses.replace(second.spec, instance_id=first.spec.instance_id)  # an old mapping for this address
        kind, text = encoder.write(stale, [1], 4, 0, 9)
        assert kind == "UnavailableError" and "stale" in text
    finally:
        first.close()
        second.close()


def _pair_threads() -> int:
    return sum(t.name.startswith("kv-dist-pair-") for t in threading.enumerate())


def test_pairing_is_signed_and_a_forged_store_starts_nothing():
    """Issue 34 item 2: with the deployment's pair key, another client of the decoder's store that bumps the pair
    counter by 10**6 and rewrites the instance id starts no pair thread and breaks nothing: the decoder puts its
    record back, an encoder with the key pairs and writes, one with another key is refused and never served."""
    key = InternalAuth(b"the-deployment-token-0123456789").pair_key
    threads_before = _pair_threads()  # earlier tests' pairs (their encoders still connected)
    pool = create_pool("torch_dist", SHAPE, address="127.0.0.1:0", timeout_s=20, pair_key=key)
    host, port = pool.spec.segment.rsplit(":", 1)
    intruder = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10))
    intruder.add("encdec/num_pairs", 10**6)
    intruder.set("encdec/instance_id", "ffffffffffffffff")
    intruder.set("encdec/pair/1000000/hello", "0" * 32 + ":" + "0" * 64)
    time.sleep(0.5)  # ten polls of the decoder's accept loop
    assert _pair_threads() == threads_before
    assert intruder.get("encdec/instance_id").decode() == pool.spec.instance_id  # put back
    good, bad = Encoder(key), Encoder(InternalAuth(b"another-deployment-token-012345").pair_key)
    try:
        waiter = pool.expect(5, [2, 3])
        assert good.write(pool.spec, [2, 3], 9, 4, 5) == ("ok", SHAPE[0] * 2 * 9 * SHAPE[4] * SHAPE[5] * 4)
        waiter.result(timeout=WAIT_S)
        assert torch.equal(read_back(pool.tensor, [2, 3], 9), reference(9, 4))
        kind, text = bad.write(pool.spec, [4], 4, 1, 6)
        assert kind == "UnavailableError" and "--internal-token-file" in text, text
        assert _pair_threads() == threads_before + 1  # the good encoder's only
    finally:
        good.stop()
        bad.stop()
        pool.close()


def test_without_a_key_a_forged_pair_counter_starts_at_most_max_pairs_threads():
    """No internal token: a jump of the counter by 10**6 starts at most MAX_PAIRS threads (it started 10**6)."""
    threads_before = _pair_threads()
    pool = create_pool("torch_dist", SHAPE, address="127.0.0.1:0", timeout_s=20)
    try:
        host, port = pool.spec.segment.rsplit(":", 1)
        dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10)).add("encdec/num_pairs", 10**6)
        time.sleep(0.5)
        assert 0 < _pair_threads() - threads_before <= MAX_PAIRS
    finally:
        pool.close()


def test_nccl_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        create_writer("torch_dist", backend="nccl", device="cpu")
    with pytest.raises(ValueError, match="kv_dist_backend"):
        create_pool("torch_dist", SHAPE, backend="mpi")


def test_config_names_the_transport_fields():
    from shared.config import DecoderServiceConfig, EncoderServiceConfig, config_from

    cfg = config_from(
        DecoderServiceConfig,
        env={
            "ENCDEC_KV_TRANSPORT": "torch_dist",
            "ENCDEC_KV_DIST_ADDRESS": "10.0.0.5:29600",
            "ENCDEC_KV_TRANSFER_DTYPE": "float16",
        },
    )
    assert (cfg.kv_transport, cfg.kv_dist_address, cfg.kv_transfer_dtype) == ("torch_dist", "10.0.0.5:29600", "float16")
    assert config_from(EncoderServiceConfig, env={"ENCDEC_KV_TRANSPORT": "torch_dist"}).kv_transport == "torch_dist"
    for bad, message in [
        (dict(kv_transport="carrier-pigeon"), "kv_transport"),
        (dict(kv_dist_address="10.0.0.5"), "host:port"),
        (dict(kv_transfer_dtype="int8"), "kv_transfer_dtype"),
        (dict(kv_dist_backend="nccl"), "cuda"),
        (dict(kv_transfer_timeout_s=0), "kv_transfer_timeout_s"),
    ]:
        with pytest.raises(ValueError, match=message):
            DecoderServiceConfig(**bad)
    with pytest.raises(ValueError, match="kv_transport"):
        EncoderServiceConfig(kv_transport="shm,bogus")
