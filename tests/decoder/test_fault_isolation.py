"""Fault isolation in the engine step (issue 20, failure 1): one request's bad value ends that request alone.

Real ``DecoderEngine`` over the tiny random BART of ``helpers.text_checkpoints`` (its max length cut to 24 so
every run is a few steps); the test plays the encoder service as tests/decoder/test_beam_search.py does. A
request is made "bad" past validation with ``object.__setattr__`` on its frozen params: that stands for a value
validation misses, and checks the step's isolation itself. Every run ends with all blocks free.
"""

from __future__ import annotations

import math
import random

import grpc
import pytest
import torch
from helpers.text_checkpoints import build_bart, sentence, with_generation
from helpers.text_paged import encode_batch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from decoder_svc.core.engine import DecoderEngine
from decoder_svc.core.sampling_params import SamplingParams
from shared.errors import status_for
from shared.kv_transport import write_blocks
from shared.models.registry import load_model, load_tokenizer

BLOCK = 4
MAX_LEN = 24
GREEDY = SamplingParams(max_tokens=12, min_tokens=8)  # still running when the beam request overflows (its step 3)


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault-isolation")
    path = with_generation(build_bart(root / "bart"), root / "bart-short", max_length=MAX_LEN)
    model, tokenizer = load_model(path), load_tokenizer(path)
    rng = random.Random(11)
    srcs = [tokenizer(sentence(rng, k))["input_ids"] for k in (3, 5, 7, 9, 11, 13, 6)]
    return model, tokenizer, srcs, encode_batch(model, srcs)


def make_engine(model, tokenizer, num_cross_blocks=64, num_self_blocks=160, max_num_seqs=48):
    c = model.config
    cross = torch.zeros(c.decoder_layers, 2, num_cross_blocks, BLOCK, c.num_heads, c.head_dim)
    return DecoderEngine(model, tokenizer, cross, num_self_blocks, BLOCK, max_num_seqs=max_num_seqs), cross


def bad(params: SamplingParams, **fields) -> SamplingParams:
    """``params`` with ``fields`` set past validation (a value validation would miss)."""
    for k, v in fields.items():
        object.__setattr__(params, k, v)
    return params


def run(engine, cross, kv, srcs, requests: dict[str, tuple[int, SamplingParams]], max_steps=400, added=()):
    """Adds every request (id -> (source index, params)) but those in ``added`` and steps until none is left.

    Returns ``(tokens, errors)``: id -> index -> generated tokens of the finished ones; id -> (error, ids of
    the other requests still unfinished when it came). ``step()`` must never raise; every block ends free.
    """
    for rid, (i, params) in requests.items():
        if rid not in added:
            engine.add_request(rid, len(srcs[i]), params)
    tokens: dict[str, dict[int, list[int]]] = {rid: {} for rid in requests}
    done: dict[str, set[int]] = {rid: set() for rid in requests}
    errors = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        out = engine.step()
        for rid, blocks in out.to_encode:
            write_blocks(cross, blocks, kv[requests[rid][0]])
            engine.mark_encoded(rid)
        for o in out.outputs:
            if getattr(o, "error", None) is not None:  # (getattr: the test also runs against the old engine)
                assert o.request_id not in errors
                unfinished = [r for r in requests if r != o.request_id and len(done[r]) < requests[r][1].n]
                errors[o.request_id] = (o.error, unfinished)
                continue
            assert o.index not in done[o.request_id], "output after finish"
            tokens[o.request_id].setdefault(o.index, []).extend(o.new_token_ids)
            if o.finished:
                done[o.request_id].add(o.index)
    assert not engine.has_unfinished_requests()
    s = engine.stats()
    assert s["num_free_self_blocks"] == s["num_self_blocks"] and s["num_free_cross_blocks"] == s["num_cross_blocks"]
    assert s["num_running"] == 0 and s["num_waiting"] == 0 and not engine.groups
    assert not engine.sampler._generators
    finished = {rid: t for rid, t in tokens.items() if rid not in errors}
    for rid in finished:
        assert len(done[rid]) == requests[rid][1].n, f"{rid} did not finish every index"
    return finished, errors


