"""``torch_dist`` transport: point-to-point send/recv of cross KV over ``torch.distributed``.

For encoder and decoder on different hosts (or devices). Gloo moves CPU
tensors over TCP; NCCL moves CUDA tensors. The code is the same for both:
``backend`` and ``device`` are parameters.

Rendezvous: the decoder hosts a ``TCPStore`` (``address``, port 0 picks a free
one) and names it in ``KVTarget.segment`` as ``host:port``, beside its
``instance_id`` (also stored under ``encdec/instance_id``). On its first write
to a decoder instance an encoder takes a pair number ``n`` from the store
counter ``encdec/num_pairs``; both sides then build a two-rank process group
(decoder rank 0, encoder rank 1) directly over ``PrefixStore("encdec/pair/n/")``
instead of ``init_process_group``, so one encoder can serve several decoders,
one decoder several encoders, and a restarted decoder (new store, new
instance id) gets fresh groups. The decoder polls the counter and serves each
pair on its own thread.

One transfer on a pair (tags keep the four message kinds apart):

1. encoder -> decoder ``header`` int64 ``[MAGIC, transfer_id, encoder_len,
   dtype_code, num_layers, num_heads, head_dim, nbytes]``;
2. decoder -> encoder ``ack`` int64 ``[status, 0]``: the decoder checks the
   header against the transfer it announced with ``expect`` (known id, pool
   layout, exactly ``len(block_ids)`` blocks' worth of positions); a malformed
   or oversized transfer is refused here, before any payload moves;
3. encoder -> decoder ``payload`` ``[num_layers, 2, encoder_len, H, D]`` in the
   pool dtype, received into a per-pair staging buffer;
4. the decoder scatters the staging buffer into the reserved block ids
   (``write_blocks``, any order of ids) and answers ``done``.

Transfers on one pair run one at a time (the encoder writes from a single
batcher thread anyway); pairs run in parallel. The payload always lands in
staging first, never straight in the pool: a transfer that times out or whose
request was cancelled can then never write late into blocks that were
already handed to another request (``cancel`` waits for an in-flight
scatter). The scatter costs one memory copy; see docs/kv_transport.md.

Faults: a dead peer closes the TCP connection and the blocked send/recv
raises; the decoder fails the announced transfer with ``UnavailableError``
and drops the pair, the encoder drops its link and the next write pairs
again. An encoder that sees a target whose ``instance_id`` differs from its
cached link's re-attaches to the new decoder.
"""

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
from shared.kv_transport.base import (
    DTYPES,
    CrossKVPool,
    CrossKVWriter,
    KVTargetSpec,
    TransferStats,
    check_write,
    write_blocks,
)

log = logging.getLogger(__name__)

MAGIC = 0x454E43445631  # "ENCDV1"
TAG_HEADER, TAG_ACK, TAG_PAYLOAD, TAG_DONE = 1, 2, 3, 4
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
OK, UNKNOWN_TRANSFER, MALFORMED, OVERSIZED, CANCELLED = 0, 1, 2, 3, 4
REASONS = {
    UNKNOWN_TRANSFER: "the decoder expects no transfer with this id (cancelled, timed out or already done)",
    MALFORMED: "the header does not describe the decoder's pool (magic, dtype, layers, heads or head_dim, byte count)",
    OVERSIZED: "the encoder length does not fit the blocks reserved for it",
    CANCELLED: "the request was cancelled while its cross KV was in flight",
}
BACKENDS = ("gloo", "nccl")
PAIR_POLL_S = 0.05
# The decoder's pair threads wait for headers with no deadline of their own; the
# request-level timeout (kv_transfer_timeout_s) bounds what a request waits.
IDLE_TIMEOUT = datetime.timedelta(days=7)


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``.

    Raises:
        ValueError: no port, or the port is not in 0..65535.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"rendezvous address {address[:80]!r} is not host:port")
    return host.strip("[]"), int(port)


