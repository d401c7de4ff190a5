"""What ``encdec bench transfer`` moves and over what: payload shapes and transport rows.

Both the bench (``encdec.bench.transfer``) and its measuring processes
(``encdec.bench.transfer_runs``) read these; neither imports the other for them.
No torch here: ``encdec`` builds the bench's flags from ``PAYLOADS`` and
``TRANSPORTS`` for every command.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# name: (num_layers, num_heads, head_dim, encoder_len) of the decoder's cross-attention
PAYLOADS = {
    "whisper-tiny": (4, 6, 64, 1500),
    "whisper-small": (12, 12, 64, 1500),
    "whisper-large-v3": (32, 20, 64, 1500),
}
# transport row name: (kv_transport, device kind, pool/writer options)
TRANSPORTS = {
    "shm": ("shm", "cpu", {}),
    "torch_dist gloo": ("torch_dist", "cpu", {"backend": "gloo", "device": "cpu"}),
    "cuda_ipc": ("cuda_ipc", "cuda", {}),
    "torch_dist nccl": ("torch_dist", "cuda", {"backend": "nccl", "device": "cuda"}),
}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Payload:
    """One cross-KV payload shape. ``dims`` = ``(num_layers, num_heads, head_dim, encoder_len)``."""

    name: str
    dims: tuple[int, int, int, int]
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:  # [L, 2, S, H, D]
        layers, heads, head_dim, encoder_len = self.dims
        return (layers, 2, encoder_len, heads, head_dim)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


def parse_payloads(text: str, dtype: str) -> list[Payload]:
    """``whisper-tiny,2x3x8x13`` -> payloads; ``LxHxDxS`` = layers x heads x head_dim x encoder_len.

    Raises:
        ValueError: an unknown name or a malformed ``LxHxDxS``.
    """
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item in PAYLOADS:
            out.append(Payload(item, PAYLOADS[item], dtype))
            continue
        parts = item.split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"payload {item!r} is neither one of {sorted(PAYLOADS)} nor LxHxDxS (e.g. 4x6x64x1500)")
        out.append(Payload(item, tuple(int(p) for p in parts), dtype))
    return out
