"""Tiny random HF checkpoints + real tokenizers trained at test time (no hub access).

Each builder writes a complete HF-format directory (``config.json``, weights,
``generation_config.json``, tokenizer files) exactly as ``save_pretrained``
does, so tests load it the way a user would: through the registry. Weights are
re-drawn with unit-scale variance (HF's 0.02 init makes every output one token
repeated) so greedy outputs vary.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path

import torch

from encdec.bench.seq2seq_checkpoints import random_init

WORDS = (
    "the a cat dog house river blue green quick slow runs jumps over under near far tree stone light dark "
    "morning evening rain snow wind sun moon star city road bridge boat train small large old new red white "
    "black yellow bird fish horse mountain valley forest garden window door table chair book paper music song "
    "happy sad cold warm bright quiet loud friend teacher child mother father sister brother open close"
).split()

D = dict(d_model=64, heads=4, layers=2, ffn=128)
MAX_POS = 256


def corpus(n: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) + rng.choice([".", "!", "?", ","])
        for _ in range(n)
    ]


def sentence(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _spm(vocab_size: int, **ids) -> object:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="unigram",
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
        **ids,
    )
    proc = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    return proc, buf.getvalue()


def _pieces(proc, skip: set[str]) -> list[tuple[str, float]]:
    return [
        (proc.id_to_piece(i), proc.get_score(i))
        for i in range(proc.get_piece_size())
        if proc.id_to_piece(i) not in skip
    ]


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Large random weights (``encdec.bench.seq2seq_checkpoints.random_init``, logits bias included)."""
    random_init(model, seed, final_logits_bias=True)


def _save(model, tokenizer, out: Path, generation: dict) -> Path:
    for k, v in generation.items():
        setattr(model.generation_config, k, v)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_t5(out: Path, v1_1: bool, seed: int = 1, max_distance: int = 128) -> Path:
    from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer

    proc, _ = _spm(300, unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1)
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + _pieces(proc, {"<unk>"})
    tok = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=MAX_POS)
    cfg = T5Config(
        vocab_size=len(vocab),
        d_model=D["d_model"],
        d_kv=16,
        d_ff=D["ffn"],
        num_layers=D["layers"],
        num_decoder_layers=D["layers"],
        num_heads=D["heads"],
        relative_attention_max_distance=max_distance,
        feed_forward_proj="gated-gelu" if v1_1 else "relu",
        tie_word_embeddings=not v1_1,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    model = T5ForConditionalGeneration(cfg)
    _reinit(model, seed)
    gen = {"suppress_tokens": [5, 6], "begin_suppress_tokens": [7, 8]} if v1_1 else {}
    return _save(model, tok, out, gen)


def build_bart(out: Path, seed: int = 2) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import BartConfig, BartForConditionalGeneration, BartTokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        corpus(),
        vocab_size=400,
        min_frequency=2,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        show_progress=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    bpe.save_model(str(out))
    tok = BartTokenizer(vocab=str(out / "vocab.json"), merges=str(out / "merges.txt"), model_max_length=MAX_POS)
    cfg = BartConfig(
        vocab_size=len(tok),
        d_model=D["d_model"],
        encoder_layers=D["layers"],
        decoder_layers=D["layers"],
        encoder_attention_heads=D["heads"],
        decoder_attention_heads=D["heads"],
        encoder_ffn_dim=D["ffn"],
        decoder_ffn_dim=D["ffn"],
        max_position_embeddings=MAX_POS,
        scale_embedding=True,
        activation_function="gelu",
    )
    model = BartForConditionalGeneration(cfg)
    _reinit(model, seed)
    return _save(model, tok, out, {"forced_bos_token_id": 0, "forced_eos_token_id": 2, "decoder_start_token_id": 2})


def build_mbart(out: Path, seed: int = 3) -> Path:
    from transformers import MBartConfig, MBartForConditionalGeneration, MBartTokenizer

    proc, _ = _spm(300, unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1)
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + _pieces(proc, {"<unk>"})
    tok = MBartTokenizer(vocab=vocab, src_lang="en_XX", tgt_lang="de_DE", model_max_length=MAX_POS)
    cfg = MBartConfig(
        vocab_size=len(tok),
        d_model=D["d_model"],
        encoder_layers=D["layers"],
        decoder_layers=D["layers"],
        encoder_attention_heads=D["heads"],
        decoder_attention_heads=D["heads"],
        encoder_ffn_dim=D["ffn"],
        decoder_ffn_dim=D["ffn"],
        max_position_embeddings=MAX_POS,
        scale_embedding=True,
        activation_function="gelu",
    )
    model = MBartForConditionalGeneration(cfg)
    _reinit(model, seed)
    return _save(
        model,
        tok,
        out,
        {
            "decoder_start_token_id": 2,
            "forced_bos_token_id": tok.convert_tokens_to_ids("de_DE"),
            "forced_eos_token_id": 2,
        },
    )


def build_marian(out: Path, seed: int = 4) -> Path:
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    proc, proto = _spm(300)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("source.spm", "target.spm"):
        (out / name).write_bytes(proto)
    pieces = [p for p, _ in _pieces(proc, {"<unk>", "<s>", "</s>"})]
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    vocab["<pad>"] = len(vocab)
    (out / "vocab.json").write_text(json.dumps(vocab))
    tok = MarianTokenizer(
        str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json"), model_max_length=MAX_POS
    )
    pad = vocab["<pad>"]
    cfg = MarianConfig(
        vocab_size=len(vocab),
        d_model=D["d_model"],
        encoder_layers=D["layers"],
        decoder_layers=D["layers"],
        encoder_attention_heads=D["heads"],
        decoder_attention_heads=D["heads"],
        encoder_ffn_dim=D["ffn"],
        decoder_ffn_dim=D["ffn"],
        max_position_embeddings=MAX_POS,
        scale_embedding=True,
        activation_function="swish",
        pad_token_id=pad,
        eos_token_id=0,
        decoder_start_token_id=pad,
        forced_eos_token_id=0,
    )
    model = MarianMTModel(cfg)
    _reinit(model, seed)
    return _save(model, tok, out, {"bad_words_ids": [[pad]]})


def with_generation(src: Path, out: Path, **fields) -> Path:
    """A copy of ``src`` whose ``generation_config.json`` also sets ``fields``."""
    shutil.copytree(src, out)
    path = out / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}, indent=2))
    return out


BUILDERS = {
    "t5": lambda out: build_t5(out, v1_1=False),
    "t5-v1_1": lambda out: build_t5(out, v1_1=True, max_distance=32),
    "bart": build_bart,
    "mbart": build_mbart,
    "marian": build_marian,
}
