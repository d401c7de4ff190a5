"""Whisper word timestamps against HF transformers on the same weights.

Alignment-head weights (dense recompute) vs HF eager ``cross_attentions``; token timestamps vs
HF ``generate(..., return_token_timestamps=True)``; words vs HF's token times and word grouping.
tiny.en and base (multilingual), on ``sample.wav``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import WhisperFeatureExtractor
from transformers.models.whisper.generation_whisper import _dynamic_time_warping, _median_filter
from transformers.models.whisper.tokenization_whisper import _combine_tokens_into_words, _split_tokens_on_spaces

from decoder_svc.whisper.word_timing import APPEND_PUNCTUATIONS as APPEND
from decoder_svc.whisper.word_timing import PREPEND_PUNCTUATIONS as PREPEND
from decoder_svc.whisper.word_timing import dtw, find_words, median_filter, token_timestamps
from encdec import DATA_DIR
from encdec.bench.hf_whisper import build_hf_whisper
from shared.models.registry import load_model, resolve_model
from shared.models.whisper_alignment import alignment_weights
from shared.models.whisper_features import load_tokenizer

CLIP = "sample.wav"
WEIGHT_ATOL = 1e-4
TIME_TOL = 0.02 + 1e-6  # one encoder frame (float32 rounding on top)


class Case:
    """One checkpoint and one clip: our model, an HF reference of its own (generate sets eager attention), HF results."""

    def __init__(self, name: str) -> None:
        self.dir = resolve_model(name)[1]
        self.ours = load_model(self.dir)
        self.specials = self.ours.generation.specials
        self.tokenizer = load_tokenizer(self.dir)
        self.hf = build_hf_whisper(self.dir)
        with open(self.dir / "config.json", encoding="utf-8") as f:
            self.hf.generation_config.alignment_heads = json.load(f)["alignment_heads"]
        pcm, _ = sf.read(DATA_DIR / CLIP, dtype="float32")
        self.seconds = len(pcm) / 16000
        x = WhisperFeatureExtractor(feature_size=80)(
            pcm, sampling_rate=16000, return_tensors="pt", return_attention_mask=True
        )
        self.features, self.attention_mask = x.input_features, x.attention_mask
        self.num_frames = int(x.attention_mask.sum())
        with torch.inference_mode():
            self.kv = self.ours.compute_cross_kv(self.ours.encode(self.features))[:, :, 0]  # [L, 2, S, H, Dh]
            self.generated, self.hf_times = self.generate(timestamps=False)
        self.prompt = self.specials.decoder_prompt()
        self.seq = [*self.prompt, *self.generated, self.specials.eot]

    @torch.inference_mode()
    def generate(self, timestamps: bool) -> tuple[list[int], list[float]]:
        out = self.hf.generate(
            self.features,
            attention_mask=self.attention_mask,
            return_timestamps=timestamps,
            return_token_timestamps=True,
        )
        ids = out["sequences"][0].tolist()
        assert len(ids) < 400 and self.specials.eot not in ids  # ended on <|endoftext|>, stripped by HF
        return ids, out["token_timestamps"][0].tolist()

    def weights(self, seq: list[int]) -> torch.Tensor:
        return alignment_weights(self.ours, seq, self.kv, self.specials.alignment_heads)


@pytest.fixture(scope="module", params=["whisper-tiny.en", "whisper-base"])
def case(request) -> Case:
    return Case(request.param)


def test_dtw_and_median_filter_match_hf():
    rng = np.random.default_rng(0)
    for shape in [(1, 1), (1, 9), (9, 1), (7, 23), (19, 150)]:
        cost = rng.standard_normal(shape)
        for matrix in (cost, np.round(cost)):  # rounded: many ties, to check the tie-breaking
            got, want = dtw(matrix), _dynamic_time_warping(matrix)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
    x = torch.randn(2, 5, 31)
    torch.testing.assert_close(median_filter(x, 7), _median_filter(x, 7), rtol=0, atol=0)  # the sorting network
    ties = torch.randint(-2, 3, (3, 4, 40)).float()  # many equal values in a window
    torch.testing.assert_close(median_filter(ties, 7), _median_filter(ties, 7), rtol=0, atol=0)
    # every window of 0s and 1s (the 0-1 principle: a network that sorts them all sorts every input), in the middle
    # of a row of 13 so that the reflect padding does not touch it
    zero_one = torch.tensor([[0.0] * 3 + [(p >> i) & 1 for i in range(7)] + [0.0] * 3 for p in range(128)])
    ties = zero_one.view(2, 64, 13)
    torch.testing.assert_close(median_filter(ties, 7), _median_filter(ties, 7), rtol=0, atol=0)
    for width in (1, 3, 5, 9):  # widths other than 7 sort each window
        torch.testing.assert_close(median_filter(x, width), _median_filter(x, width), rtol=0, atol=0)
    x[0, 1, 10] = float("nan")  # NaN: the sort, as HF's
    torch.testing.assert_close(median_filter(x, 7), _median_filter(x, 7), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(median_filter(x[..., :3], 7), x[..., :3])
    with pytest.raises(ValueError):
        median_filter(x, 4)


def test_alignment_weights_match_hf_eager(case):
    heads = case.specials.alignment_heads
    with torch.inference_mode():
        out = case.hf(input_features=case.features, decoder_input_ids=torch.tensor([case.seq]), output_attentions=True)
    want = torch.stack([out.cross_attentions[layer][0, head] for layer, head in heads])  # [heads, T, 1500]
    got = case.weights(case.seq)
    assert got.shape == (len(heads), len(case.seq), 1500) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=WEIGHT_ATOL, rtol=0)
    torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[:2]), atol=1e-5, rtol=0)
    if case.specials.multilingual:
        return
    packed = load_model(case.dir)  # the decoder service's form (decode-step weights packed for the CPU kernel)
    packed.pack_decode_weights()
    got = alignment_weights(packed, case.seq, case.kv, heads)
    torch.testing.assert_close(got, want, atol=WEIGHT_ATOL, rtol=0)


def test_alignment_weights_reject_bad_input(case):
    heads = case.specials.alignment_heads
    with pytest.raises(ValueError):
        alignment_weights(case.ours, case.seq, case.kv, [(case.ours.config.decoder_layers, 0)])
    with pytest.raises(ValueError):
        alignment_weights(case.ours, case.seq, case.kv[:, :, :, :1], heads)
    with pytest.raises(ValueError):
        alignment_weights(case.ours, [], case.kv, heads)


def test_token_timestamps_match_hf_generate(case):
    p, n = len(case.prompt), len(case.generated)
    times = token_timestamps(case.weights(case.seq), case.num_frames, p)
    assert len(times) == len(case.seq) and times[:p] == [0.0] * p
    np.testing.assert_allclose(times[p : p + n], case.hf_times, atol=TIME_TOL, rtol=0)
    if case.specials.multilingual:
        return
    # Timestamp mode: the prompt loses <|notimestamps|>, the sequence holds timestamp tokens.
    generated, hf_times = case.generate(timestamps=True)
    assert any(case.specials.is_timestamp(t) for t in generated)
    prompt = case.specials.decoder_prompt(timestamps=True)
    seq = [*prompt, *generated, case.specials.eot]
    times = token_timestamps(case.weights(seq), case.num_frames, len(prompt))
    np.testing.assert_allclose(times[len(prompt) : len(prompt) + len(generated)], hf_times, atol=TIME_TOL, rtol=0)


def test_find_words(case):
    p, text_ids = len(case.prompt), case.generated
    probs = np.linspace(0.5, 0.99, len(case.seq) - p).tolist()  # distinct per token: shows which tokens are averaged
    offset = 30.0
    weights = case.weights(case.seq)
    words = find_words(case.tokenizer, case.specials, case.seq, p, probs, weights, case.num_frames)
    shifted = find_words(case.tokenizer, case.specials, case.seq, p, probs, weights, case.num_frames, offset)

    assert "".join(w.word for w in words) == case.tokenizer.decode(text_ids)
    hf_words, hf_tokens, _ = _combine_tokens_into_words(case.tokenizer, text_ids, "english")
    assert [w.word for w in words] == hf_words and [w.tokens for w in words] == hf_tokens
    starts = [w.start for w in words]
    assert starts[0] == 0.0 and starts == sorted(starts)
    assert words[0].end > 0.0  # the <|notimestamps|> row kept (openai's rows): HF's first token time is 0.0
    assert all(w.start <= w.end <= case.seconds for w in words)
    assert [t + offset for w in words for t in (w.start, w.end)] == pytest.approx(
        [t for w in shifted for t in (w.start, w.end)]
    )

    # HF's time of token i is where token i ends (its pipeline: span (ts[i - 1], ts[i])); HF pins the first
    # generated token to 0.0, so spans that read its time are skipped; the rest must agree. A word that absorbed
    # punctuation keeps its own piece's times and probability (openai merges after timing).
    pieces, _, piece_idx = _split_tokens_on_spaces(case.tokenizer, text_ids)
    own = [ix for piece, ix in zip(pieces, piece_idx) if piece.strip() not in PREPEND and piece not in APPEND]
    assert len(own) == len(words)
    for w, ix in zip(words, own):
        lo, hi = ix[0], ix[-1]
        if lo >= 2:
            assert abs(w.start - case.hf_times[lo - 1]) <= TIME_TOL, w
        if hi >= 1:
            assert abs(w.end - case.hf_times[hi]) <= TIME_TOL, w
        assert w.probability == pytest.approx(np.mean([probs[i] for i in ix])), w
