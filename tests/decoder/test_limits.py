"""The decoder's request limits (``decoder_svc.session.limits``): --max-new-tokens, --max-n, --max-beams, --max-input-tokens."""

from __future__ import annotations

import numpy as np
import pytest

from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.session.inputs import RequestInput
from decoder_svc.session.limits import apply_request_limits
from decoder_svc.whisper.options import WhisperJob
from shared.config import DecoderServiceConfig
from shared.errors import InvalidRequestError

TEXT = RequestInput(encoder_len=5, input_ids=[5, 6, 7, 8, 1])
AUDIO = RequestInput(encoder_len=1500, pcm=np.zeros(16000, dtype=np.float32))


def limits(**fields) -> DecoderServiceConfig:
    return DecoderServiceConfig(**fields)


def test_defaults_leave_requests_alone():
    params = SamplingParams(temperature=0.5, n=16)
    assert apply_request_limits(params, TEXT, limits()) is params
    beams = SamplingParams(num_beams=16, n=4)
    assert apply_request_limits(beams, AUDIO, limits()) is beams


def test_max_tokens_over_max_new_tokens_is_refused_naming_both_and_the_flag():
    with pytest.raises(InvalidRequestError) as err:
        apply_request_limits(SamplingParams(max_tokens=65), TEXT, limits(max_new_tokens=64))
    message = str(err.value)
    assert "65" in message and "64" in message and "--max-new-tokens" in message and "max_tokens" in message
    with pytest.raises(InvalidRequestError, match="min_tokens is 70.*--max-new-tokens"):
        apply_request_limits(SamplingParams(min_tokens=70), TEXT, limits(max_new_tokens=64))
    at_limit = SamplingParams(max_tokens=64)
    assert apply_request_limits(at_limit, TEXT, limits(max_new_tokens=64)) is at_limit


def test_unset_max_tokens_becomes_the_limit_except_in_whisper_windows():
    capped = apply_request_limits(SamplingParams(temperature=0.3, seed=1), TEXT, limits(max_new_tokens=32))
    assert capped.max_tokens == 32 and capped.temperature == pytest.approx(0.3) and capped.seed == 1
    assert apply_request_limits(SamplingParams(n=2, temperature=1.0), AUDIO, limits(max_new_tokens=32)).max_tokens == 32
    whisper = RequestInput(encoder_len=1500, pcm=AUDIO.pcm, whisper=object.__new__(WhisperJob))
    unset = SamplingParams()
    assert apply_request_limits(unset, whisper, limits(max_new_tokens=32)).max_tokens is None  # per window: 448
    with pytest.raises(InvalidRequestError, match="--max-new-tokens"):
        apply_request_limits(SamplingParams(max_tokens=33), whisper, limits(max_new_tokens=32))


@pytest.mark.parametrize(
    "params, config, flag",
    [
        (SamplingParams(n=3, temperature=1.0), dict(max_n=2), "--max-n"),
        (SamplingParams(num_beams=5), dict(max_beams=4), "--max-beams"),
        (SamplingParams(num_beams=5, n=3), dict(max_n=2), "--max-n"),
    ],
)
def test_n_and_beams(params, config, flag):
    with pytest.raises(InvalidRequestError, match=flag):
        apply_request_limits(params, AUDIO, limits(**config))


def test_max_input_tokens_counts_text_sources_only():
    with pytest.raises(InvalidRequestError) as err:
        apply_request_limits(SamplingParams(), TEXT, limits(max_input_tokens=4))
    assert "5 tokens" in str(err.value) and "at most 4" in str(err.value) and "--max-input-tokens" in str(err.value)
    assert apply_request_limits(SamplingParams(), TEXT, limits(max_input_tokens=5)).max_tokens is None
    assert apply_request_limits(SamplingParams(), AUDIO, limits(max_input_tokens=1)).max_tokens is None


def test_limit_flags_parse_and_validate():
    from shared.config import config_from

    config = config_from(DecoderServiceConfig, env={"ENCDEC_MAX_NEW_TOKENS": "12", "ENCDEC_MAX_N": "3"})
    assert (config.max_new_tokens, config.max_n) == (12, 3)
    with pytest.raises(ValueError, match="max_beams"):
        limits(max_beams=17)
