"""Shared pytest fixtures. Keep this file small; add fixtures by topic."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from encdec import DATA_DIR

# Without CUDA the Triton kernels run under the interpreter, and TRITON_INTERPRET must be set before anything
# imports triton: test modules that import transformers' generation utilities pull in torch._inductor, which
# imports triton at collection time. Set here, before any test module is collected; it affects only triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The benches the tests run (in subprocesses, which inherit this) measure the machine's peak at their start and end
# with small products: seconds each on a slow CPU otherwise, and no test reads the peak's value
# (encdec/bench/peak.py default_sizes).
os.environ.setdefault("ENCDEC_BENCH_PEAK_SIZES", "256")


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    """Model tests run with 2 torch threads, as on CI's 2-core machines, whatever this machine has."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def redis_url():
    """URL of a real redis-server: ``$REDIS_URL`` if set (CI starts one), else a
    ``LocalRedisServer`` started for the session."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from encdec.redis_server import LocalRedisServer

    with LocalRedisServer() as server:
        yield server.url


@pytest.fixture
def redis_key_prefix(redis_url):
    """A key prefix unique to this test; its keys are deleted afterwards (never FLUSHDB)."""
    import redis

    prefix = f"test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


WHISPER_CLIPS_DIR = str(DATA_DIR)


@pytest.fixture(scope="session")
def whisper_model_dir():
    from shared.models.registry import resolve_model

    return resolve_model("whisper-tiny.en")[1]


@pytest.fixture(scope="session")
def whisper_features():
    """Log-mel features ``[80, 3000]`` of every committed clip, by file name."""
    import soundfile as sf

    from shared.models.whisper_features import log_mel_spectrogram

    out = {}
    for name in sorted(n for n in os.listdir(WHISPER_CLIPS_DIR) if n.endswith(".wav")):
        pcm, sr = sf.read(os.path.join(WHISPER_CLIPS_DIR, name), dtype="float32")
        assert sr == 16000 and pcm.ndim == 1, name
        out[name] = log_mel_spectrogram(pcm)
    return out


@pytest.fixture(scope="session")
def hf_whisper(whisper_model_dir):
    """HF ``WhisperForConditionalGeneration`` holding the same CT2 weights (the reference)."""
    from encdec.bench.hf_whisper import build_hf_whisper

    return build_hf_whisper(whisper_model_dir)


@pytest.fixture(scope="session")
def hf_whisper_tokens(hf_whisper, whisper_features):
    """HF greedy ``generate`` ids of each clip run alone (no prompt, no end token): the truth.

    Computed once per session; the parity, engine and end-to-end tests all compare with it.
    """
    import torch

    out = {}
    with torch.inference_mode():
        for name, feats in whisper_features.items():
            ids = hf_whisper.generate(feats[None]).tolist()[0]
            assert ids and ids[-1] != 50256 and ids[0] not in (50257, 50362), ids
            out[name] = ids
    return out


@pytest.fixture(scope="session")
def text_checkpoints(tmp_path_factory):
    """Tiny random T5 (v1.0, v1.1), BART, mBART, Marian HF directories with trained tokenizers, built once.

    Also ``t5-long``: the T5 v1.0 weights with pad and the end token suppressed, for outputs past the bucket boundary.
    """
    from helpers.text_checkpoints import BUILDERS, with_generation

    root = tmp_path_factory.mktemp("text-checkpoints")
    dirs = {name: build(root / name) for name, build in BUILDERS.items()}
    dirs["t5-long"] = with_generation(dirs["t5"], root / "t5-long", suppress_tokens=[0, 1])
    return dirs


@pytest.fixture(scope="session")
def tiny_services(redis_url, tmp_path_factory):
    """The session's whisper-tiny.en stack (``helpers.stacks.stack``), shared by every module that needs a plain
    one (e2e, CLI); a test that kills one of its processes restarts it before it ends."""
    from helpers.stacks import TINY, TINY_ENCODE_TIMEOUT_S, stack

    # The realtime tests run 8 unpaced streams at once, more than 2 cores decode in real time: the measured-capacity
    # rule is off here (tests/e2e/test_e2e_realtime.py tests it on the whisper-base stack).
    decoder_args = ("--encode-timeout-s", str(TINY_ENCODE_TIMEOUT_S), "--realtime-capacity", "0")
    with stack(TINY, redis_url, tmp_path_factory.mktemp("tiny-logs"), decoder_args) as svc:
        yield svc


@pytest.fixture(scope="session")
def tiny_stub(tiny_services):
    import grpc

    from shared.proto import decoder_pb2_grpc

    with grpc.insecure_channel(tiny_services.decoder_address) as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel)
