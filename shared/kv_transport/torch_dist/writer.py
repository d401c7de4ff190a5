"""``torch_dist`` encoder side: pairs with each decoder instance once and sends each request's cross KV."""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shared.errors import InvalidRequestError, UnavailableError
from shared.kv_transport.base import DTYPES, CrossKVWriter, KVTargetSpec, TransferStats, check_write
from shared.kv_transport.torch_dist.protocol import (
    DTYPE_CODES,
    MAGIC,
    OK,
    REASONS,
    TAG_ACK,
    TAG_DONE,
    TAG_HEADER,
    TAG_PAYLOAD,
    check_backend,
    new_pair_group,
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
