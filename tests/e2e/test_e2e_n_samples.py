"""n > 1 parallel samples and beam search end to end: Redis + encoder_svc + decoder_svc processes over gRPC.

The model is the tiny random BART of ``text_checkpoints`` (with its own tokenizer).
"""

from __future__ import annotations

import random
import uuid

import grpc
import pytest
import torch
from helpers.text_checkpoints import build_bart, sentence
from test_e2e_whisper import assert_all_blocks_free, wait_state

from encdec.launcher import Services
from shared.proto import decoder_pb2, decoder_pb2_grpc


@pytest.fixture(scope="module")
def served(redis_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("nsamples")
    path = build_bart(root / "bart")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    with (
        Services(
            model=str(path),
            redis_url=redis_url,
            log_dir=str(root),
            log_level="WARNING",
            extra_decoder_args=["--block-size", "8", "--max-num-seqs", "8"],
        ) as svc,
        grpc.insecure_channel(svc.decoder_address) as channel,
    ):
        yield path, tok, decoder_pb2_grpc.DecoderServiceStub(channel)


def src(tok, seed: int, words: int = 8) -> list[int]:
    return tok(sentence(random.Random(seed), words))["input_ids"]


def request(ids: list[int], request_id: str = "", **sampling) -> decoder_pb2.GenerateRequest:
    return decoder_pb2.GenerateRequest(
        request_id=request_id, input_ids=decoder_pb2.TokenIds(ids=ids), sampling=decoder_pb2.SamplingParams(**sampling)
    )


def by_index(messages) -> dict[int, dict]:
    """index -> {tokens, text, finish_reason, stop_token_id, score, finals}."""
    out: dict[int, dict] = {}
    for m in messages:
        r = out.setdefault(m.index, {"tokens": [], "text": "", "finals": 0})
        assert not r["finals"], f"message for index {m.index} after its finish"
        r["tokens"] += list(m.token_ids)
        r["text"] += m.text
        if m.finish_reason:
            r.update(finals=1, finish_reason=m.finish_reason, score=m.score if m.HasField("score") else None)
    return out


def test_n2_request_streams_two_indexed_samples(served):
    _, tok, stub = served
    rid = f"n2-{uuid.uuid4().hex[:8]}"
    sampling = {"temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 16}
    messages = list(stub.Generate(request(src(tok, 0), rid, **sampling), timeout=120))
    samples = by_index(messages)
    assert sorted(samples) == [0, 1] and all(r["finals"] == 1 for r in samples.values())
    assert {m.index for m in messages[:-1]} == {0, 1}  # both indices stream before the end
    for r in samples.values():
        assert r["text"] == tok.decode(r["tokens"], skip_special_tokens=True)
        assert r["finish_reason"] in (decoder_pb2.FINISH_REASON_STOP, decoder_pb2.FINISH_REASON_LENGTH)
    last = messages[-1]
    total = sum(len(r["tokens"]) for r in samples.values())
    assert last.usage.completion_tokens == total and last.usage.prompt_tokens == 1
    assert sum(m.HasField("usage") for m in messages) == 1
    record = wait_state(stub, rid, decoder_pb2.REQUEST_STATE_FINISHED)
    assert record.completion_tokens == total
    # Reproducible: the same seeded request again, and sample 0 is the seeded n=1 request.
    again = by_index(stub.Generate(request(src(tok, 0), **sampling), timeout=120))
    assert [again[i]["tokens"] for i in (0, 1)] == [samples[i]["tokens"] for i in (0, 1)]
    one = by_index(stub.Generate(request(src(tok, 0), temperature=1.0, seed=7, max_tokens=16), timeout=120))
    assert one[0]["tokens"] == samples[0]["tokens"]
    assert_all_blocks_free(stub)


def test_abort_of_n3_request_mid_stream_ends_every_sample_and_frees_every_block(served):
    _, tok, stub = served
    rid = f"abort-n3-{uuid.uuid4().hex[:8]}"
    call = stub.Generate(request(src(tok, 1), rid, temperature=1.0, n=3, max_tokens=240, ignore_eos=True), timeout=120)
    first = next(call)
    assert first.token_ids
    assert stub.Abort(decoder_pb2.AbortRequest(request_id=rid)).aborted
    rest = list(call)
    assert rest[-1].finish_reason == decoder_pb2.FINISH_REASON_ABORT
    samples = by_index([first, *rest])  # (no message of an index after its final one)
    assert sorted(samples) == [0, 1, 2]  # each sample ends with its own ABORT, not only index 0
    assert all(r["finals"] == 1 and r["finish_reason"] == decoder_pb2.FINISH_REASON_ABORT for r in samples.values())
    streamed = sum(len(m.token_ids) for m in [first, *rest])
    assert streamed < 3 * 240  # ended by the abort
    assert rest[-1].usage.completion_tokens == streamed
    record = wait_state(stub, rid, decoder_pb2.REQUEST_STATE_ABORTED)
    assert record.finish_reason == "abort" and record.completion_tokens == streamed
    assert_all_blocks_free(stub)


def test_client_cancel_of_n2_request_frees_every_block(served):
    _, tok, stub = served
    rid = f"cancel-n2-{uuid.uuid4().hex[:8]}"
    call = stub.Generate(request(src(tok, 2), rid, temperature=1.0, n=2, max_tokens=240, ignore_eos=True), timeout=120)
    assert next(call).token_ids
    call.cancel()
    wait_state(stub, rid, decoder_pb2.REQUEST_STATE_ABORTED)
    assert_all_blocks_free(stub)


def test_request_that_can_never_fit_is_failed_in_redis_before_its_status(served):
    """A request refused after its record exists (n over max_num_seqs 8: RESOURCE_EXHAUSTED) is already
    FAILED, with the error, when the client gets the status: GetRequest right after it, no polling."""
    _, tok, stub = served
    for i in range(20):  # the old order (status, then the record) lost this race about 1 time in 7
        rid = f"never-fits-{i}-{uuid.uuid4().hex[:8]}"
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request(src(tok, 3), rid, temperature=1.0, n=9, max_tokens=8), timeout=60))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        assert "max_num_seqs" in err.value.details()
        record = stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=rid))
        assert record.state == decoder_pb2.REQUEST_STATE_FAILED and "max_num_seqs" in record.error, record
    assert_all_blocks_free(stub)


