"""``--dtype bfloat16`` on the CPU (issue 24, opt-in where the CPU has AVX-512 BF16 or AMX): encoder and decoder
as separate processes with bfloat16 weights and products (``shared.models.bfloat16``: float32 residual stream and
norms; the decoder's products on ``packed_linear_bf16``), KV in bfloat16, real gRPC and Redis.

bfloat16 keeps 8 bits of mantissa, so a close call between two tokens may go the other way than in float32:
transcripts are compared with HF float32 by count (``encdec bench whisper --bf16`` reports it), and the test
checks what must hold exactly: every request finishes with a sensible transcript, the cross KV travels in
bfloat16 (half float32's bytes), one request alone equals itself sent with others, and no block leaks.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from test_e2e_whisper import CLIPS, assert_all_blocks_free, generate

from encdec import DATA_DIR
from encdec.launcher import Services
from shared.device import CPU_BF16_FLAGS, cpu_bf16_flags
from shared.proto import decoder_pb2_grpc

pytestmark = pytest.mark.skipif(
    not cpu_bf16_flags(), reason=f"this CPU has none of {', '.join(CPU_BF16_FLAGS)} (bfloat16 is refused here)"
)
CROSS_KV_BYTES_FP32 = 4 * 1500 * 384 * 2 * 4  # whisper-tiny.en: layers x positions x d_model x (K, V) x 4 bytes


@pytest.fixture(scope="module")
def services(redis_url, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("bf16-logs")
    bf16 = ["--dtype", "bfloat16"]
    with Services(
        redis_url=redis_url,
        log_dir=str(log_dir),
        extra_encoder_args=bf16,
        extra_decoder_args=[*bf16, "--encoder-cache", "0"],
    ) as svc:
        yield svc, log_dir


def test_bfloat16_services_transcribe_with_kv_in_bfloat16(services, hf_whisper_tokens):
    svc, log_dir = services
    with grpc.insecure_channel(svc.decoder_address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        alone = {clip: generate(stub, (DATA_DIR / clip).read_bytes()) for clip in CLIPS}
        with ThreadPoolExecutor(len(CLIPS)) as pool:
            together = dict(zip(CLIPS, pool.map(lambda c: generate(stub, (DATA_DIR / c).read_bytes()), CLIPS)))
        assert_all_blocks_free(stub)
    tokens = {clip: [t for m in messages for t in m.token_ids] for clip, messages in alone.items()}
    for clip, ids in tokens.items():
        assert ids[-1] == 50256 and len(ids) > 5, clip  # finished with the end token, not cut off
        text = "".join(m.text for m in alone[clip])
        assert len(text.split()) >= 4, (clip, text)
    same = sum(tokens[c][:-1] == hf_whisper_tokens[c] for c in CLIPS)
    assert same >= 1, "bfloat16 transcripts share nothing with float32 HF"  # close calls may differ, not all
    assert {c: [t for m in together[c] for t in m.token_ids] for c in CLIPS} == tokens  # batched == alone
    log = (log_dir / "decoder.log").read_text()
    sizes = {int(n) for n in re.findall(r"cross KV for \S+: (\d+) bytes", log)}
    assert sizes == {CROSS_KV_BYTES_FP32 // 2}, sizes  # bfloat16 cross KV: half of float32's
