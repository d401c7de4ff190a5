"""T5 (v1.0, v1.1), BART, mBART, Marian vs HF transformers on tiny random checkpoints.

Each checkpoint is a full HF directory (weights, config, generation config,
trained tokenizer) loaded through the registry. Greedy ids come from the real
``DecoderEngine`` (scheduler, paged KV, sampler with the checkpoint's forced /
suppressed tokens) with every input in one continuous batch; the test plays the
encoder service (padded batch encode, cross KV written at the reserved blocks).
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.text_checkpoints import sentence
from helpers.text_paged import BLOCK, engine_greedy, teacher_forced_logits

from shared.models.registry import load_model, load_tokenizer

ARCHS = ["t5", "t5-v1_1", "bart", "mbart", "marian"]
MAX_NEW = 24


def hf_model(path):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(path).eval()


def sources(tokenizer, n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 6, 12, 20, 30, 45, 60][:n]
    return [tokenizer(sentence(rng, k))["input_ids"] for k in lengths]


def hf_greedy(hf, src: list[int], max_new: int) -> list[int]:
    """HF ``generate`` alone, without the decoder start token (the end token kept when produced)."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([src]), max_new_tokens=max_new, do_sample=False, num_beams=1)[0].tolist()
    return out[1:]


def explain_mismatch(model, tokenizer, path, srcs, got, expected) -> str:
    """What a failing greedy comparison needs to be told apart: a near tie that float rounding may flip, or a wrong
    answer (the exact float64 margin at the first differing token), and whether a second engine run repeats it."""
    i = next(k for k, (g, e) in enumerate(zip(got, expected)) if g != e)
    pos = next((k for k, (g, e) in enumerate(zip(got[i], expected[i])) if g != e), min(len(got[i]), len(expected[i])))
    prefix = [model.generation.decoder_start_token_id, *expected[i][:pos]]
    with torch.inference_mode():
        exact = (
            hf_model(path)
            .double()(input_ids=torch.tensor([srcs[i]]), decoder_input_ids=torch.tensor([prefix]))
            .logits[0, -1]
        )
    ours_tok = got[i][pos] if pos < len(got[i]) else None
    margin = (
        f"float64 logits there: HF's token {expected[i][pos]} {float(exact[expected[i][pos]]):.4f}, "
        f"ours {ours_tok} {float(exact[ours_tok]):.4f}"
        if ours_tok is not None and pos < len(expected[i])
        else ""
    )
    again = engine_greedy(model, tokenizer, srcs, MAX_NEW)
    rerun = (
        "a second engine run gives the same ids"
        if again == got
        else (
            "a second engine run "
            + ("matches HF" if again == expected else "gives other ids")
            + ": the engine is not deterministic"
        )
    )
    return f"source {i} differs from HF at generated token {pos}: ours {got[i]}, HF {expected[i]}; {margin}; {rerun}"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logits_match_hf(text_checkpoints, arch):
    path = text_checkpoints[arch]
    model, tokenizer, hf = load_model(path), load_tokenizer(path), hf_model(path)
    model.pack_decode_weights()  # as the decoder service loads it (kernels/packed_linear.py where it runs)
    srcs = sources(tokenizer)
    expected = [hf_greedy(hf, s, MAX_NEW) for s in srcs]
    got = engine_greedy(model, tokenizer, srcs, MAX_NEW)
    if got != expected:
        pytest.fail(explain_mismatch(model, tokenizer, path, srcs, got, expected))
    distinct = {t for ids in expected for t in ids}
    assert len(distinct) >= 15, f"{arch}: outputs too uniform to prove parity ({len(distinct)} distinct tokens)"

    # Teacher-forced logits at every decoder position, each pair alone through the paged path (fp32),
    # measured against HF in float64: the large random weights of these checkpoints amplify float32
    # rounding (HF's own fp32 logits are off by up to ~0.1 here), so ours must be as close to the
    # exact values as HF fp32 is, not bit-equal to HF's summation order.
    start = model.generation.decoder_start_token_id
    targets = [[start, *ids] for ids in expected]
    worst = hf_worst = 0.0
    exact = hf_model(path).double()
    with torch.inference_mode():
        for src, tgt in zip(srcs, targets):
            mine = teacher_forced_logits(model, [src], [tgt], block_size=BLOCK)[0]  # [T, V]
            ref = hf(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([tgt])).logits[0]  # [T, V]
            ref64 = exact(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([tgt])).logits[0]  # [T, V]
            worst = max(worst, float((ref64 - mine).abs().max()))
            hf_worst = max(hf_worst, float((ref64 - ref).abs().max()))
    print(
        f"{arch}: max |logit error| vs float64: ours {worst:.2e}, HF fp32 {hf_worst:.2e} over every position of {len(srcs)} pairs"
    )
    assert worst <= 2 * hf_worst + 1e-5