def alone(bart, i: int, params: SamplingParams) -> list[int]:
    model, tokenizer, srcs, kv = bart
    engine, cross = make_engine(model, tokenizer)
    got, errors = run(engine, cross, kv, srcs, {"alone": (i, params)})
    assert not errors
    return got["alone"][0]


def test_beam_overflow_fails_alone_beside_six_greedy(bart):
    """length_penalty=1e3 overflows ``generated_len ** length_penalty`` at the beam's third step: that request
    ends INVALID_ARGUMENT naming the parameter, its blocks freed; the 6 greedy requests running beside it finish
    token-exact with their runs alone."""
    model, tokenizer, srcs, kv = bart
    expected = {f"g{i}": alone(bart, i, GREEDY) for i in range(6)}
    engine, cross = make_engine(model, tokenizer)
    beam = bad(SamplingParams(num_beams=2, max_tokens=10, min_tokens=6), length_penalty=1e3)
    requests = {f"g{i}": (i, GREEDY) for i in range(6)} | {"beam": (6, beam)}
    got, errors = run(engine, cross, kv, srcs, requests)
    assert set(errors) == {"beam"}
    err, unfinished = errors["beam"]
    assert len(unfinished) == 6  # every greedy request was running when it failed
    code, message = status_for(err)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'beam'" in message and "length_penalty=1000.0" in message and "OverflowError" in message
    assert {rid: t[0] for rid, t in got.items()} == expected


def test_internal_failure_of_one_sampled_request_names_it(bart):
    """A non-arithmetic failure in one request's own sampling rows (a float top_k reaching ``torch.topk``) ends
    that n=2 request INTERNAL naming it; the greedy requests beside it are token-exact; nothing leaks."""
    model, tokenizer, srcs, kv = bart
    expected = {f"g{i}": alone(bart, i, GREEDY) for i in range(2)}
    engine, cross = make_engine(model, tokenizer)
    sampled = bad(SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=10), top_k=float("nan"))
    got, errors = run(engine, cross, kv, srcs, {"g0": (0, GREEDY), "odd": (4, sampled), "g1": (1, GREEDY)})
    assert set(errors) == {"odd"}
    code, message = status_for(errors["odd"][0])
    assert code == grpc.StatusCode.INTERNAL and "'odd'" in message and "sampler" in message
    assert {rid: t[0] for rid, t in got.items()} == expected


def test_failure_outside_one_request_still_fails_the_step(bart, monkeypatch):
    """The model forward is not one request's: its exception leaves ``step()`` as before."""
    model, tokenizer, srcs, kv = bart
    engine, cross = make_engine(model, tokenizer)
    engine.add_request("a", len(srcs[0]), GREEDY)
    out = engine.step()
    write_blocks(cross, out.to_encode[0][1], kv[0])
    engine.mark_encoded("a")

    def broken(*args, **kwargs):
        raise RuntimeError("forward broke")

    monkeypatch.setattr(engine.model_runner.model, "forward", broken)
    with pytest.raises(RuntimeError, match="forward broke"):
        engine.step()
    engine.abort("a")


