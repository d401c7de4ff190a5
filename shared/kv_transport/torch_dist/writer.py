"""``torch_dist`` encoder side: pairs with each decoder instance once and sends each request's cross KV."""

from __future__ import annotations

import contextlib
import datetime
import hmac
import logging
import os
import socket
import stat
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shared.errors import InvalidRequestError, UnavailableError
from shared.kv_transport.base import DTYPES, CrossKVWriter, KVTargetSpec, TransferStats, check_write
from shared.kv_transport.torch_dist.protocol import (
    DTYPE_CODES,
    MAGIC,
    OK,
    PAIR_POLL_S,
    REASONS,
    TAG_ACK,
    TAG_DONE,
    TAG_HEADER,
    TAG_PAYLOAD,
    check_backend,
    instance_mac,
    new_pair_group,
    pair_hello,
    parse_address,
)

log = logging.getLogger(__name__)


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
        timeout_s: bound on pairing and every send/recv (seconds):
            a hung decoder holds the encoder at most this long per write.
        handshake_timeout_s: bound on reaching the rendezvous store and reading
            the decoder's identity (seconds): a peer that accepts the TCP
            connection and says nothing fails the connect after this long.
        pair_key: the deployment's pair key (``InternalAuth.pair_key``), or None. With it the encoder pairs only
            with a decoder whose instance record the key signs (``encdec/instance_mac``) and signs its own hello
            for the pair (``protocol.pair_hello``), without which the decoder does not serve the pair.

    Connecting (``connect``) takes only the lock of its own target address: one
    address that does not answer never holds up writes to, or connects with,
    other decoders; concurrent connects to the same address share one attempt.

    Raises:
        ValueError: unknown backend, nccl without CUDA.
    """

    def __init__(
        self,
        *,
        backend: str = "gloo",
        device: str = "cpu",
        timeout_s: float = 30.0,
        handshake_timeout_s: float = 5.0,
        pair_key: bytes | None = None,
    ) -> None:
        self.pair_key = pair_key
        self.device = check_backend(backend, device)
        self.backend = backend
        self.timeout_s = timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self._links: dict[str, _Link] = {}
        self._connecting: dict[str, Future] = {}  # segment -> the connect in progress (its result: the link)
        self._lock = threading.Lock()  # guards the two dicts only; never held while connecting

    def connected(self, spec: KVTargetSpec) -> bool:
        with self._lock:
            link = self._links.get(spec.segment)
        return link is not None and link.instance_id == spec.instance_id

    def connect(self, spec: KVTargetSpec) -> None:
        self._link(spec)

    def _link(self, spec: KVTargetSpec) -> _Link:
        for _ in range(2):  # a shared attempt may have reached another instance than ours: then one of our own
            with self._lock:
                link = self._links.get(spec.segment)
                if link is not None and link.instance_id == spec.instance_id:
                    return link
                attempt = self._connecting.get(spec.segment)
                mine = attempt is None
                if mine:
                    attempt = self._connecting[spec.segment] = Future()
            if not mine:
                link = attempt.result()  # raises that attempt's UnavailableError
                if link.instance_id == spec.instance_id:
                    return link
                continue
            try:
                link = self._connect(spec)
            except BaseException as exc:
                with self._lock:
                    self._connecting.pop(spec.segment, None)
                attempt.set_exception(exc)
                raise
            with self._lock:
                old = self._links.get(spec.segment)
                if old is not None and old.instance_id != link.instance_id:  # the decoder there restarted
                    log.info("decoder at %s is a new instance (%s); paired again", spec.segment, link.instance_id)
                self._links[spec.segment] = link
                self._connecting.pop(spec.segment, None)
            attempt.set_result(link)
            return link
        raise UnavailableError(f"decoder at {spec.segment} changed instance while connecting; retry")

    def _connect(self, spec: KVTargetSpec) -> _Link:
        host, port = parse_address(spec.segment)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        handshake = datetime.timedelta(seconds=min(self.handshake_timeout_s, self.timeout_s))
        try:  # fail fast when nobody listens (TCPStore itself retries until its timeout)
            with socket.create_connection((host, port), timeout=handshake.total_seconds()) as probe:
                local_host = probe.getsockname()[0]  # the interface that reaches the decoder: Gloo binds here
                peer = probe.getpeername()[:2]
            store, instance_id, backend = _open_store(host, port, peer, handshake)
            if self.pair_key is not None and not self._signed(store, instance_id, backend):
                time.sleep(4 * PAIR_POLL_S)  # a rewritten record: the decoder puts its own back at its next poll
                instance_id, backend = (store.get(k).decode() for k in ("encdec/instance_id", "encdec/backend"))
                if not self._signed(store, instance_id, backend):
                    raise UnavailableError(
                        f"the cross-KV rendezvous at {spec.segment} holds no instance record signed with this "
                        "deployment's internal token: start decoder and encoder with the same --internal-token-file"
                    )
        except (OSError, RuntimeError, TimeoutError) as exc:
            raise UnavailableError(
                f"cannot reach the decoder's cross-KV rendezvous at {spec.segment} within "
                f"kv_dist_handshake_timeout_s={handshake.total_seconds():g} s: {str(exc).splitlines()[0][:200]}"
            ) from exc
        if instance_id != spec.instance_id:
            raise UnavailableError(
                f"decoder at {spec.segment} is instance {instance_id}, the target names {spec.instance_id} (stale target: the decoder restarted)"
            )
        if backend != self.backend:
            raise UnavailableError(
                f"decoder at {spec.segment} uses kv_dist_backend {backend!r}, this encoder {self.backend!r}"
            )
        store.set_timeout(timeout)  # a real decoder answered: pairing gets the full bound
        n = store.add("encdec/num_pairs", 1)
        if self.pair_key is not None:  # the decoder serves pair n only once this hello checks out
            store.set(f"encdec/pair/{n}/hello", pair_hello(self.pair_key, instance_id, n))
        try:
            group = new_pair_group(self.backend, dist.PrefixStore(f"encdec/pair/{n}/", store), 1, local_host, timeout)
        except RuntimeError as exc:
            raise UnavailableError(f"pairing with the decoder at {spec.segment} failed: {exc}") from exc
        log.info("paired with decoder %s at %s (pair %d, %s)", instance_id, spec.segment, n, self.backend)
        return _Link(instance_id, store, group)

    def _signed(self, store: dist.TCPStore, instance_id: str, backend: str) -> bool:
        """True when the store's ``encdec/instance_mac`` signs ``(instance_id, backend)`` under the pair key."""
        if not store.check(["encdec/instance_mac"]):
            return False
        return hmac.compare_digest(store.get("encdec/instance_mac"), instance_mac(self.pair_key, instance_id, backend))

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


