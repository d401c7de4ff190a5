"""HF-format Whisper directories (``WhisperForConditionalGeneration``) through the registry.

Tiny random checkpoints written here with ``transformers`` (safetensors and ``pytorch_model.bin``,
128 mel bins with fewer decoder than encoder layers, English-only) must give HF's encoder output,
cross-attention K/V and decoder logits; whisper-base saved in HF layout must load to the same
weights, generation defaults and greedy tokens as the CTranslate2 whisper-base.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import soundfile as sf
import torch
from helpers.paged_greedy import paged_greedy_decode

from encdec import DATA_DIR
from encdec.bench.hf_whisper import build_hf_whisper
from shared.models.hf_checkpoint import load_hf_weights
from shared.models.registry import load_model, load_tokenizer, resolve_model
from shared.models.whisper_features import log_mel_spectrogram, special_token_ids
from shared.models.whisper_hf import ct2_weights_from_hf, read_hf_whisper, whisper_config_fields

ATOL = 1e-4  # tiny random checkpoints vs HF
BASE_LOGIT_ATOL = 1e-3  # whisper-base: HF-dir load vs CTranslate2 load
TINY_LANGUAGES = ("en", "de", "fr", "ja", "zh")  # a subset of the tokenizer's: lang_to_id must be what counts
CASES = {
    "multilingual-safetensors": dict(enc=2, dec=2, mels=80, weights="safetensors", tokenizer="tokenizer.json"),
    "mel128-fewer-decoder-layers-bin": dict(enc=3, dec=1, mels=128, weights="bin", tokenizer="bpe"),
    "english-only": dict(enc=2, dec=2, mels=80, weights="safetensors", tokenizer="tokenizer.json", english=True),
}


def _features(name: str, mels: int) -> torch.Tensor:
    pcm, sr = sf.read(DATA_DIR / name, dtype="float32")
    assert sr == 16000 and pcm.ndim == 1, name
    return log_mel_spectrogram(pcm, mels)  # [mels, 3000]


def _write_tokenizer(src_dir, dst_dir, layout: str) -> None:
    """``tokenizer.json`` as is, or the transformers-4 layout: vocab.json + merges.txt + added_tokens.json."""
    if layout == "tokenizer.json":
        shutil.copy(src_dir / "tokenizer.json", dst_dir / "tokenizer.json")
        return
    tok = json.loads((src_dir / "tokenizer.json").read_text(encoding="utf-8"))
    (dst_dir / "vocab.json").write_text(json.dumps(tok["model"]["vocab"]), encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    (dst_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    (dst_dir / "added_tokens.json").write_text(json.dumps(added), encoding="utf-8")


def _write_generation_config(dst_dir, ids: dict[str, int], languages, alignment_heads, suppress, begin_suppress):
    from transformers import GenerationConfig

    eot = ids["<|endoftext|>"]
    extra = {}
    if languages:
        extra = dict(
            lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in languages},
            task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        )
    GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"],
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        max_length=448,
        no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids["<|startofprev|>"],
        is_multilingual=bool(languages),
        alignment_heads=[list(h) for h in alignment_heads],
        suppress_tokens=list(suppress),
        begin_suppress_tokens=list(begin_suppress),
        max_initial_timestamp_index=50,
        **extra,
    ).save_pretrained(dst_dir)


def _write_preprocessor(dst_dir, mels: int) -> None:
    from transformers import WhisperFeatureExtractor

    WhisperFeatureExtractor(feature_size=mels).save_pretrained(dst_dir)


@pytest.fixture(scope="module")
def base_dir():
    return resolve_model("whisper-base")[1]


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory, base_dir):
    """``(case, directory, HF model)`` of a random tiny HF Whisper checkpoint."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    from transformers.initialization import no_init_weights

    case = dict(CASES[request.param], name=request.param)
    src = resolve_model("whisper-tiny.en")[1] if case.get("english") else base_dir
    ids = special_token_ids(src)
    cfg = WhisperConfig(
        vocab_size=51864 if case.get("english") else 51865,
        num_mel_bins=case["mels"],
        d_model=64,
        encoder_layers=case["enc"],
        decoder_layers=case["dec"],
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(len(request.param))
    with no_init_weights():  # HF's init leaves biases 0 and norms 1: every tensor is randomized below instead
        hf = WhisperForConditionalGeneration(cfg).eval()
    hf.tie_weights()  # skipped with the init: proj_out shares the token embedding, as in a loaded checkpoint
    with torch.no_grad():  # so that every mapped tensor matters
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "layer_norm.weight" in name else 0.1 * torch.randn_like(p))
    assert hf.proj_out.weight is hf.model.decoder.embed_tokens.weight
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    if case["weights"] == "bin":  # transformers 5 saves safetensors only; the .bin layout of older checkpoints
        torch.save(hf.state_dict(), path / "pytorch_model.bin")
        (path / "model.safetensors").unlink()
    _write_tokenizer(src, path, case["tokenizer"])
    languages = () if case.get("english") else TINY_LANGUAGES
    _write_generation_config(path, ids, languages, [(1, 0), (1, 3)], [1, 2, 7], [220, ids["<|endoftext|>"]])
    _write_preprocessor(path, case["mels"])
    return case, path, hf


