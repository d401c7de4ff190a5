"""The ``torch_dist`` wire protocol: message tags, header layout, status codes and the pair group.

Shared by the decoder's pool (``pool.py``) and the encoder's writer (``writer.py``); the protocol itself is
described in the package docstring (``shared/kv_transport/torch_dist/__init__.py``).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets

import torch
import torch.distributed as dist

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
# Pair threads a decoder runs at once (encoders paired or pairing): the store is writable by whoever reaches it,
# so a forged ``encdec/num_pairs`` of 10**6 must not start 10**6 threads (issue 34 item 2).
MAX_PAIRS = 64
# Seconds a pair number waits for its encoder's signed hello (with a pair key) before the decoder drops it.
PAIR_HELLO_WAIT_S = 30.0


def instance_mac(pair_key: bytes, instance_id: str, backend: str) -> bytes:
    """Hex HMAC-SHA256 of a decoder's ``(instance_id, backend)`` under the deployment's pair key
    (``shared.internal_auth.InternalAuth.pair_key``): stored beside them, so an encoder tells the decoder's own
    record from one rewritten by another client of the store."""
    return hmac.new(pair_key, f"instance|{instance_id}|{backend}".encode(), hashlib.sha256).hexdigest().encode()


def pair_hello(pair_key: bytes, instance_id: str, n: int) -> bytes:
    """An encoder's hello for pair ``n`` of decoder ``instance_id``: ``<nonce hex>:<HMAC hex>`` (the nonce makes
    each one new; the MAC binds it to the instance and the pair number)."""
    nonce = secrets.token_hex(16)
    mac = hmac.new(pair_key, f"pair|{instance_id}|{n}|{nonce}".encode(), hashlib.sha256).hexdigest()
    return f"{nonce}:{mac}".encode()


def check_pair_hello(pair_key: bytes, instance_id: str, n: int, hello: bytes) -> bool:
    """True when ``hello`` is ``pair_hello`` of this key, instance and pair number (compared in constant time)."""
    nonce, _, mac = hello.decode("ascii", "replace").partition(":")
    expected = hmac.new(pair_key, f"pair|{instance_id}|{n}|{nonce}".encode(), hashlib.sha256).hexdigest()
    return len(nonce) == 32 and hmac.compare_digest(mac.encode(), expected.encode())


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