def _open_store(host: str, port: int, peer: tuple, timeout: datetime.timedelta) -> tuple[dist.TCPStore, str, str]:
    """A ``TCPStore`` client of the decoder's store and the decoder's ``(instance_id, backend)``, within ``timeout``.

    The client's constructor waits for the server's answer to its handshake with no bound of its own (a peer
    that accepts and stays silent holds it forever), so it runs on a thread of its own; past ``timeout`` the
    connection it opened to ``peer`` (the resolved ``(ip, port)``) is shut down, which ends that thread.

    Raises:
        TimeoutError: no answer within ``timeout``.
        RuntimeError: the store refused or dropped the connection, or lacks the keys.
    """
    result: Future = Future()

    def open_() -> None:
        try:
            store = dist.TCPStore(host, port, None, False, timeout)
            result.set_result((store, store.get("encdec/instance_id").decode(), store.get("encdec/backend").decode()))
        except BaseException as exc:  # noqa: BLE001 - raised again by the waiting caller
            result.set_exception(exc)

    before = _sockets_to(peer)
    threading.Thread(target=open_, name="kv-dist-handshake", daemon=True).start()
    try:
        return result.result(timeout=timeout.total_seconds())
    except TimeoutError:
        for fd in _sockets_to(peer) - before:
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)  # the shared socket: the thread's blocked recv returns
        raise TimeoutError(f"no answer from the rendezvous store at {host}:{port}") from None


def _sockets_to(peer: tuple) -> set[int]:
    """File descriptors of this process's TCP sockets connected to ``peer`` (Linux ``/proc``; elsewhere none)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            with contextlib.suppress(OSError, ValueError):
                if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    continue
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if sock.type == socket.SOCK_STREAM and _ip_port(sock.getpeername()) == _ip_port(peer):
                        found.add(fd)
    return found


def _ip_port(address) -> tuple[str, int] | None:
    """``(ip, port)`` of a socket address, an IPv4-mapped IPv6 address as IPv4 (TCPStore dials over IPv6)."""
    if not isinstance(address, tuple) or len(address) < 2:
        return None
    return str(address[0]).removeprefix("::ffff:"), int(address[1])
