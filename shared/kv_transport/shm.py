"""``shm`` transport: the cross-KV pool is a POSIX shared-memory segment.

The decoder creates the segment (name unguessable, mode 0600 as
``multiprocessing.shared_memory`` creates it) and unlinks it on close. The
encoder maps each segment once, caches the mapping, and writes blocks in
place: no pickling and no copy through gRPC.

A mapping is never unmapped under a live tensor: ``torch.frombuffer`` keeps
the mmap object alive but not its buffer export, so ``mmap.close()`` would
unmap the pages while a view of the pool (the engine's cross cache, a
concurrent ``write``) still points at them, and a later mapping at the same
address would receive that view's writes. The tensors here are made through a
NumPy array, which holds the export: ``close()`` then raises ``BufferError``
(caught) and the pages go when the last view does.

Segment layout: a 64-byte header (int64 ``[MAGIC, dtype code, *shape]``) and
then the pool tensor. The encoder checks a target's shape and dtype against
the header, so a target that merely has the pool's byte count (another dtype
or block geometry of the same size) is refused instead of writing outside
the blocks it names.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
import re
import secrets
import struct
import threading
import time
from multiprocessing import resource_tracker

import numpy as np
import torch

from shared.errors import InvalidRequestError, UnavailableError
from shared.kv_transport.base import DTYPES, CrossKVPool, CrossKVWriter, KVTargetSpec, TransferStats, write_blocks

_INSTANCE_ID = re.compile(r"[0-9a-f]{16}")
MAGIC = 0x454E43534B5631  # "ENCSKV1"
HEADER = struct.Struct("<8q")  # [MAGIC, dtype code, 6 pool dims]: 64 bytes, so the pool starts cache-line aligned
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}


def _layout(spec: KVTargetSpec) -> tuple[int, ...]:
    return (MAGIC, DTYPE_CODES[spec.dtype], *spec.shape)


def _tensor_over(buf, spec: KVTargetSpec) -> torch.Tensor:
    """The pool tensor over ``buf`` (an mmap) after the header; it holds ``buf``'s buffer export (see module docstring)."""
    raw = np.frombuffer(
        buf, dtype=np.uint8, count=spec.nbytes, offset=HEADER.size
    )  # NumPy has no bfloat16: bytes, then a view
    return torch.from_numpy(raw).view(DTYPES[spec.dtype]).view(spec.shape)


