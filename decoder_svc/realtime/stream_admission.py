"""Which realtime streams this replica takes: refused at open when its measured capacity is spent.

A stream is refused (RESOURCE_EXHAUSTED) when ``max_realtime_streams`` are live, or when the live streams'
re-decodes already take longer than their step (the moving average of a step's decode time over
``realtime_step_ms``, measured per stream): one more stream would make every stream fall behind real time.
"""

from __future__ import annotations

from shared.errors import ResourceExhaustedError

FULL_FRACTION = 1.0  # a step that takes its whole interval: the streams have no time left


class StreamAdmission:
    """The replica's live streams (``open`` / ``close``), with the ``max_streams`` and step-time rules."""

    def __init__(self, max_streams: int, step_s: float) -> None:
        self.max_streams, self.step_s = max_streams, step_s
        self.live: set = set()

    def check(self) -> None:
        """Raises ResourceExhaustedError when a new stream would not be kept up with (module docstring)."""
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

    def open(self, session) -> None:
        self.live.add(session)

    def close(self, session) -> None:
        self.live.discard(session)
