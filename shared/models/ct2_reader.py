"""Read a CTranslate2 ``model.bin`` into torch tensors, without CTranslate2.

File layout (little-endian; CTranslate2 ``src/models/model.cc``, binary version 6)::

    uint32 binary_version
    uint16 len, bytes spec_name (NUL-terminated)
    uint32 spec_revision
    uint32 num_variables
    num_variables x {
        uint16 len, bytes name (NUL-terminated)
        uint8  rank
        rank x uint32 dims
        uint8  dtype id   (0 f32, 1 i8, 2 i16, 3 i32, 4 f16, 5 bf16)
        uint32 num_bytes
        bytes  data
    }
    uint32 num_aliases
    num_aliases x { uint16 len, bytes alias; uint16 len, bytes target }
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

# dtype id -> (numpy dtype used to view the bytes, torch dtype of the result)
_DTYPES: dict[int, tuple[np.dtype, torch.dtype]] = {
    0: (np.dtype("<f4"), torch.float32),
    1: (np.dtype("i1"), torch.int8),
    2: (np.dtype("<i2"), torch.int16),
    3: (np.dtype("<i4"), torch.int32),
    4: (np.dtype("<f2"), torch.float16),
    5: (np.dtype("<u2"), torch.bfloat16),  # raw bits, reinterpreted below
}

SUPPORTED_BINARY_VERSIONS = (5, 6)


@dataclass
class CT2Model:
    """Contents of one ``model.bin``.

    Attributes:
        spec_name: e.g. ``"WhisperSpec"``.
        binary_version: file format version.
        revision: spec revision.
        variables: name -> tensor (aliases resolved to the same tensor object).
    """

    spec_name: str
    binary_version: int
    revision: int
    variables: dict[str, torch.Tensor] = field(default_factory=dict)


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise ValueError(
                f"{self.path}: truncated or garbled CTranslate2 model.bin: reading {what} needs "
                f"{n} bytes at offset {self.pos}, file has {len(self.buf)}"
            )
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u16(self, what: str) -> int:
        return struct.unpack("<H", self.take(2, what))[0]

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def string(self, what: str) -> str:
        n = self.u16(f"length of {what}")
        raw = bytes(self.take(n, what))
        if n == 0 or raw[-1] != 0:
            raise ValueError(
                f"{self.path}: garbled CTranslate2 model.bin: {what} at offset {self.pos - n} is not NUL-terminated"
            )
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.path}: garbled CTranslate2 model.bin: {what} is not UTF-8") from exc


def read_ct2_model(path: str | Path, expected_spec: str | None = None) -> CT2Model:
    """Parse a CTranslate2 ``model.bin``.

    The file is read once into one buffer; each variable is a copy-free numpy
    view over it, wrapped as a torch tensor (do not mutate in place).

    Args:
        path: the ``model.bin`` file, or the directory holding it.
        expected_spec: if given, the spec name the file must declare
            (e.g. ``"WhisperSpec"``).

    Returns:
        ``CT2Model`` with every variable and alias by name.

    Raises:
        FileNotFoundError: no such file.
        ValueError: truncated or garbled file, unknown dtype or version, wrong
            spec, dangling alias; the message names the file.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "model.bin"
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path}: empty file, not a CTranslate2 model.bin")
    data = bytearray(size)  # writable, owned buffer: tensors view it without copies
    with open(path, "rb") as f:
        if f.readinto(data) != size:
            raise ValueError(f"{path}: short read")
    cur = _Cursor(memoryview(data), path)

    version = cur.u32("binary version")
    if version not in SUPPORTED_BINARY_VERSIONS:
        raise ValueError(
            f"{path}: unsupported CTranslate2 binary version {version} (supported: {SUPPORTED_BINARY_VERSIONS})"
        )
    spec = cur.string("spec name")
    if expected_spec is not None and spec != expected_spec:
        raise ValueError(f"{path}: model spec is {spec!r}, expected {expected_spec!r}")
    revision = cur.u32("spec revision")
    num_vars = cur.u32("variable count")

    variables: dict[str, torch.Tensor] = {}
    for i in range(num_vars):
        name = cur.string(f"name of variable {i}")
        rank = cur.u8(f"rank of {name}")
        dims = [cur.u32(f"dim {d} of {name}") for d in range(rank)]
        dtype_id = cur.u8(f"dtype of {name}")
        if dtype_id not in _DTYPES:
            raise ValueError(f"{path}: variable {name!r} has unknown dtype id {dtype_id}")
        np_dtype, torch_dtype = _DTYPES[dtype_id]
        nbytes = cur.u32(f"byte count of {name}")
        expected = int(np.prod(dims, dtype=np.int64)) * np_dtype.itemsize
        if nbytes != expected:
            raise ValueError(
                f"{path}: variable {name!r} of shape {dims} and dtype id {dtype_id} declares {nbytes} bytes, expected {expected}"
            )
        start = cur.pos
        cur.take(nbytes, f"data of {name}")
        arr = np.frombuffer(data, dtype=np_dtype, count=nbytes // np_dtype.itemsize, offset=start).reshape(dims)
        t = torch.from_numpy(arr)
        if torch_dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        variables[name] = t

    num_aliases = cur.u32("alias count") if cur.pos < len(data) else 0
    for i in range(num_aliases):
        alias = cur.string(f"alias {i}")
        target = cur.string(f"target of alias {alias!r}")
        if target not in variables:
            raise ValueError(f"{path}: alias {alias!r} points to missing variable {target!r}")
        variables[alias] = variables[target]
    if cur.pos != len(data):
        raise ValueError(f"{path}: garbled CTranslate2 model.bin: {len(data) - cur.pos} unread bytes after the aliases")
    return CT2Model(spec_name=spec, binary_version=version, revision=revision, variables=variables)


def load_ct2_weights(path: str | Path, expected_spec: str | None = None) -> dict[str, torch.Tensor]:
    """Return ``name -> tensor`` for every variable and alias in a ``model.bin``.

    See ``read_ct2_model`` for arguments and errors.
    """
    return read_ct2_model(path, expected_spec).variables


def read_ct2_spec_name(path: str | Path) -> str:
    """Read only the header of a ``model.bin`` and return its spec name.

    Raises:
        ValueError: the header is truncated or garbled.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "model.bin"
    with open(path, "rb") as f:
        head = f.read(4 + 2 + 512)
    cur = _Cursor(memoryview(head), path)
    version = cur.u32("binary version")
    if version not in SUPPORTED_BINARY_VERSIONS:
        raise ValueError(f"{path}: unsupported CTranslate2 binary version {version}")
    return cur.string("spec name")
