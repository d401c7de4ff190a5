"""``torch_dist`` decoder side: the pool tensor, the rendezvous store and one receiving thread per encoder."""

from __future__ import annotations

import datetime
import logging
import math
import secrets
import socket
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shared.errors import InvalidRequestError, UnavailableError
from shared.kv_transport.base import DTYPES, CrossKVPool, KVTargetSpec, TransferStats, write_blocks
from shared.kv_transport.torch_dist.protocol import (
    CANCELLED,
    DTYPE_NAMES,
    IDLE_TIMEOUT,
    MAGIC,
    MALFORMED,
    MAX_PAIRS,
    OK,
    OVERSIZED,
    PAIR_HELLO_WAIT_S,
    PAIR_POLL_S,
    REASONS,
    TAG_ACK,
    TAG_DONE,
    TAG_HEADER,
    TAG_PAYLOAD,
    UNKNOWN_TRANSFER,
    _sync,
    check_backend,
    check_pair_hello,
    instance_mac,
    new_pair_group,
    parse_address,
)

log = logging.getLogger(__name__)


@dataclass
class _Transfer:
    """A transfer the decoder announced: ``expected`` -> ``receiving`` -> ``done`` (or ``cancelled``)."""

    block_ids: list[int]
    future: Future = field(default_factory=Future)
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: str = "expected"
    pair: int = 0