@pytest.fixture(scope="module")
def tiny_ours(tiny):
    """The tiny checkpoint loaded through the registry."""
    return load_model(tiny[1])


def test_registry_resolves_and_loads(tiny, tiny_ours, base_dir):
    case, path, _ = tiny
    assert resolve_model(path) == ("whisper", path.resolve())
    assert resolve_model(str(path))[0] == "whisper"
    ours = tiny_ours
    c = ours.config
    assert (c.d_model, c.num_heads, c.head_dim, c.ffn_dim) == (64, 4, 16, 128)
    assert (c.encoder_layers, c.decoder_layers, c.num_mel_bins) == (case["enc"], case["dec"], case["mels"])
    g, s = ours.generation, ours.generation.specials
    assert g.suppress_tokens == [1, 2, 7] and g.begin_suppress_tokens == [220, s.eot] and g.max_length == 448
    assert s.alignment_heads == ((1, 0), (1, 3))
    if case.get("english"):
        assert g.decoder_prompt_ids == [50257, 50362] and s.eot == 50256 and s.languages == {}
        assert not s.multilingual
    else:
        assert g.decoder_prompt_ids == [50258, 50259, 50359, 50363] and s.eot == 50257
        assert dict(s.languages) == {code: special_token_ids(base_dir)[f"<|{code}|>"] for code in TINY_LANGUAGES}
        reference = load_tokenizer(base_dir)
        tokenizer = load_tokenizer(path)
        text = " The quarterly budget, 3.5% up: Grüße aus 東京."
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        ids = torch.randint(0, 51865, (400,), generator=torch.Generator().manual_seed(1)).tolist()
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_encoder_cross_kv_and_paged_logits_match_hf(tiny, tiny_ours):
    case, _, hf = tiny
    ours, c = tiny_ours, tiny_ours.config
    feats = torch.stack([_features(n, case["mels"]) for n in ("short.wav", "numbers.wav")])  # [2, mels, 3000]
    with torch.inference_mode():
        ref_enc = hf.model.encoder(feats).last_hidden_state  # [2, 1500, 64]
        ref_kv = torch.stack(
            [
                torch.stack([attn.k_proj(ref_enc), attn.v_proj(ref_enc)]).view(2, 2, -1, c.num_heads, c.head_dim)
                for attn in (layer.encoder_attn for layer in hf.model.decoder.layers)
            ]
        )  # [L, 2, B, S, H, Dh]
    enc = ours.encode(feats)
    torch.testing.assert_close(enc, ref_enc, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.compute_cross_kv(enc), ref_kv, atol=ATOL, rtol=0)

    prompt = torch.randint(0, c.vocab_size, (6,), generator=torch.Generator().manual_seed(7)).tolist()
    defaults = ours.generation
    ours.generation = dataclasses.replace(
        defaults, decoder_prompt_ids=prompt, suppress_tokens=[], begin_suppress_tokens=[]
    )
    scores: list[list[torch.Tensor]] = []
    try:
        got = paged_greedy_decode(ours, feats, block_size=5, max_new_tokens=4, stagger=1, scores=scores)
    finally:
        ours.generation = defaults
    for b in range(2):
        with torch.inference_mode():
            ref = hf(input_features=feats[b : b + 1], decoder_input_ids=torch.tensor([prompt + got[b]])).logits[0]
        assert scores[b], case["name"]
        for step, row in enumerate(scores[b]):
            torch.testing.assert_close(row, ref[len(prompt) - 1 + step], atol=ATOL, rtol=0)
        assert got[b] == ref[len(prompt) - 1 : len(prompt) - 1 + len(got[b])].argmax(-1).tolist()


