"""The server events of ``GET /v1/realtime`` from the decoder's ``TranscribeStream`` events (``Translator``), and the
client events' envelope (``parse_client_event``, ``decode_audio``, ``error_event``). Pure functions, no I/O: the
route (``gateway_svc.routes.realtime``) does that; the session settings are ``gateway_svc.realtime_session``.

OpenAI-style clients get OpenAI's events (``input_audio_buffer.speech_started`` ...,
``conversation.item.input_audio_transcription.delta`` / ``.completed``), vLLM-style ones vLLM's
(``transcription.delta``); ``transcription.done`` ends every stream a final commit closed. Event shapes:
https://platform.openai.com/docs/api-reference/realtime-server-events (beta and GA) and vLLM's
``vllm/entrypoints/openai/realtime/protocol.py``.
"""

from __future__ import annotations

import base64
import binascii
import uuid

import orjson

from gateway_svc.errors import GatewayError, error_body
from shared.proto import decoder_pb2

PARTIAL = "conversation.item.input_audio_transcription.partial"  # our extension: unstable text, replaced


class EventError(GatewayError):
    """A client event the gateway refuses: an ``error`` event, the session goes on."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(400, message, param, code)


def new_id(prefix: str) -> str:
    """OpenAI-style ids: ``event_...``, ``item_...``, ``sess_...``."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def event(kind: str, **fields) -> dict:
    """A server event: its ``type``, a fresh ``event_id``, then ``fields``."""
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(err: GatewayError, client_event_id: str | None = None) -> dict:
    """OpenAI's ``error`` event for ``err`` (``error.event_id``: the client event at fault, if known)."""
    return event(
        "error",
        error={**error_body(err.status, err.message, err.param, err.code)["error"], "event_id": client_event_id},
    )


def close_code(status: int) -> int:
    """The WebSocket close code after a fatal error of HTTP ``status``: 1013 (try again later) for 429 / 503,
    1008 (policy violation) for the client's other errors, 1011 (internal error) for the server's."""
    if status in (429, 503):
        return 1013
    return 1008 if status < 500 else 1011


def parse_client_event(text: str) -> dict:
    """A client event's JSON object, with a string ``type``.

    Raises:
        EventError: not JSON, not an object, no ``type``.
    """
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise EventError(f"the event is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("type"), str):
        raise EventError("an event is a JSON object with a string 'type'", "type", "invalid_event")
    return parsed


def decode_audio(client_event: dict) -> bytes:
    """The PCM bytes of an ``input_audio_buffer.append``.

    Raises:
        EventError: ``audio`` missing, not a string or not base64.
    """
    audio = client_event.get("audio")
    if not isinstance(audio, str):
        raise EventError("input_audio_buffer.append needs 'audio': base64 of PCM16 samples", "audio")
    try:
        return base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise EventError("audio is not valid base64", "audio", "invalid_base64") from None


def done_event(text: str, usage: decoder_pb2.Usage | None = None) -> dict:
    """vLLM's ``transcription.done``: a stream's whole text and its token usage (vLLM's ``UsageInfo`` names; the
    encoder positions are the prompt)."""
    usage = usage or decoder_pb2.Usage()
    tokens = {"prompt_tokens": usage.encoder_tokens, "completion_tokens": usage.completion_tokens}
    tokens["total_tokens"] = tokens["prompt_tokens"] + tokens["completion_tokens"]
    return event("transcription.done", text=text, usage=tokens)


class Translator:
    """One stream's decoder events -> the client's server events.

    ``style`` "openai": per utterance (one conversation item) ``input_audio_buffer.speech_started`` /
    ``.speech_stopped``, ``input_audio_buffer.committed`` (at the VAD's stop, else just before the transcript),
    ``conversation.item.input_audio_transcription.delta`` for each final segment (append-only), ``.completed``
    with the utterance's text. ``style`` "vllm": ``transcription.delta`` for each final only. Both: ``PARTIAL``
    events when ``partials`` (the running utterance's unstable text after its deltas; each replaces the last) and
    ``transcription.done`` (every final's text, token usage) at the stream's ``end``.

    Args:
        previous_item_id: the last item of the socket's previous stream (``committed``'s ``previous_item_id``).
    """

    def __init__(self, style: str, partials: bool, previous_item_id: str | None = None) -> None:
        self.style, self.partials = style, partials
        self.last_item_id = previous_item_id  # the item committed last
        self._items: dict[int, str] = {}  # decoder utterance -> item id
        self._committed: set[int] = set()
        self._spoken: set[int] = set()  # utterances with a delta sent (the first is stripped of its space)
        self._finals: list[str] = []  # every final's text, as the decoder sent it

    def events(self, response: decoder_pb2.TranscribeStreamResponse) -> list[dict]:
        """The server events for one decoder message (none for ``started``, or what the style leaves out)."""
        kind = response.WhichOneof("event")
        u = response.utterance
        if kind == "end":
            return [done_event("".join(self._finals).strip(), response.end.usage)]
        if kind == "final":
            return self._final(u, response.final.text)
        if kind == "partial":
            if not self.partials:
                return []
            text = response.partial.text if self._key(u) in self._spoken else response.partial.text.lstrip()
            return [event(PARTIAL, item_id=self._item(u), content_index=0, text=text)]
        if self.style == "vllm" or kind == "started":
            return []
        if kind == "speech_started":
            ms = round(response.speech_started.audio_s * 1000)
            return [event("input_audio_buffer.speech_started", audio_start_ms=ms, item_id=self._item(u))]
        if kind == "speech_stopped":
            ms = round(response.speech_stopped.audio_s * 1000)
            return [
                event("input_audio_buffer.speech_stopped", audio_end_ms=ms, item_id=self._item(u)),
                *self._commit(u),
            ]
        if kind == "utterance_done":
            done = response.utterance_done
            usage = {"type": "duration", "seconds": round(max(done.end - done.start, 0.0), 3)}
            completed = event(
                "conversation.item.input_audio_transcription.completed",
                item_id=self._item(u),
                content_index=0,
                transcript=done.text.strip(),
                usage=usage,
            )
            return [*self._commit(u), completed]
        return []

    def _final(self, u: int, text: str) -> list[dict]:
        self._finals.append(text)
        key = self._key(u)
        delta = text if key in self._spoken else text.lstrip()
        if not delta:
            return []
        self._spoken.add(key)
        if self.style == "vllm":
            return [event("transcription.delta", delta=delta)]
        kind = "conversation.item.input_audio_transcription.delta"
        return [event(kind, item_id=self._item(u), content_index=0, delta=delta)]

    def _key(self, u: int) -> int:
        return -1 if self.style == "vllm" else u  # vLLM's text is one per stream, OpenAI's one per item

    def _item(self, u: int) -> str:
        if u not in self._items:
            self._items[u] = new_id("item")
        return self._items[u]

    def _commit(self, u: int) -> list[dict]:
        if u in self._committed:
            return []
        self._committed.add(u)
        previous, self.last_item_id = self.last_item_id, self._item(u)
        return [event("input_audio_buffer.committed", item_id=self.last_item_id, previous_item_id=previous)]
