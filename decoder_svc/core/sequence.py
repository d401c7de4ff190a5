"""One decoder request's state as the scheduler and block manager see it (pure Python)."""

from __future__ import annotations

import enum
import itertools
import time

from decoder_svc.core.sampling_params import SamplingParams

_arrival_counter = itertools.count()


def next_arrival_order() -> int:
    """A new place in the queues' first-come-first-served order (what a new ``Sequence`` takes)."""
    return next(_arrival_counter)


def sample_seq_id(request_id: str, index: int) -> str:
    """Scheduler id of sample / beam sequence ``index`` of ``request_id``: the request id itself
    for index 0, else ``"{request_id}\x00{index}"`` (a client id that collides with one is
    refused as a duplicate by ``DecoderEngine.add_request``)."""
    return request_id if index == 0 else f"{request_id}\x00{index}"


class SequenceStatus(enum.Enum):
    """Life cycle: WAITING_CROSS_BLOCKS -> ENCODING -> WAITING <-> RUNNING -> FINISHED_*."""

    WAITING_CROSS_BLOCKS = enum.auto()  # queued until its cross-attention KV blocks fit
    ENCODING = enum.auto()  # cross blocks reserved; the encoder service is filling them
    WAITING = enum.auto()  # cross KV present; waiting for self blocks / a batch seat
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """A request's decoder tokens, blocks and progress.

    Attributes:
        request_id: caller's id, unique among unfinished requests.
        prompt_token_ids: decoder prompt (e.g. Whisper's start-of-transcript ids).
        output_token_ids: generated tokens, end token included once sampled.
        encoder_len: cross-attention KV length (encoder output frames / tokens).
        sampling_params: how to pick each next token.
        eos_token_id: token that stops the sequence ("stop").
        max_total_len: model's max decoder length (prompt + output), e.g. 448.
        output_text: the output stage's detokenizer + stop-string matcher
            (``decoder_svc.core.detokenizer.OutputText``), or None.
        stop_reason: the stop token id or stop string that ended a "stop" sequence.
        status: a `SequenceStatus`.
        block_table: self-attention KV block ids, in order.
        cross_block_ids: cross-attention KV block ids, allocated once.
        num_computed_tokens: tokens whose self-attention K/V are in the cache.
        arrival_time: `time.monotonic()` at creation.
        arrival_order: monotonically increasing tie-breaker (preemption picks the largest); a later
            sequence of the same request (a Whisper window) may keep its first one (``next_arrival_order``).
        priority: scheduling priority, lower value = earlier (vLLM's convention);
            ties are first come first served.
        group_id: the request this sequence belongs to (``request_id`` unless it is
            one of several samples / beams of a request, ``decoder_svc.core.sequence_group``).
        index: which sample of the request (0..n-1); beams use 0 while running.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        encoder_len: int,
        sampling_params: SamplingParams,
        eos_token_id: int,
        max_total_len: int,
        priority: int = 0,
        arrival_order: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.priority = priority
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.encoder_len = encoder_len
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_total_len = max_total_len
        self.status = SequenceStatus.WAITING_CROSS_BLOCKS
        self.block_table: list[int] = []
        self.cross_block_ids: list[int] = []
        self.num_computed_tokens = 0
        self.arrival_time = time.monotonic()
        self.arrival_order = next(_arrival_counter) if arrival_order is None else arrival_order
        # Set by the output stage (``decoder_svc.core.output_processor``): the ``OutputText`` that turns
        # output tokens into streamed text and finds stop strings (None: token-level stops only).
        self.output_text = None
        # What ended a "stop": the stop token id (the end token included) or the stop string.
        self.stop_reason: int | str | None = None
        self.group_id = request_id
        self.index = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_len(self) -> int:
        """Most tokens (prompt + output) this sequence can ever hold."""
        max_tokens = self.sampling_params.max_tokens
        if max_tokens is None:
            return self.max_total_len
        return min(self.max_total_len, self.num_prompt_tokens + max_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """ "stop", "length", "abort", or None while unfinished."""
        return _FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids that end the sequence ("stop") and that ``min_tokens`` masks:
        the end token (unless ``ignore_eos``) and ``sampling_params.stop_token_ids``."""
        extra = self.sampling_params.stop_token_ids
        return extra if self.sampling_params.ignore_eos else (self.eos_token_id, *extra)

    def check_token_stop(self) -> SequenceStatus | None:
        """The finished status the last appended token implies by ids and lengths alone, or None.

        The scheduler's check: a stop token id ("stop", sets ``stop_reason`` to
        the id), then ``sampling_params.stop_criterion`` ("stop", ``stop_reason``
        its ``reason``), then the length limit (``max_tokens`` / model max length,
        "length"). Before ``min_tokens`` new tokens only the length limit can end
        the sequence (a forced end token at the model's max length ends it as "length").
        """
        if not self.output_token_ids:
            return None
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.sampling_params.min_tokens and last in self.stop_token_ids:
            self.stop_reason = last
            return SequenceStatus.FINISHED_STOPPED
        criterion = self.sampling_params.stop_criterion
        if criterion is not None and criterion(self.output_token_ids):
            self.stop_reason = getattr(criterion, "reason", "stop_criterion")
            return SequenceStatus.FINISHED_STOPPED
        if self.num_tokens >= self.max_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def update_text(self, status: SequenceStatus | None) -> SequenceStatus | None:
        """The output stage's check: detokenizes the last token into ``output_text`` and matches stop strings.

        Args:
            status: what ``check_token_stop`` decided for that token.

        Returns:
            ``status``, or FINISHED_STOPPED when the new text completed a stop
            string (``stop_reason`` = the string; it wins over a length limit
            reached by the same token). A stop token's text is kept only with
            ``include_stop_str_in_output``; at a finish the held-back text and
            trailing bytes are released.

        Raises:
            RuntimeError: ``output_text`` is None or already finished.
        """
        text = self.output_text
        if text is None:
            raise RuntimeError(f"{self.request_id!r} has no output_text")
        last = self.output_token_ids[-1]
        if status is SequenceStatus.FINISHED_STOPPED and self.stop_reason == last:  # a stop token id
            text.finish(last if self.sampling_params.include_stop_str_in_output else None)
            return status
        if status is SequenceStatus.FINISHED_STOPPED:  # the stop criterion: the last token's text is output
            text.add_token(last, check_stop=False)
            text.finish()
            return status
        matched = text.add_token(last, check_stop=self.num_output_tokens >= self.sampling_params.min_tokens)
        if matched is not None:
            self.stop_reason = matched
            return SequenceStatus.FINISHED_STOPPED
        if status is not None:
            text.finish()
        return status

    def check_stop(self) -> SequenceStatus | None:
        """Both checks in the engine's order: ``check_token_stop``, then ``update_text`` when
        ``output_text`` is set. Order: a stop token id, a stop string, the length limit."""
        status = self.check_token_stop()
        if self.output_text is not None and self.output_token_ids:
            status = self.update_text(status)
        return status

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, cross={self.cross_block_ids})"
        )
