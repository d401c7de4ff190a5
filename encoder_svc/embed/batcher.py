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
least recently served job (jobs never served yet first, in arrival order), so
jobs take turns forward by forward (round robin) and a new small job runs in the
very next forward. Every job with a sequence in that forward counts as served.

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

log = logging.getLogger(__name__)


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
    """

    seqs: list[Encoded]
    pooling: str
    future: Future = field(default_factory=Future)
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    served: tuple[int, int] = (-1, 0)

    def done(self) -> bool:
        return self.future.done()


def plan_forwards(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Groups sequence indices into forwards: sorted by length, each forward's
    ``count x longest`` at most ``max_batch_tokens`` (a longer single sequence runs alone).

    Returns:
        Lists of indices into ``lengths``, shortest sequences first.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending, so lengths[i] is the longest of current + [i].
        if current and (len(current) + 1) * lengths[i] > max_batch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


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
    """

    def __init__(self, engine: EmbedEngine, max_batch_tokens: int, num_threads: int | None = None) -> None:
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self._queue: queue.Queue[EmbedJob | None] = queue.Queue()
        self._arrivals = itertools.count()
        self._thread = threading.Thread(target=self._loop, args=(num_threads,), name="embed-batcher", daemon=True)
        self._thread.start()

    def submit(self, seqs: list[Encoded], pooling: str) -> Future:
        """Queues one request's sequences; the future gives one tensor per sequence.

        Cancel the future (``future.cancel()``) when the caller no longer wants the
        result: the sequences not yet run are dropped before the next forward.
        """
        job = EmbedJob(seqs, pooling, outputs=[None] * len(seqs), pending=list(range(len(seqs))))
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

    def _loop(self, num_threads: int | None) -> None:
        use_threads(num_threads)
        jobs: list[EmbedJob] = []
        running = True
        for turn in itertools.count():
            if running:
                running = self._take_new(jobs, block=not jobs)
            jobs = [j for j in jobs if not j.done()]  # cancelled (client gone), failed or finished
            if not jobs:
                if not running:
                    return
                continue
            self._run_one(jobs, turn)

    def _run_one(self, jobs: list[EmbedJob], turn: int) -> None:
        """Runs the one forward holding the shortest pending sequence of the least recently served job."""
        units = [(job, i) for job in jobs for i in job.pending]
        lengths = [len(job.seqs[i].ids) for job, i in units]
        first = min(jobs, key=lambda j: j.served)
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
        log.debug(
            "forward of %d sequences (longest %d) in %.1f ms",
            len(live),
            max(lengths[k] for k in group),
            (time.perf_counter() - start) * 1000.0,
        )
