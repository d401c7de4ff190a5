"""Sampler: same filtered scores as HF's processors / warpers; per-request seeded RNG."""

import pytest
import torch
from transformers.generation.logits_process import (
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from decoder_svc.core.sampler import Sampler, SamplingRow
from decoder_svc.core.sampling_params import SamplingParams

V = 97
SUPPRESS = [3, 5, 50, 96]
BEGIN = [7, 0]


def hf_scores(row_logits, params, is_first):
    """HF's processors then warpers on one row (``[1, V]``), in generate()'s order."""
    scores = row_logits[None].clone()
    input_ids = torch.zeros(1, 2 if is_first else 5, dtype=torch.long)
    scores = SuppressTokensAtBeginLogitsProcessor(BEGIN, begin_index=2)(input_ids, scores)
    scores = SuppressTokensLogitsProcessor(SUPPRESS)(input_ids, scores)
    if params.greedy:
        return scores[0]
    scores = TemperatureLogitsWarper(params.temperature)(input_ids, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(input_ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(input_ids, scores)
    return scores[0]


PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.5, top_k=20, top_p=0.5),
    SamplingParams(temperature=2.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=500, top_p=0.999),
    SamplingParams(temperature=0.9, top_p=0.01),
]


@pytest.mark.parametrize("is_first", [True, False])
def test_filtered_scores_match_hf(is_first):
    torch.manual_seed(0)
    logits = torch.randn(len(PARAMS), V) * 3
    logits[1, 10:14] = 4.0  # ties at the top-k boundary
    sampler = Sampler(SUPPRESS, BEGIN)
    rows = [SamplingRow(f"r{i}", p, is_first) for i, p in enumerate(PARAMS)]
    processed = sampler.process_logits(logits, rows)
    for i, p in enumerate(PARAMS):
        ours = processed[i] if p.greedy else Sampler.warp(processed[i], p)
        torch.testing.assert_close(ours, hf_scores(logits[i], p, is_first), rtol=0, atol=0)


def test_greedy_respects_suppression():
    logits = torch.zeros(2, V)
    logits[:, 7] = 10.0  # begin-suppressed
    logits[:, 3] = 20.0  # always suppressed
    logits[:, 9] = 5.0
    rows = [SamplingRow("a", SamplingParams(), True), SamplingRow("b", SamplingParams(), False)]
    assert Sampler(SUPPRESS, BEGIN)(logits, rows).sampled_token_ids == [9, 7]


def run_seeded(companions, steps=6):
    """Tokens of request 'x' (seed 1234) over steps while other rows share its batch."""
    torch.manual_seed(99)
    row_logits = [torch.randn(V) for _ in range(steps)]
    sampler = Sampler(SUPPRESS, BEGIN)
    px = SamplingParams(temperature=1.5, top_k=40, top_p=0.95, seed=1234)
    got = []
    for t in range(steps):
        rows, logits = [], []
        for j, p in enumerate(companions):
            rows.append(SamplingRow(f"c{j}", p, t == 0))
            logits.append(torch.randn(V))
        pos = len(rows) // 2
        rows.insert(pos, SamplingRow("x", px, t == 0))
        logits.insert(pos, row_logits[t])
        got.append(sampler(torch.stack(logits), rows).sampled_token_ids[pos])
    return got


def test_seeded_request_independent_of_batch_companions():
    alone = run_seeded([])
    assert alone == run_seeded([SamplingParams(), SamplingParams(temperature=1.0, seed=7)])
    assert alone == run_seeded([SamplingParams(temperature=0.3)] * 5)  # unseeded companions too
    # And equal to a plain reference draw from the request's own generator.
    torch.manual_seed(99)
    gen = torch.Generator().manual_seed(1234)
    px = SamplingParams(temperature=1.5, top_k=40, top_p=0.95, seed=1234)
    sampler = Sampler(SUPPRESS, BEGIN)
    ref = []
    for t in range(6):
        row = sampler.process_logits(torch.randn(1, V), [SamplingRow("x", px, t == 0)])[0]
        ref.append(int(torch.multinomial(Sampler.warp(row, px).softmax(-1), 1, generator=gen)))
    assert alone == ref


def test_global_rng_untouched_and_release():
    sampler = Sampler()
    state = torch.get_rng_state()
    rows = [SamplingRow("a", SamplingParams(temperature=1.0, seed=1), False)]
    sampler(torch.randn(1, V, generator=torch.Generator().manual_seed(0)), rows)
    assert torch.equal(state, torch.get_rng_state())
    sampler.release("a")
    assert not sampler._generators
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, V), rows)


