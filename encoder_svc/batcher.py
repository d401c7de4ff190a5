"""Batches pending Encode requests into one encoder forward and hands off cross KV."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.compute_thread import use_threads
from shared.device import model_device
from shared.errors import UnavailableError
from shared.kv_transport import CrossKVWriter, KVTargetSpec

log = logging.getLogger(__name__)

# Seconds before the Encode call's gRPC deadline after which the encoder no longer starts a cross-KV write.
# The decoder frees the reserved blocks at the deadline; a write has this long to finish (an 18 MB shm write
# takes a small fraction of it: docs/benchmarks.md, Measurements formerly in docstrings). A write stalled longer
# than this (e.g. the process stopped mid-copy) is not covered.
WRITE_MARGIN_S = 0.5
ANSWER_HOLD_S = 0.02  # longest a written item's answer waits for the batch's next writes


@dataclass
class EncodeItem:
    """One pending Encode request.

    Attributes:
        request_id: the decoder's request id.
        pcm: float32 mono samples at the model's sample rate, ``[N]`` (audio models; else None).
        spec: where the cross KV goes.
        block_ids: the decoder's reserved cross blocks, in token order.
        input_ids: source token ids (text models; else None).
        features: ``[num_mel_bins, 3000]`` float32 log-mel features sent instead of ``pcm`` (else None).
        transfer_id: the transfer the decoder announced (torch_dist; else 0).
        write_deadline: ``time.monotonic()`` after which the cross KV must not be
            written (None: no limit). Set from the Encode call's gRPC deadline
            less ``WRITE_MARGIN_S``: the decoder frees the reserved blocks when
            that deadline passes, so a write that starts later could land in
            blocks another request owns by then (shm and cuda_ipc write in place).
        future: resolves to ``(encoder_len, encode_ms, batch_size, TransferStats)`` or an error.
        order: the sort key of its Generate request (``encoder_svc.server.encode_order``): pending items are
            taken lowest first, ties in submission order.
    """

    request_id: str
    pcm: np.ndarray | None
    spec: KVTargetSpec
    block_ids: list[int]
    input_ids: list[int] | None = None
    features: np.ndarray | None = None
    transfer_id: int = 0
    write_deadline: float | None = None
    future: Future = field(default_factory=Future)
    order: tuple = ()

    def past_write_deadline(self) -> bool:
        return self.write_deadline is not None and time.monotonic() > self.write_deadline


class EncodeBatcher:
    """A worker thread that runs the encoder over batches of pending requests.

    The first pending request waits for others until none has arrived for
    ``batch_wait_ms`` (each arrival extends the window, so a burst that
    reaches the encoder over ~100 ms becomes one batch instead of a lone first
    request and the rest: a batched forward costs far less than one forward
    per source; measured: docs/benchmarks.md, Measurements formerly in
    docstrings), never more than ``max_batch_wait_ms`` in all
    (the dynamic batching of Triton Inference Server's ``max_queue_delay``, with
    the delay counted from the latest arrival);
    up to ``max_batch_size`` run in one forward, within ``max_batch_tokens``
    padded encoder positions (requests x the longest: a source's token count,
    an audio window's ``max_source_positions``, 1500 for Whisper). A request
    that would overflow the budget opens the next batch. Per request: log-mel
    features (audio) or padded source ids (text), encoder, every decoder layer's cross-attention K/V projection,
    then ``writer.write`` into the decoder's blocks. A failure in one request's
    write fails only that request.

    Features and source ids are built on the CPU and moved to the model's
    device (``shared.device.model_device``); the cross KV stays there and each
    writer copies it where its transport needs it (host memory for shm and
    gloo, a device copy for cuda_ipc).

    Args:
        model: exposes ``encode``, ``compute_cross_kv`` (see
            ``shared.models.whisper``) and ``features(pcm)``.
        writer: the KV transport's encoder-side writer.
        max_batch_size: most requests per forward.
        batch_wait_ms: how long the batch waits for the next request (milliseconds).
        max_batch_wait_ms: the longest the first request waits in all (milliseconds;
            None: ``batch_wait_ms``, a fixed window).
        max_batch_tokens: most padded encoder positions per forward (None: no
            limit); a single longer request still runs, alone.
        num_threads: torch intra-op threads of the batcher thread
            (``shared.compute_thread``); None keeps the process setting.
        warm_up: run once on the batcher thread before the first batch (first-call
            costs); the constructor returns when it is done and raises what it raised.
    """

    def __init__(
        self,
        model,
        featurize,
        writer: CrossKVWriter,
        max_batch_size: int,
        batch_wait_ms: float,
        num_threads: int | None = None,
        warm_up: Callable[[], None] | None = None,
        max_batch_tokens: int | None = None,
        max_batch_wait_ms: float | None = None,
    ) -> None:
        self.model = model
        self.device = model_device(model)
        self.featurize = featurize
        self.writer = writer
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.max_batch_wait_s = max(batch_wait_ms, max_batch_wait_ms if max_batch_wait_ms is not None else 0.0) / 1000.0
        self.max_batch_tokens = max_batch_tokens
        self._carried: EncodeItem | None = None  # took the queue's next item, but it opens the next batch
        # (order, submission count, item); the stop sentinel None sorts after every item
        self._queue: queue.PriorityQueue[tuple] = queue.PriorityQueue()
        self._submitted = itertools.count()
        self._started: Future = Future()
        self._in_flight = 0  # items submitted and not answered (the registry's load, ``in_flight``)
        self._in_flight_lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._loop, args=(num_threads, warm_up), name="encode-batcher", daemon=True
        )
        self._thread.start()
        self._started.result()  # the warm-up's exception, if any

    def submit(self, item: EncodeItem) -> Future:
        with self._in_flight_lock:
            self._in_flight += 1
        item.future.add_done_callback(self._done)
        self._put(item)
        return item.future

    def _put(self, item: EncodeItem | None) -> None:
        key = (0, item.order) if item is not None else (1, ())
        self._queue.put((key, next(self._submitted), item))

    def _get(self, timeout: float | None = None) -> EncodeItem | None:
        return self._queue.get(timeout=timeout)[2]

    @property
    def in_flight(self) -> int:
        """Items queued or running (submitted, not yet answered or cancelled); safe from any thread."""
        return self._in_flight

    def _done(self, _future: Future) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1

    def stop(self) -> None:
        self._put(None)
        self._thread.join(timeout=10)

    def _positions(self, item: EncodeItem) -> int:
        """Encoder positions ``item`` takes in a padded batch."""
        return len(item.input_ids) if item.input_ids is not None else self.model.config.max_source_positions

    def _next_batch(self) -> list[EncodeItem] | None:
        first, self._carried = self._carried or self._get(), None
        if first is None:
            return None
        batch, longest = [first], self._positions(first)
        start = time.monotonic()
        last_call = start + self.max_batch_wait_s
        deadline = min(start + self.batch_wait_s, last_call)
        while len(batch) < self.max_batch_size:
            try:
                item = self._get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                self._put(None)
                break
            widest = max(longest, self._positions(item))
            if self.max_batch_tokens is not None and (len(batch) + 1) * widest > self.max_batch_tokens:
                self._carried = item
                break
            batch.append(item)
            longest = widest
            deadline = min(time.monotonic() + self.batch_wait_s, last_call)  # an arrival keeps the window open
        return batch

    def _loop(self, num_threads: int | None, warm_up: Callable[[], None] | None) -> None:
        use_threads(num_threads)
        try:
            if warm_up is not None:
                warm_up()
        except BaseException as exc:  # noqa: BLE001 - raised again by the constructor
            self._started.set_exception(exc)
            return
        self._started.set_result(None)
        while (batch := self._next_batch()) is not None:
            batch = [item for item in batch if item.future.set_running_or_notify_cancel()]
            if batch:
                self._run(batch)

    def _forward(self, batch: list[EncodeItem]) -> tuple[torch.Tensor, list[int]]:
        """Encoder + cross-KV projection of a batch: ``([L, 2, B, S, H, D], encoder_len of each item)``.

        Audio: stacked log-mel features, every item ``S`` long. Text: source ids
        right-padded to the longest with an attention mask; item ``i`` owns the
        first ``len(input_ids_i)`` positions.
        """
        with torch.inference_mode():
            if batch[0].input_ids is not None:
                lens = [len(item.input_ids) for item in batch]
                ids = torch.zeros(len(batch), max(lens), dtype=torch.long)  # [B, S]
                for i, item in enumerate(batch):
                    ids[i, : lens[i]] = torch.tensor(item.input_ids, dtype=torch.long)
                mask = (torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]).long()  # [B, S]
                encoder_out = self.model.encode(ids.to(self.device), mask.to(self.device))  # [B, S, d_model]
            else:
                features = torch.stack(
                    [
                        self.featurize(item.pcm) if item.features is None else torch.from_numpy(item.features)
                        for item in batch
                    ]
                ).to(self.device)  # [B, n_mels, frames]
                encoder_out = self.model.encode(features)  # [B, S, d_model]
                lens = [encoder_out.shape[1]] * len(batch)
            return self.model.compute_cross_kv(encoder_out), lens  # [L, 2, B, S, H, D]

    def _write(
        self, item: EncodeItem, cross_kv: torch.Tensor, encoder_len: int, start: float, batch_size: int
    ) -> tuple | BaseException:
        """Writes one item's cross KV (``[L, 2, encoder_len, H, D]``); returns its future's result, or the error."""
        try:
            if item.past_write_deadline():
                raise _too_late(item)
            stats = self.writer.write(item.spec, item.block_ids, cross_kv, item.transfer_id)
        except Exception as exc:  # noqa: BLE001 - fail this request only
            log.info("cross KV for %s not delivered (%s): %s", item.request_id, item.spec.transport, exc)
            return exc
        log.info(
            "cross KV for %s: %d bytes in %.2f ms (%.2f GB/s, %s)",
            item.request_id,
            stats.nbytes,
            stats.ms,
            stats.gb_per_s,
            item.spec.transport,
        )
        return encoder_len, (time.perf_counter() - start) * 1000.0, batch_size, stats

    def _run(self, batch: list[EncodeItem]) -> None:
        start = time.perf_counter()
        for item in [item for item in batch if item.past_write_deadline()]:  # its decoder gave up: skip the forward
            item.future.set_exception(_too_late(item))
            batch.remove(item)
        if not batch:
            return
        try:
            cross_kv, lens = self._forward(batch)
        except Exception as exc:  # noqa: BLE001 - every waiting request must hear of it
            log.exception("encoder forward failed")
            for item in batch:
                item.future.set_exception(exc)
            return
        # Answers are held while the next writes run, up to ANSWER_HOLD_S: each answer wakes the event loop thread,
        # which then competed with the remaining writes for the GIL (32 t5-small writes interleaved with their answers
        # were slow: docs/benchmarks.md, Measurements formerly in docstrings). A slow target (torch_dist) therefore
        # delays the others' answers by at most the hold.
        held: list[tuple[EncodeItem, tuple | BaseException]] = []
        held_since = time.perf_counter()
        try:
            for i, item in enumerate(batch):
                held.append((item, self._write(item, cross_kv[:, :, i, : lens[i]], lens[i], start, len(batch))))
                if time.perf_counter() - held_since > ANSWER_HOLD_S:
                    _answer(held)
                    held_since = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - an error outside a write: every request not yet answered hears of it
            log.exception("cross KV delivery failed")
            answered = {id(item) for item, _ in held} | {id(item) for item in batch if item.future.done()}
            held += [(item, exc) for item in batch if id(item) not in answered]
        finally:
            _answer(held)
        log.debug("encoded %d requests in %.1f ms", len(batch), (time.perf_counter() - start) * 1000.0)


def _answer(held: list[tuple[EncodeItem, tuple | BaseException]]) -> None:
    """Sets each held future to its result or exception, and empties ``held``."""
    for item, result in held:
        if isinstance(result, BaseException):
            item.future.set_exception(result)
        else:
            item.future.set_result(result)
    held.clear()


def _too_late(item: EncodeItem) -> UnavailableError:
    return UnavailableError(
        f"cross KV for {item.request_id} not written: the Encode call's deadline (less "
        f"{WRITE_MARGIN_S:g} s) passed; the decoder has released its blocks"
    )