def test_unsupported_variants_are_refused(tiny):
    _, path, _ = tiny
    hf_config = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="head count"):
        whisper_config_fields({**hf_config, "decoder_attention_heads": 8})
    with pytest.raises(ValueError, match="scale_embedding"):
        whisper_config_fields({**hf_config, "scale_embedding": True})
    config, _, _ = read_hf_whisper(path)
    layers = config["encoder_layers"], config["decoder_layers"]
    weights = load_hf_weights(path)
    untied = {**weights, "proj_out.weight": weights["model.decoder.embed_tokens.weight"] + 1}
    with pytest.raises(ValueError, match="untied"):
        ct2_weights_from_hf(untied, *layers)
    with pytest.raises(KeyError, match="encoder_attn.k_proj"):
        ct2_weights_from_hf({k: v for k, v in weights.items() if "encoder_attn.k_proj" not in k}, *layers)
    preprocessor = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**preprocessor, "feature_size": 3}))
    try:
        with pytest.raises(ValueError, match="feature_size 3"):
            read_hf_whisper(path)
    finally:
        (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))


@pytest.fixture(scope="module")
def base_pair(tmp_path_factory, base_dir):
    """``(CTranslate2 whisper-base, the same weights saved and loaded as an HF directory, that directory)``."""
    path = tmp_path_factory.mktemp("whisper-base-hf")
    build_hf_whisper(base_dir).save_pretrained(path)
    ct2_config = json.loads((base_dir / "config.json").read_text())
    ids = special_token_ids(base_dir)
    names = {v: k for k, v in ids.items()}
    _write_tokenizer(base_dir, path, "tokenizer.json")
    _write_generation_config(
        path,
        ids,
        [names[i][2:-2] for i in ct2_config["lang_ids"]],
        ct2_config["alignment_heads"],
        ct2_config["suppress_ids"],
        ct2_config["suppress_ids_begin"],
    )
    _write_preprocessor(path, 80)
    ct2, ours = load_model("whisper-base"), load_model(path)
    for model in (ct2, ours):  # as the decoder service loads them
        model.pack_decode_weights()
    return ct2, ours, path


def test_whisper_base_hf_dir_equals_ct2(base_pair):
    ct2, ours, path = base_pair
    assert resolve_model(path)[0] == "whisper"
    assert ours.config == ct2.config
    assert ours.generation == ct2.generation  # prompt, eos, suppress lists, max_length, specials
    assert len(ours.generation.specials.languages) == 99 and len(ours.generation.specials.alignment_heads) == 8
    theirs = ct2.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name

    feats = _features("sample.wav", 80)[None]
    got_scores: list[list[torch.Tensor]] = []
    ref_scores: list[list[torch.Tensor]] = []
    got = paged_greedy_decode(ours, feats, block_size=16, scores=got_scores)[0]
    ref = paged_greedy_decode(ct2, feats, block_size=16, scores=ref_scores)[0]
    assert got == ref and len(got) > 10
    for a, b in zip(got_scores[0], ref_scores[0], strict=True):
        torch.testing.assert_close(a, b, atol=BASE_LOGIT_ATOL, rtol=0)
    assert "quarterly budget" in load_tokenizer(path).decode(got, skip_special_tokens=True)
