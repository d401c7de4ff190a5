"""Dynamic batching of encoder-only work across concurrent requests by a token budget.

A worker thread owns the model. Whenever it is free it takes every pending job
(no waiting window: a lone request runs at once, and requests that arrive while
a forward runs form the next batch), flattens their sequences, sorts them by
length so that sequences of similar length share a forward, and cuts the
sorted list into forwards of at most ``max_batch_tokens`` padded tokens
(sequences x longest). A job's future resolves once all its sequences are done;
a failed forward fails only the jobs with a sequence in it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from encoder_svc.embed_engine import EmbedEngine, Encoded

log = logging.getLogger(__name__)


@dataclass
class EmbedJob:
    """The sequences of one request and what to compute for each.

    Attributes:
        seqs: tokenized inputs.
        pooling: ``cls`` / ``mean`` / ``last``, or ``logits`` for the
            classification head (applies to every sequence of the job).
        future: resolves to a list of float32 tensors, one per sequence, in order.
    """

    seqs: list[Encoded]
    pooling: str
    future: Future = field(default_factory=Future)
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    remaining: int = 0
    failed: bool = False


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


class EmbedBatcher:
    """Runs ``EmbedJob``s on a worker thread, batching across jobs.

    Args:
        engine: the loaded encoder-only model.
        max_batch_tokens: padded-token budget of one forward.
    """

    def __init__(self, engine: EmbedEngine, max_batch_tokens: int) -> None:
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self._queue: queue.Queue[EmbedJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="embed-batcher", daemon=True)
        self._thread.start()

    def submit(self, seqs: list[Encoded], pooling: str) -> Future:
        """Queues one request's sequences; the future gives one tensor per sequence."""
        job = EmbedJob(seqs, pooling, outputs=[None] * len(seqs), remaining=len(seqs))
        if not seqs:
            job.future.set_result([])
        else:
            self._queue.put(job)
        return job.future

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _take_pending(self) -> list[EmbedJob] | None:
        first = self._queue.get()
        if first is None:
            return None
        jobs = [first]
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)
                break
            jobs.append(job)
        return [j for j in jobs if j.future.set_running_or_notify_cancel()]

    def _loop(self) -> None:
        while (jobs := self._take_pending()) is not None:
            if jobs:
                self._run(jobs)

    def _run(self, jobs: list[EmbedJob]) -> None:
        units = [(job, i) for job in jobs for i in range(len(job.seqs))]
        lengths = [len(job.seqs[i].ids) for job, i in units]
        for group in plan_forwards(lengths, self.max_batch_tokens):
            members = [units[k] for k in group]
            live = [(job, i) for job, i in members if not job.failed]
            if not live:
                continue
            start = time.perf_counter()
            try:
                outs = self.engine.forward([job.seqs[i] for job, i in live], [job.pooling for job, _ in live])
            except Exception as exc:
                log.exception("encoder-only forward failed")
                for job, _ in live:
                    if not job.failed:
                        job.failed = True
                        job.future.set_exception(exc)
                continue
            for (job, i), out in zip(live, outs):
                job.outputs[i] = out
                job.remaining -= 1
                if job.remaining == 0:
                    job.future.set_result(job.outputs)
            log.debug("forward of %d sequences (longest %d) in %.1f ms", len(live), max(lengths[k] for k in group),
                      (time.perf_counter() - start) * 1000.0)
