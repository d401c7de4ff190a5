"""``--quantize int8`` on a text model end to end: Redis + int8 encoder_svc + int8 decoder_svc (tiny T5), real gRPC.

Three sources of very different lengths sent at once (the encoder pads them into one batch, the decoder steps them
together) must give the greedy ids of the same int8 model run in this process, one source at a time
(``shared.models.quantize``: int8 is batch-invariant, the services' split changes nothing).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
from helpers.text_checkpoints import sentence
from helpers.text_paged import engine_greedy

from encdec.launcher import Services
from shared.models.quantize import apply_quantization
from shared.models.registry import load_model, load_tokenizer
from shared.proto import decoder_pb2, decoder_pb2_grpc

MAX_NEW = 16


def test_int8_t5_services_equal_the_int8_model(text_checkpoints, redis_url, tmp_path):
    path = text_checkpoints["t5"]
    tok = load_tokenizer(path)
    rng = random.Random(3)
    srcs = [tok(sentence(rng, n))["input_ids"] for n in (40, 2, 11)]
    model = load_model(path)
    apply_quantization(model, "int8", "decoder")
    apply_quantization(model, "int8", "encoder")
    expected = [engine_greedy(model, tok, [s], MAX_NEW)[0] for s in srcs]

    int8 = ["--quantize", "int8"]
    decoder_args = [*int8, "--block-size", "8", "--max-num-seqs", "4"]
    with Services(
        model=str(path),
        redis_url=redis_url,
        log_dir=str(tmp_path),
        log_level="WARNING",
        extra_encoder_args=int8,
        extra_decoder_args=decoder_args,
    ) as svc:
        with grpc.insecure_channel(svc.decoder_address) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)

            def generate(ids: list[int]) -> list[int]:
                request = decoder_pb2.GenerateRequest(
                    input_ids=decoder_pb2.TokenIds(ids=ids), sampling=decoder_pb2.SamplingParams(max_tokens=MAX_NEW)
                )
                return [t for m in stub.Generate(request, timeout=120) for t in m.token_ids]

            with ThreadPoolExecutor(len(srcs)) as pool:
                together = list(pool.map(generate, srcs))
    assert together == expected
    assert len({t for ids in expected for t in ids}) >= 10  # outputs varied enough to mean something
