"""End to end per text architecture: Redis + encoder_svc + decoder_svc processes over real gRPC.

Each service loads the tiny checkpoint directory with ``--model PATH``. Three
sources of very different lengths (one a 2-token segment given as ids) decoded
concurrently must equal each decoded alone and HF ``generate``.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from helpers.text_checkpoints import sentence

from encdec.launcher import Services
from shared.models.registry import load_tokenizer
from shared.proto import decoder_pb2, decoder_pb2_grpc

MAX_NEW = 16


@pytest.fixture(scope="module", params=["t5", "bart", "mbart", "marian"])
def served(request, text_checkpoints, redis_url, tmp_path_factory):
    path = text_checkpoints[request.param]
    log_dir = tmp_path_factory.mktemp(f"logs-{request.param}")
    with Services(
        model=str(path),
        redis_url=redis_url,
        log_dir=str(log_dir),
        log_level="WARNING",
        extra_decoder_args=["--block-size", "8", "--max-num-seqs", "4"],
    ) as svc:
        with grpc.insecure_channel(svc.decoder_address) as channel:
            yield request.param, path, decoder_pb2_grpc.DecoderServiceStub(channel)


def run(stub, **fields) -> tuple[list[int], list]:
    request = decoder_pb2.GenerateRequest(sampling=decoder_pb2.SamplingParams(max_tokens=MAX_NEW), **fields)
    messages = list(stub.Generate(request, timeout=120))
    return [t for m in messages for t in m.token_ids], messages


def test_batch_invariance_and_hf_parity(served):
    arch, path, stub = served
    from transformers import AutoModelForSeq2SeqLM

    tok = load_tokenizer(path)
    rng = random.Random(3)
    srcs = [
        tok(sentence(rng, 50))["input_ids"],
        tok(sentence(rng, 1))["input_ids"][:2],
        tok(sentence(rng, 12))["input_ids"],
    ]
    assert len(srcs[1]) == 2 and len(srcs[0]) > 40
    requests = [dict(input_ids=decoder_pb2.TokenIds(ids=s)) for s in srcs]
    alone = [run(stub, **r)[0] for r in requests]
    with ThreadPoolExecutor(3) as pool:
        together = [f.result()[0] for f in [pool.submit(run, stub, **r) for r in requests]]
    assert together == alone
    hf = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    with torch.inference_mode():
        expected = [
            hf.generate(torch.tensor([s]), max_new_tokens=MAX_NEW, do_sample=False)[0].tolist()[1:] for s in srcs
        ]
    assert alone == expected, arch

    # Text input goes through the checkpoint's tokenizer; the last message reports the defaults.
    text = sentence(rng, 8)
    ids, messages = run(stub, text=text)
    assert ids == run(stub, input_ids=decoder_pb2.TokenIds(ids=tok(text)["input_ids"]))[0]
    final = messages[-1]
    assert final.usage.encoder_tokens == len(tok(text)["input_ids"])
    assert any(s.startswith("decoder_start_token_id=") for s in final.applied_generation_defaults)
    assert "".join(m.text for m in messages) == tok.decode(ids, skip_special_tokens=True)


def test_decoder_prompt_and_length_limits(served):
    arch, path, stub = served
    tok = load_tokenizer(path)
    src = decoder_pb2.TokenIds(ids=tok("the cat runs")["input_ids"])
    base, _ = run(stub, input_ids=src)
    prefixed, messages = run(stub, input_ids=src, decoder_prompt_ids=decoder_pb2.TokenIds(ids=base[:2]))
    assert messages[-1].usage.prompt_tokens == 3
    # The same continuation after the given prefix (the last base token may be a forced end token).
    assert prefixed[: len(base) - 3] == base[2:-1]
    too_long = decoder_pb2.TokenIds(ids=[5] * 300)  # max source positions is 256
    with pytest.raises(grpc.RpcError) as info:
        run(stub, input_ids=too_long)
    assert (
        info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "300" in info.value.details()
        and "256" in info.value.details()
    )
    ids, messages = run(stub, input_ids=too_long, truncate=True)
    assert messages[-1].usage.encoder_tokens == 256 and ids
    with pytest.raises(grpc.RpcError) as info:
        run(stub, audio=b"RIFF")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:  # the message names the bad id and where it is
        run(stub, input_ids=decoder_pb2.TokenIds(ids=[5, 10**6, 6]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input_ids[1] is 1000000" in info.value.details()


def test_truncated_text_keeps_the_special_tokens(served):
    """truncate=true on `text` cuts as HF `tokenizer(text, truncation=True, max_length=256)` does.

    It once cut the token ids at 256, dropping the end token (and mBART's language code), so the
    source differed from what HF feeds the model and the output from HF's.
    """
    arch, path, stub = served
    tok = load_tokenizer(path)
    text = sentence(random.Random(11), 400)
    expected_src = tok(text, truncation=True, max_length=256)["input_ids"]
    assert len(tok(text)["input_ids"]) > 256 and len(expected_src) == 256
    ids, messages = run(stub, text=text, truncate=True)
    assert ids == run(stub, input_ids=decoder_pb2.TokenIds(ids=expected_src))[0], arch
    assert messages[-1].usage.encoder_tokens == 256
    assert "truncated_source=256" in messages[-1].applied_generation_defaults
    # A source of exactly 256 tokens is not cut and not reported as truncated.
    _, messages = run(stub, input_ids=decoder_pb2.TokenIds(ids=expected_src), truncate=True)
    assert not any(s.startswith("truncated_source") for s in messages[-1].applied_generation_defaults)


def _token_text(tok, token_id: int) -> str:
    """vLLM's logprobs token: decoded alone, special tokens kept, a SentencePiece "▁" start kept as a space."""
    text = tok.decode([token_id])
    return " " + text if tok.convert_ids_to_tokens(token_id).startswith("▁") and not text.startswith(" ") else text


def test_logprob_tokens_are_the_token_texts(served):
    arch, path, stub = served
    tok = load_tokenizer(path)
    sampling = decoder_pb2.SamplingParams(max_tokens=MAX_NEW, logprobs=True, top_logprobs=5)
    request = decoder_pb2.GenerateRequest(text=sentence(random.Random(5), 10), sampling=sampling)
    messages = list(stub.Generate(request, timeout=120))
    ids = [t for m in messages for t in m.token_ids]
    lps = [lp for m in messages for lp in m.logprobs]
    # Forced tokens (BART's forced_bos_token_id) leave fewer than 5 alternatives at their step.
    assert [lp.token_id for lp in lps] == ids and all(1 <= len(lp.top) <= 5 for lp in lps)
    for lp in lps:
        assert lp.token == _token_text(tok, lp.token_id), (arch, lp)
        assert [t.token for t in lp.top] == [_token_text(tok, t.token_id) for t in lp.top], (arch, lp)
    # Joined, the texts of the tokens that are not special are the decoded output.
    special = set(tok.all_special_ids)
    plain = [lp.token for lp in lps if lp.token_id not in special]
    assert "".join(plain).strip() == tok.decode(ids, skip_special_tokens=True).strip(), arch
    assert all(lp.token == tok.convert_ids_to_tokens(lp.token_id) for lp in lps if lp.token_id in special)
    # A word-start piece (SentencePiece "▁cat", byte-level "Ġcat") keeps its space: " cat".
    starts = [
        t.token for lp in lps for t in [lp, *lp.top] if tok.convert_ids_to_tokens(t.token_id).startswith(("▁", "Ġ"))
    ]
    assert starts and all(t.startswith(" ") for t in starts), (arch, starts)


def test_get_stats_names_the_served_text_model(served):
    arch, path, stub = served
    stats = stub.GetStats(decoder_pb2.GetStatsRequest())
    assert stats.model == str(path) and stats.input_kind == "text", stats
    names = list(stats.served_model_names)
    assert str(path) in names and names == sorted(names)
    tok = load_tokenizer(path)
    for name in names:  # every name it reports is one Generate accepts
        ids, _ = run(stub, model=name, input_ids=decoder_pb2.TokenIds(ids=tok("the cat")["input_ids"]))
        assert ids, name
