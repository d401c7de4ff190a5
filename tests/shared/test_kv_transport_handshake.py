"""The torch_dist writer's connect against a peer that accepts TCP and never speaks (issue 20, failure 6).

The silent peer is a plain listening socket in this process; the real decoder side is a ``TorchDistCrossKVPool``
in this process too, the writer pairing with it over 127.0.0.1 as the encoder service does. The connect gives up
after ``handshake_timeout_s`` with UNAVAILABLE and leaves no thread behind; concurrent connects to one silent
address share one attempt; a write to a real pool never waits for a silent connect in progress.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_kv_transport import SHAPE, read_back, reference

from shared.errors import UnavailableError
from shared.kv_transport import KVTargetSpec, ShmCrossKVPool, create_pool
from shared.kv_transport.torch_dist import TorchDistCrossKVWriter


class SilentPeer:
    """Accepts every TCP connection on 127.0.0.1 and never sends a byte."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.1)
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self.accepted.append(self.server.accept()[0])
            except TimeoutError:
                pass

    def spec(self) -> KVTargetSpec:
        return KVTargetSpec("torch_dist", f"127.0.0.1:{self.server.getsockname()[1]}", SHAPE, "float32", "0" * 16)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self.accepted:
            conn.close()
        self.server.close()


@pytest.fixture
def silent():
    peer = SilentPeer()
    yield peer
    peer.close()


def handshake_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kv-dist-handshake"]


def test_silent_peer_fails_the_connect_after_the_handshake_timeout(silent):
    writer = TorchDistCrossKVWriter(timeout_s=30.0, handshake_timeout_s=1.0)
    with pytest.raises(UnavailableError, match="kv_dist_handshake_timeout_s=1 s"):
        writer.connect(silent.spec())
    assert not writer.connected(silent.spec())
    deadline = time.monotonic() + 10
    while handshake_threads() and time.monotonic() < deadline:  # its socket was shut down: the thread ends
        time.sleep(0.05)
    assert not handshake_threads()


def test_concurrent_connects_to_one_silent_address_share_one_attempt(silent):
    writer = TorchDistCrossKVWriter(timeout_s=30.0, handshake_timeout_s=1.5)
    with ThreadPoolExecutor(4) as pool:
        errors = [f.exception(timeout=30) for f in [pool.submit(writer.connect, silent.spec()) for _ in range(4)]]
    assert all(isinstance(e, UnavailableError) for e in errors), errors
    assert len(silent.accepted) == 2, "one attempt: the reachability probe and the store client"


def test_a_write_to_a_real_pool_does_not_wait_for_a_silent_connect(silent):
    writer = TorchDistCrossKVWriter(timeout_s=30.0, handshake_timeout_s=10.0)
    pool = create_pool("torch_dist", SHAPE, address="127.0.0.1:0")
    try:
        with ThreadPoolExecutor(1) as executor:
            stuck = executor.submit(writer.connect, silent.spec())
            deadline = time.monotonic() + 10
            while len(silent.accepted) < 2 and time.monotonic() < deadline:  # the connect now waits in its handshake
                time.sleep(0.02)
            assert len(silent.accepted) == 2
            arrival = pool.expect(3, [4, 1, 7])
            stats = writer.write(pool.spec, [4, 1, 7], reference(13, seed=5), transfer_id=3)
            assert arrival.result(timeout=30).nbytes == stats.nbytes
            torch.testing.assert_close(read_back(pool.tensor, [4, 1, 7], 13), reference(13, seed=5), rtol=0, atol=0)
            assert not stuck.done(), "the silent connect should still be in its handshake"
            silent.close()  # the peer hangs up and stops listening: the stuck connect ends
            with pytest.raises(UnavailableError):
                stuck.result(timeout=60)
    finally:
        writer.close()
        pool.close()


def test_shm_segment_is_readable_and_writable_by_its_owner_only():
    pool = ShmCrossKVPool(SHAPE)
    try:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{pool.spec.segment}").st_mode) == 0o600
    finally:
        pool.close()
