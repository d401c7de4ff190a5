"""Conversion between the decoder's public proto messages (``encdec.v1`` DecoderService) and its own types.

Into the service: ``SamplingParams`` from its proto. Out of it: one
``GenerateResponse`` per stream message (text delta, token ids, logprobs,
finish / stop reason, usage on the request's last message), a
``RequestRecord`` from the Redis record, ``DecoderStats`` from the engine's
stats. No I/O and no state: the servicer and the request session call these.
"""

from __future__ import annotations

from decoder_svc.engine import RequestOutput
from decoder_svc.request_state import RequestRecord
from decoder_svc.sampling_params import SamplingParams
from shared.errors import InvalidRequestError
from shared.proto import decoder_pb2

# Every field of the SamplingParams proto message; a test checks the two sets cover it.
_SCALAR_SAMPLING_FIELDS = frozenset(
    {
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "max_tokens",
        "min_tokens",
        "ignore_eos",
        "min_p",
        "repetition_penalty",
        "no_repeat_ngram_size",
        "include_stop_str_in_output",
        "logprobs",
        "top_logprobs",
        "n",
        "num_beams",
        "length_penalty",
        "early_stopping",
    }
)
_REPEATED_SAMPLING_FIELDS = frozenset({"stop", "stop_token_ids"})

FINISH_REASONS = {
    "stop": decoder_pb2.FINISH_REASON_STOP,
    "length": decoder_pb2.FINISH_REASON_LENGTH,
    "abort": decoder_pb2.FINISH_REASON_ABORT,
}

MAX_REQUEST_ID_LEN = 256  # characters of a client-chosen request id


def sampling_params_from_pb(pb: decoder_pb2.SamplingParams, vocab_size: int) -> SamplingParams:
    """Proto -> ``SamplingParams``; unset fields keep their defaults.

    Every field of the proto message must be listed in ``_SCALAR_SAMPLING_FIELDS``
    or ``_REPEATED_SAMPLING_FIELDS``: an unknown one (added to the proto but not
    implemented) is refused, never ignored.

    Args:
        pb: the request's ``sampling`` message.
        vocab_size: the model's vocabulary size (``stop_token_ids`` must lie below it).

    Raises:
        InvalidRequestError: a field out of range (the message names it) or not implemented.
    """
    unknown = sorted({f.name for f, _ in pb.ListFields()} - _SCALAR_SAMPLING_FIELDS - _REPEATED_SAMPLING_FIELDS)
    if unknown:
        raise InvalidRequestError(f"sampling.{unknown[0]} is not supported by this server; leave it unset")
    kwargs = {f: getattr(pb, f) for f in _SCALAR_SAMPLING_FIELDS if pb.HasField(f)}
    kwargs.update({f: tuple(getattr(pb, f)) for f in _REPEATED_SAMPLING_FIELDS})
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        raise InvalidRequestError(f"sampling: {exc}") from exc
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"sampling.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
    return params


def generate_response(
    request_id: str, item: RequestOutput, text: str, finish_reason: str | None
) -> decoder_pb2.GenerateResponse:
    """One stream message for ``item``: its new tokens (and logprobs), ``text`` as streamed, its sample index.

    Args:
        text: the text delta to send (``item.text`` with a window-joining space, if any).
        finish_reason: "stop" / "length" / "abort" on the sample's last message (then ``item.stop_reason``
            becomes ``stop_str`` or ``stop_token_id``); None on the others.
    """
    message = decoder_pb2.GenerateResponse(
        request_id=request_id, text=text, token_ids=item.new_token_ids, index=item.index, score=item.score
    )
    if item.logprobs:
        message.logprobs.extend(logprobs_pb(lp) for lp in item.logprobs)
    if finish_reason is not None:
        message.finish_reason = FINISH_REASONS[finish_reason]
        if isinstance(item.stop_reason, str):
            message.stop_str = item.stop_reason
        elif item.stop_reason is not None:
            message.stop_token_id = item.stop_reason
    return message


def add_usage(
    message: decoder_pb2.GenerateResponse, usage: dict[str, int], encoder_tokens: int, applied: list[str]
) -> None:
    """Completes the request's last message: token counts and the generation defaults in effect.

    Args:
        usage: ``{"prompt_tokens": ..., "completion_tokens": ...}`` over the request (all windows and samples).
        encoder_tokens: cross-attention KV positions over the request's windows.
        applied: ``RequestInput.applied``.
    """
    message.usage.CopyFrom(decoder_pb2.Usage(encoder_tokens=encoder_tokens, **usage))
    message.applied_generation_defaults.extend(applied)


def logprobs_pb(lp) -> decoder_pb2.Logprobs:
    """``decoder_svc.sampler.TokenLogprobs`` -> its proto message."""
    return decoder_pb2.Logprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[decoder_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def request_record_pb(record: RequestRecord) -> decoder_pb2.RequestRecord:
    """The Redis record (``decoder_svc.request_state``) as GetRequest returns it; unset counts are 0."""
    return decoder_pb2.RequestRecord(
        request_id=record.request_id,
        state=getattr(decoder_pb2, f"REQUEST_STATE_{record.state.name}"),
        model=record.model,
        created_at=record.created_at,
        updated_at=record.updated_at,
        prompt_tokens=record.prompt_tokens or 0,
        completion_tokens=record.completion_tokens or 0,
        finish_reason=record.finish_reason or "",
        error=record.error or "",
    )


def stats_pb(stats: dict) -> decoder_pb2.DecoderStats:
    """``DecoderEngine.stats()`` (plus the servicer's entries: ``max_concurrent_requests``, the admission queue's
    ``AdmissionQueue.stats()``) -> ``DecoderStats``; keys the proto lacks are dropped, counts become ints and the
    waits (``*_s``, seconds) stay floats."""
    fields = decoder_pb2.DecoderStats.DESCRIPTOR.fields_by_name
    double = fields["oldest_queue_wait_s"].type  # FieldDescriptor.TYPE_DOUBLE
    return decoder_pb2.DecoderStats(
        **{k: float(v) if fields[k].type == double else int(v) for k, v in stats.items() if k in fields}
    )


def shown_request_id(request_id: str) -> str:
    """``request_id`` as an error message shows it: cut at ``MAX_REQUEST_ID_LEN`` characters."""
    return request_id if len(request_id) <= MAX_REQUEST_ID_LEN else request_id[:MAX_REQUEST_ID_LEN] + "..."
