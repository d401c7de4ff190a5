"""Generation controls end to end: Redis + encoder_svc + decoder_svc processes over real gRPC.

The model is the tiny random BART of ``text_checkpoints`` with its tokenizer
swapped for a byte-level BPE trained on multi-byte text (``test_detokenizer``),
so sampled outputs split UTF-8 characters across tokens.
"""

from __future__ import annotations

import json
import math
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from helpers.byte_tokenizer import byte_level_tokenizer
from helpers.text_checkpoints import build_bart, sentence

from decoder_svc.core.detokenizer import REPLACEMENT_CHAR
from encdec.launcher import Services
from shared.proto import decoder_pb2, decoder_pb2_grpc


@pytest.fixture(scope="module")
def served(redis_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    path = build_bart(root / "bart")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    tok = byte_level_tokenizer(root / "tok", vocab_size=vocab)
    assert len(tok) == vocab
    for f in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / f).unlink(missing_ok=True)
    tok.save_pretrained(path)
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


def src(tok, seed: int, words: int = 8) -> decoder_pb2.TokenIds:
    return decoder_pb2.TokenIds(ids=tok(sentence(random.Random(seed), words))["input_ids"])


def generate(stub, source, **sampling) -> tuple[list[int], list]:
    request = decoder_pb2.GenerateRequest(input_ids=source, sampling=decoder_pb2.SamplingParams(**sampling))
    messages = list(stub.Generate(request, timeout=120))
    return [t for m in messages for t in m.token_ids], messages


def text_of(messages) -> str:
    return "".join(m.text for m in messages)


def test_seeded_request_reproducible_beside_unseeded_companions(served):
    _, tok, stub = served
    seeded = {
        "temperature": 1.0,
        "top_k": 50,
        "top_p": 0.95,
        "min_p": 0.01,
        "seed": 1234,
        "max_tokens": 24,
        "ignore_eos": True,
    }
    alone, _ = generate(stub, src(tok, 0), **seeded)
    jobs = [(src(tok, 0), seeded)] + [(src(tok, i), {"temperature": 1.0, "max_tokens": 24}) for i in range(1, 6)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = [f.result()[0] for f in [pool.submit(generate, stub, s, **p) for s, p in jobs]]
    assert together[0] == alone and len(alone) == 24
    other_seed, _ = generate(stub, src(tok, 0), **{**seeded, "seed": 99})
    assert other_seed != alone


def test_utf8_streaming_with_byte_level_tokens(served):
    """Sampled byte-level tokens: the streamed deltas join to the full decode, so no delta ever carries a
    U+FFFD for a character whose bytes arrive in several tokens, and no character is repeated."""
    _, tok, stub = served
    split_chars = 0
    for seed in range(6):
        ids, messages = generate(stub, src(tok, seed), temperature=1.5, seed=seed, max_tokens=48, ignore_eos=True)
        full = tok.decode(ids, skip_special_tokens=True)
        assert text_of(messages) == full
        pieces = [tok.decode([t]) for t in ids]
        split_chars += sum(REPLACEMENT_CHAR in p for p in pieces) and sum(
            ord(c) > 127 and c != REPLACEMENT_CHAR for c in full
        )
    assert split_chars > 0, "no multi-byte character split across tokens was generated; the test proves nothing"


def test_stop_strings_and_stop_token_ids(served):
    _, tok, stub = served
    source = src(tok, 7, 12)
    ids, messages = generate(stub, source, max_tokens=40, ignore_eos=True)
    full = text_of(messages)
    assert full == tok.decode(ids, skip_special_tokens=True) and len(full) > 20
    for a, n in ((5, 4), (11, 1), (len(full) - 3, 3)):
        stop = full[a : a + n]
        cut = full.find(stop)
        got, msgs = generate(stub, source, max_tokens=40, ignore_eos=True, stop=[stop, "\x00never"])
        assert text_of(msgs) == full[:cut] and got == ids[: len(got)]
        final = msgs[-1]
        assert final.finish_reason == decoder_pb2.FINISH_REASON_STOP and final.stop_str == stop
        assert final.WhichOneof("stop_reason") == "stop_str"
        # The last token is the one that completed the match: one token fewer would not contain it.
        assert stop not in tok.decode(got[:-1], skip_special_tokens=True) and stop in tok.decode(
            got, skip_special_tokens=True
        )
        _, msgs = generate(stub, source, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
        assert text_of(msgs) == full[: cut + len(stop)]
    i = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i] and ids[i] > 4)
    got, msgs = generate(stub, source, max_tokens=40, ignore_eos=True, stop_token_ids=[ids[i]])
    assert got == ids[: i + 1] and msgs[-1].stop_token_id == ids[i]
    assert text_of(msgs) == tok.decode(ids[:i], skip_special_tokens=True)
    # min_tokens defers the stop token; max_tokens ends as "length".
    got, msgs = generate(stub, source, max_tokens=40, ignore_eos=True, stop_token_ids=[ids[i]], min_tokens=i + 2)
    assert len(got) > i + 1 and msgs[-1].finish_reason in (
        decoder_pb2.FINISH_REASON_STOP,
        decoder_pb2.FINISH_REASON_LENGTH,
    )
    got, msgs = generate(stub, source, max_tokens=9, ignore_eos=True)
    assert (
        len(got) == 9
        and msgs[-1].finish_reason == decoder_pb2.FINISH_REASON_LENGTH
        and msgs[-1].WhichOneof("stop_reason") is None
    )


