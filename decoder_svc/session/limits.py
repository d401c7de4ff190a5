"""The decoder's request limits: how much one Generate may ask for (``--max-new-tokens``, ``--max-n``,
``--max-beams``, ``--max-input-tokens``).

``apply_request_limits`` runs in Generate once the sampling parameters and the input are parsed; a request over
a limit gets INVALID_ARGUMENT naming the field, its value, the limit and the flag that sets it. The other bounds
live where their values are parsed: audio seconds (``--max-audio-s``, ``decoder_svc.session.inputs``), the hard caps on
list lengths and ranges (``decoder_svc.core.sampling_params``), message bytes (``--max-message-bytes``, the gRPC
server), calls per client (``--max-requests-per-client``, ``shared.client_limits``). ``PriorityGate`` bounds the
priority a call may ask for (``--min-client-priority``, ``--priority-token-file``; issue 34 item 5).
"""

from __future__ import annotations

import dataclasses
import hmac

from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.session.inputs import RequestInput
from shared.config import DecoderServiceConfig
from shared.errors import InvalidRequestError, PermissionDeniedError
from shared.public_auth import MIN_TOKEN_CHARS, read_token_file

PRIORITY_TOKEN_METADATA = "x-encdec-priority-token"
# The most urgent priority even a token holder may ask for: int32's floor is left to nobody, so an operator's
# own requests (at MIN_PRIORITY) still come before any client's.
MIN_PRIORITY = -1000


class PriorityGate:
    """Which ``priority`` a call may ask for (lower = earlier; ``decoder_svc.core.scheduler``).

    Priorities from ``config.min_client_priority`` up are open to every call; a more urgent one, down to
    ``MIN_PRIORITY``, needs the token of ``config.priority_token_file`` in the call's metadata
    ``x-encdec-priority-token`` (compared in constant time).

    Raises:
        ValueError: (construction) the token file cannot be read or is not ASCII.
    """

    def __init__(self, config: DecoderServiceConfig) -> None:
        self.floor = config.min_client_priority
        path = config.priority_token_file
        token = read_token_file(path, "priority_token_file") if path else None
        if token is not None and len(token) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"priority_token_file {path!r} holds {len(token)} characters; a token needs {MIN_TOKEN_CHARS} or more"
            )
        self._token = token.encode() if token else None

    def check(self, priority: int, metadata, what: str = "request") -> None:
        """Checks a call's ``priority`` against the floor and, below it, its priority token.

        Raises:
            InvalidRequestError: more urgent than ``min_client_priority`` without a token (or no token configured),
                or than ``MIN_PRIORITY``.
            PermissionDeniedError: below the floor with a token that is not the configured one.
        """
        if priority >= self.floor:
            return
        sent = [v for k, v in (metadata or ()) if k == PRIORITY_TOKEN_METADATA]
        lowest = f"the lowest accepted is {self.floor} (--min-client-priority)"
        if not sent or self._token is None:
            hint = (
                f"; a more urgent one needs metadata {PRIORITY_TOKEN_METADATA!r} with the --priority-token-file token"
                if self._token is not None
                else ""
            )
            raise InvalidRequestError(
                f"priority {priority} is more urgent than this server lets a {what} ask for: {lowest}{hint}; send "
                f"{self.floor} or more"
            )
        value = sent[0] if isinstance(sent[0], bytes) else str(sent[0]).encode("utf-8", "replace")
        if not hmac.compare_digest(value.strip(), self._token):
            raise PermissionDeniedError(f"{PRIORITY_TOKEN_METADATA} does not match this server's --priority-token-file")
        if priority < MIN_PRIORITY:
            raise InvalidRequestError(
                f"priority {priority} is more urgent than any call may ask for: the lowest is {MIN_PRIORITY} even "
                "with the priority token"
            )


def apply_request_limits(params: SamplingParams, inp: RequestInput, config: DecoderServiceConfig) -> SamplingParams:
    """Checks one request against ``config``'s limits; returns ``params`` with the token limit applied.

    ``max_new_tokens`` > 0 refuses a larger ``sampling.max_tokens``; an unset ``max_tokens`` becomes the limit,
    except for Whisper's windowed decoding (``inp.whisper`` set), where an unset one leaves each 30 s window to
    the model's own bound and a set one counts over the whole request. 0 = the model's limit (nothing to check).

    Args:
        params: the request's parsed sampling parameters (``decoder_svc.session.convert.sampling_params_from_pb``).
        inp: its parsed input (``decoder_svc.session.inputs.parse_input``): ``input_ids`` of a text request are counted.
        config: ``max_new_tokens``, ``max_n``, ``max_beams``, ``max_input_tokens`` (0 = the model's limit).

    Raises:
        InvalidRequestError: a value above its limit (the message names both and the flag).
    """
    if params.n > config.max_n:
        raise InvalidRequestError(
            f"sampling.n is {params.n}; this server returns at most {config.max_n} samples per request (--max-n)"
        )
    if params.num_beams > config.max_beams:
        raise InvalidRequestError(
            f"sampling.num_beams is {params.num_beams}; this server searches at most {config.max_beams} beams "
            "(--max-beams)"
        )
    if config.max_input_tokens and inp.input_ids is not None and len(inp.input_ids) > config.max_input_tokens:
        raise InvalidRequestError(
            f"the source has {len(inp.input_ids)} tokens; this server accepts at most {config.max_input_tokens} "
            "(--max-input-tokens): shorten it"
        )
    limit = config.max_new_tokens
    if not limit:
        return params
    if params.min_tokens > limit:
        raise InvalidRequestError(
            f"sampling.min_tokens is {params.min_tokens}; this server generates at most {limit} tokens per sample "
            "(--max-new-tokens)"
        )
    if params.max_tokens is None:
        return params if inp.whisper is not None else dataclasses.replace(params, max_tokens=limit)
    if params.max_tokens > limit:
        raise InvalidRequestError(
            f"sampling.max_tokens is {params.max_tokens}; this server generates at most {limit} tokens per sample "
            "(--max-new-tokens)"
        )
    return params
