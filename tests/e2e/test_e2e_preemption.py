"""Preemption end to end: a deliberately tiny self-attention KV cache, real Redis + encoder + decoder processes.

Eight requests that together need about twice the self blocks the decoder has
run concurrently; the scheduler recompute-preempts (drops self KV, keeps cross
KV) and resumes them. Every request must still produce exactly the tokens it
produces alone (greedy and seeded sampling alike), and every block must come
back. The decoder is batch-invariant on CPU (tests/decoder/test_batch_invariance.py);
the encoder runs one request per forward here, because its padded batches
differ from a source alone in the last bits, which this chaotic tiny model
could turn into another token.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers.metrics import scrape
from helpers.text_checkpoints import build_bart, sentence

from encdec.launcher import Services
from encdec.redis_server import free_port
from shared.proto import decoder_pb2, decoder_pb2_grpc

BLOCK_SIZE, NUM_SELF_BLOCKS, NEW_TOKENS = 4, 64, 64  # one 256-position request fits; 8 x 64 tokens need ~2x the pool
PREEMPTIONS = ("encdec_decoder_num_preemptions_total", ())


@pytest.fixture(scope="module")
def served(redis_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    path = build_bart(root / "bart")
    port = free_port()
    args = [
        "--block-size",
        str(BLOCK_SIZE),
        "--num-self-blocks",
        str(NUM_SELF_BLOCKS),
        "--max-num-seqs",
        "8",
        "--encoder-cache",
        "0",
        "--metrics-port",
        str(port),
    ]
    with (
        Services(
            model=str(path),
            redis_url=redis_url,
            log_dir=str(root),
            log_level="WARNING",
            extra_decoder_args=args,
            extra_encoder_args=["--max-batch-size", "1"],
        ) as svc,
        grpc.insecure_channel(svc.decoder_address) as channel,
    ):
        yield decoder_pb2_grpc.DecoderServiceStub(channel), port


def generate(stub, text: str, sampling: dict) -> list[int]:
    request = decoder_pb2.GenerateRequest(text=text, sampling=decoder_pb2.SamplingParams(**sampling))
    return [t for m in stub.Generate(request, timeout=300) for t in m.token_ids]


def test_preempted_requests_finish_with_exact_tokens(served):
    stub, metrics_port = served
    rng = random.Random(7)
    jobs = []
    for i in range(8):
        sampling = {"max_tokens": NEW_TOKENS, "ignore_eos": True}
        if i % 2:
            sampling.update(temperature=1.0, top_k=40, seed=100 + i)
        jobs.append((sentence(rng, 4 + 3 * i), sampling))
    alone = [generate(stub, text, sampling) for text, sampling in jobs]  # one at a time: never preempted
    before = scrape(metrics_port).get(PREEMPTIONS, 0.0)
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: generate(stub, *job), jobs))
    preemptions = scrape(metrics_port)[PREEMPTIONS] - before
    assert preemptions > 0, "the pool was large enough for all requests: the test proves nothing"
    assert all(len(t) == NEW_TOKENS for t in alone)
    assert together == alone
    stats = stub.GetStats(decoder_pb2.GetStatsRequest())
    assert stats.num_free_self_blocks == stats.num_self_blocks == NUM_SELF_BLOCKS, stats
    assert stats.num_free_cross_blocks == stats.num_cross_blocks and stats.num_running == stats.num_waiting == 0, stats
