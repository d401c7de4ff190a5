"""A growable float32 sample buffer, so decoded audio is written once into its final array.

Joining decoded pieces at the end (``np.concatenate``) holds the audio twice at its peak; this buffer is
allocated at the length the file's header declares (pages become resident only as they are written), and grows
by doubling only when a stream outruns its hint or states no length.
"""

from __future__ import annotations

import numpy as np

_MIN_CAPACITY = 1 << 16  # samples (4 s at 16 kHz)


class PcmBuffer:
    """Samples appended in order; ``samples()`` is the ``[N]`` float32 written so far (a view, no copy).

    Args:
        capacity: expected total in samples (a header's length); more still fits, at the cost of one copy
            per doubling.
    """

    def __init__(self, capacity: int = 0) -> None:
        self._data = np.empty(max(int(capacity), _MIN_CAPACITY), np.float32)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def append(self, samples: np.ndarray, scale: float = 1.0) -> None:
        """Appends ``samples`` (``[n]``, any real dtype), multiplied by ``scale``, as float32."""
        end = self._size + len(samples)
        if end > len(self._data):
            grown = np.empty(max(end, 2 * len(self._data)), np.float32)
            grown[: self._size] = self._data[: self._size]
            self._data = grown
        target = self._data[self._size : end]
        if scale == 1.0:
            target[:] = samples
        else:
            np.multiply(samples, np.float32(scale), out=target, casting="unsafe")
        self._size = end

    def samples(self) -> np.ndarray:
        return self._data[: self._size]