def test_tiny_temperatures_are_greedy_and_never_fail_the_batch():
    """1e-45 would overflow logits / temperature; such rows sample greedily, companions are unharmed."""
    from decoder_svc.core.sampling_params import SAMPLING_EPS

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 30
    rows = [
        SamplingRow("tiny", SamplingParams(temperature=1e-45), False),
        SamplingRow("below-eps", SamplingParams(temperature=SAMPLING_EPS / 2), False),
        SamplingRow("companion", SamplingParams(temperature=1.0, seed=7), False),
    ]
    out = Sampler()(logits, rows).sampled_token_ids
    assert out[:2] == logits[:2].argmax(-1).tolist()
    alone = Sampler()(logits[2:], rows[2:]).sampled_token_ids
    assert out[2] == alone[0]


def test_min_tokens_masks_stop_ids_like_hf():
    """Rows below min_tokens get every stop id masked (HF MinNewTokensLengthLogitsProcessor); others untouched."""
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    torch.manual_seed(1)
    logits = torch.randn(3, V)
    rows = [
        SamplingRow(
            "below", SamplingParams(min_tokens=4), False, num_tokens=5, num_output_tokens=2, stop_token_ids=(11, 12)
        ),
        SamplingRow(
            "reached", SamplingParams(min_tokens=4), False, num_tokens=7, num_output_tokens=4, stop_token_ids=(11,)
        ),
        SamplingRow(
            "ignore-eos", SamplingParams(min_tokens=4, ignore_eos=True), False, num_tokens=4, num_output_tokens=1
        ),
    ]
    ours = Sampler().process_logits(logits, rows)
    for i, r in enumerate(rows):
        hf = MinNewTokensLengthLogitsProcessor(
            r.num_tokens - r.num_output_tokens, r.params.min_tokens, list(r.stop_token_ids) or [V + 1]
        )
        torch.testing.assert_close(
            ours[i], hf(torch.zeros(1, r.num_tokens, dtype=torch.long), logits[i : i + 1])[0], rtol=0, atol=0
        )
    assert ours[0, 11] == -float("inf") and ours[1, 11] == logits[1, 11]


# -- min_p, repetition_penalty, no_repeat_ngram_size, min_tokens: one mixed batch against HF ------------------


def hf_full(row_logits, row, stop_ids):
    """HF generate()'s processors and warpers in its order on one row whose decoder tokens are ``row.token_ids``."""
    from transformers.generation.logits_process import (
        MinNewTokensLengthLogitsProcessor,
        MinPLogitsWarper,
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
    )

    p = row.params
    input_ids = torch.tensor([list(row.token_ids)])
    prompt_len = row.num_tokens - row.num_output_tokens
    scores = row_logits[None].clone()
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty))(input_ids, scores)
    if p.no_repeat_ngram_size:
        scores = NoRepeatNGramLogitsProcessor(p.no_repeat_ngram_size)(input_ids, scores)
    if p.min_tokens:
        scores = MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, list(stop_ids))(input_ids, scores)
    scores = SuppressTokensLogitsProcessor(SUPPRESS)(input_ids, scores)
    scores = SuppressTokensAtBeginLogitsProcessor(BEGIN, begin_index=prompt_len)(input_ids, scores)
    if p.greedy:
        return scores[0]
    scores = TemperatureLogitsWarper(p.temperature)(input_ids, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(input_ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(input_ids, scores)
    if p.min_p:
        scores = MinPLogitsWarper(p.min_p)(input_ids, scores)
    return scores[0]


MIXED = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7, temperature=0.8),
    SamplingParams(no_repeat_ngram_size=2),
    SamplingParams(no_repeat_ngram_size=1, temperature=1.0, top_k=30),
    SamplingParams(no_repeat_ngram_size=3, repetition_penalty=2.0),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.6, top_p=0.9, min_p=0.2),
    SamplingParams(temperature=1.5, top_k=10, min_p=1.0),
    SamplingParams(
        min_tokens=50, repetition_penalty=1.1, no_repeat_ngram_size=2, temperature=1.2, top_k=40, top_p=0.95, min_p=0.02
    ),
    SamplingParams(min_tokens=60, stop_token_ids=(4, 9)),
    SamplingParams(min_tokens=3, stop_token_ids=(4, 9), temperature=0.9),  # reached: nothing masked
]
STOP_IDS = (2,)  # the end token in these tests


