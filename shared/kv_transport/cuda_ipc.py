"""``cuda_ipc`` transport: the cross-KV pool lives on a CUDA device; the encoder writes it in place.

The decoder allocates its pool on a GPU and exports it once with torch's own
CUDA IPC mechanism: ``UntypedStorage._share_cuda_`` (the path
``torch.multiprocessing.reductions.reduce_tensor`` takes for CUDA tensors)
returns the ``cudaIpcMemHandle_t`` of the caching-allocator segment that holds
the pool, the pool's byte offset and size in it, torch's IPC reference counter,
and an IPC event recorded after the pool's initialisation. These travel as the
``KVTarget.segment`` string (``cuda-ipc:v1:`` + URL-safe base64 of JSON), so
the proto needs no new field.

The encoder opens the handle once per decoder instance with
``UntypedStorage._new_shared_cuda`` (``rebuild_cuda_tensor``'s path: waits on
the event, then ``cudaIpcOpenMemHandle``; measured: docs/benchmarks.md, Measurements formerly in docstrings) and
caches the mapping by
``instance_id``. A new instance on the same GPU means the decoder restarted:
the old mapping is dropped (closing the handle). Each write is a device copy
(host-to-device first when the encoder ran on CPU) on the encoder's current
stream, followed by a wait on a CUDA event recorded after it, so ``write``
returns only once the blocks are in the decoder's memory: the Encode reply is
the completion message that orders the write before the decoder's first
decode step.

The GPU is identified by its UUID, not its index, so the decoder and encoder
may see it under different ``CUDA_VISIBLE_DEVICES`` numbering. The decoder's
pool is placed on the current CUDA device (``CUDA_VISIBLE_DEVICES`` picks it).

Trust: a CUDA IPC handle gives access to the whole allocator segment, so
Encode must stay on the internal network (as for ``shm``); the writer checks
that the handle's byte size equals what the target's shape and dtype
describe, and that one instance never changes its handle.

Over 300 lines: the segment format (``CudaIpcHandle``), the pool that exports it and the
writer that opens it are one protocol and share ``_EXPORTED`` (a writer in the exporting process uses the
tensor itself), so they stay together.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass

import torch

from shared.errors import InvalidRequestError, UnavailableError
from shared.kv_transport.base import DTYPES, CrossKVPool, CrossKVWriter, KVTargetSpec, TransferStats, write_blocks

SEGMENT_PREFIX = "cuda-ipc:v1:"
MAX_SEGMENT_CHARS = 8192  # a real handle encodes to ~400 characters
_MAX_HANDLE_BYTES = 2048  # torch's handle is 64 bytes of cudaIpcMemHandle_t plus a few version bytes
_INSTANCE_ID = re.compile(r"[0-9a-f]{16}")
_BYTES_FIELDS = ("mem_handle", "ref_counter", "event_handle")

# Pools exported by this very process, by instance id: CUDA cannot open an IPC
# handle in the process that exported it, so a writer here uses the tensor itself.
_EXPORTED: dict[str, torch.Tensor] = {}


def require_cuda() -> None:
    """Raises ValueError naming why this process cannot use ``cuda_ipc``."""
    if torch.cuda.is_available():
        return
    why = (
        "this torch build has no CUDA support"
        if torch.version.cuda is None
        else "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)"
    )
    raise ValueError(
        f"kv_transport 'cuda_ipc' needs a CUDA GPU, but {why}; use kv_transport 'shm' on a CPU-only machine"
    )


@dataclass(frozen=True)
class CudaIpcHandle:
    """Everything ``UntypedStorage._new_shared_cuda`` needs, plus the GPU's UUID.

    Attributes:
        device_uuid: ``str(torch.cuda.get_device_properties(i).uuid)`` of the pool's GPU.
        mem_handle: the caching allocator's shareable handle of the segment (bytes).
        size_bytes: the pool storage's size in bytes.
        offset_bytes: the pool storage's offset in the segment, in bytes.
        ref_counter: name of torch's shared-memory reference-counter file (bytes).
        ref_counter_offset: this export's slot in that file.
        event_handle: ``cudaIpcEventHandle_t`` of the event recorded after the pool was initialised.
        event_sync_required: whether the importer must wait on that event.
    """

    device_uuid: str
    mem_handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def to_segment(self) -> str:
        """Encodes the handle as a ``KVTarget.segment`` string (ASCII, ~400 characters)."""
        fields = asdict(self)
        for name in _BYTES_FIELDS:
            fields[name] = base64.b64encode(fields[name]).decode("ascii")
        blob = json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()
        return SEGMENT_PREFIX + base64.urlsafe_b64encode(blob).decode("ascii")

    @classmethod
    def from_segment(cls, segment: str) -> CudaIpcHandle:
        """Decodes ``to_segment``'s output.

        Raises:
            ValueError: not a ``cuda-ipc:v1:`` segment, undecodable, a field
                missing, extra, of the wrong type or out of range.
        """
        if not isinstance(segment, str) or not segment.startswith(SEGMENT_PREFIX):
            raise ValueError(f"cuda_ipc segment must start with {SEGMENT_PREFIX!r}, got {str(segment)[:32]!r}")
        if len(segment) > MAX_SEGMENT_CHARS:
            raise ValueError(f"cuda_ipc segment is {len(segment)} characters; at most {MAX_SEGMENT_CHARS}")
        try:
            fields = json.loads(base64.urlsafe_b64decode(segment[len(SEGMENT_PREFIX) :].encode("ascii")))
        except (binascii.Error, UnicodeError, ValueError) as exc:
            raise ValueError(f"cuda_ipc segment does not decode: {exc}") from exc
        expected = {
            "device_uuid": str,
            "mem_handle": str,
            "size_bytes": int,
            "offset_bytes": int,
            "ref_counter": str,
            "ref_counter_offset": int,
            "event_handle": str,
            "event_sync_required": bool,
        }
        if not isinstance(fields, dict) or set(fields) != set(expected):
            got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
            raise ValueError(f"cuda_ipc segment must hold the fields {sorted(expected)}, got {got}")
        for name, kind in expected.items():
            # bool is an int subclass: check it exactly, and keep it out of the int fields
            if not isinstance(fields[name], kind) or (kind is int and isinstance(fields[name], bool)):
                raise ValueError(f"cuda_ipc segment field {name!r} must be {kind.__name__}")
        for name in ("size_bytes", "offset_bytes", "ref_counter_offset"):
            if fields[name] < 0:
                raise ValueError(f"cuda_ipc segment field {name!r} must be >= 0, got {fields[name]}")
        for name in _BYTES_FIELDS:
            try:
                fields[name] = base64.b64decode(fields[name].encode("ascii"), validate=True)
            except (binascii.Error, UnicodeError) as exc:
                raise ValueError(f"cuda_ipc segment field {name!r} is not base64") from exc
            if not 0 < len(fields[name]) <= _MAX_HANDLE_BYTES:
                raise ValueError(f"cuda_ipc segment field {name!r} must hold 1..{_MAX_HANDLE_BYTES} bytes")
        return cls(**fields)


def check_target(spec: KVTargetSpec) -> CudaIpcHandle:
    """Checks a ``cuda_ipc`` target without touching a GPU and returns its handle.

    Raises:
        InvalidRequestError: another transport, a malformed shape, dtype,
            instance id or segment, or a handle whose byte size is not the
            size of the pool the shape and dtype describe.
    """
    if spec.transport != "cuda_ipc":
        raise InvalidRequestError(f"cuda_ipc writer got a {spec.transport!r} target")
    try:
        spec.validate()
        handle = CudaIpcHandle.from_segment(spec.segment)
    except ValueError as exc:
        raise InvalidRequestError(f"malformed KV target: {exc}") from exc
    if not _INSTANCE_ID.fullmatch(spec.instance_id):
        raise InvalidRequestError(f"malformed KV target: instance id {spec.instance_id[:64]!r} is not 16 hex digits")
    if handle.size_bytes != spec.nbytes:
        raise InvalidRequestError(
            f"KV target shape {list(spec.shape)} {spec.dtype} describes {spec.nbytes} bytes, "
            f"but its CUDA IPC handle exports {handle.size_bytes}"
        )
    return handle


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_index(device_uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == device_uuid:
            return index
    raise UnavailableError(
        f"the decoder's GPU {device_uuid} is not visible to this encoder (another host, or CUDA_VISIBLE_DEVICES)"
    )


class CudaIpcCrossKVPool(CrossKVPool):
    """Decoder-side pool on a CUDA device, exported once with a CUDA IPC handle.

    Args:
        shape: ``[num_layers, 2, num_blocks, block_size, num_heads, head_dim]``.
        dtype: ``float32``, ``float16`` or ``bfloat16``.
        device: a CUDA device (``cuda:0``); None = the current CUDA device.

    Raises:
        ValueError: no CUDA GPU here (the message says why), a non-CUDA
            device, unknown dtype or empty shape.
        torch.OutOfMemoryError: the pool does not fit on the device.
    """

    def __init__(
        self, shape: tuple[int, ...], dtype: str = "float32", device: str | torch.device | None = None
    ) -> None:
        require_cuda()
        if dtype not in DTYPES:
            raise ValueError(f"unknown pool dtype {dtype!r}; known: {sorted(DTYPES)}")
        shape = tuple(int(s) for s in shape)
        if len(shape) != 6 or math.prod(shape) <= 0:
            raise ValueError(f"pool shape {shape} must be 6 positive dimensions")
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"cuda_ipc pool device must be a CUDA device, got {dev}")
        self.tensor = torch.zeros(shape, dtype=DTYPES[dtype], device=dev)  # [L, 2, blocks, bs, H, D]
        (
            index,
            mem_handle,
            size_bytes,
            offset_bytes,
            ref_counter,
            ref_counter_offset,
            event_handle,
            event_sync_required,
        ) = self.tensor.untyped_storage()._share_cuda_()
        handle = CudaIpcHandle(
            _device_uuid(index),
            mem_handle,
            size_bytes,
            offset_bytes,
            ref_counter,
            ref_counter_offset,
            event_handle,
            bool(event_sync_required),
        )
        instance_id = secrets.token_hex(8)
        self.spec = KVTargetSpec("cuda_ipc", handle.to_segment(), shape, dtype, instance_id)
        _EXPORTED[instance_id] = self.tensor

    def close(self) -> None:
        """Forgets the pool; torch frees it once every importer has released its mapping."""
        if _EXPORTED.pop(self.spec.instance_id, None) is not None:
            del self.tensor


def _fitting(pool: torch.Tensor, spec: KVTargetSpec) -> torch.Tensor:
    if tuple(pool.shape) != spec.shape or pool.dtype != DTYPES[spec.dtype]:
        raise InvalidRequestError(
            f"KV target shape {list(spec.shape)} {spec.dtype} is not the layout decoder instance {spec.instance_id} exported"
        )
    return pool


@dataclass
class _OpenPool:
    segment: str
    device_uuid: str
    tensor: torch.Tensor


class CudaIpcCrossKVWriter(CrossKVWriter):
    """Encoder-side writer: opens each decoder instance's pool once, then device copies.

    Raises:
        ValueError: no CUDA GPU here (the message says why).
    """

    def __init__(self) -> None:
        require_cuda()
        self._open: dict[str, _OpenPool] = {}
        self._lock = threading.Lock()

    @property
    def open_instances(self) -> list[str]:
        """Decoder instance ids whose pools are mapped now."""
        with self._lock:
            return list(self._open)

    def _pool(self, spec: KVTargetSpec, handle: CudaIpcHandle) -> torch.Tensor:
        with self._lock:
            cached = self._open.get(spec.instance_id)
            if cached is not None:
                if cached.segment != spec.segment:
                    raise InvalidRequestError(
                        f"KV target of decoder instance {spec.instance_id} names another pool than the one it exported"
                    )
                return _fitting(cached.tensor, spec)
            local = _EXPORTED.get(spec.instance_id)
            index = _local_index(handle.device_uuid)
            # One decoder per GPU: a new instance there is a restarted decoder, and its old mapping is stale.
            for old in [i for i, p in self._open.items() if p.device_uuid == handle.device_uuid]:
                del self._open[old]
            if local is not None:
                tensor = local
            else:
                try:
                    storage = torch.UntypedStorage._new_shared_cuda(
                        index,
                        handle.mem_handle,
                        handle.size_bytes,
                        handle.offset_bytes,
                        handle.ref_counter,
                        handle.ref_counter_offset,
                        handle.event_handle,
                        handle.event_sync_required,
                    )
                except RuntimeError as exc:
                    raise UnavailableError(
                        f"cannot open the CUDA IPC handle of decoder instance {spec.instance_id} (decoder gone?): {exc}"
                    ) from exc
                stride = torch.empty(spec.shape, device="meta").stride()
                tensor = torch.empty(0, dtype=DTYPES[spec.dtype], device=torch.device("cuda", index)).set_(
                    storage, 0, spec.shape, stride
                )
            self._open[spec.instance_id] = _OpenPool(spec.segment, handle.device_uuid, tensor)
            return _fitting(tensor, spec)

    def write(
        self, spec: KVTargetSpec, block_ids: list[int], cross_kv: torch.Tensor, transfer_id: int = 0
    ) -> TransferStats:
        """See ``CrossKVWriter.write``; returns once the blocks are in the decoder's GPU memory.

        ``cross_kv`` may live on the CPU (copied host-to-device) or on any GPU;
        ``transfer_id`` is unused (the write is in place).
        """
        start = time.perf_counter()
        pool = self._pool(spec, check_target(spec))
        with torch.cuda.device(pool.device):
            try:
                write_blocks(pool, block_ids, cross_kv)  # checks everything before the first copy
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from exc
            done = torch.cuda.Event()
            done.record()
            done.synchronize()  # the Encode reply must not overtake the copy
        return TransferStats(cross_kv.numel() * pool.element_size(), (time.perf_counter() - start) * 1000.0)

    def close(self) -> None:
        with self._lock:
            self._open.clear()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
