"""The decoder's request limits: how much one Generate may ask for (``--max-new-tokens``, ``--max-n``,
``--max-beams``, ``--max-input-tokens``).

``apply_request_limits`` runs in Generate once the sampling parameters and the input are parsed; a request over
a limit gets INVALID_ARGUMENT naming the field, its value, the limit and the flag that sets it. The other bounds
live where their values are parsed: audio seconds (``--max-audio-s``, ``decoder_svc.session.inputs``), the hard caps on
list lengths and ranges (``decoder_svc.core.sampling_params``), message bytes (``--max-message-bytes``, the gRPC
server), calls per client (``--max-requests-per-client``, ``shared.client_limits``).
"""

from __future__ import annotations

import dataclasses

from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.session.inputs import RequestInput
from shared.config import DecoderServiceConfig
from shared.errors import InvalidRequestError


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
