"""Embed inputs under hostile sizes and load, in process (the engine and batcher the EmbedService runs):
the character bound before tokenizing, linear pair truncation equal to HF's, the Tokenize token cap,
deadlines dropping a queued job unrun, and a short job's forward not filled with long sequences.
The same cases against a real service process: ``tests/e2e/test_embed_hostile.py``."""

from __future__ import annotations

import random
import threading
import time

import pytest
from helpers.embed_checkpoints import WORDS, build_classifier

from encoder_svc.embed.batcher import MAX_SKIPS, DeadlineExceededError, EmbedBatcher, plan_forwards
from encoder_svc.embed.engine import load_embed_engine
from encoder_svc.embed.tokenizing import MAX_CHARS_PER_TOKEN, longest_first
from shared.errors import InvalidRequestError, ResourceExhaustedError


@pytest.fixture(scope="module", params=["bert", "roberta", "minilm"])
def engine(request, tmp_path_factory):
    if request.param == "minilm":
        return load_embed_engine("all-MiniLM-L6-v2")
    return load_embed_engine(str(build_classifier(tmp_path_factory.mktemp(request.param) / "m", request.param, 1)))


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice([*WORDS, "日本", "🙂", "x-y", "  ", "unaffable"]) for _ in range(n))


def test_pair_truncation_equals_hf_ids_types_and_offsets(engine):
    """The linear pair truncation gives what the HF tokenizer gives, odd budgets and ties included."""
    tok, rng = engine.tokenizer, random.Random(0)
    for special in (True, False):
        for _ in range(150):
            a, b = _text(rng, rng.randint(0, 160)), _text(rng, rng.randint(0, 160))
            if rng.random() < 0.2:
                b = a  # equal lengths: the tie rule
            ours = engine.tokenize(
                [a], [b], truncate=True, add_special_tokens=special, check_length=False, offsets=True
            )
            ref = tok(
                [a],
                [b],
                truncation="longest_first",
                max_length=engine.max_input_length,
                add_special_tokens=special,
                return_offsets_mapping=True,
            )
            assert ours[0].ids == ref["input_ids"][0], (special, a, b)
            assert ours[0].type_ids == (ref["token_type_ids"][0] if "token_type_ids" in ref else None)
            assert ours[0].offsets == [tuple(o) for o in ref["offset_mapping"][0]]


def test_longest_first_rule():
    assert longest_first(10, 20, 100) == (10, 20)
    assert longest_first(300, 20, 100) == (80, 20)
    assert longest_first(20, 300, 100) == (20, 80)
    assert longest_first(300, 300, 101) == (50, 51)  # a tie: the second segment keeps the odd token
    assert longest_first(301, 300, 101) == (51, 50)


def test_text_over_the_character_bound_is_refused_or_cut_before_tokenizing(engine, monkeypatch):
    limit = engine.max_input_chars
    assert limit == engine.max_input_length * MAX_CHARS_PER_TOKEN
    calls = []
    real = engine.tokenizer.__class__.__call__
    monkeypatch.setattr(engine.tokenizer.__class__, "__call__", lambda *a, **k: calls.append(1) or real(*a, **k))
    huge = "x" * (limit + 1)
    with pytest.raises(
        InvalidRequestError, match=rf"input 1 has {limit + 1} characters, more than .* {limit} .*truncate"
    ):
        engine.tokenize(["fine", huge])
    with pytest.raises(InvalidRequestError, match="the text_pair of input 0 has"):
        engine.tokenize(["fine"], [huge])
    assert not calls  # refused before any tokenizer work
    text = "word " * (2 * limit)
    cut = engine.tokenize([text], truncate=True)[0]
    assert cut.ids == real(engine.tokenizer, text, truncation=True, max_length=engine.max_input_length)["input_ids"]


def test_tokenize_total_token_cap(engine):
    texts = ["one two three four five six seven eight"] * 50
    engine.tokenize(texts, check_length=False, max_total_tokens=10_000)
    with pytest.raises(ResourceExhaustedError, match="more than 100 tokens in all"):
        engine.tokenize(texts, check_length=False, max_total_tokens=100)


def test_short_sequences_do_not_share_a_forward_with_long_ones():
    lengths = [256] * 40 + [9, 12]
    groups = plan_forwards(lengths, max_batch_tokens=4096)
    assert groups[0] == [40, 41]  # before: the two short ones and 14 long ones in one 4096-token forward
    assert all(len(g) * 256 <= 4096 for g in groups[1:])
    assert plan_forwards([3, 10, 40, 64], 4096) == [[0, 1, 2, 3]]  # all short: one forward
    assert plan_forwards([100, 150, 200, 250], 4096) == [[0, 1, 2], [3]]  # within 2x of the shortest


