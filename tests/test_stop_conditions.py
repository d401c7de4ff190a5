"""Stop conditions of a sequence: end token, min_tokens, ignore_eos, max_tokens / model max length."""

import pytest

from decoder_svc.sequence import Sequence, SequenceStatus
from shared.sampling_params import SamplingParams

EOS = 2


def run(params: SamplingParams, tokens: list[int], max_total_len: int = 100) -> tuple[SequenceStatus | None, int]:
    """Appends ``tokens`` until a stop; returns (status, tokens consumed)."""
    seq = Sequence("r", [0], 10, params, EOS, max_total_len)
    for n, t in enumerate(tokens, 1):
        seq.append_token(t)
        status = seq.check_stop()
        if status is not None:
            return status, n
    return None, len(tokens)


def test_eos_stops():
    assert run(SamplingParams(), [5, 6, EOS, 7]) == (SequenceStatus.FINISHED_STOPPED, 3)


def test_min_tokens_defers_eos():
    # An end token before min_tokens (only possible when forced) does not stop; after it, it does.
    assert run(SamplingParams(min_tokens=4), [EOS, 5, 6, EOS, 7]) == (SequenceStatus.FINISHED_STOPPED, 4)
    assert run(SamplingParams(min_tokens=3), [5, 6, EOS]) == (SequenceStatus.FINISHED_STOPPED, 3)


def test_ignore_eos_runs_to_max_tokens():
    assert run(SamplingParams(ignore_eos=True, max_tokens=5), [EOS] * 10) == (SequenceStatus.FINISHED_LENGTH, 5)
    assert run(SamplingParams(ignore_eos=True), [EOS] * 200, max_total_len=8) == (SequenceStatus.FINISHED_LENGTH, 7)


def test_max_tokens_is_length():
    assert run(SamplingParams(max_tokens=3), [5, 6, 7, 8]) == (SequenceStatus.FINISHED_LENGTH, 3)


@pytest.mark.parametrize("kwargs, field", [
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
])
def test_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
