"""``--quantize int8`` end to end: Redis + int8 encoder_svc + int8 decoder_svc as separate processes, real gRPC.

Every bundled clip is sent at once (the encoder batches them, the decoder steps them together): each transcript must
equal HF transformers' fp32 greedy one (``shared.models.quantize``: per-token activation scales keep every bundled
clip's transcript and make int8 batch-invariant), and every KV block must come back.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from test_e2e_whisper import assert_all_blocks_free, generate

from encdec import DATA_DIR
from encdec.launcher import Services
from shared.proto import decoder_pb2, decoder_pb2_grpc

DATA = DATA_DIR


@pytest.fixture(scope="module")
def stub(redis_url, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("int8-service-logs")
    int8 = ["--quantize", "int8"]
    with Services(redis_url=redis_url, log_dir=str(log_dir), extra_encoder_args=int8, extra_decoder_args=int8) as svc:
        with grpc.insecure_channel(svc.decoder_address) as channel:
            yield decoder_pb2_grpc.DecoderServiceStub(channel)


def test_int8_services_transcribe_every_clip_like_hf(stub, hf_whisper_tokens):
    names = sorted(hf_whisper_tokens)
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {
            n: pool.submit(generate, stub, (DATA / n).read_bytes(), f"int8-{uuid.uuid4().hex[:8]}") for n in names
        }
        results = {n: f.result() for n, f in futures.items()}
    for name, messages in results.items():
        tokens = [t for m in messages for t in m.token_ids]
        assert messages[-1].finish_reason == decoder_pb2.FINISH_REASON_STOP
        assert tokens[:-1] == hf_whisper_tokens[name], name
    assert_all_blocks_free(stub)