@pytest.mark.parametrize("first", [True, False])
def test_mixed_batch_matches_hf_processors_and_warpers(first):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(len(MIXED), V, generator=g) * 4
    logits[:, :12] = logits[:, :12].abs() * -1  # negative scores on repeated ids exercise the multiply branch
    rows = []
    for i, p in enumerate(MIXED):
        prompt = [1, 2 + i % 3]
        out = [] if first else torch.randint(0, 12, (6 + i,), generator=g).tolist() + [5, 6, 5]  # small ids repeat
        toks = prompt + out
        row = SamplingRow(f"r{i}", p, first, len(toks), 0, len(out), (*STOP_IDS, *p.stop_token_ids), toks)
        rows.append(row)
    sampler = Sampler(SUPPRESS, BEGIN)
    processed = sampler.process_logits(logits, rows)
    for i, (p, row) in enumerate(zip(MIXED, rows)):
        ours = processed[i] if p.greedy else Sampler.warp(processed[i], p)
        torch.testing.assert_close(
            ours, hf_full(logits[i], row, row.stop_token_ids), rtol=0, atol=0, msg=f"row {i}: {p}"
        )
    # The controls really acted on these rows (the test would not notice a no-op otherwise).
    changed = processed != Sampler(SUPPRESS, BEGIN).process_logits(
        logits, [SamplingRow(r.request_id, SamplingParams(), first, r.num_tokens) for r in rows]
    )
    if not first:
        assert all(changed[i].any() for i in (1, 2, 3, 4, 5, 9, 10))


def test_from_sequence_fills_history_only_when_needed():
    from decoder_svc.core.sequence import Sequence

    seq = Sequence("s", [1, 2], 4, SamplingParams(repetition_penalty=1.2, stop_token_ids=(7,)), 2, 50)
    seq.append_token(9)
    row = SamplingRow.from_sequence(seq)
    assert list(row.token_ids) == [1, 2, 9] and row.stop_token_ids == (2, 7) and row.num_output_tokens == 1
    assert SamplingRow.from_sequence(Sequence("t", [1], 4, SamplingParams(ignore_eos=True), 2, 50)).token_ids == ()


def test_logprobs_are_of_the_scores_the_token_was_picked_from():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=g) * 3
    rows = [
        SamplingRow("greedy", SamplingParams(logprobs=True, top_logprobs=5), False),
        SamplingRow("sampled", SamplingParams(temperature=0.7, top_k=3, seed=1, logprobs=True, top_logprobs=20), False),
        SamplingRow("none", SamplingParams(temperature=1.0), False),
    ]
    sampler = Sampler(SUPPRESS, BEGIN)
    result = sampler(logits, rows)
    toks = result.sampled_token_ids
    lps = result.logprobs
    assert set(lps) == {"greedy", "sampled"} and sampler(logits[2:].clone(), rows[2:]).logprobs == {}
    processed = sampler.process_logits(logits, rows)
    greedy = lps["greedy"]
    ref = torch.log_softmax(processed[0], -1)
    assert (
        greedy.token_id == toks[0]
        and greedy.rank == 1
        and greedy.top[0] == (toks[0], pytest.approx(float(ref[toks[0]])))
    )
    assert [t for t, _ in greedy.top] == ref.topk(5).indices.tolist()
    sampled = lps["sampled"]
    ref = torch.log_softmax(Sampler.warp(processed[1], rows[1].params), -1)
    assert sampled.token_id == toks[1] and sampled.logprob == pytest.approx(float(ref[toks[1]]))
    assert len(sampled.top) == 3  # top_k=3 leaves three finite tokens; the -inf ones are omitted
    assert abs(sum(torch.tensor([v for _, v in sampled.top]).exp().tolist()) - 1) < 1e-5
    assert sampled.rank == 1 + sum(v > sampled.logprob for _, v in sampled.top)


