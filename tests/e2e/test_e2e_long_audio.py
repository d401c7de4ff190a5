"""Whisper audio longer than 30 s, end to end: request limits and ``max_tokens`` over the long-form windows.

Long-form decoding itself (HF's sequential algorithm: segments, seek, fallback, parity with HF
``generate``, concurrency, abort / disconnect / a failing window) is tested in
``test_e2e_whisper_longform.py``. Here: ``max_tokens`` counts over the whole request (every window and
attempt; the request ends with "length" when it runs out), and audio over ``--max-audio-s`` is refused
from its header / sample count before any decoding, with no Redis record or block left behind.
"""

from __future__ import annotations

import uuid

import grpc
import numpy as np
import pytest
import soundfile as sf
from helpers.audio_files import wav_bytes
from test_e2e_whisper import assert_all_blocks_free, wait_state

from encdec import DATA_DIR
from encdec.launcher import Services
from shared.proto import decoder_pb2, decoder_pb2_grpc

RATE = 16000
GAP_S = 0.6
MAX_AUDIO_S = 50  # the decoder's --max-audio-s here (the default 600 s is checked in test_e2e_whisper.py)


def long_clip(seconds: float = 45.0) -> np.ndarray:
    """``[seconds * 16000]`` float32: the committed clips with 0.6 s gaps, repeated, cut at ``seconds``."""
    parts, total, target = [], 0, int(seconds * RATE)
    clips = [sf.read(p, dtype="float32")[0] for p in sorted(DATA_DIR.glob("*.wav"))]
    while total < target:
        for pcm in clips:
            parts += [pcm, np.zeros(int(GAP_S * RATE), np.float32)]
            total += len(pcm) + int(GAP_S * RATE)
    return np.concatenate(parts)[:target]


@pytest.fixture(scope="module")
def services(redis_url, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("long-audio-logs")
    no_metrics = ["--metrics-port", "0"]  # other test modules may run services beside these
    with Services(
        redis_url=redis_url,
        log_dir=str(log_dir),
        extra_encoder_args=no_metrics,
        extra_decoder_args=[*no_metrics, "--max-audio-s", str(MAX_AUDIO_S)],
    ) as svc:
        yield svc


@pytest.fixture(scope="module")
def stub(services):
    with grpc.insecure_channel(services.decoder_address) as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel)


def _pcm(samples: np.ndarray, rate: int = RATE) -> decoder_pb2.PcmAudio:
    return decoder_pb2.PcmAudio(samples=samples.astype("<f4").tobytes(), sample_rate=rate)


def test_max_tokens_counts_over_the_whole_request(stub):
    clip = long_clip()
    whole = list(stub.Generate(decoder_pb2.GenerateRequest(pcm=_pcm(clip)), timeout=300))
    assert whole[-1].finish_reason == decoder_pb2.FINISH_REASON_STOP and whole[-1].usage.encoder_tokens == 3000
    first_window = whole[0].token_ids  # the first accepted window's tokens (greedy: no retry on this clip)
    budget = len(first_window) + 3
    request_id = f"long-budget-{uuid.uuid4().hex[:8]}"
    messages = list(
        stub.Generate(
            decoder_pb2.GenerateRequest(
                request_id=request_id, pcm=_pcm(clip), sampling=decoder_pb2.SamplingParams(max_tokens=budget)
            ),
            timeout=300,
        )
    )
    final = messages[-1]
    assert final.finish_reason == decoder_pb2.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == budget
    assert list(messages[0].token_ids) == list(first_window)
    assert messages[0].segments[0].text == whole[0].segments[0].text
    record = wait_state(stub, request_id, decoder_pb2.REQUEST_STATE_FINISHED)
    assert record.finish_reason == "length" and record.completion_tokens == budget
    assert_all_blocks_free(stub)


@pytest.mark.parametrize("kind", ["audio", "pcm"])
def test_over_configured_limit_is_invalid_argument(stub, kind):
    seconds, rate = MAX_AUDIO_S + 1, 8000  # checked before resampling
    samples = np.zeros(seconds * rate, np.float32)
    fields = {"audio": wav_bytes(samples, rate, "PCM_U8")} if kind == "audio" else {"pcm": _pcm(samples, rate)}
    request_id = f"long-over-{uuid.uuid4().hex[:8]}"
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(decoder_pb2.GenerateRequest(request_id=request_id, **fields), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{seconds:.2f}" in info.value.details() and f"{MAX_AUDIO_S:.2f}" in info.value.details(), (
        info.value.details()
    )
    with pytest.raises(grpc.RpcError) as missing:  # no Redis record left behind
        stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert_all_blocks_free(stub)
