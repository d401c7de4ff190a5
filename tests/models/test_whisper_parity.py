"""Parity of our paged Whisper tiny.en with HF transformers on the same CT2 weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.paged_greedy import paged_greedy_decode

from encdec import DATA_DIR
from shared.attention_metadata import AttentionMetadata
from shared.models.registry import load_model, resolve_model

DATA = DATA_DIR
CLIPS = sorted(p.name for p in DATA.glob("*.wav"))
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def model_dir(whisper_model_dir) -> Path:
    return whisper_model_dir


@pytest.fixture(scope="module")
def ours(model_dir):
    """Loaded as the decoder service does: decode-step weights packed where the CPU kernel runs."""
    model = load_model(model_dir)
    model.pack_decode_weights()
    return model


@pytest.fixture(scope="module")
def hf(hf_whisper):
    return hf_whisper


@pytest.fixture(scope="module")
def features(whisper_features) -> dict[str, torch.Tensor]:
    return whisper_features


@pytest.fixture(scope="module")
def hf_tokens(hf_whisper_tokens) -> dict[str, list[int]]:
    """HF greedy ``generate`` ids of each clip run alone: the truth (see conftest)."""
    return hf_whisper_tokens


PAIR = ["sample.wav", "short.wav"]


@pytest.fixture(scope="module")
def hf_encoder_out(hf, features) -> torch.Tensor:
    """HF encoder output of the ``PAIR`` clips, ``[2, 1500, 384]``."""
    with torch.inference_mode():
        return hf.model.encoder(torch.stack([features[n] for n in PAIR])).last_hidden_state


def test_clips_committed():
    assert len(CLIPS) >= 4 and "sample.wav" in CLIPS


def test_encoder_output_close(ours, features, hf_encoder_out):
    batch = torch.stack([features[n] for n in PAIR])  # [2, 80, 3000]
    ref = hf_encoder_out
    got = ours.encode(batch)
    assert got.shape == (2, 1500, 384) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    print(f"max |encoder_out - hf| = {(got - ref).abs().max().item():.2e}")
    # Batching must not change an input's result beyond float noise.
    torch.testing.assert_close(ours.encode(batch[1:]), got[1:], atol=1e-4, rtol=1e-4)


def test_cross_kv_matches_hf_projections(ours, hf, hf_encoder_out):
    with torch.inference_mode():
        enc = hf_encoder_out[:1]  # [1, 1500, 384]
        kv = ours.compute_cross_kv(enc)  # [4, 2, 1, 1500, 6, 64]
        assert kv.shape == (4, 2, 1, 1500, 6, 64)
        for i, layer in enumerate(hf.model.decoder.layers):
            k = layer.encoder_attn.k_proj(enc).view(1, 1500, 6, 64)
            v = layer.encoder_attn.v_proj(enc).view(1, 1500, 6, 64)
            torch.testing.assert_close(kv[i, 0], k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(kv[i, 1], v, atol=1e-5, rtol=1e-5)


def _prefill_logits(model, feats: torch.Tensor, seqs: list[list[int]], block_size: int = 7) -> list[torch.Tensor]:
    """Teacher-forced logits at every position of each sequence, all in one flat prefill step."""
    c = model.config
    enc = model.encode(feats)
    cross = model.compute_cross_kv(enc)  # [L, 2, B, S, H, Dh]
    b, s = enc.shape[:2]
    n_cross = -(-s // block_size)
    perm = torch.randperm(b * n_cross, generator=torch.Generator().manual_seed(1))
    cross_tables = perm.view(b, n_cross)
    cross_cache = torch.zeros(c.decoder_layers, 2, b * n_cross, block_size, c.num_heads, c.head_dim)
    for i in range(b):
        padded = torch.zeros(c.decoder_layers, 2, n_cross * block_size, c.num_heads, c.head_dim)
        padded[:, :, :s] = cross[:, :, i]
        cross_cache[:, :, cross_tables[i]] = padded.view(
            c.decoder_layers, 2, n_cross, block_size, c.num_heads, c.head_dim
        )
    lens = [len(x) for x in seqs]
    n_self = [-(-n // block_size) for n in lens]
    self_perm = torch.randperm(sum(n_self), generator=torch.Generator().manual_seed(2)).tolist()
    tables, slots, start = [], [], 0
    for n, nb in zip(lens, n_self):
        blocks = self_perm[start : start + nb]
        start += nb
        tables.append(blocks + [0] * (max(n_self) - nb))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
    qsl = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.long)
    md = AttentionMetadata(
        query_start_loc=qsl,
        slot_mapping=torch.tensor(slots),
        seq_lens=torch.tensor(lens),
        block_tables=torch.tensor(tables),
        cross_block_tables=cross_tables.long(),
        encoder_lens=torch.full((b,), s),
        logits_indices=qsl[1:] - 1,
        max_query_len=max(lens),
        max_seq_len=max(lens),
        max_encoder_len=s,
    )
    self_cache = torch.zeros(c.decoder_layers, 2, sum(n_self), block_size, c.num_heads, c.head_dim)
    ids = torch.tensor([t for x in seqs for t in x])
    pos = torch.cat([torch.arange(n) for n in lens])
    logits = model.compute_logits(model(ids, pos, md, self_cache, cross_cache))  # [T, V]
    return list(logits.split(lens))


def test_teacher_forced_logits_close(ours, hf, features, hf_tokens, hf_encoder_out):
    names = PAIR
    prompt = ours.generation.decoder_prompt_ids
    seqs = [prompt + hf_tokens[n] + [50256] for n in names]
    feats = torch.stack([features[n] for n in names])
    got = _prefill_logits(ours, feats, seqs)
    worst = 0.0
    enc = hf_encoder_out
    with torch.inference_mode():
        for i, seq in enumerate(seqs):
            ref = hf(encoder_outputs=(enc[i : i + 1],), decoder_input_ids=torch.tensor([seq])).logits[0]
            worst = max(worst, (got[i] - ref).abs().max().item())
            torch.testing.assert_close(got[i], ref, atol=LOGIT_ATOL, rtol=0)
    print(f"max |logits - hf| = {worst:.2e}")


def test_greedy_alone_matches_hf_generate(ours, features, hf_tokens):
    got = paged_greedy_decode(ours, features["sample.wav"][None], block_size=16)[0]
    assert got == hf_tokens["sample.wav"]


def test_greedy_batch_matches_hf_generate_and_alone(ours, features, hf_tokens):
    """Every clip in one flat varlen batch equals HF generate on that clip alone.

    Block size 7 divides neither 1500 nor the lengths; clips join one step
    apart (prefill mixed with decode steps) and finish at different steps,
    freeing blocks that the others reuse.
    """
    feats = torch.stack([features[n] for n in CLIPS])
    got = paged_greedy_decode(ours, feats, block_size=7, stagger=1, seed=3)
    assert got == [hf_tokens[n] for n in CLIPS]
    assert len({len(hf_tokens[n]) for n in CLIPS}) > 1  # sequences really finish at different steps


def test_registry_names_and_errors(model_dir, tmp_path):
    from shared.models.registry import ModelNotFoundError, model_names

    assert resolve_model("openai/whisper-tiny.en") == ("whisper", model_dir)
    assert resolve_model(str(model_dir)) == ("whisper", model_dir.resolve())
    assert {"whisper-tiny.en", "openai/whisper-tiny.en", str(model_dir)} <= model_names(model_dir)
    for bad in ("no-such-model", str(tmp_path)):
        with pytest.raises(ModelNotFoundError, match="whisper-tiny.en"):
            resolve_model(bad)


def test_ct2_reader_rejects_bad_files(model_dir, tmp_path):
    from shared.models.ct2_reader import load_ct2_weights

    raw = (model_dir / "model.bin").read_bytes()
    w = load_ct2_weights(model_dir / "model.bin", expected_spec="WhisperSpec")
    assert w["decoder/projection/weight"] is w["decoder/embeddings/weight"]  # alias resolved
    assert w["encoder/conv1/weight"].shape == (384, 80, 3) and w["encoder/conv1/weight"].dtype == torch.float16
    cases = {
        "truncated": (raw[: len(raw) // 2], "truncated"),
        "garbled_version": (b"\xff" * 4 + raw[4:], "binary version"),
        "trailing": (raw + b"\x00" * 3, "unread bytes"),
    }
    for name, (data, msg) in cases.items():
        bad = tmp_path / f"{name}.bin"
        bad.write_bytes(data)
        with pytest.raises(ValueError, match=msg) as info:
            load_ct2_weights(bad)
        assert str(bad) in str(info.value)
    with pytest.raises(ValueError, match="expected 'T5Spec'"):
        load_ct2_weights(model_dir / "model.bin", expected_spec="T5Spec")
