"""Stop conditions of a sequence: end token, min_tokens, ignore_eos, max_tokens / model max length."""

import random

import pytest
from helpers.byte_tokenizer import MULTIBYTE, byte_level_tokenizer

from decoder_svc.core.detokenizer import REPLACEMENT_CHAR, OutputText
from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.core.sequence import Sequence, SequenceStatus

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


class StopAfter:
    """A stop criterion that says stop once it has seen ``n`` output tokens; counts its calls."""

    reason = "enough"

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self, output_token_ids) -> bool:
        self.calls += 1
        return len(output_token_ids) >= self.n


def test_stop_criterion_ends_the_sequence_after_a_stop_token_and_before_the_length_limit():
    crit = StopAfter(3)
    assert run(SamplingParams(stop_criterion=crit), [5, 6, 7, 8]) == (SequenceStatus.FINISHED_STOPPED, 3)
    assert crit.calls == 3
    assert run(SamplingParams(stop_criterion=StopAfter(3)), [5, 6, EOS, 7]) == (SequenceStatus.FINISHED_STOPPED, 3)
    seq = Sequence("r", [0], 10, SamplingParams(stop_criterion=StopAfter(2)), EOS, 100)
    seq.append_token(EOS)
    assert seq.check_token_stop() is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == EOS  # the id first
    seq = Sequence("r", [0], 10, SamplingParams(stop_criterion=StopAfter(2), max_tokens=2), EOS, 100)
    seq.append_token(5)
    seq.append_token(6)
    assert seq.check_token_stop() is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == "enough"
    with pytest.raises(ValueError, match="stop_criterion"):
        SamplingParams(stop_criterion=3)
    with pytest.raises(ValueError, match="stop_criterion"):
        SamplingParams(stop_criterion=StopAfter(1), n=2, temperature=1.0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# -- stop strings, stop token ids and streamed text (byte-level BPE tokenizer) ---------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return byte_level_tokenizer(tmp_path_factory.mktemp("bpe-stop"))


def stream(tok, params: SamplingParams, ids: list[int], max_total_len: int = 500):
    """Runs ``ids`` through a Sequence as the engine does (append, check_stop, pop_delta).

    Returns (status, stop_reason, deltas, tokens consumed); asserts after every
    step that the streamed text is a prefix of what the stream ends with.
    """
    seq = Sequence("r", [2], 10, params, EOS, max_total_len)
    seq.output_text = OutputText(tok, params.stop, params.include_stop_str_in_output)
    deltas, status = [], None
    for t in ids:
        seq.append_token(t)
        status = seq.check_stop()
        deltas.append(seq.output_text.pop_delta())
        if status is not None:
            break
    assert status is not None, "stream did not end"
    final = "".join(deltas)
    for k in range(len(deltas)):
        assert final.startswith("".join(deltas[:k]))  # nothing streamed was later taken back
    return status, seq.stop_reason, deltas, seq.num_output_tokens


def test_stop_string_inside_one_token(tok):
    ids = tok.encode(" the house runs", add_special_tokens=False) + [EOS]
    piece = [t for t in ids if tok.decode([t]) == " house"]
    assert piece, "the tokenizer should have ' house' as one token"
    status, reason, deltas, n = stream(tok, SamplingParams(stop=("ous",)), ids)
    assert (status, reason, "".join(deltas)) == (SequenceStatus.FINISHED_STOPPED, "ous", " the h")
    assert n == ids.index(piece[0]) + 1  # the token holding the match is the last one generated
    status, reason, deltas, _ = stream(tok, SamplingParams(stop=("ous",), include_stop_str_in_output=True), ids)
    assert "".join(deltas) == " the hous"


def test_stop_string_spanning_tokens_is_never_streamed(tok):
    ids = tok.encode(" the cat dog river", add_special_tokens=False) + [EOS]
    status, reason, deltas, _ = stream(tok, SamplingParams(stop=("t dog r",)), ids)
    assert (reason, "".join(deltas)) == ("t dog r", " the ca")
    assert not any("t" in d for d in deltas[1:])  # " cat" was held back from the step it arrived
    # A partial match that fails is released (nothing lost, nothing repeated).
    status, reason, deltas, _ = stream(tok, SamplingParams(stop=("t dog x",)), ids)
    assert (status, reason, "".join(deltas)) == (SequenceStatus.FINISHED_STOPPED, EOS, " the cat dog river")


def test_earliest_of_several_stop_strings(tok):
    ids = tok.encode(" blue green red white", add_special_tokens=False) + [EOS]
    _status, reason, deltas, _ = stream(tok, SamplingParams(stop=("white", "green", "zzz")), ids)
    assert (reason, "".join(deltas)) == ("green", " blue ")


def test_stop_token_ids(tok):
    ids = tok.encode(" the cat. the dog.", add_special_tokens=False)
    dot = tok.convert_tokens_to_ids(".")
    status, reason, deltas, n = stream(tok, SamplingParams(stop_token_ids=(dot,)), ids + [EOS])
    assert (status, reason, "".join(deltas), n) == (
        SequenceStatus.FINISHED_STOPPED,
        dot,
        " the cat",
        ids.index(dot) + 1,
    )
    _, _, deltas, _ = stream(tok, SamplingParams(stop_token_ids=(dot,), include_stop_str_in_output=True), ids + [EOS])
    assert "".join(deltas) == " the cat."
    # min_tokens defers both the stop token and stop strings.
    status, reason, deltas, n = stream(
        tok, SamplingParams(stop_token_ids=(dot,), stop=("cat",), min_tokens=ids.index(dot) + 2), ids + [EOS]
    )
    assert (reason, "".join(deltas)) == (dot, " the cat. the dog")


def test_length_and_ignore_eos_release_held_back_text(tok):
    ids = tok.encode(" the cat dog", add_special_tokens=False)
    status, reason, deltas, _ = stream(tok, SamplingParams(stop=(" dog house",), max_tokens=len(ids)), ids)
    assert (status, reason, "".join(deltas)) == (SequenceStatus.FINISHED_LENGTH, None, " the cat dog")
    assert deltas[-1].endswith(" dog")  # held back until the end
    status, _, deltas, n = stream(tok, SamplingParams(ignore_eos=True, max_tokens=len(ids) + 2), [EOS] + ids + [EOS])
    assert (status, "".join(deltas), n) == (SequenceStatus.FINISHED_LENGTH, " the cat dog", len(ids) + 2)


@pytest.mark.parametrize("seed", range(4))
def test_stop_string_property(tok, seed):
    """A random substring of a multi-byte text as the stop string: the stream is the full decode cut before its
    first occurrence (after it with include_stop_str_in_output), with no U+FFFD in any delta."""
    from helpers.text_checkpoints import WORDS

    rng = random.Random(seed)
    for _ in range(20):
        text = " ".join(rng.choice(MULTIBYTE + list(WORDS)) for _ in range(rng.randrange(2, 10)))
        ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids)
        a = rng.randrange(len(full))
        stop = full[a : a + rng.randrange(1, 8)]
        include = rng.random() < 0.5
        _status, reason, deltas, _ = stream(
            tok, SamplingParams(stop=(stop,), include_stop_str_in_output=include), ids + [EOS]
        )
        cut = full.find(stop)
        assert (reason, "".join(deltas)) == (stop, full[: cut + len(stop) if include else cut]), (text, stop)
        assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_stop_criterion_keeps_the_last_tokens_text(tok):
    """Unlike a stop token id, the token that met the criterion is text like any other: it is streamed."""
    ids = tok.encode(" the cat sat down", add_special_tokens=False)
    status, reason, deltas, n = stream(tok, SamplingParams(stop_criterion=StopAfter(3)), ids + [EOS])
    assert (status, reason, n) == (SequenceStatus.FINISHED_STOPPED, "enough", 3)
    assert "".join(deltas) == tok.decode(ids[:3])
