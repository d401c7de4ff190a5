"""``--stream-interval``: Generate merges a request's messages until N new tokens are held (decoder_svc/server.py).

Through a real encoder + decoder + Redis with ``--stream-interval 4`` on a tiny T5: the first token and the finish
go out at once, the middle in messages of 4 tokens, and the tokens and text are those of HF greedy decoding;
``n = 2`` samples are merged per index. ``_Coalescer`` itself: merging, and each sample's final message flushing it.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from decoder_svc.session.request_progress import StreamCoalescer as _Coalescer
from encdec.launcher import Services
from shared.models.registry import load_tokenizer
from shared.proto import decoder_pb2, decoder_pb2_grpc


@pytest.fixture(scope="module")
def served(text_checkpoints, redis_url, tmp_path_factory):
    path = text_checkpoints["t5"]
    with Services(
        model=str(path),
        redis_url=redis_url,
        log_dir=str(tmp_path_factory.mktemp("logs")),
        log_level="WARNING",
        extra_decoder_args=["--stream-interval", "4", "--max-num-seqs", "4"],
    ) as svc:
        with grpc.insecure_channel(svc.decoder_address) as channel:
            yield path, decoder_pb2_grpc.DecoderServiceStub(channel)


def test_messages_merge_to_the_interval_and_equal_hf(served):
    path, stub = served
    from transformers import AutoModelForSeq2SeqLM

    tok = load_tokenizer(path)
    ids = tok("a few words to translate here")["input_ids"]
    request = decoder_pb2.GenerateRequest(
        input_ids=decoder_pb2.TokenIds(ids=ids), sampling=decoder_pb2.SamplingParams(max_tokens=10, ignore_eos=True)
    )
    messages = list(stub.Generate(request, timeout=120))
    assert [len(m.token_ids) for m in messages] == [1, 4, 4, 1]  # first at once; 4 + 4; the finish at once
    assert messages[-1].finish_reason == decoder_pb2.FINISH_REASON_LENGTH
    assert [m.finish_reason for m in messages[:-1]] == [decoder_pb2.FINISH_REASON_UNSPECIFIED] * 3
    got = [t for m in messages for t in m.token_ids]
    hf = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False)[0].tolist()[
            1:
        ]
    assert got == expected
    assert "".join(m.text for m in messages) == tok.decode(got, skip_special_tokens=True)
    assert messages[-1].usage.completion_tokens == 10


def test_samples_are_merged_per_index(served):
    _, stub = served
    request = decoder_pb2.GenerateRequest(
        text="another source sentence",
        sampling=decoder_pb2.SamplingParams(max_tokens=9, ignore_eos=True, n=2, temperature=0.8, seed=7),
    )
    by_index: dict[int, list[int]] = {0: [], 1: []}
    for m in stub.Generate(request, timeout=120):
        by_index[m.index].append(len(m.token_ids))
    assert by_index == {0: [1, 4, 4], 1: [1, 4, 4]}


def test_coalescer_merges_and_flushes_on_each_final():
    c = _Coalescer(3)
    msg = lambda i, text, ids, **kw: decoder_pb2.GenerateResponse(
        request_id="r", index=i, text=text, token_ids=ids, **kw
    )
    assert c.add(msg(0, "a", [1]), 1, False).token_ids == [1]  # a sample's first message goes out at once
    assert c.add(msg(1, "x", [9]), 1, False).token_ids == [9]
    assert c.add(msg(0, "b", [2]), 1, False) is None
    assert c.add(msg(1, "y", [8]), 1, False) is None
    assert c.add(msg(0, "c", [3], score=-1.5), 1, False) is None
    out = c.add(msg(0, "d", [4]), 1, False)  # 3 held tokens: merged text, ids appended, the newest set score kept
    assert (out.text, list(out.token_ids), out.score) == ("bcd", [2, 3, 4], -1.5)
    # an abort ends each sample with its own final message (decoder_svc.server._each_unfinished_sample), which
    # carries what was held for it: index 1's "y"
    final = c.add(msg(1, "", [], finish_reason=decoder_pb2.FINISH_REASON_ABORT), 0, True)
    assert (final.index, final.text, list(final.token_ids), final.finish_reason) == (
        1,
        "y",
        [8],
        decoder_pb2.FINISH_REASON_ABORT,
    )
    final = c.add(msg(0, "", [], finish_reason=decoder_pb2.FINISH_REASON_ABORT), 0, True)
    assert final.finish_reason == decoder_pb2.FINISH_REASON_ABORT and c.held == {}
    assert _Coalescer(1).add(msg(0, "a", [1]), 1, False) is not None