def test_penalties_and_min_tokens_match_hf_generate(served):
    path, tok, stub = served
    from transformers import AutoModelForSeq2SeqLM

    hf = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    source = src(tok, 3, 10)
    cases = [
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        ({"no_repeat_ngram_size": 1}, {"no_repeat_ngram_size": 1}),
        (
            {"repetition_penalty": 0.8, "no_repeat_ngram_size": 3, "min_tokens": 12},
            {"repetition_penalty": 0.8, "no_repeat_ngram_size": 3, "min_new_tokens": 12},
        ),
    ]
    plain, _ = generate(stub, source, max_tokens=20)
    for ours, theirs in cases:
        got, _msgs = generate(stub, source, max_tokens=20, **ours)
        assert got != plain, f"{ours} changed nothing on this source; pick another"
        with torch.inference_mode():
            expected = hf.generate(torch.tensor([list(source.ids)]), max_new_tokens=20, do_sample=False, **theirs)[
                0
            ].tolist()[1:]
        assert got == expected, ours
    assert len(generate(stub, source, max_tokens=20, min_tokens=20)[0]) == 20


def test_logprobs_consistent_with_tokens(served):
    path, tok, stub = served
    from transformers import AutoModelForSeq2SeqLM

    source = src(tok, 5)
    ids, messages = generate(stub, source, max_tokens=12, logprobs=True, top_logprobs=5)
    lps = [lp for m in messages for lp in m.logprobs]
    assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
    assert [lp.token_id for lp in lps] == ids
    for lp in lps:  # greedy: the token is the most likely one
        assert lp.rank == 1 and lp.top[0].token_id == lp.token_id and lp.top[0].logprob == lp.logprob <= 0
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        # Byte-level BPE: each token's text is its decode alone (U+FFFD for part of a multi-byte character).
        assert lp.token == tok.decode([lp.token_id])
        assert [t.token for t in lp.top] == [tok.decode([t.token_id]) for t in lp.top]
    # Same numbers as HF: log_softmax of generate()'s processed scores.
    hf = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([list(source.ids)]),
            max_new_tokens=12,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    assert out.sequences[0].tolist()[1:] == ids
    ref = [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.scores, ids)]
    assert [lp.logprob for lp in lps] == pytest.approx(ref, abs=1e-3)
    # Sampled: finite logprobs of the drawn tokens, reproducible with the seed; no top list unless asked.
    sampled = {"temperature": 1.2, "top_k": 40, "seed": 3, "max_tokens": 12, "logprobs": True}
    ids1, m1 = generate(stub, source, **sampled)
    ids2, m2 = generate(stub, source, **sampled)
    l1 = [lp for m in m1 for lp in m.logprobs]
    assert ids1 == ids2 and [lp.logprob for lp in l1] == [lp.logprob for m in m2 for lp in m.logprobs]
    assert all(math.isfinite(lp.logprob) and lp.logprob <= 0 and lp.rank >= 1 and not lp.top for lp in l1)
    _, plain = generate(stub, source, max_tokens=4)
    assert not any(m.logprobs for m in plain)


@pytest.mark.parametrize(
    "sampling, field",
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": ["y" * 257]}, "stop"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": 2**63}, "seed must be in [0, 9223372036854775807]"),  # the bound the proto documents
    ],
)
def test_bad_generation_controls_are_invalid_argument(served, sampling, field):
    _, tok, stub = served
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, src(tok, 1), **sampling)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()
    stats = stub.GetStats(decoder_pb2.GetStatsRequest())
    assert stats.num_free_self_blocks == stats.num_self_blocks and stats.num_running == stats.num_waiting == 0
    assert generate(stub, src(tok, 1), max_tokens=2)[0]  # still serving