def check_backend(backend: str, device: str) -> torch.device:
    """Validates a backend/device pair and returns the device.

    Raises:
        ValueError: unknown backend, or NCCL with a non-CUDA device.
    """
    if backend not in BACKENDS:
        raise ValueError(f"kv_dist_backend must be one of {BACKENDS}, got {backend!r}")
    dev = torch.device(device)
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError(f"the nccl backend moves CUDA tensors; kv_device is {device!r}")
    return dev


def new_pair_group(backend: str, store: dist.Store, rank: int, hostname: str, timeout: datetime.timedelta):
    """A two-rank process group over ``store`` (a ``PrefixStore`` per pair), not the global one.

    Gloo binds its sockets to ``hostname``; the constructor returns once both
    ranks connected (or raises after ``timeout``). NCCL connects lazily at
    the first send/recv.
    """
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def _sync(device: torch.device) -> None:
    # NCCL's wait() only orders the current stream; the host must see the data before answering.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        self._store.set("encdec/instance_id", instance_id)
        self._store.set("encdec/backend", backend)
        shape = tuple(int(s) for s in shape)
        self.spec = KVTargetSpec("torch_dist", f"{self._hostname}:{self._store.port}", shape, dtype, instance_id)
        self.spec.validate()
        self.tensor = torch.zeros(shape, dtype=DTYPES[dtype], device=self.device)
        self._lock = threading.Lock()
        self._pending: dict[int, _Transfer] = {}
        self._pairs: dict[int, object] = {}
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
        served = 0
        while not self._closed.wait(PAIR_POLL_S):
            try:
                count = self._store.add("encdec/num_pairs", 0)
            except Exception:  # noqa: BLE001 - the store went away with close()
                return
            for n in range(served + 1, count + 1):
                threading.Thread(target=self._serve_pair, args=(n,), name=f"kv-dist-pair-{n}", daemon=True).start()
            served = max(served, count)

    def _serve_pair(self, n: int) -> None:
        try:
            pg = new_pair_group(
                self.backend, dist.PrefixStore(f"encdec/pair/{n}/", self._store), 0, self._hostname, IDLE_TIMEOUT
            )
        except Exception as exc:  # noqa: BLE001 - an encoder that never showed up
            log.warning("cross-KV pair %d not established: %s", n, exc)
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


@dataclass
class _Link:
    """The encoder's end of one pair: the decoder instance it belongs to and its group."""

    instance_id: str
    store: object
    group: object
    lock: threading.Lock = field(default_factory=threading.Lock)