def test_beam_search_over_grpc_equals_hf(served):
    from transformers import AutoModelForSeq2SeqLM

    path, tok, stub = served
    hf = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    ids = src(tok, 3, words=10)
    kw = {"num_beams": 4, "length_penalty": 1.5, "early_stopping": True}
    messages = list(stub.Generate(request(ids, max_tokens=12, n=3, **kw), timeout=120))
    assert [m.index for m in messages] == [0, 1, 2]  # nothing streams before the end; then one message per beam
    beams = by_index(messages)
    with torch.inference_mode():
        g = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            num_return_sequences=3,
            output_scores=True,
            return_dict_in_generate=True,
            **kw,
        )
    eos, pad = hf.generation_config.eos_token_id, hf.generation_config.pad_token_id
    for i, seq in enumerate(g.sequences.tolist()):
        expected = [t for t in seq[1:] if t != pad]
        if eos in expected:
            expected = expected[: expected.index(eos) + 1]
        assert beams[i]["tokens"] == expected
        assert beams[i]["score"] == pytest.approx(float(g.sequences_scores[i]), abs=1e-4)
        assert beams[i]["text"] == tok.decode(beams[i]["tokens"], skip_special_tokens=True)
    assert messages[-1].usage.completion_tokens == sum(len(b["tokens"]) for b in beams.values())
    assert_all_blocks_free(stub)


@pytest.mark.parametrize(
    "sampling, field",
    [
        ({"n": 0}, "n must be"),
        ({"n": 17, "temperature": 1.0}, "n must be"),
        ({"n": 2}, "temperature"),
        ({"num_beams": 17}, "num_beams"),
        ({"num_beams": 2, "n": 3}, "n (3) must be <= num_beams"),
        ({"num_beams": 2, "temperature": 0.7}, "temperature"),
        ({"num_beams": 2, "stop": ["x"]}, "stop"),
        ({"num_beams": 2, "logprobs": True}, "logprobs"),
        ({"num_beams": 2, "length_penalty": float("inf")}, "length_penalty"),
    ],
)
def test_bad_n_and_beam_combinations_are_invalid_argument(served, sampling, field):
    _, tok, stub = served
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request(src(tok, 4), **sampling), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()
    assert_all_blocks_free(stub)
