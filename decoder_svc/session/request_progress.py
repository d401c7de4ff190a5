"""A Generate request's bookkeeping, without I/O: token counts over its samples (and a Whisper request's
windows), and ``--stream-interval`` merging of its stream messages.

``decoder_svc.session.request_session.RequestSession`` owns one ``RequestProgress``
and one ``StreamCoalescer`` per request (the rules they follow are in that
module's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decoder_svc.core.engine import RequestOutput
from decoder_svc.session.inputs import RequestInput
from shared.proto import decoder_pb2


@dataclass
class RequestProgress:
    """Where a request stands: its current window and its token counts.

    ``input`` is what Encode sends (a Whisper session's current window);
    ``window`` counts the windows encoded before it and ``base_*`` the tokens
    of the sequences before the current one (``decoder_svc.session.whisper_session``);
    ``prompt_tokens`` / ``completion_tokens`` / ``encoder_tokens`` are the request's totals.
    """

    input: RequestInput
    prompt_tokens: int = 0
    completion_tokens: int = 0
    window: int = 0
    base_prompt_tokens: int = 0
    base_completion_tokens: int = 0
    encoder_tokens: int = 0
    sample_completion: dict[int, int] = field(default_factory=dict)  # n > 1 / beams: completion tokens per index

    def usage(self) -> dict[str, int]:
        """Token counts as of the last output (recorded on abort and failure too)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}

    def count(self, item: RequestOutput) -> None:
        """Request totals from a window's output (the Abort RPC's output already carries the totals)."""
        if item.finish_reason != "abort":
            self.sample_completion[item.index] = item.completion_tokens  # n > 1: summed over the samples
            self.prompt_tokens = self.base_prompt_tokens + item.prompt_tokens
            self.completion_tokens = self.base_completion_tokens + sum(self.sample_completion.values())


class StreamCoalescer:
    """``--stream-interval``: one request's GenerateResponse messages merged until ``interval`` new tokens are held.

    A sample's first message and its final one go out at once (time to first token and the finish are never
    delayed); in between, messages are merged (text concatenated, token ids and logprobs appended, the rest
    from the newest) per sample index. ``interval`` 1 sends every message as it comes.
    """

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.held: dict[int, decoder_pb2.GenerateResponse] = {}
        self.held_tokens: dict[int, int] = {}
        self.started: set[int] = set()

    def add(
        self, message: decoder_pb2.GenerateResponse, new_tokens: int, final: bool
    ) -> decoder_pb2.GenerateResponse | None:
        """The message to send now (``message`` merged into what was held for its index), or None (held)."""
        index = message.index
        held = self.held.pop(index, None)
        if held is not None:
            text = held.text + message.text
            held.MergeFrom(message)  # appends repeated fields; the newest set scalars win
            held.text, message = text, held
        tokens = self.held_tokens.pop(index, 0) + new_tokens
        if self.interval <= 1 or final or index not in self.started or tokens >= self.interval:
            self.started.add(index)
            return message
        self.held[index], self.held_tokens[index] = message, tokens
        return None