def test_t5_relative_bias_past_bucket_boundary(text_checkpoints):
    """Source of > 128 tokens and > 128 generated tokens: both sides pass max_distance (128)."""
    path = text_checkpoints["t5-long"]
    model, tokenizer, hf = load_model(path), load_tokenizer(path), hf_model(path)
    rng = random.Random(7)
    long_src = tokenizer(sentence(rng, 140))["input_ids"]
    assert len(long_src) > 128
    srcs = [long_src, tokenizer(sentence(rng, 4))["input_ids"]]
    max_new = 140
    expected = [hf_greedy(hf, s, max_new) for s in srcs]
    assert all(len(e) == max_new for e in expected)  # the end token is suppressed by the checkpoint
    assert engine_greedy(model, tokenizer, srcs, max_new) == expected
    # The argmax settles on one token here, so check the values: logits at all 141 positions, whose
    # position bias reaches past max_distance (source > 128, decoder > 128 tokens).
    tgt = [model.generation.decoder_start_token_id, *expected[0]]
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([long_src]), decoder_input_ids=torch.tensor([tgt])).logits[0]  # [141, V]
    mine = teacher_forced_logits(model, [long_src], [tgt], block_size=BLOCK)[0]
    assert float((ref - mine).abs().max()) < 1e-4


def test_generation_defaults_are_read(text_checkpoints):
    g = load_model(text_checkpoints["mbart"]).generation
    tok = load_tokenizer(text_checkpoints["mbart"])
    assert g.decoder_start_token_id == 2 and g.forced_bos_token_id == tok.convert_tokens_to_ids("de_DE")
    assert "forced_eos_token_id=2" in g.applied()
    marian = load_model(text_checkpoints["marian"]).generation
    pad = load_tokenizer(text_checkpoints["marian"]).pad_token_id
    assert marian.decoder_start_token_id == pad and pad in marian.suppress_tokens
    t5 = load_model(text_checkpoints["t5-v1_1"]).generation
    assert t5.decoder_start_token_id == 0 and t5.suppress_tokens == [5, 6] and t5.begin_suppress_tokens == [7, 8]


def test_sharded_and_bin_weights_load_the_same(text_checkpoints, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    src = text_checkpoints["bart"]
    hf = AutoModelForSeq2SeqLM.from_pretrained(src)
    for name in ("sharded", "bin"):
        out = tmp_path / name
        if name == "sharded":
            hf.save_pretrained(out, max_shard_size="50KB")
            assert len(list(out.glob("*.safetensors"))) > 1
        else:  # transformers 5 writes safetensors even when asked for .bin: write the .bin by hand
            out.mkdir()
            torch.save(hf.state_dict(), out / "pytorch_model.bin")
            assert not list(out.glob("*.safetensors"))
        for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            (out / f).write_bytes((src / f).read_bytes())
        a, b = load_model(src), load_model(out)
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
            assert ka == kb and torch.equal(va, vb), (name, ka)


def test_directory_without_tokenizer_files_is_refused(text_checkpoints, tmp_path):
    # AutoTokenizer once built an empty tokenizer from config.json alone: the services started and
    # every text became a couple of special tokens, with empty text streamed back.
    src = text_checkpoints["bart"]
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    load_model(tmp_path)  # the weights alone still load
    with pytest.raises(FileNotFoundError, match="no tokenizer in .*tokenizer.json"):
        load_tokenizer(tmp_path)
    for arch in ARCHS:
        assert len(load_tokenizer(text_checkpoints[arch])) > 100
