"""The ``torch_dist`` wire protocol: message tags, header layout, status codes and the pair group.

Shared by the decoder's pool (``pool.py``) and the encoder's writer (``writer.py``); the protocol itself is
described in the package docstring (``shared/kv_transport/torch_dist/__init__.py``).
"""

from __future__ import annotations

import datetime

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
