"""Conversion between the decoder's public proto messages (``encdec.v1`` DecoderService) and its own types.

Into the service: ``SamplingParams`` from its proto. Out of it: one
``GenerateResponse`` per stream message (text delta, token ids, logprobs
with each token's text, finish / stop reason, usage on the request's last
message), a ``RequestRecord`` from the Redis record, ``DecoderStats`` from the
engine's stats. No I/O; the one state is ``TokenTexts``' cache of token texts
by id (one per tokenizer, held by ``decoder_svc.session.sessions.Sessions``). The servicer
and the request session call these.
"""

from __future__ import annotations

import functools
import json

from google.protobuf.descriptor import FieldDescriptor

from decoder_svc.core.engine import RequestOutput
from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.replicas.request_state import RequestRecord
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

# DecoderStats field type -> the cast of its value (every other field is a count: int).
_STATS_CASTS = {FieldDescriptor.TYPE_DOUBLE: float, FieldDescriptor.TYPE_STRING: str}


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
    request_id: str, item: RequestOutput, text: str, finish_reason: str | None, token_texts: TokenTexts
) -> decoder_pb2.GenerateResponse:
    """One stream message for ``item``: its new tokens (and logprobs), ``text`` as streamed, its sample index.

    Args:
        text: the text delta to send (``item.text`` with a window-joining space, if any).
        finish_reason: "stop" / "length" / "abort" on the sample's last message (then ``item.stop_reason``
            becomes ``stop_str`` or ``stop_token_id``); None on the others.
        token_texts: the logprobs' token texts (``Logprobs.token``); only called when ``item`` has logprobs.
    """
    message = decoder_pb2.GenerateResponse(
        request_id=request_id, text=text, token_ids=item.new_token_ids, index=item.index, score=item.score
    )
    if item.logprobs:
        message.logprobs.extend(logprobs_pb(lp, token_texts) for lp in item.logprobs)
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


class TokenTexts:
    """Each token's text on its own, as vLLM's OpenAI logprobs give it (``Logprobs.token``), cached by id.

    The text is ``tokenizer.decode([token_id])`` with special tokens kept
    ("</s>", "<|endoftext|>"), as vLLM's ``convert_ids_list_to_tokens``
    (``vllm/tokenizers/detokenizer_utils.py``), with the leading space a
    SentencePiece word-start marker stands for put back: T5 / mBART / Marian's
    "▁cat" decodes alone to "cat", and ``convert_tokens_to_string(["▁cat"])``
    gives "cat" too (the Metaspace decoder drops the first token's prefix
    space), so neither HF call keeps it; as vLLM's ``_restore_leading_spaces``,
    each marker leading the vocabulary piece (``convert_ids_to_tokens``) that
    decode dropped becomes a space: " cat". Byte-level BPE (BART, Whisper)
    keeps its space through decode ("Ġcat" -> " cat") and its pieces never hold
    "▁" (U+2581 is three bytes there). A byte-level token holding part of a
    multi-byte UTF-8 character decodes to U+FFFD; unlike vLLM's
    ``_verify_tokens`` it is not rebuilt from the preceding tokens. An id the
    tokenizer does not know (a model's padded vocabulary rows) is "".

    A decode runs on the event loop and a step names up to 21 tokens per
    sequence (``top_logprobs`` <= 20), so texts are cached by id (LRU,
    ``max_cached`` ids). Built once per tokenizer;
    nothing is decoded for requests without logprobs.

    Args:
        tokenizer: the engine's HF tokenizer (``DecoderEngine.tokenizer``).
        max_cached: most token texts kept (the vocabulary when it is smaller).
    """

    def __init__(self, tokenizer, max_cached: int = 1 << 16) -> None:
        self.tokenizer = tokenizer
        self.marker = _word_start_marker(tokenizer)
        self.text = functools.lru_cache(maxsize=max_cached)(self._decode)

    def _decode(self, token_id: int) -> str:
        try:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False) or ""
        except IndexError:  # a SentencePiece processor refuses ids past its vocabulary (fast tokenizers give "")
            return ""
        if self.marker is None:
            return text
        piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
        missing = (len(piece) - len(piece.lstrip(self.marker))) - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text


def _word_start_marker(tokenizer) -> str | None:
    """The character a tokenizer's pieces carry for a preceding space, when decode drops it: a fast tokenizer's
    Metaspace pre-tokenizer's ``replacement`` (SentencePiece's "▁"), "▁" for a Python SentencePiece tokenizer
    (Marian); None for byte-level BPE and the others."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "\u2581" if _holds_sentencepiece(tokenizer) else None
    pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    for step in [pre, *pre.get("pretokenizers", [])]:
        if step.get("type") == "Metaspace":
            return step.get("replacement", "\u2581")
    return None


def _holds_sentencepiece(tokenizer) -> bool:
    return any(type(v).__module__.startswith("sentencepiece") for v in getattr(tokenizer, "__dict__", {}).values())


def logprobs_pb(lp, token_texts: TokenTexts) -> decoder_pb2.Logprobs:
    """``decoder_svc.core.sampler.TokenLogprobs`` -> its proto message, each token with its text (``token_texts``)."""
    text = token_texts.text
    return decoder_pb2.Logprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        token=text(lp.token_id),
        top=[decoder_pb2.TokenLogprob(token_id=t, logprob=v, token=text(t)) for t, v in lp.top],
    )


def request_record_pb(record: RequestRecord) -> decoder_pb2.RequestRecord:
    """The Redis record (``decoder_svc.replicas.request_state``) as GetRequest returns it; unset counts are 0."""
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
        owner=record.owner or "",
        audio_bytes=record.audio_bytes or 0,
        finals=record.finals or 0,
    )


def stats_pb(stats: dict) -> decoder_pb2.DecoderStats:
    """``DecoderEngine.stats()`` (plus the servicer's entries: ``max_concurrent_requests``, the admission queue's
    ``AdmissionQueue.stats()``, the served model's ``model`` / ``served_model_names`` / ``input_kind``) ->
    ``DecoderStats``; keys the proto lacks are dropped, counts become ints, the waits (``*_s``, seconds) floats,
    the model fields strings (``served_model_names`` a list of them)."""
    fields = decoder_pb2.DecoderStats.DESCRIPTOR.fields_by_name

    def cast(name: str, v):
        f = fields[name]
        one = _STATS_CASTS.get(f.type, int)
        return [one(x) for x in v] if f.is_repeated else one(v)

    return decoder_pb2.DecoderStats(**{k: cast(k, v) for k, v in stats.items() if k in fields})


def check_request_id(request_id: str) -> None:
    """Refuses a client-chosen request id over ``MAX_REQUEST_ID_LEN`` characters or with a character that is not
    printable (a newline would forge log lines; the id is also a Redis key).

    Raises:
        InvalidRequestError: naming the length and the limit, or the first such character's position.
    """
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequestError(f"request_id is {len(request_id)} characters; the limit is {MAX_REQUEST_ID_LEN}")
    bad = next((i for i, c in enumerate(request_id) if not c.isprintable()), None)
    if bad is not None:
        raise InvalidRequestError(
            f"request_id has a character that is not printable at position {bad} ({request_id[bad]!r}); use "
            "letters, digits and punctuation"
        )


def shown_request_id(request_id: str) -> str:
    """``request_id`` as an error message shows it: cut at ``MAX_REQUEST_ID_LEN`` characters."""
    return request_id if len(request_id) <= MAX_REQUEST_ID_LEN else request_id[:MAX_REQUEST_ID_LEN] + "..."