def test_every_proto_sampling_field_is_implemented_or_refused():
    """A SamplingParams proto field the server does not read would be silently ignored: each one must map
    onto a ``decoder_svc.core.sampling_params.SamplingParams`` attribute, and a set field outside that list is refused."""
    import dataclasses

    from decoder_svc.session.convert import _REPEATED_SAMPLING_FIELDS, _SCALAR_SAMPLING_FIELDS
    from shared.proto import decoder_pb2

    proto_fields = {f.name for f in decoder_pb2.SamplingParams.DESCRIPTOR.fields}
    assert proto_fields == _SCALAR_SAMPLING_FIELDS | _REPEATED_SAMPLING_FIELDS
    assert proto_fields <= {f.name for f in dataclasses.fields(SamplingParams)}


def test_seed_bound_is_documented_and_named():
    """A seed of 2**63 was refused by a bound the proto did not state: the proto documents [0, 2**63 - 1] and the
    message names the bound in full and what to send."""
    from pathlib import Path

    from decoder_svc.core.sampling_params import MAX_SEED

    assert MAX_SEED == 2**63 - 1
    SamplingParams(seed=0)
    SamplingParams(seed=MAX_SEED)
    for seed in (2**63, 2**64 - 1, -1):
        with pytest.raises(ValueError, match=rf"seed must be in \[0, 9223372036854775807\].*got {seed}; send a"):
            SamplingParams(seed=seed)
    lines = (Path(__file__).parents[2] / "proto/encdec/v1/decoder.proto").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "uint64 seed = 4;" in line)
    comment = " ".join(line for line in lines[at - 2 : at + 1] if "//" in line)  # the field's own comment lines
    assert "[0, 2**63 - 1]" in comment and "INVALID_ARGUMENT" in comment, comment


def test_multinomial_one_draws_torch_multinomials_tokens_and_advances_the_generator_alike():
    """The fast draw (uniform doubles -> -log1p(-u) -> argmax(p / q)) must pick torch.multinomial's token from the
    same generator and leave it in the same state: sampled Whisper windows (temperature fallback) and seeded
    requests depend on it. Rows of Whisper's width at the temperatures of the fallback ladder, rows with zeros
    (top-k / top-p leave them), exact ties, a one-hot row, and a float64 row (the torch.multinomial fallback)."""
    from decoder_svc.core.sampler import multinomial_one

    width = 51865
    rows = []
    for seed in range(40):
        logits = torch.randn(width, generator=torch.Generator().manual_seed(seed)) * (1 + seed % 6)
        temperature = (0.2, 0.4, 0.6, 0.8, 1.0)[seed % 5]
        probs = (logits / temperature).softmax(-1)
        if seed % 4 == 0:  # a top-k / top-p row: most entries exactly 0
            probs[probs < probs.quantile(0.999)] = 0
            probs /= probs.sum()
        rows.append(probs)
    rows.append(torch.full((width,), 1.0 / width))  # every entry tied
    one_hot = torch.zeros(width)
    one_hot[12345] = 1.0
    rows.append(one_hot)
    rows.append(torch.randn(width, dtype=torch.float64).softmax(-1))  # not float32: torch.multinomial itself
    for i, probs in enumerate(rows):
        ours, ref = torch.Generator().manual_seed(1000 + i), torch.Generator().manual_seed(1000 + i)
        for _ in range(4):
            assert multinomial_one(probs, ours) == int(torch.multinomial(probs, 1, generator=ref)), f"row {i}"
        assert torch.equal(ours.get_state(), ref.get_state()), f"row {i}: the generator advanced differently"
