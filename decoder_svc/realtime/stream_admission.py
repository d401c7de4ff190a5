"""Which realtime streams this replica takes: refused at open when its measured capacity is spent.

A stream is refused (RESOURCE_EXHAUSTED) when

- ``max_realtime_streams`` are live;
- the live streams' re-decodes already take longer than their step (the moving average of a step's decode time
  over ``realtime_step_ms``, measured per stream): every stream is falling behind real time;
- the streams, this one included, would need more decoding than the replica has: each stream's step costs
  ``step_cost_s``, the median of the replica's last ``COST_SAMPLES`` step decode times each divided by the streams
  in an utterance when it ended (their steps run at the same time, batched in the encoder and the engine; the
  median, so a fresh decoder's slow first steps do not count), and a stream needs
  ``step_cost_s / step_s`` seconds of decoding per second of audio; over ``realtime_capacity`` (1.0: all of the
  replica's time) in all, one more stream would make them all fall behind. This is what refuses a burst of
  opens that come before any of them has decoded a step; until the replica has timed ``MIN_COST_SAMPLES`` steps
  (a fresh decoder), only the first two rules apply.
"""

from __future__ import annotations

import statistics
from collections import deque

from shared.errors import ResourceExhaustedError

FULL_FRACTION = 1.0  # a step that takes its whole interval: the streams have no time left
COST_SAMPLES = 20  # the steps step_cost_s is the median of
MIN_COST_SAMPLES = 3  # fewer timed steps: no estimate yet


class StreamAdmission:
    """The replica's live streams (``open`` / ``close``), with the rules of the module docstring.

    Args:
        max_streams: ``max_realtime_streams``. step_s: the server's step (``realtime_step_ms`` in seconds).
        capacity: ``realtime_capacity``, decoding seconds per second the streams may need in all; 0 turns the
            projected-load rule off.
    """

    def __init__(self, max_streams: int, step_s: float, capacity: float = 1.0) -> None:
        self.max_streams, self.step_s, self.capacity = max_streams, step_s, capacity
        self.live: set = set()
        self._costs: deque[float] = deque(maxlen=COST_SAMPLES)

    @property
    def step_cost_s(self) -> float | None:
        """A stream's step, seconds of decoding (module docstring); None before ``MIN_COST_SAMPLES`` timed steps."""
        return statistics.median(self._costs) if len(self._costs) >= MIN_COST_SAMPLES else None

    def observe(self, step_time_s: float) -> None:
        """A live stream's step took ``step_time_s`` (its decode, wall seconds)."""
        self._costs.append(step_time_s / max(1, sum(1 for s in self.live if s.open)))

    def load(self, new_step_s: float | None = None) -> float:
        """Seconds of decoding per second of audio the live streams need (and one more of step ``new_step_s``)."""
        cost = self.step_cost_s
        if cost is None:
            return 0.0
        steps = [s.settings.step_s for s in self.live] + ([new_step_s] if new_step_s else [])
        return sum(cost / step for step in steps)

    def check(self, step_s: float | None = None) -> None:
        """Raises ResourceExhaustedError when a new stream (of step ``step_s``; None: the server's) would not be kept
        up with (module docstring)."""
        if len(self.live) >= self.max_streams:
            raise ResourceExhaustedError(
                f"this decoder serves {len(self.live)} realtime streams, its limit (--max-realtime-streams="
                f"{self.max_streams}); retry later or open the stream on another replica"
            )
        slowest = max((s.step_time_s for s in self.live if s.open), default=0.0)
        if slowest > FULL_FRACTION * self.step_s:
            raise ResourceExhaustedError(
                f"this decoder's {len(self.live)} realtime streams take {slowest:.2f} s per {self.step_s:.2f} s step "
                "already: one more would fall behind real time; retry later or use another replica"
            )
        load = self.load(step_s or self.step_s)
        if self.capacity and load > self.capacity:
            raise ResourceExhaustedError(
                f"this decoder's {len(self.live)} realtime streams and one more would need {load:.2f} s of decoding "
                f"per second of audio (a step costs {self.step_cost_s:.2f} s here), over its capacity of "
                f"{self.capacity:g} (--realtime-capacity): every stream would fall behind real time; retry later "
                "or use another replica"
            )

    def open(self, session) -> None:
        self.live.add(session)

    def close(self, session) -> None:
        self.live.discard(session)
