"""The ``device`` / ``kv_device`` / ``dtype`` settings: validation messages, startup on a missing GPU, and
``device=cpu`` set explicitly decoding exactly what the default does (real Whisper tiny.en, through the
encoder's batcher, the shm transport and the decoder engine that ``build_engine`` makes).

The GPU side (model on cuda, torch and triton attention) is checked by scripts/gpu_model_check.py.
"""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.startup import build_engine
from encdec import DATA_DIR
from encoder_svc.batcher import EncodeBatcher, EncodeItem
from shared.config import (
    CPU_MAX_BATCH_TOKENS,
    CUDA_MAX_BATCH_TOKENS,
    DecoderServiceConfig,
    EncoderServiceConfig,
    add_config_arguments,
    config_from,
)
from shared.device import resolve_device, same_device, torch_dtype
from shared.kv_transport import create_writer
from shared.models.registry import load_model
from shared.models.whisper_features import log_mel_spectrogram

ROOT = Path(__file__).resolve().parents[2]
CLIPS = ["short.wav", "weather.wav"]
NO_CUDA = not torch.cuda.is_available()


# ---- validation (config time: strings only, so a GPU-less machine validates a GPU deployment) ----------------


@pytest.mark.parametrize("cls", [DecoderServiceConfig, EncoderServiceConfig])
@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "CUDA", "cpu:0", "mps"])
def test_device_spelling_refused(cls, bad):
    with pytest.raises(ValueError, match=r"device must be cpu, cuda or cuda:N"):
        cls(device=bad)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kv_device": "cuda"}, r"kv_device 'cuda' differs from device 'cpu'.*leave kv_device unset"),
        (
            {"device": "cuda:1", "kv_device": "cuda:0", "kv_transport": "cuda_ipc"},
            r"kv_device 'cuda:0' differs from device 'cuda:1'",
        ),
        (
            {"device": "cuda"},
            r"kv_transport shm keeps the cross-KV pool in host shared memory.*use kv_transport cuda_ipc",
        ),
        ({"kv_transport": "cuda_ipc"}, r"cuda_ipc puts the cross-KV pool on a GPU: set device cuda"),
        ({"device": "cuda", "kv_transport": "torch_dist"}, r"gloo sends CPU tensors only.*use kv_dist_backend nccl"),
        (
            {"device": "cuda", "kv_transport": "cuda_ipc", "quantize": "int8"},
            r"quantize int8 is CPU dynamic quantization.*quantize none",
        ),
        ({"dtype": "float16"}, r"dtype float16 is for CUDA devices.*set device cuda"),
        ({"dtype": "half"}, r"dtype must be one of: float32, float16, bfloat16"),
    ],
)
def test_decoder_device_combinations_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecoderServiceConfig(**kwargs)


def test_cpu_bfloat16_needs_avx512_bf16_or_amx(monkeypatch):
    """``--dtype bfloat16`` on the CPU is opt-in where the CPU multiplies bfloat16 natively, refused elsewhere
    with the flags it needs; the decoder's KV follows it into bfloat16."""
    import shared.config.base as base

    monkeypatch.setattr(base, "cpu_bf16_flags", lambda: [])
    for cls in (DecoderServiceConfig, EncoderServiceConfig):
        with pytest.raises(ValueError, match=r"bfloat16 on the CPU needs AVX-512 BF16 or AMX.*avx512_bf16 or amx_bf16"):
            cls(dtype="bfloat16")
    monkeypatch.setattr(base, "cpu_bf16_flags", lambda: ["avx512_bf16"])
    decoder = DecoderServiceConfig(dtype="bfloat16")
    assert decoder.kv_transfer_dtype == "bfloat16" and EncoderServiceConfig(dtype="bfloat16").dtype == "bfloat16"
    assert DecoderServiceConfig(dtype="bfloat16", kv_transfer_dtype="float16").kv_transfer_dtype == "float16"
    assert DecoderServiceConfig(dtype="bfloat16", kv_transfer_dtype="float32").kv_transfer_dtype == "float32"  # kept
    assert DecoderServiceConfig().kv_transfer_dtype == "float32"
    with pytest.raises(ValueError, match=r"quantize int8 takes float32 weights"):
        DecoderServiceConfig(dtype="bfloat16", quantize="int8")
    with pytest.raises(ValueError, match=r"dtype float16 is for CUDA devices"):
        DecoderServiceConfig(dtype="float16")


def test_decoder_kv_device_follows_device():
    assert DecoderServiceConfig().kv_device == "cpu"
    gpu = DecoderServiceConfig(device="cuda:0", kv_transport="cuda_ipc")
    assert gpu.kv_device == "cuda:0"
    assert DecoderServiceConfig(device="cuda", kv_device="cuda:0", kv_transport="cuda_ipc").kv_device == "cuda:0"
    nccl = DecoderServiceConfig(device="cuda", kv_transport="torch_dist", kv_dist_backend="nccl", dtype="bfloat16")
    assert nccl.kv_device == "cuda" and same_device(nccl.kv_device, "cuda:0")


def test_encoder_kv_device_defaults_to_what_the_backend_sends_from():
    assert EncoderServiceConfig().kv_device == "cpu"
    assert EncoderServiceConfig(device="cuda").kv_device == "cpu"  # gloo stages on the CPU
    assert EncoderServiceConfig(device="cuda:1", kv_dist_backend="nccl").kv_device == "cuda:1"
    with pytest.raises(ValueError, match=r"gloo sends CPU tensors only"):
        EncoderServiceConfig(kv_device="cuda")
    assert EncoderServiceConfig(kv_device="cuda", kv_transport="shm").kv_device == "cuda"  # torch_dist unused
    with pytest.raises(ValueError, match=r"quantize int8 is CPU dynamic quantization"):
        EncoderServiceConfig(device="cuda", quantize="int8")


