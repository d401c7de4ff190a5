"""Cross-attention KV transport: the decoder owns the pool, the encoder writes into it.

Transports are chosen by name (``kv_transport`` in the config): ``shm`` (same
host, CPU), ``cuda_ipc`` (same host, GPU) and ``torch_dist`` (Gloo / NCCL
point-to-point, across hosts), all behind the same two classes.
"""

import importlib
import threading

import torch

from shared.errors import InvalidRequestError
from shared.kv_transport.base import CrossKVPool, CrossKVWriter, KVTargetSpec, TransferStats, write_blocks
from shared.kv_transport.shm import ShmCrossKVPool, ShmCrossKVWriter


def _lazy(module: str, name: str):
    """A factory importing ``module`` only when its pool or writer is created (``cuda_ipc``
    costs a CPU-only machine nothing; there it raises ValueError saying CUDA is missing)."""

    def make(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    return make


POOLS = {"shm": ShmCrossKVPool, "cuda_ipc": _lazy("shared.kv_transport.cuda_ipc", "CudaIpcCrossKVPool")}
WRITERS = {"shm": ShmCrossKVWriter, "cuda_ipc": _lazy("shared.kv_transport.cuda_ipc", "CudaIpcCrossKVWriter")}
POOLS["torch_dist"] = _lazy("shared.kv_transport.torch_dist", "TorchDistCrossKVPool")
WRITERS["torch_dist"] = _lazy("shared.kv_transport.torch_dist", "TorchDistCrossKVWriter")


def create_pool(transport: str, shape: tuple[int, ...], dtype: str = "float32", **options) -> CrossKVPool:
    """Creates the decoder-side pool of ``transport`` (see ``CrossKVPool``).

    ``options`` go to the pool class (torch_dist: ``address``, ``backend``,
    ``device``, ``timeout_s``).

    Raises:
        ValueError: unknown transport name, or a bad option.
    """
    if transport not in POOLS:
        raise ValueError(f"unknown kv_transport {transport!r}; known: {sorted(POOLS)}")
    return POOLS[transport](shape, dtype, **options)


def create_writer(transport: str, **options) -> CrossKVWriter:
    """Creates the encoder-side writer of ``transport``; ``options`` go to its class.

    Raises:
        ValueError: unknown transport name, or a bad option.
    """
    if transport not in WRITERS:
        raise ValueError(f"unknown kv_transport {transport!r}; known: {sorted(WRITERS)}")
    return WRITERS[transport](**options)


class WriterSet(CrossKVWriter):
    """Encoder side: one writer per accepted transport, created on first use, chosen by the target.

    Args:
        transports: the transport names this encoder accepts.
        options: per-transport keyword options for ``create_writer``.

    Raises:
        ValueError: an unknown transport name.
    """

    def __init__(self, transports: list[str], options: dict[str, dict] | None = None) -> None:
        unknown = [t for t in transports if t not in WRITERS]
        if unknown or not transports:
            raise ValueError(f"unknown kv_transport {unknown or transports!r}; known: {sorted(WRITERS)}")
        self.transports = list(transports)
        self.options = options or {}
        self._writers: dict[str, CrossKVWriter] = {}
        self._lock = threading.Lock()

    def check(self, spec: KVTargetSpec) -> None:
        """Raises ``InvalidRequestError`` when this encoder does not accept the target's transport."""
        if spec.transport not in self.transports:
            raise InvalidRequestError(
                f"KV target transport {spec.transport[:32]!r} is not accepted by this encoder (kv_transport={','.join(self.transports)})"
            )

    def writer(self, transport: str) -> CrossKVWriter:
        with self._lock:
            if transport not in self._writers:
                self._writers[transport] = create_writer(transport, **self.options.get(transport, {}))
            return self._writers[transport]

    def connected(self, spec: KVTargetSpec) -> bool:
        self.check(spec)
        return self.writer(spec.transport).connected(spec)

    def connect(self, spec: KVTargetSpec) -> None:
        self.check(spec)
        self.writer(spec.transport).connect(spec)

    def write(
        self, spec: KVTargetSpec, block_ids: list[int], cross_kv: torch.Tensor, transfer_id: int = 0
    ) -> TransferStats:
        self.check(spec)
        return self.writer(spec.transport).write(spec, block_ids, cross_kv, transfer_id)

    def close(self) -> None:
        with self._lock:
            writers, self._writers = list(self._writers.values()), {}
        for w in writers:
            w.close()


__all__ = [
    "CrossKVPool",
    "CrossKVWriter",
    "KVTargetSpec",
    "TransferStats",
    "WriterSet",
    "ShmCrossKVPool",
    "ShmCrossKVWriter",
    "create_pool",
    "create_writer",
    "write_blocks",
]