class TorchDistCrossKVWriter(CrossKVWriter):
    """Encoder side: pairs with each decoder instance once and sends each request's cross KV.

    Args:
        backend: ``gloo`` or ``nccl``; must match the decoder's.
        device: where payloads are staged for sending (``cpu`` for Gloo,
            ``cuda`` for NCCL); ``cross_kv`` is moved there.
        timeout_s: bound on connecting, pairing and every send/recv (seconds):
            a hung decoder holds the encoder at most this long per write.

    Raises:
        ValueError: unknown backend, nccl without CUDA.
    """

    def __init__(self, *, backend: str = "gloo", device: str = "cpu", timeout_s: float = 30.0) -> None:
        self.device = check_backend(backend, device)
        self.backend = backend
        self.timeout_s = timeout_s
        self._links: dict[str, _Link] = {}
        self._lock = threading.Lock()

    def _link(self, spec: KVTargetSpec) -> _Link:
        with self._lock:
            link = self._links.get(spec.segment)
            if link is not None and link.instance_id == spec.instance_id:
                return link
            if link is not None:  # the decoder behind this address restarted: stale mapping
                log.info("decoder at %s is a new instance (%s); pairing again", spec.segment, spec.instance_id)
                self._links.pop(spec.segment, None)
            link = self._connect(spec)
            self._links[spec.segment] = link
            return link

    def _connect(self, spec: KVTargetSpec) -> _Link:
        host, port = parse_address(spec.segment)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:  # fail fast when nobody listens (TCPStore itself retries until its timeout)
            with socket.create_connection((host, port), timeout=min(self.timeout_s, 5.0)) as probe:
                local_host = probe.getsockname()[0]  # the interface that reaches the decoder: Gloo binds here
            store = dist.TCPStore(host, port, None, False, timeout)
            instance_id = store.get("encdec/instance_id").decode()
            backend = store.get("encdec/backend").decode()
        except (OSError, RuntimeError) as exc:
            raise UnavailableError(f"cannot reach the decoder's cross-KV rendezvous at {spec.segment}: {exc}") from exc
        if instance_id != spec.instance_id:
            raise UnavailableError(
                f"decoder at {spec.segment} is instance {instance_id}, the target names {spec.instance_id} (stale target: the decoder restarted)"
            )
        if backend != self.backend:
            raise UnavailableError(
                f"decoder at {spec.segment} uses kv_dist_backend {backend!r}, this encoder {self.backend!r}"
            )
        n = store.add("encdec/num_pairs", 1)
        try:
            group = new_pair_group(self.backend, dist.PrefixStore(f"encdec/pair/{n}/", store), 1, local_host, timeout)
        except RuntimeError as exc:
            raise UnavailableError(f"pairing with the decoder at {spec.segment} failed: {exc}") from exc
        log.info("paired with decoder %s at %s (pair %d, %s)", instance_id, spec.segment, n, self.backend)
        return _Link(instance_id, store, group)

    def write(
        self, spec: KVTargetSpec, block_ids: list[int], cross_kv: torch.Tensor, transfer_id: int = 0
    ) -> TransferStats:
        """Sends ``cross_kv`` ``[L, 2, S, H, D]`` for ``transfer_id``; see ``CrossKVWriter.write``.

        Raises:
            InvalidRequestError: malformed target or block ids (nothing sent),
                or the decoder refused the header (nothing written).
            UnavailableError: the decoder cannot be reached, restarted, or the
                connection broke mid-transfer (the link is dropped; the next
                write pairs again).
        """
        start = time.perf_counter()
        if spec.transport != "torch_dist":
            raise InvalidRequestError(f"torch_dist writer got a {spec.transport!r} target")
        try:
            spec.validate()
            parse_address(spec.segment)
            encoder_len = check_write(spec.shape, block_ids, tuple(cross_kv.shape))
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        if not 0 <= transfer_id < 2**63:
            raise InvalidRequestError(f"transfer_id {transfer_id} does not fit int64")
        payload = cross_kv.to(device=self.device, dtype=DTYPES[spec.dtype]).contiguous()  # [L, 2, S, H, D]
        num_layers, _, _, _, num_heads, head_dim = spec.shape
        nbytes = payload.numel() * payload.element_size()
        header = torch.tensor(
            [MAGIC, transfer_id, encoder_len, DTYPE_CODES[spec.dtype], num_layers, num_heads, head_dim, nbytes],
            dtype=torch.int64,
            device=self.device,
        )
        link = self._link(spec)
        reply = torch.zeros(2, dtype=torch.int64, device=self.device)
        with link.lock:
            try:
                link.group.send([header], 0, TAG_HEADER).wait()
                link.group.recv([reply], 0, TAG_ACK).wait()
                status = int(reply[0].item())
                if status == OK:
                    link.group.send([payload], 0, TAG_PAYLOAD).wait()
                    link.group.recv([reply], 0, TAG_DONE).wait()
                    status = int(reply[0].item())
            except RuntimeError as exc:
                self._drop(spec.segment, link)
                raise UnavailableError(
                    f"cross-KV transfer to the decoder at {spec.segment} failed: {str(exc).splitlines()[0][:300]}"
                ) from exc
        if status != OK:
            raise InvalidRequestError(f"decoder refused cross-KV transfer {transfer_id}: {REASONS.get(status, status)}")
        return TransferStats(nbytes, (time.perf_counter() - start) * 1000.0)

    def _drop(self, segment: str, link: _Link) -> None:
        with self._lock:
            if self._links.get(segment) is link:
                del self._links[segment]

    def close(self) -> None:
        with self._lock:
            self._links.clear()