class ShmCrossKVPool(CrossKVPool):
    """Decoder-side pool in a new shared-memory segment.

    Args:
        shape: ``[num_layers, 2, num_blocks, block_size, num_heads, head_dim]``.
        dtype: ``float32``, ``float16`` or ``bfloat16``.

    Raises:
        ValueError: unknown dtype or empty shape.
        OSError: the segment cannot be created (e.g. /dev/shm too small).
    """

    def __init__(self, shape: tuple[int, ...], dtype: str = "float32") -> None:
        if dtype not in DTYPES:
            raise ValueError(f"unknown pool dtype {dtype!r}; known: {sorted(DTYPES)}")
        instance_id = secrets.token_hex(8)
        self.spec = KVTargetSpec("shm", f"encdec-kv-{instance_id}", tuple(int(s) for s in shape), dtype, instance_id)
        if self.spec.nbytes <= 0:
            raise ValueError(f"pool shape {shape} is empty")
        # shm_open + mmap as multiprocessing.shared_memory does, but our own mmap (whose export the tensor holds):
        # SharedMemory's own close / __del__ would unmap under live views or complain at exit while one lives.
        size = HEADER.size + self.spec.nbytes
        fd = _posixshmem.shm_open("/" + self.spec.segment, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            _posixshmem.shm_unlink("/" + self.spec.segment)
            raise
        finally:
            os.close(fd)
        resource_tracker.register("/" + self.spec.segment, "shared_memory")  # unlinked if this process dies first
        self._lock = threading.Lock()
        try:
            HEADER.pack_into(self._mmap, 0, *_layout(self.spec))
            self.tensor = _tensor_over(self._mmap, self.spec)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Unlinks the segment's name; its pages stay mapped until the last view of ``tensor`` is gone. Idempotent."""
        with self._lock:
            if self._mmap is None:
                return
            self.__dict__.pop("tensor", None)
            try:
                self._mmap.close()
            except BufferError:  # a view is still alive (e.g. the engine's cross cache): unmapped when it goes
                pass
            self._mmap = None
            try:
                _posixshmem.shm_unlink("/" + self.spec.segment)
            except FileNotFoundError:  # someone else removed the name already
                pass
            resource_tracker.unregister("/" + self.spec.segment, "shared_memory")


class ShmCrossKVWriter(CrossKVWriter):
    """Encoder-side writer; maps each segment once and caches the mapping.

    Segments are opened with ``shm_open`` + ``mmap`` directly rather than
    through ``SharedMemory``: on Python 3.11 an attached ``SharedMemory`` is
    registered with the resource tracker, which would unlink the decoder's
    segment when the encoder exits.
    """

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _check_layout(spec: KVTargetSpec, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != spec.shape or tensor.dtype != DTYPES[spec.dtype]:
            raise InvalidRequestError(
                f"segment {spec.segment} holds a {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} "
                f"pool, but the target describes {list(spec.shape)} {spec.dtype}"
            )

    def _attach(self, spec: KVTargetSpec) -> torch.Tensor:
        with self._lock:
            cached = self._maps.get(spec.segment)
            if cached is not None:
                self._check_layout(spec, cached[1])
                return cached[1]
            try:
                fd = _posixshmem.shm_open("/" + spec.segment, os.O_RDWR, mode=0o600)
            except FileNotFoundError as exc:
                raise UnavailableError(f"cross-KV segment {spec.segment} is gone (decoder restarted?)") from exc
            try:
                size = os.fstat(fd).st_size
                if size != HEADER.size + spec.nbytes:
                    raise InvalidRequestError(
                        f"segment {spec.segment} holds {size - HEADER.size} bytes of pool, but the target's shape "
                        f"and dtype describe {spec.nbytes}"
                    )
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            if HEADER.unpack_from(mm, 0) != _layout(spec):  # same byte count, another dtype or block geometry
                magic, code, *shape = HEADER.unpack_from(mm, 0)
                mm.close()
                dtype = {v: k for k, v in DTYPE_CODES.items()}.get(code, "?") if magic == MAGIC else "unknown-layout"
                raise InvalidRequestError(
                    f"segment {spec.segment} holds a {shape} {dtype} pool, but the target describes "
                    f"{list(spec.shape)} {spec.dtype}"
                )
            self._drop_stale()
            tensor = _tensor_over(mm, spec)
            self._maps[spec.segment] = (mm, tensor)
            return tensor

    def _drop_stale(self) -> None:
        # A restarted decoder brings a new segment; mappings of unlinked ones only pin memory.
        if not os.path.isdir("/dev/shm"):
            return
        for name in [n for n in self._maps if not os.path.exists(f"/dev/shm/{n}")]:
            self._close_one(name)

    def _close_one(self, name: str) -> None:
        mm, tensor = self._maps.pop(name)
        del tensor
        try:
            mm.close()
        except BufferError:  # a concurrent write still holds the tensor: unmapped when it lets go
            pass

    def write(
        self, spec: KVTargetSpec, block_ids: list[int], cross_kv: torch.Tensor, transfer_id: int = 0
    ) -> TransferStats:
        start = time.perf_counter()
        if spec.transport != "shm":
            raise InvalidRequestError(f"shm writer got a {spec.transport!r} target")
        try:
            spec.validate()
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        if not _INSTANCE_ID.fullmatch(spec.instance_id) or spec.segment != f"encdec-kv-{spec.instance_id}":
            raise InvalidRequestError(
                f"malformed KV target: segment {spec.segment[:64]!r} does not belong to decoder instance {spec.instance_id[:64]!r}"
            )
        pool = self._attach(spec)
        try:
            write_blocks(pool, block_ids, cross_kv)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        return TransferStats(cross_kv.numel() * pool.element_size(), (time.perf_counter() - start) * 1000.0)

    def close(self) -> None:
        with self._lock:
            for name in list(self._maps):
                self._close_one(name)