def test_overflowing_values_are_refused_up_front():
    """Each float whose effect is exponentiated or multiplied is range-checked, the message naming field and range."""
    cases = [
        ({"num_beams": 2, "length_penalty": 400.0}, "length_penalty must be in [-10, 10]"),
        ({"num_beams": 2, "length_penalty": -1e3}, "length_penalty must be in [-10, 10]"),
        ({"temperature": 1e308}, "temperature must be in [0, 100]"),
        ({"temperature": float("nan")}, "temperature"),
        ({"repetition_penalty": 1e-30}, "repetition_penalty must be in [0.01, 100]"),
        ({"repetition_penalty": 1e30}, "repetition_penalty must be in [0.01, 100]"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("inf")}, "min_p"),
        ({"top_k": float("nan")}, "top_k must be an integer"),
        ({"stop_token_ids": [float("inf")]}, "stop_token_ids must be integers"),
        ({"ignore_eos": float("nan")}, "ignore_eos must be true or false"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as info:
            SamplingParams(**kwargs)
        assert message in str(info.value), (kwargs, str(info.value))
    for ok in (
        {"num_beams": 4, "length_penalty": 10.0},
        {"num_beams": 4, "length_penalty": -10.0},
        {"temperature": 100.0},
        {"repetition_penalty": 0.01},
    ):
        SamplingParams(**ok)


# -- fuzz: random extreme values for every field beside a fixed greedy request ------------------------------------

# Extremes (in and out of range, NaN, inf, wrong types) for any field; valid values (range edges included) for the
# rest, so that most examples run and the accepted extremes are driven through the step.
_SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1e-45, 1e-5, 0.01, 0.5, 1.0, 2.0, 10.0]
_SPECIAL_FLOATS += [10.5, 100.0, 101.0, 400.0, 1e3, 1e38, 1e308, -1e-5, -1.0, -10.0, -11.0, -1e308]
_WRONG_TYPE = st.sampled_from([None, "1", b"1", True, [1], 1.5, math.nan])
_FLOAT = st.one_of(st.sampled_from(_SPECIAL_FLOATS), st.floats(), _WRONG_TYPE)
_SPECIAL_INTS = [0, 1, 2, 3, 4, 16, 17, 20, 21, 399, 400, 2**31, 2**63 - 1, 2**63, 10**30, -1, -(2**63)]
_INT = st.one_of(st.sampled_from(_SPECIAL_INTS), st.integers(-3, 30), _WRONG_TYPE, st.sampled_from([math.inf, -1.0]))
_BOOL = st.one_of(st.booleans(), _WRONG_TYPE, st.sampled_from([0, 1]))
_EXTREME = {
    **dict.fromkeys(("temperature", "top_p", "min_p", "repetition_penalty", "length_penalty"), _FLOAT),
    **dict.fromkeys(("top_k", "min_tokens", "no_repeat_ngram_size", "top_logprobs", "n", "num_beams", "seed"), _INT),
    "max_tokens": st.one_of(st.none(), _INT),
    **dict.fromkeys(("ignore_eos", "include_stop_str_in_output", "logprobs", "early_stopping"), _BOOL),
    "stop": st.one_of(st.lists(st.text(max_size=300), max_size=18), _WRONG_TYPE, st.just("ab")),
    "stop_token_ids": st.one_of(st.lists(_INT, max_size=4), _WRONG_TYPE),
}


def _edges(lo: float, hi: float, *inner: float):
    return st.one_of(st.sampled_from([lo, hi, *inner]), st.floats(lo, hi))


_VALID = {
    "temperature": _edges(0.0, 100.0, 1e-45, 1e-5, 1.0000001e-5, 0.7, 1.0, 2.0),
    "top_p": _edges(5e-324, 1.0, 1e-30, 0.5),
    "min_p": _edges(0.0, 1.0, 1e-30, 0.5),
    "repetition_penalty": _edges(0.01, 100.0, 0.5, 1.0, 2.0),
    "length_penalty": _edges(-10.0, 10.0, -1.0, 0.0, 1.0, 2.0),
    "top_k": st.sampled_from([0, 1, 2, 50, 399, 400, 10**30]),
    "min_tokens": st.one_of(st.integers(0, 30), st.just(10**6)),
    "no_repeat_ngram_size": st.sampled_from([0, 1, 2, 3, 10**6]),
    "top_logprobs": st.integers(0, 20),
    "n": st.sampled_from([1, 1, 2, 3, 16]),
    "num_beams": st.sampled_from([1, 1, 2, 3, 16]),
    "seed": st.one_of(st.none(), st.sampled_from([0, 2**63 - 1]), st.integers(0, 2**63 - 1)),
    "max_tokens": st.one_of(st.none(), st.sampled_from([1, 2, 10, 10**9])),
    **dict.fromkeys(("ignore_eos", "include_stop_str_in_output", "logprobs", "early_stopping"), st.booleans()),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 399), max_size=3),
}