def test_encoder_batch_token_budget_defaults_by_device():
    assert EncoderServiceConfig().max_batch_tokens == CPU_MAX_BATCH_TOKENS == 4096  # 2 Whisper windows of 1500
    assert EncoderServiceConfig(device="cuda:1").max_batch_tokens == CUDA_MAX_BATCH_TOKENS == 12288
    assert EncoderServiceConfig(max_batch_tokens=12288).max_batch_tokens == 12288  # an explicit budget stays
    assert (
        config_from(
            EncoderServiceConfig, env={"ENCDEC_MAX_BATCH_TOKENS": "0", "ENCDEC_DEVICE": "cuda"}
        ).max_batch_tokens
        == 12288
    )
    with pytest.raises(ValueError, match=r"max_batch_tokens must be >= 1, or 0 for the device's default; got -1"):
        EncoderServiceConfig(max_batch_tokens=-1)
    with pytest.raises(ValueError, match=r"max_inputs_per_request must be >= 1, got 0"):
        EncoderServiceConfig(max_inputs_per_request=0)


def test_device_from_env_and_flag():
    env = {"ENCDEC_DEVICE": "cuda:0", "ENCDEC_KV_TRANSPORT": "cuda_ipc", "ENCDEC_DTYPE": "float16"}
    config = config_from(DecoderServiceConfig, env=env)
    assert (config.device, config.kv_device, config.dtype) == ("cuda:0", "cuda:0", "float16")
    import argparse

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EncoderServiceConfig)
    args = parser.parse_args(["--device", "cpu", "--dtype", "float32"])
    assert config_from(EncoderServiceConfig, args, env={"ENCDEC_DEVICE": "cuda"}).device == "cpu"  # the flag wins


# ---- startup (torch is asked only now) -----------------------------------------------------------------------


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
def test_resolve_device_without_cuda_says_what_to_do():
    assert resolve_device("cpu") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(
            ValueError, match=rf"device '{name}' requested but .*set device cpu \(ENCDEC_DEVICE=cpu / --device cpu\)"
        ):
            resolve_device(name)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
@pytest.mark.parametrize(
    "argv",
    [
        ["serve-decoder", "--device", "cuda", "--kv-transport", "cuda_ipc", "--redis-url", "redis://127.0.0.1:1/0"],
        ["serve-encoder", "--device", "cuda:0", "--kv-transport", "cuda_ipc"],
        ["serve-encoder", "--device", "cuda", "--model", "all-MiniLM-L6-v2"],
    ],
)
def test_service_started_on_a_missing_gpu_exits_with_the_reason(argv):
    result = subprocess.run(
        [sys.executable, "-m", "encdec.cli", *argv], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "encdec: error: device 'cuda" in result.stderr and "set device cpu" in result.stderr, result.stderr[-2000:]


def test_torch_dtype():
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        torch_dtype("fp8")


# ---- device=cpu set explicitly == the default, token for token ------------------------------------------------


def _pcm(name: str) -> np.ndarray:
    with wave.open(str(DATA_DIR / name)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0


def _transcribe(enc: EncoderServiceConfig, dec: DecoderServiceConfig, params: SamplingParams) -> dict[str, list[int]]:
    """Every clip in one batch: encoder batcher (on ``enc.device``) -> shm writer -> ``build_engine``'s pool and engine."""
    model = load_model(dec.model, torch_dtype(dec.dtype), resolve_device(dec.device))
    encoder_model = load_model(enc.model, torch_dtype(enc.dtype), resolve_device(enc.device))
    engine, pool = build_engine(dec, model)
    writer = create_writer("shm")
    batcher = EncodeBatcher(encoder_model, log_mel_spectrogram, writer, max_batch_size=4, batch_wait_ms=0)
    tokens: dict[str, list[int]] = {}
    try:
        for clip in CLIPS:
            engine.add_request(clip, model.config.max_source_positions, params)
            tokens[clip] = []
        for _ in range(500):
            if not engine.has_unfinished_requests():
                break
            out = engine.step()
            for rid, blocks in out.to_encode:
                batcher.submit(EncodeItem(rid, _pcm(rid), pool.spec, blocks)).result(timeout=120)
                engine.mark_encoded(rid)
            for o in out.outputs:
                tokens[o.request_id] += o.new_token_ids
        assert not engine.has_unfinished_requests()
        assert engine.model_runner.device == torch.device(dec.device)
    finally:
        batcher.stop()
        writer.close()
        pool.close()
    return tokens


@pytest.fixture(scope="module")
def small_pools():
    return {"num_self_blocks": 64, "num_cross_blocks": 2 * 94, "max_num_seqs": 4}


def test_explicit_cpu_device_decodes_exactly_like_the_default(small_pools, hf_whisper_tokens):
    greedy, seeded = SamplingParams(), SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=11, max_tokens=12)
    default = DecoderServiceConfig(**small_pools, encoder_cache=0)
    explicit = DecoderServiceConfig(**small_pools, encoder_cache=0, device="cpu", kv_device="cpu", dtype="float32")
    enc_default, enc_explicit = EncoderServiceConfig(), EncoderServiceConfig(device="cpu", dtype="float32")
    for params in (greedy, seeded):
        want = _transcribe(enc_default, default, params)
        got = _transcribe(enc_explicit, explicit, params)
        assert got == want, params
        if params is greedy:
            assert want == {c: hf_whisper_tokens[c] + [50256] for c in CLIPS}
        else:
            assert all(len(t) == 12 or t[-1] == 50256 for t in got.values()), got
