"""Admission control of the decoder's Generate calls: a bounded queue, an estimated wait, deadlines (no torch).

A request is *queued* from its admission (the Generate call, before its input is parsed) until its first token,
or its end: it waits for cross blocks, for its Encode, or for a batch seat. Each new call is checked at once,
before any parsing, Redis write or KV block:

- more than ``max_waiting_requests`` requests of its priority or better already queued: RESOURCE_EXHAUSTED;
- its estimated wait (below) over ``max_queue_time_s``: RESOURCE_EXHAUSTED;
- its gRPC deadline passed, or its estimated wait is longer than the time it has left: DEADLINE_EXCEEDED.

Each message says how many requests wait and to retry later or use another replica (TEI answers 429 on a full
queue, TGI "Model is overloaded"). Priority follows the scheduler's (``decoder_svc.core.scheduler``, vLLM's): lower
value first, first come first served among equals. Only requests queued with a priority at least as good count
against a new one, so a higher-priority request still enters a queue full of lower-priority ones; the worst of
those (largest priority value, latest arrival) whose Encode has not started is then refused in its place
(RESOURCE_EXHAUSTED, recorded FAILED), so the queue stays within its bound.

A queued request whose deadline passes, or will pass within ``DEADLINE_MARGIN_S``, when the engine hands it to the
encoder is dropped before its Encode (``Ticket.check_encode``: DEADLINE_EXCEEDED, recorded FAILED, its blocks
freed); an Encode carries the request's deadline (``decoder_svc.session.encode_client``).

**Estimated wait.** The larger of the queue's wait and the wait for a batch seat ("Seats" below). The queue's
wait is the work ahead of the new request: 0 when nothing with a priority at least as good waits, else
``max(ahead * gap, open)``. ``ahead`` is the requests queued with priority
at least as good; ``gap`` the median busy time per request between departures (first tokens) of a busy queue, over the
last ``GAP_SAMPLES`` samples of the last ``GAP_WINDOW_S`` seconds: the queue's measured service rate. Departures
closer than ``BATCH_GAP_S`` (the requests of one batch, whose first tokens come out of one step) make one sample:
the gap before the first of them shared by all of them, so a batch of 16 every 8 s prices a request at 0.5 s
(with a sample per departure the 15 gaps of ~0 made the median 0, and a loaded decoder admitted anything up to
``max_waiting_requests``). The gap that opens a busy
period (from the queue filling to its first departure: one request's whole time to first token, model warm-up
and encoder stalls included) is no sample, so requests sent one at a time never price a burst that will share a
batch as if it ran one by one; the median (the lower of two) and the window bound what one slow departure does.
``open`` is the gap open now (since the last departure, or since the queue filled): a queue that has not moved
for that long is not expected to move sooner, so an encoder that stopped delivering raises the estimate as it
stalls, and once it delivers again the estimate falls back at once.

**Seats.** A request also waits for a batch seat (``seats``, the engine's ``max_num_seqs``), which requests
already decoding hold for as long as their whole output takes; the departure gap does not see that when the queue
has not been busy (nothing queued, every seat held by long requests). The estimate is the larger of the queue's
wait above and the wait for a seat, which comes from the service time of finished requests (first token to end;
the last ``SERVICE_SAMPLES``, which hold no model warm-up: that falls before the first token): the request needs
``beyond = ahead + in service - seats + 1`` seats to free, the first when the request in service expected to end
soonest does (its residual time: the median of the finished service times longer than what it has run, less what
it has run; as long again when it has outrun them all, or before any request has finished), each further one a
median service time / seats later (requests in service end spread out). With a seat free it is 0: an idle decoder
always admits, and a burst of ``seats`` requests all enter. A cold start's burst, all at once, finds nothing
measured and nothing running yet: the open gap prices it, and ``max_waiting_requests`` bounds it.

Single-threaded: every method runs on the service's event loop; ``stats`` may also be read from the metrics
scrape thread (it copies what it reads).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.errors import DeadlineExceededError, ResourceExhaustedError, ServiceError

GAP_SAMPLES = 32  # departures the service-rate estimate takes the median of
GAP_WINDOW_S = 120.0  # seconds: older departures no longer speak for the service rate
DEADLINE_MARGIN_S = 0.05  # a request handed to the encoder with less time left than this is not encoded
BATCH_GAP_S = 0.05  # departures closer than this left one step together (one batch): one rate sample
SERVICE_SAMPLES = 32  # finished requests whose service time (first token to end) prices a seat's turnover


@dataclass(eq=False)
class Ticket:
    """One admitted request's place in the queue (``AdmissionQueue.admit``).

    Attributes:
        priority: the request's priority (lower = earlier).
        admitted_at: ``time.monotonic()`` of its admission.
        deadline: ``time.monotonic()`` by which its gRPC call ends; None without a deadline.
        order: admission order (ties of priority: first come first served).
        started: its first token is out (it left the queue).
        encoding: its first Encode was sent: it is never displaced.
        refusal: why it was displaced by a higher-priority request; delivered through ``bind``'s callback.
    """

    priority: int
    admitted_at: float
    deadline: float | None
    order: int
    started: bool = False
    encoding: bool = False
    refusal: ServiceError | None = None
    _fail: Callable[[BaseException], None] | None = field(default=None, repr=False)
    _clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def bind(self, fail: Callable[[BaseException], None]) -> None:
        """``fail(exc)`` ends the request (its session's stream); called at once if it was already displaced."""
        self._fail = fail
        if self.refusal is not None:
            fail(self.refusal)

    def time_left(self, now: float | None = None) -> float | None:
        """Seconds to the deadline (negative once passed); None without one."""
        if self.deadline is None:
            return None
        return self.deadline - (self._clock() if now is None else now)

    def check_encode(self) -> ServiceError | None:
        """The engine hands the request to the encoder: the error that ends it instead when it was displaced, or
        its deadline passed or leaves less than ``DEADLINE_MARGIN_S``; else None (it may no longer be displaced)."""
        if self.refusal is not None:
            return self.refusal
        left = self.time_left()
        if left is not None and left < DEADLINE_MARGIN_S:
            waited = self._clock() - self.admitted_at
            return DeadlineExceededError(
                f"the request's deadline passed while it waited {waited:.1f} s for the encoder; it was not "
                "encoded. Retry with a longer deadline, or send it to another replica"
            )
        self.encoding = True
        return None


def _median(values: list[float]) -> float:
    """The median of sorted ``values`` (the lower one of an even count)."""
    return values[(len(values) - 1) // 2]


def _residual(services: list[float], ran: float) -> float:
    """Seconds a request that has decoded ``ran`` seconds is expected to go on: the median of the finished service
    times (sorted ``services``) longer than ``ran``, less ``ran``; as long again when it outran every one of them."""
    longer = services[bisect.bisect_right(services, ran) :]
    return _median(longer) - ran if longer else ran


class AdmissionQueue:
    """The decoder's queued requests, their estimated wait, and the admission limits.

    Args:
        max_waiting_requests: most requests queued with a priority at least as good as a new one's (>= 1).
        max_queue_time_s: longest estimated wait a new request is admitted to (seconds, > 0).
        clock: monotonic seconds (tests pass their own).
        seats: requests the engine runs at once (``max_num_seqs``), or None: the estimate then ignores requests
            in service (see "Seats" in the module docstring).

    Raises:
        ValueError: a limit out of range.
    """

    def __init__(
        self,
        max_waiting_requests: int,
        max_queue_time_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        seats: int | None = None,
    ) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        if not 0 < max_queue_time_s < float("inf"):
            raise ValueError(f"max_queue_time_s must be > 0 and finite (seconds), got {max_queue_time_s}")
        if seats is not None and seats < 1:
            raise ValueError(f"seats must be >= 1, got {seats}")
        self.max_waiting_requests = max_waiting_requests
        self.max_queue_time_s = max_queue_time_s
        self.seats = seats
        self._clock = clock
        self._queued: dict[int, Ticket] = {}  # id(ticket) -> ticket, not yet started
        self._in_service: dict[int, float] = {}  # id(ticket) -> its first token's time: it holds a batch seat
        self._services: deque[float] = deque(maxlen=SERVICE_SAMPLES)  # seconds from first token to a finished end
        self._orders = itertools.count()
        # [when, busy seconds, departures]: one sample per departure, or per batch of departures (BATCH_GAP_S)
        self._gaps: deque[list[float]] = deque(maxlen=GAP_SAMPLES)
        self._since_departure = False  # ``_last_event`` is a departure (not the start of a busy period)
        self._sampled = False  # the last departure made or joined a sample (not the busy period's opening batch)
        self._last_event: float | None = None  # last departure, or when the queue last filled from empty
        self.num_refused: dict[str, int] = {"queue_full": 0, "queue_time": 0, "deadline": 0, "displaced": 0}

    # --- the queue ------------------------------------------------------------
    def admit(self, priority: int, time_remaining: float | None) -> Ticket:
        """Admits a new request or refuses it at once (see the module docstring).

        Args:
            priority: the request's priority (lower = earlier).
            time_remaining: seconds left of its gRPC deadline (``context.time_remaining()``); None: none.

        Returns:
            its ticket: pass it to ``started`` at its first token and to ``leave`` at its end (or on any failure
            before its session runs).

        Raises:
            ResourceExhaustedError: the queue is full for its priority, or its estimated wait exceeds
                ``max_queue_time_s``.
            DeadlineExceededError: its deadline passed, or is shorter than its estimated wait.
        """
        now = self._clock()
        ahead = sum(1 for t in self._queued.values() if t.priority <= priority)
        total = len(self._queued)
        if ahead >= self.max_waiting_requests:
            self.num_refused["queue_full"] += 1
            raise ResourceExhaustedError(
                f"this decoder is overloaded: {total} requests are waiting (max_waiting_requests="
                f"{self.max_waiting_requests}); retry later or send the request to another replica"
            )
        wait = self._estimate(ahead, now)
        if wait > self.max_queue_time_s:
            self.num_refused["queue_time"] += 1
            raise ResourceExhaustedError(
                f"this decoder is overloaded: {total} requests are waiting, an estimated {wait:.1f} s "
                f"(max_queue_time_s={self.max_queue_time_s:g}); retry later or send the request to another replica"
            )
        if time_remaining is not None and time_remaining < max(wait, DEADLINE_MARGIN_S):
            self.num_refused["deadline"] += 1
            raise DeadlineExceededError(
                f"the request's deadline ({max(time_remaining, 0.0):.2f} s left) is shorter than its estimated "
                f"wait of {wait:.1f} s behind {ahead} waiting requests; it was not queued. Retry with a longer "
                "deadline, or send it to another replica"
            )
        deadline = None if time_remaining is None else now + time_remaining
        ticket = Ticket(priority, now, deadline, next(self._orders), _clock=self._clock)
        if not self._queued:
            self._last_event, self._since_departure = now, False  # a busy period starts
        self._queued[id(ticket)] = ticket
        if total + 1 > self.max_waiting_requests:
            self._displace_for(ticket)
        return ticket

    def _displace_for(self, ticket: Ticket) -> None:
        """Refuses the worst queued request of lower priority than ``ticket``'s whose Encode has not started."""
        victims = [t for t in self._queued.values() if t.priority > ticket.priority and not t.encoding]
        if not victims:
            return  # every lower-priority one is being encoded already: over the bound until they start
        victim = max(victims, key=lambda t: (t.priority, t.order))
        self._queued.pop(id(victim))
        self.num_refused["displaced"] += 1
        victim.refusal = ResourceExhaustedError(
            f"this decoder is overloaded: the request (priority {victim.priority}) was displaced from the queue by "
            f"one of higher priority ({len(self._queued)} requests are waiting, max_waiting_requests="
            f"{self.max_waiting_requests}); retry later or send the request to another replica"
        )
        if victim._fail is not None:
            victim._fail(victim.refusal)

    def started(self, ticket: Ticket | None) -> None:
        """``ticket``'s request produced its first token: it leaves the queue (a service-rate sample)."""
        if ticket is None or ticket.started:
            return
        ticket.started = True
        if self._queued.pop(id(ticket), None) is None:
            return
        now = self._clock()
        self._in_service[id(ticket)] = now
        if self._last_event is not None and self._since_departure:  # between two departures of a busy queue
            gap = max(now - self._last_event, 0.0)
            if gap >= BATCH_GAP_S:
                self._gaps.append([now, gap, 1])
                self._sampled = True
            elif self._sampled:  # the same batch as the last departure: it shares that sample's gap
                self._gaps[-1][0] = now
                self._gaps[-1][1] += gap
                self._gaps[-1][2] += 1
        else:
            self._sampled = False  # the busy period's opening (batch): no sample
        self._last_event = now if self._queued else None
        self._since_departure = self._last_event is not None

    def leave(self, ticket: Ticket | None, finished: bool = False) -> None:
        """``ticket``'s request ended (any way): it no longer waits, and frees its batch seat. ``finished``: it ran
        to its end (not aborted, failed or cut), so the time from its first token is a service-time sample. An
        end before the first token is no rate sample: it was not served."""
        if ticket is None:
            return
        ticket.started = True
        if self._queued.pop(id(ticket), None) is not None and not self._queued:
            self._last_event, self._since_departure = None, False
        started_at = self._in_service.pop(id(ticket), None)
        if started_at is not None and finished:
            self._services.append(max(self._clock() - started_at, 0.0))

    # --- what it looks like -----------------------------------------------------
    def _estimate(self, ahead: int, now: float) -> float:
        """Seconds a new request with ``ahead`` requests before it is expected to wait (module docstring): the
        larger of the queue's wait and the wait for a batch seat."""
        return max(self._queue_wait(ahead, now), self._seat_wait(ahead, now))

    def _queue_wait(self, ahead: int, now: float) -> float:
        """``max(ahead * gap, open)``; 0 with nothing ahead."""
        if ahead == 0:
            return 0.0
        recent = sorted(busy / count for when, busy, count in self._gaps if now - when <= GAP_WINDOW_S)
        gap = _median(recent) if recent else 0.0
        open_gap = max(now - self._last_event, 0.0) if self._queued and self._last_event is not None else 0.0
        return max(ahead * gap, open_gap)

    def _seat_wait(self, ahead: int, now: float) -> float:
        """Until ``beyond`` seats free (module docstring, "Seats"); 0 with a seat free or without ``seats``."""
        if self.seats is None:
            return 0.0
        beyond = ahead + len(self._in_service) - self.seats + 1  # seats that must free before it gets one
        if beyond <= 0:
            return 0.0
        services = sorted(self._services)
        first_free = min((_residual(services, now - t) for t in self._in_service.values()), default=0.0)
        per_seat = _median(services) / self.seats if services else 0.0
        return first_free + (beyond - 1) * per_seat

    def stats(self) -> dict:
        """``num_queued_requests``, ``oldest_queue_wait_s`` (the longest-waiting queued request's wait) and
        ``estimated_queue_wait_s`` (a new request's at priority 0), for GetStats and ``/metrics``."""
        now = self._clock()
        queued = list(self._queued.values())
        ahead = sum(1 for t in queued if t.priority <= 0)
        return {
            "num_queued_requests": len(queued),
            "oldest_queue_wait_s": max((now - t.admitted_at for t in queued), default=0.0),
            "estimated_queue_wait_s": self._estimate(ahead, now),
            "max_waiting_requests": self.max_waiting_requests,
        }