class GatedEngine:
    """Wraps the engine: records the sequences of each forward; every forward waits for ``gate``."""

    def __init__(self, engine):
        self.engine = engine
        self.forwards: list[list[int]] = []
        self.started = threading.Event()
        self.gate = threading.Event()

    def forward(self, seqs, poolings):
        self.started.set()
        assert self.gate.wait(timeout=60)
        self.forwards.append([len(s.ids) for s in seqs])
        return self.engine.forward(seqs, poolings)


@pytest.fixture(scope="module")
def minilm():
    return load_embed_engine("all-MiniLM-L6-v2")


def test_expired_and_cancelled_jobs_are_dropped_before_their_forward(minilm):
    long = minilm.tokenize(["word " * 300] * 32, truncate=True)  # 256 tokens each: several forwards
    gated = GatedEngine(minilm)
    b = EmbedBatcher(gated, max_batch_tokens=1024)
    try:
        big = b.submit(long, "mean")
        assert gated.started.wait(timeout=60)  # the big job's first forward is under way (held at the gate)
        expiring = b.submit(minilm.tokenize(["expires in the queue"] * 3), "mean", time.monotonic() + 0.05)
        cancelled = b.submit(minilm.tokenize(["the client goes away"] * 2), "mean")
        assert b.stats()["num_requests"] == 3
        assert cancelled.cancel()
        time.sleep(0.1)  # the deadline passes while the first forward still waits at the gate
        gated.gate.set()
        assert len(big.result(timeout=120)) == 32
        with pytest.raises(DeadlineExceededError, match="dropped unrun"):
            expiring.result(timeout=10)
        assert b.submit(minilm.tokenize(["still serving"]), "mean").result(timeout=60)
    finally:
        gated.gate.set()
        b.stop()
    ran = [n for f in gated.forwards for n in f]
    assert sorted(ran) == sorted([256] * 32 + [len(minilm.tokenize(["still serving"])[0].ids)])  # nothing else ran
    assert b.num_dropped == {"expired": 1, "cancelled": 1}
    assert b.stats() == {"num_requests": 0, "num_sequences": 0, "oldest_wait_s": 0.0}


def test_a_short_job_gets_the_next_forward_and_a_short_one_beside_long_jobs(minilm):
    """A short job goes before a long one that arrived just before it, and its forward holds no long
    sequence: it waits for the forward under way at most."""
    long = minilm.tokenize(["word " * 300] * 32, truncate=True)
    gated = GatedEngine(minilm)
    b = EmbedBatcher(gated, max_batch_tokens=4096)
    try:
        big = b.submit(long, "mean")
        assert gated.started.wait(timeout=60)
        big2 = b.submit(long, "mean")  # arrives first, never served yet, like the short one
        short = b.submit(minilm.tokenize(["a short one"]), "mean")
        gated.gate.set()
        short.result(timeout=60)
        big.result(timeout=120)
        big2.result(timeout=120)
    finally:
        gated.gate.set()
        b.stop()
    short_len = len(minilm.tokenize(["a short one"])[0].ids)
    assert gated.forwards[1] == [short_len]  # the very next forward, alone (before: big2's, then with 15 long)
    assert sorted(n for f in gated.forwards for n in f) == sorted([256] * 64 + [short_len])


def test_an_unserved_long_job_is_passed_over_a_bounded_number_of_times(minilm):
    long = minilm.tokenize(["word " * 300] * 2, truncate=True)
    gated = GatedEngine(minilm)
    b = EmbedBatcher(gated, max_batch_tokens=5)  # every sequence runs alone
    try:
        first = b.submit(long, "mean")
        assert gated.started.wait(timeout=60)
        waiting = b.submit(long, "mean")
        shorts = [b.submit(minilm.tokenize([f"short {k}"]), "mean") for k in range(MAX_SKIPS + 3)]
        gated.gate.set()
        for f in (first, waiting, *shorts):
            f.result(timeout=120)
    finally:
        gated.gate.set()
        b.stop()
    kinds = ["long" if f == [256] else "short" for f in gated.forwards]
    # 'waiting' goes after MAX_SKIPS later, shorter jobs went before it, not after all of them
    assert kinds[: MAX_SKIPS + 2] == ["long"] + ["short"] * MAX_SKIPS + ["long"]
    assert kinds.count("short") == MAX_SKIPS + 3
