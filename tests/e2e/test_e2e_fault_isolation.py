"""One request's bad value never ends its neighbours (issue 20, failure 1), through real services over gRPC.

Redis + encoder_svc + decoder_svc processes, the tiny random BART of ``helpers.text_checkpoints``. Before the
fix, ``num_beams=2`` with ``length_penalty=1e3`` raised ``OverflowError`` inside the shared engine step and every
request running at that moment ended INTERNAL.

The second decoder is started with the length_penalty bound lifted (a ``sitecustomize`` on its PYTHONPATH): that
stands for a value validation misses, so the bad request reaches the engine and the step's own isolation, the
request session and the status interceptor are what is checked.
"""

from __future__ import annotations

import os
import random
import textwrap
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from helpers.text_checkpoints import build_bart, sentence
from test_e2e_whisper import assert_all_blocks_free, wait_state

from encdec.launcher import Services
from shared.proto import decoder_pb2, decoder_pb2_grpc

GREEDY = {"max_tokens": 12, "min_tokens": 8}
BAD_BEAM = {"num_beams": 2, "length_penalty": 1e3, "max_tokens": 10, "min_tokens": 6}
NUM_GREEDY = 6


@contextmanager
def serve(redis_url, root, env: dict[str, str] | None = None):
    """The services over a fresh tiny BART, started with ``env`` set; yields ``(tokenizer, decoder stub)``."""
    path = build_bart(root / "bart")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in (env or {}).items():
            mp.setenv(k, v)
        svc = Services(
            model=str(path),
            redis_url=redis_url,
            log_dir=str(root),
            log_level="WARNING",
            extra_decoder_args=["--block-size", "8", "--max-num-seqs", "16"],
        ).start()  # the children keep the environment they were started with
    try:
        with grpc.insecure_channel(svc.decoder_address) as channel:
            yield tok, decoder_pb2_grpc.DecoderServiceStub(channel)
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def served(redis_url, tmp_path_factory):
    with serve(redis_url, tmp_path_factory.mktemp("fault-isolation")) as served:
        yield served


@pytest.fixture(scope="module")
def served_unbounded(redis_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("fault-isolation-unbounded")
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import decoder_svc.core.sampling_params as sp

            sp.MAX_LENGTH_PENALTY = 1e4  # a range validation misses: the engine step must isolate the request
            """
        )
    )
    root_dir = str(Path(__file__).resolve().parents[2])  # the tree under test, ahead of any installed copy
    pythonpath = os.pathsep.join(p for p in (str(site), root_dir, os.environ.get("PYTHONPATH", "")) if p)
    with serve(redis_url, root, {"PYTHONPATH": pythonpath}) as served:
        yield served


def request(tok, seed: int, request_id: str, **sampling) -> decoder_pb2.GenerateRequest:
    ids = tok(sentence(random.Random(seed), 4 + seed))["input_ids"]
    return decoder_pb2.GenerateRequest(
        request_id=request_id, input_ids=decoder_pb2.TokenIds(ids=ids), sampling=decoder_pb2.SamplingParams(**sampling)
    )


def tokens(stub, req) -> tuple[list[int], int]:
    messages = list(stub.Generate(req, timeout=120))
    return [t for m in messages for t in m.token_ids], messages[-1].finish_reason


def run_beside_greedy(tok, stub) -> tuple[grpc.RpcError | None, dict[int, tuple[list[int], int]], str]:
    """The bad beam request with ``NUM_GREEDY`` greedy ones at once; returns its error, their results, its id."""
    tag = uuid.uuid4().hex[:8]
    bad_id = f"bad-{tag}"
    with ThreadPoolExecutor(NUM_GREEDY + 1) as pool:
        greedy = {i: pool.submit(tokens, stub, request(tok, i, f"g{i}-{tag}", **GREEDY)) for i in range(NUM_GREEDY)}
        bad = pool.submit(tokens, stub, request(tok, NUM_GREEDY, bad_id, **BAD_BEAM))
        results = {i: f.result() for i, f in greedy.items()}
        error = bad.exception()
    return error, results, bad_id


def alone(tok, stub) -> dict[int, list[int]]:
    return {
        i: tokens(stub, request(tok, i, f"alone{i}-{uuid.uuid4().hex[:8]}", **GREEDY))[0] for i in range(NUM_GREEDY)
    }


def test_overflowing_length_penalty_is_refused_and_neighbours_finish(served):
    tok, stub = served
    expected = alone(tok, stub)
    error, results, _ = run_beside_greedy(tok, stub)
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "length_penalty must be in [-10, 10]" in error.details()
    assert {i: r[0] for i, r in results.items()} == expected
    assert all(r[1] in (decoder_pb2.FINISH_REASON_STOP, decoder_pb2.FINISH_REASON_LENGTH) for r in results.values())
    assert_all_blocks_free(stub)


def test_engine_isolates_a_request_whose_value_overflows(served_unbounded):
    """The overflow happens inside the shared step: that request alone ends INVALID_ARGUMENT naming its
    parameters (recorded FAILED in Redis), the greedy requests decoding beside it are token-exact, no block
    leaks, and the decoder goes on serving."""
    tok, stub = served_unbounded
    expected = alone(tok, stub)
    error, results, bad_id = run_beside_greedy(tok, stub)
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "length_penalty=1000.0" in error.details() and "OverflowError" in error.details()
    assert bad_id in error.details()
    assert {i: r[0] for i, r in results.items()} == expected
    record = wait_state(stub, bad_id, decoder_pb2.REQUEST_STATE_FAILED)
    assert "length_penalty" in record.error
    assert_all_blocks_free(stub)
    assert tokens(stub, request(tok, 0, f"after-{uuid.uuid4().hex[:8]}", **GREEDY))[0] == expected[0]