@st.composite
def fuzzed_kwargs(draw) -> dict:
    """Valid values for some fields (made a valid combination), then extremes for up to two of them."""
    kwargs = draw(st.fixed_dictionaries({}, optional=_VALID))
    if kwargs.get("top_logprobs"):
        kwargs["logprobs"] = True
    if kwargs.get("num_beams", 1) > 1:
        for name in ("temperature", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs"):
            kwargs.pop(name, None)
        kwargs["n"] = min(kwargs.get("n", 1), kwargs["num_beams"])
    elif kwargs.get("n", 1) > 1 and kwargs.get("temperature", 0.0) < 1e-5:
        kwargs["temperature"] = 1.0
    if kwargs.get("max_tokens") is not None and kwargs.get("min_tokens", 0) > kwargs["max_tokens"]:
        kwargs["min_tokens"] = kwargs["max_tokens"]
    for name in draw(st.lists(st.sampled_from(sorted(_EXTREME)), max_size=2, unique=True)):
        kwargs[name] = draw(_EXTREME[name])
    return kwargs


REFUSED = (ValueError,)  # InvalidRequestError and CapacityError are ValueErrors


@pytest.fixture(scope="module")
def fuzz_engine(bart):
    """One engine for every example (the engine must stay usable after each), and the greedy reference."""
    model, tokenizer, *_ = bart
    return make_engine(model, tokenizer, num_self_blocks=200), alone(bart, 0, GREEDY)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(kwargs=fuzzed_kwargs())
def test_fuzzed_sampling_params_never_harm_the_step(bart, fuzz_engine, kwargs):
    """Random extreme values for every field: each fuzzed request is refused (ValueError at construction or at
    ``add_request``) or runs to a finish without error; ``step()`` never raises, the greedy request beside it is
    token-exact, and every block is free afterwards."""
    _, _, srcs, kv = bart
    (engine, cross), expected = fuzz_engine
    try:
        params = SamplingParams(**kwargs)
        engine.add_request("fuzz", len(srcs[5]), params)
    except REFUSED as exc:
        event(f"refused: {str(exc).split(' ')[0]}")
        return
    event("ran")
    requests = {"fuzz": (5, params), "greedy": (0, GREEDY)}
    got, errors = run(engine, cross, kv, srcs, requests, max_steps=2000, added={"fuzz"})
    assert not errors, {rid: str(e) for rid, (e, _) in errors.items()}
    assert got["greedy"][0] == expected
    assert len(got["fuzz"]) == params.n


def test_documented_bounds_are_accepted_through_the_proto():
    """The proto's float fields arrive rounded to float32: each documented inclusive bound must still pass."""
    from decoder_svc.core.sampling_params import (
        MAX_LENGTH_PENALTY,
        MAX_REPETITION_PENALTY,
        MAX_TEMPERATURE,
        MIN_LENGTH_PENALTY,
        MIN_REPETITION_PENALTY,
    )
    from decoder_svc.session.convert import sampling_params_from_pb
    from shared.proto import decoder_pb2

    for fields in (
        {"repetition_penalty": MIN_REPETITION_PENALTY},
        {"repetition_penalty": MAX_REPETITION_PENALTY},
        {"temperature": MAX_TEMPERATURE},
        {"num_beams": 2, "length_penalty": MIN_LENGTH_PENALTY},
        {"num_beams": 2, "length_penalty": MAX_LENGTH_PENALTY},
    ):
        params = sampling_params_from_pb(decoder_pb2.SamplingParams(**fields), 51864)
        assert all(abs(getattr(params, k) - v) < 1e-6 for k, v in fields.items()), fields
