"""Dynamic batching of encoder-only work across concurrent requests by a token budget.

A worker thread owns the model and keeps a list of active jobs. Each turn of its
loop it takes every newly submitted job (no waiting window: a lone request runs
at once), drops jobs whose future was cancelled (the client went away: the
servicer cancels the future when its gRPC call is cancelled), plans forwards
over the remaining sequences of all active jobs (sorted by length so that
sequences of similar length share a forward, cut into forwards of at most
``max_batch_tokens`` padded tokens, sequences x longest) and runs only ONE of
them before looking again. So a cancelled request's remaining forwards never
run, and a request that arrives while a big one is in progress joins it
between two forwards instead of waiting for its end.

Which forward runs: the one holding the shortest remaining sequence of the
least recently served job (jobs never served yet first: the one with the fewest
tokens pending, unless an earlier one has been passed over ``MAX_SKIPS`` times), so
jobs take turns forward by forward (round robin) and a new small job runs in the
very next forward. Every job with a sequence in that forward counts as served.

Sequences of very different lengths do not share a forward (``plan_forwards``
starts a new one when a sequence is more than ``LENGTH_BUCKET_RATIO`` times the
shortest of the forward, beyond ``SHORT_SEQUENCE_TOKENS``): the forward a new short
job gets is a short one, not a full budget of other jobs' long sequences, so a short
request waits at most for the forward under way and its own short one.

A job whose gRPC deadline passes before its turn is dropped unrun (its future fails
with ``DeadlineExceededError``), as is a cancelled one: neither costs a forward.

A job's future resolves once all its sequences are done; a failed forward fails
only the jobs with a sequence in it. Futures stay pending (never "running")
until they resolve, so ``Future.cancel()`` works at any time. Each sequence is
computed on its own in a packed forward, so its output does not depend on what
else shares the forward.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from encoder_svc.embed.engine import EmbedEngine, Encoded
from shared.compute_thread import use_threads
from shared.errors import DeadlineExceededError

log = logging.getLogger(__name__)

LENGTH_BUCKET_RATIO = 2
"""A forward holds no sequence more than this many times longer than its shortest one (beyond
``SHORT_SEQUENCE_TOKENS``)."""
SHORT_SEQUENCE_TOKENS = 64
"""Sequences up to this many tokens share a forward whatever their lengths (each costs little)."""
MAX_SKIPS = 4
"""Times a job never served yet may be passed over by later, shorter ones before it goes first."""


@dataclass
class EmbedJob:
    """The sequences of one request and what to compute for each.

    Attributes:
        seqs: tokenized inputs.
        pooling: ``cls`` / ``mean`` / ``last``, or ``logits`` for the
            classification head (applies to every sequence of the job).
        future: resolves to a list of float32 tensors, one per sequence, in order;
            cancelling it drops the job's sequences not yet run.
        pending: indices of the sequences not yet run.
        served: ordering key of the last turn the job had a sequence in a forward
            (-1: none yet), then its arrival number.
        deadline: ``time.monotonic()`` after which the job's result is of no use
            (its gRPC deadline), or None.
        submitted: ``time.monotonic()`` of its submission.
        skips: times a later, shorter job went before it while it was never served.
    """

    seqs: list[Encoded]
    pooling: str
    future: Future = field(default_factory=Future)
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    served: tuple[int, int] = (-1, 0)
    deadline: float | None = None
    submitted: float = field(default_factory=time.monotonic)
    skips: int = 0

    def done(self) -> bool:
        return self.future.done()


def plan_forwards(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Groups sequence indices into forwards: sorted by length, each forward's
    ``count x longest`` at most ``max_batch_tokens`` (a longer single sequence runs alone),
    and no sequence longer than ``SHORT_SEQUENCE_TOKENS`` beside one ``LENGTH_BUCKET_RATIO``
    times shorter.

    Returns:
        Lists of indices into ``lengths``, shortest sequences first.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending, so lengths[i] is the longest of current + [i].
        bucket_end = max(LENGTH_BUCKET_RATIO * lengths[current[0]], SHORT_SEQUENCE_TOKENS) if current else 0
        if current and ((len(current) + 1) * lengths[i] > max_batch_tokens or lengths[i] > bucket_end):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def _turn_order(job: EmbedJob) -> tuple[int, int, int, int]:
    """Which job's sequence the next forward holds (the smallest key): the least recently served;
    among jobs never served, the one with the fewest pending tokens (a short request does not wait
    behind a long one that arrived just before it), unless one was passed over ``MAX_SKIPS`` times."""
    turn, arrival = job.served
    if turn >= 0 or job.skips >= MAX_SKIPS:
        return turn, 0, 0, arrival
    return turn, 1, sum(len(job.seqs[i].ids) for i in job.pending), arrival


def _resolve(future: Future, result=None, exc: BaseException | None = None) -> None:
    """Sets a result or exception unless the future was cancelled meanwhile."""
    if future.set_running_or_notify_cancel():
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)


class EmbedBatcher:
    """Runs ``EmbedJob``s on a worker thread, batching across jobs, one forward at a time.

    Args:
        engine: the loaded encoder-only model.
        max_batch_tokens: padded-token budget of one forward.
        num_threads: torch intra-op threads of the batcher thread
            (``shared.compute_thread``); None keeps the process setting.
        metrics: ``shared.metrics.EmbedMetrics`` to record forwards and dropped
            jobs in, or None.

    Attributes:
        num_dropped: jobs dropped unrun by reason (``expired``, ``cancelled``).
    """

    def __init__(
        self, engine: EmbedEngine, max_batch_tokens: int, num_threads: int | None = None, metrics=None
    ) -> None:
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self.metrics = metrics
        self.num_dropped = {"expired": 0, "cancelled": 0}
        self._queue: queue.Queue[EmbedJob | None] = queue.Queue()
        self._jobs: list[EmbedJob] = []  # the worker's active jobs; read without a lock by ``stats``
        self._arrivals = itertools.count()
        self._thread = threading.Thread(target=self._loop, args=(num_threads,), name="embed-batcher", daemon=True)
        self._thread.start()

    def submit(self, seqs: list[Encoded], pooling: str, deadline: float | None = None) -> Future:
        """Queues one request's sequences; the future gives one tensor per sequence.

        Cancel the future (``future.cancel()``) when the caller no longer wants the
        result: the sequences not yet run are dropped before the next forward.

        Args:
            deadline: ``time.monotonic()`` past which the result is of no use; the
                sequences not run by then are dropped and the future fails with
                ``DeadlineExceededError``.
        """
        job = EmbedJob(seqs, pooling, outputs=[None] * len(seqs), pending=list(range(len(seqs))), deadline=deadline)
        if not seqs:
            job.future.set_result([])
        else:
            self._queue.put(job)
        return job.future

    def stop(self) -> None:
        """Finishes the jobs already submitted, then ends the worker."""
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _take_new(self, jobs: list[EmbedJob], block: bool) -> bool:
        """Moves newly submitted jobs into ``jobs``; False once ``stop`` was called."""
        while True:
            try:
                job = self._queue.get(block=block)
            except queue.Empty:
                return True
            if job is None:
                return False
            block = False
            job.served = (-1, next(self._arrivals))
            jobs.append(job)

    def stats(self) -> dict:
        """Queue state now: ``num_requests`` (jobs submitted, not finished), ``num_sequences``
        (their sequences not yet run), ``oldest_wait_s`` (seconds since the oldest one's submission)."""
        jobs = list(self._jobs)
        now = time.monotonic()
        with self._queue.mutex:
            queued = list(self._queue.queue)
        jobs += [j for j in queued if j is not None]
        return {
            "num_requests": len(jobs),
            "num_sequences": sum(len(j.pending) for j in jobs),
            "oldest_wait_s": max((now - j.submitted for j in jobs), default=0.0),
        }

    def _drop(self, job: EmbedJob, reason: str) -> None:
        self.num_dropped[reason] += 1
        if self.metrics is not None:
            self.metrics.observe_dropped(reason, len(job.pending))
        log.debug("dropped a %s job of %d sequences not yet run", reason, len(job.pending))

    def _prune(self, jobs: list[EmbedJob]) -> list[EmbedJob]:
        """The jobs still to run: expired ones fail unrun, cancelled, failed and finished ones leave."""
        now = time.monotonic()
        kept = []
        for job in jobs:
            if job.future.cancelled():  # the call ended: its client went away, or its deadline passed first
                if job.pending:
                    expired = job.deadline is not None and now >= job.deadline
                    self._drop(job, "expired" if expired else "cancelled")
                continue
            if job.done():
                continue
            if job.deadline is not None and now >= job.deadline:
                self._drop(job, "expired")
                _resolve(
                    job.future,
                    exc=DeadlineExceededError(
                        f"the call's deadline passed after {now - job.submitted:.3f} s in the embed queue, before its "
                        f"{len(job.pending)} sequences could run; they were dropped unrun: retry with a longer deadline"
                    ),
                )
                continue
            kept.append(job)
        return kept

    def _loop(self, num_threads: int | None) -> None:
        use_threads(num_threads)
        jobs: list[EmbedJob] = self._jobs
        running = True
        for turn in itertools.count():
            if running:
                running = self._take_new(jobs, block=not jobs)
            jobs = self._jobs = self._prune(jobs)
            if not jobs:
                if not running:
                    return
                continue
            self._run_one(jobs, turn)

    def _run_one(self, jobs: list[EmbedJob], turn: int) -> None:
        """Runs the one forward holding the shortest pending sequence of the least recently served job."""
        units = [(job, i) for job in jobs for i in job.pending]
        lengths = [len(job.seqs[i].ids) for job, i in units]
        first = min(jobs, key=_turn_order)
        for job in jobs:  # an unserved job that a later, shorter one went before: it goes first after MAX_SKIPS
            if job.served[0] < 0 and job is not first and job.served[1] < first.served[1]:
                job.skips += 1
        group = next(g for g in plan_forwards(lengths, self.max_batch_tokens) if any(units[k][0] is first for k in g))
        live = [units[k] for k in group]
        start = time.perf_counter()
        for job, _ in live:
            job.served = (turn, job.served[1])
        try:
            outs = self.engine.forward([job.seqs[i] for job, i in live], [job.pooling for job, _ in live])
        except Exception as exc:
            log.exception("encoder-only forward failed")
            for job, _ in live:
                if not job.done():
                    _resolve(job.future, exc=exc)
            return
        done_idx: dict[int, set[int]] = {}
        for (job, i), out in zip(live, outs):
            job.outputs[i] = out
            done_idx.setdefault(id(job), set()).add(i)
        for job in {id(j): j for j, _ in live}.values():
            ran = done_idx[id(job)]
            job.pending = [i for i in job.pending if i not in ran]
            if not job.pending and not job.done():
                _resolve(job.future, job.outputs)
        seconds = time.perf_counter() - start
        if self.metrics is not None:
            self.metrics.observe_forward(len(live), sum(lengths[k] for k in group), seconds)
        log.debug(
            "forward of %d sequences (longest %d) in %.1f ms",
            len(live),
            max(lengths[k] for k in group),
            seconds * 1000.0,
        )