class TorchDistCrossKVPool(CrossKVPool):
    """Decoder side: the pool tensor, the rendezvous store and one receiving thread per encoder.

    Args:
        shape: ``[num_layers, 2, num_blocks, block_size, num_heads, head_dim]``.
        dtype: pool dtype and the dtype that travels (``float32``, ``float16``, ``bfloat16``).
        address: ``host:port`` the store listens on (port 0 picks a free one);
            ``host`` must be reachable by the encoders and is where Gloo binds.
        backend: ``gloo`` or ``nccl``.
        device: the pool's device (``cpu``, ``cuda``, ``cuda:1``).
        timeout_s: how long building a pair's group may take (seconds).
        pair_key: the deployment's pair key (``InternalAuth.pair_key``, from ``--internal-token-file``), or None.
            With it the store also holds ``encdec/instance_mac`` and a pair is served only once its encoder wrote a
            valid ``encdec/pair/<n>/hello`` (``protocol.pair_hello``): a client of the store without the token
            starts nothing. Either way at most ``MAX_PAIRS`` pairs run, and a rewritten ``encdec/instance_id`` is
            put back at the next poll.

    Raises:
        ValueError: unknown dtype or backend, nccl without CUDA, bad address.
        RuntimeError: the store cannot listen there (port taken).
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: str = "float32",
        *,
        address: str = "127.0.0.1:0",
        backend: str = "gloo",
        device: str = "cpu",
        timeout_s: float = 30.0,
        pair_key: bytes | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"unknown pool dtype {dtype!r}; known: {sorted(DTYPES)}")
        self.device = check_backend(backend, device)
        self.backend = backend
        host, port = parse_address(address)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, port, None, True, self._timeout, wait_for_workers=False)
        self._hostname = socket.gethostname() if host in ("0.0.0.0", "::") else host
        instance_id = secrets.token_hex(8)
        self._pair_key = pair_key
        self._record = {"encdec/instance_id": instance_id.encode(), "encdec/backend": backend.encode()}
        if pair_key is not None:
            self._record["encdec/instance_mac"] = instance_mac(pair_key, instance_id, backend)
        for key, value in self._record.items():
            self._store.set(key, value)
        shape = tuple(int(s) for s in shape)
        self.spec = KVTargetSpec("torch_dist", f"{self._hostname}:{self._store.port}", shape, dtype, instance_id)
        self.spec.validate()
        self.tensor = torch.zeros(shape, dtype=DTYPES[dtype], device=self.device)
        self._lock = threading.Lock()
        self._pending: dict[int, _Transfer] = {}
        self._pairs: dict[int, object] = {}
        self._serving: set[int] = set()  # pair numbers with a thread (paired or pairing)
        self._closed = threading.Event()
        self._accept = threading.Thread(target=self._accept_pairs, name="kv-dist-accept", daemon=True)
        self._accept.start()

    # -- announcing transfers (event loop / any thread) ------------------------
    def expect(self, transfer_id: int, block_ids: list[int]) -> Future:
        """Announces ``transfer_id`` into ``block_ids``; see ``CrossKVPool.expect``.

        Raises:
            ValueError: the id is already announced.
        """
        transfer = _Transfer(list(block_ids))
        with self._lock:
            if transfer_id in self._pending:
                raise ValueError(f"transfer {transfer_id} is already expected")
            self._pending[transfer_id] = transfer
        return transfer.future

    def cancel(self, transfer_id: int) -> None:
        """Forgets the transfer; waits for a scatter in progress, so no write for it lands afterwards."""
        with self._lock:
            transfer = self._pending.pop(transfer_id, None)
        if transfer is None:
            return
        with transfer.lock:
            if transfer.state != "done":
                transfer.state = "cancelled"
        transfer.future.cancel()

    @property
    def num_pairs(self) -> int:
        """Encoders currently paired with this decoder."""
        return len(self._pairs)

    # -- pairing (accept thread) -------------------------------------------------
    def _accept_pairs(self) -> None:
        """Polls the pair counter; serves each new pair number on a thread of its own once it may run (its signed
        hello arrived, with a pair key), at most ``MAX_PAIRS`` at once; keeps the instance record as written."""
        served = 0  # highest pair number looked at
        waiting: dict[int, float] = {}  # pair number -> monotonic time its hello must have come by (pair key)
        while not self._closed.wait(PAIR_POLL_S):
            try:
                count = self._store.add("encdec/num_pairs", 0)
                self._keep_record()
                if count > served:
                    if count - served > MAX_PAIRS:  # a forged jump: only the newest numbers can be real encoders
                        log.warning(
                            "cross-KV pair counter jumped from %d to %d (another client of the store?): only the "
                            "newest %d are considered",
                            served,
                            count,
                            MAX_PAIRS,
                        )
                    now = time.monotonic()
                    for n in range(max(served + 1, count - MAX_PAIRS + 1), count + 1):
                        waiting[n] = now + PAIR_HELLO_WAIT_S
                    served = count
                for n in self._ready_pairs(waiting):
                    if len(self._serving) >= MAX_PAIRS:
                        log.warning("cross-KV pair %d refused: %d pairs already run (MAX_PAIRS)", n, MAX_PAIRS)
                        continue
                    self._serving.add(n)
                    threading.Thread(target=self._serve_pair, args=(n,), name=f"kv-dist-pair-{n}", daemon=True).start()
            except Exception:  # noqa: BLE001 - the store went away with close()
                return

    def _ready_pairs(self, waiting: dict[int, float]) -> list[int]:
        """Pair numbers of ``waiting`` that may be served now (removed from it): every one without a pair key;
        with one, those whose hello is valid. A wrong hello, or none within ``PAIR_HELLO_WAIT_S``, drops the
        number (logged)."""
        if self._pair_key is None:
            ready = sorted(waiting)
            waiting.clear()
            return ready
        ready, now = [], time.monotonic()
        for n in sorted(waiting):
            key = f"encdec/pair/{n}/hello"
            if not self._store.check([key]):
                if now > waiting[n]:
                    del waiting[n]
                    log.warning("cross-KV pair %d dropped: no hello within %g s", n, PAIR_HELLO_WAIT_S)
                continue
            del waiting[n]
            if check_pair_hello(self._pair_key, self.spec.instance_id, n, self._store.get(key)):
                ready.append(n)
            else:
                log.warning("cross-KV pair %d refused: its hello is not signed with this deployment's token", n)
        return ready

    def _keep_record(self) -> None:
        """Writes the instance record back where another client of the store changed or deleted a key of it."""
        for key, value in self._record.items():
            if not self._store.check([key]) or self._store.get(key) != value:
                log.warning("cross-KV rendezvous key %s was changed by another client of the store; restored", key)
                self._store.set(key, value)

    def _serve_pair(self, n: int) -> None:
        try:
            pg = new_pair_group(
                self.backend, dist.PrefixStore(f"encdec/pair/{n}/", self._store), 0, self._hostname, IDLE_TIMEOUT
            )
        except Exception as exc:  # noqa: BLE001 - an encoder that never showed up
            log.warning("cross-KV pair %d not established: %s", n, exc)
            self._serving.discard(n)
            return
        self._pairs[n] = pg
        log.info("cross-KV pair %d established (%s)", n, self.backend)
        staging = torch.empty(0, dtype=torch.uint8, device=self.device)
        try:
            while not self._closed.is_set():
                header = torch.zeros(8, dtype=torch.int64, device=self.device)
                pg.recv([header], 1, TAG_HEADER).wait()
                fields = header.tolist()
                status, transfer, shape, dtype = self._admit(n, fields)
                pg.send([torch.tensor([status, 0], dtype=torch.int64, device=self.device)], 1, TAG_ACK).wait()
                if status == MALFORMED and fields[0] != MAGIC:
                    raise RuntimeError("bad magic: the peer does not speak this protocol")
                if status != OK:
                    continue
                nbytes = fields[7]
                if staging.numel() < nbytes:
                    staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                payload = staging[:nbytes].view(DTYPES[dtype]).view(shape)  # [L, 2, S, H, D]
                start = time.perf_counter()
                try:
                    pg.recv([payload], 1, TAG_PAYLOAD).wait()
                    _sync(self.device)
                except Exception as exc:
                    self._fail(
                        transfer, UnavailableError(f"encoder lost during the cross-KV transfer (pair {n}): {exc}")
                    )
                    raise
                status = self._finish(fields[1], transfer, payload, nbytes, start)
                pg.send([torch.tensor([status, 0], dtype=torch.int64, device=self.device)], 1, TAG_DONE).wait()
        except Exception as exc:  # noqa: BLE001 - the peer is gone or broke the protocol
            if not self._closed.is_set():
                log.info("cross-KV pair %d closed: %s", n, str(exc).splitlines()[0][:200])
        finally:
            self._pairs.pop(n, None)
            self._serving.discard(n)
            with self._lock:
                stuck = [t for t in self._pending.values() if t.pair == n and t.state == "receiving"]
            for transfer in stuck:
                self._fail(transfer, UnavailableError(f"encoder lost during the cross-KV transfer (pair {n})"))

    def _admit(self, n: int, fields: list[int]) -> tuple[int, _Transfer | None, tuple[int, ...], str]:
        magic, transfer_id, encoder_len, code, layers, heads, head_dim, nbytes = fields
        num_layers, _, _, block_size, num_heads, dh = self.spec.shape
        with self._lock:
            transfer = self._pending.get(transfer_id)
            if magic != MAGIC:
                return MALFORMED, None, (), ""
            if transfer is None or transfer.state != "expected":
                return UNKNOWN_TRANSFER, None, (), ""
            status = OK
            dtype = DTYPE_NAMES.get(code, "")
            if (layers, heads, head_dim) != (num_layers, num_heads, dh) or dtype != self.spec.dtype:
                status = MALFORMED
            elif not 1 <= encoder_len <= len(transfer.block_ids) * block_size or math.ceil(
                encoder_len / block_size
            ) != len(transfer.block_ids):
                status = OVERSIZED
            elif nbytes != num_layers * 2 * encoder_len * num_heads * dh * DTYPES[dtype].itemsize:
                status = MALFORMED
            if status != OK:
                self._pending.pop(transfer_id, None)
                self._fail(transfer, InvalidRequestError(f"cross-KV transfer {transfer_id} refused: {REASONS[status]}"))
                return status, None, (), ""
            transfer.state, transfer.pair = "receiving", n
            return OK, transfer, (num_layers, 2, encoder_len, num_heads, dh), dtype

    def _finish(self, transfer_id: int, transfer: _Transfer, payload: torch.Tensor, nbytes: int, start: float) -> int:
        with transfer.lock:
            if transfer.state != "receiving":  # cancelled while the payload was in flight: drop it
                return CANCELLED
            write_blocks(self.tensor, transfer.block_ids, payload)
            _sync(self.device)
            transfer.state = "done"
        with self._lock:
            self._pending.pop(transfer_id, None)
        stats = TransferStats(nbytes, (time.perf_counter() - start) * 1000.0)
        try:
            transfer.future.set_result(stats)
        except InvalidStateError:  # the waiter gave up in the meantime
            pass
        return OK

    @staticmethod
    def _fail(transfer: _Transfer | None, exc: Exception) -> None:
        if transfer is None:
            return
        with transfer.lock:
            transfer.state = "cancelled"
        try:
            transfer.future.set_exception(exc)
        except InvalidStateError:
            pass

    def close(self) -> None:
        """Stops pairing and fails pending transfers; pair threads end when their encoders disconnect."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._accept.join(timeout=2)
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for transfer in pending:
            self._fail(transfer, UnavailableError("decoder shutting down"))
        self._pairs.clear()
