"""Cross-attention KV transport: the decoder owns the pool, the encoder writes into it.

Transports are chosen by name (``kv_transport`` in the config). Only ``shm``
exists today; ``cuda_ipc`` and ``torch_dist`` plug in behind the same two
classes.
"""

from shared.kv_transport.base import CrossKVPool, CrossKVWriter, KVTargetSpec, write_blocks
from shared.kv_transport.shm import ShmCrossKVPool, ShmCrossKVWriter

POOLS = {"shm": ShmCrossKVPool}
WRITERS = {"shm": ShmCrossKVWriter}


def create_pool(transport: str, shape: tuple[int, ...], dtype: str = "float32") -> CrossKVPool:
    """Creates the decoder-side pool of ``transport`` (see ``CrossKVPool``).

    Raises:
        ValueError: unknown transport name.
    """
    if transport not in POOLS:
        raise ValueError(f"unknown kv_transport {transport!r}; known: {sorted(POOLS)}")
    return POOLS[transport](shape, dtype)


def create_writer(transport: str) -> CrossKVWriter:
    """Creates the encoder-side writer of ``transport``.

    Raises:
        ValueError: unknown transport name.
    """
    if transport not in WRITERS:
        raise ValueError(f"unknown kv_transport {transport!r}; known: {sorted(WRITERS)}")
    return WRITERS[transport]()


__all__ = [
    "CrossKVPool",
    "CrossKVWriter",
    "KVTargetSpec",
    "ShmCrossKVPool",
    "ShmCrossKVWriter",
    "create_pool",
    "create_writer",
    "write_blocks",
]
