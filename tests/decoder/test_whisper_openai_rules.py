"""openai-whisper's decoding rules in the long-form loop (decoder_svc/whisper/{quality,clips,repetition,word_seek,
longform}.py): the text compression ratio, best_of ranking, loops, clips and the VAD gate, the prompt reset, word
timing that moves the seek, hallucination_silence_threshold.

The references are openai-whisper's ``transcribe.py`` / ``decoding.py`` rules restated in each test (the package
is not a dependency); HF's rules are tested in test_whisper_longform.py against HF itself.
"""

from __future__ import annotations

import zlib

import pytest

from decoder_svc.whisper.clips import gate_clips, intersect_clips, parse_clip_timestamps, speech_windows
from decoder_svc.whisper.longform import LongFormOptions, LongFormState
from decoder_svc.whisper.quality import (
    FallbackRules,
    Verdict,
    compression_ratio,
    judge,
    rank_samples,
    text_compression_ratio,
    text_passes,
)
from decoder_svc.whisper.repetition import LoopStop, ends_in_loop, find_loops, has_loop, loop_words
from decoder_svc.whisper.word_seek import is_segment_anomaly, word_seek
from decoder_svc.whisper.word_timing import WordTiming
from shared.models.whisper import load_tokenizer
from shared.models.whisper_features import special_token_ids
from shared.models.whisper_specials import WhisperSpecials

VOCAB = 51864  # tiny.en
LOOP = "The museum features a museum of the 19th century. " * 4


@pytest.fixture(scope="module")
def tokenizer(whisper_model_dir):
    return load_tokenizer(whisper_model_dir)


@pytest.fixture(scope="module")
def specials(whisper_model_dir):
    return WhisperSpecials.from_token_ids(special_token_ids(whisper_model_dir), VOCAB)


def decode_with(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


# --- quality: the ratio, the ranking, loops ------------------------------------------------------------------


def test_text_ratio_catches_the_loop_the_id_ratio_lets_through(tokenizer, specials):
    """The issue's loop: four copies of one sentence. openai-whisper's ratio of the text is over 2.4; HF's ratio of
    the ids' bytes is not, so HF's rules with openai-whisper's threshold accept it."""
    sentence = tokenizer(LOOP.split(". ")[0] + ".", add_special_tokens=False)["input_ids"]
    ts = specials.timestamp_begin
    ids = []  # each copy its own segment: <|t|> text <|t'|>, the times moving on as a window's do
    for k in range(4):
        ids += [ts + 150 * k, *sentence, ts + 150 * k + 140]
    text = tokenizer.decode(specials.text_tokens(ids)).strip()
    assert text_compression_ratio(text) == len(text.encode()) / len(zlib.compress(text.encode()))
    assert text_compression_ratio(text) > 2.4 > compression_ratio([*ids, specials.eot], VOCAB)
    assert text_compression_ratio("") == 0.0
    rules = FallbackRules()
    verdict = judge([*ids, specials.eot], [-0.1] * (len(ids) + 1), 0.0, 0, rules, VOCAB, text=text)
    assert verdict.verdict is Verdict.RETRY and verdict.repetition
    hf = judge([*ids, specials.eot], [-0.1] * (len(ids) + 1), 0.0, 0, FallbackRules(decoding_rules="hf"), VOCAB)
    assert hf.verdict is Verdict.ACCEPT
    with pytest.raises(ValueError, match="pass text"):
        judge([specials.eot], [-0.1], 0.0, 0, rules, VOCAB)


@pytest.mark.parametrize(
    ("text", "loops"),
    [
        ("I'm gonna go to sleep, I'm gonna go to sleep, I'm gonna go to sleep", [(0, 5, 3)]),
        ("the new one, the new one, the new one, the new one", [(0, 3, 4)]),
        ("no, no, no", []),  # 3 words: speech
        ("so so so so so so so so so", [(0, 1, 9)]),
        ("I'll be right back, I'll be right back.", []),  # twice is speech
        ("He said: a b c a b c a b c and then left", [(2, 3, 3)]),
        ("Ich bin ein Mann, ich bin ein Mann, ich bin ein Mann.", [(0, 4, 3)]),
    ],
)
def test_loops_are_phrases_said_back_to_back(text, loops):
    found = find_loops(loop_words(text))
    assert [(lp.start, lp.period, lp.copies) for lp in found] == loops
    assert has_loop(text) == bool(loops)
    assert text_passes(text, 2.4) == (not loops)


@pytest.mark.parametrize(
    ("text", "ends"),
    [
        ("the new one, the new one, the new one", True),
        ("He said: a b c a b c a b c", True),
        ("a b c a b c a b c and then left", False),  # a loop, but not at the end
        ("no, no, no", False),
        ("so so so so so so so so", False),  # 8 words: not yet a loop
        ("so so so so so so so so so", True),
    ],
)
def test_ends_in_loop_is_a_loop_at_the_end_that_every_continuation_keeps(text, ends):
    words = loop_words(text)
    assert ends_in_loop(words) == ends
    if ends:  # what follows never takes the loop away: the attempt fails whatever it decodes after
        for tail in ("", " and then it stopped", " the new one the", " so"):
            assert has_loop(text + tail)


def test_loop_stop_ends_a_greedy_attempt_at_its_loop_on_text_tokens_only(tokenizer, specials):
    """``LoopStop`` is asked after every token with the ids so far (as ``Sequence.check_token_stop`` does); it reads
    the window's text tokens (timestamps between copies do not hide the loop), leaves the last word out (it may
    still grow), and says stop at the first token after which the text ends in a loop, never before."""
    sentence = tokenizer(" The new one.", add_special_tokens=False)["input_ids"]
    ts = specials.timestamp_begin
    ids = []
    for k in range(5):
        ids += [ts + 10 * k, *sentence, ts + 10 * k + 8]

    def words_before_last(n: int) -> list[str]:
        return loop_words(tokenizer.decode(specials.text_tokens(ids[:n])))[:-1]

    stop = LoopStop(decode_with(tokenizer), lambda t: t < specials.eot)
    said = [n for n in range(1, len(ids) + 1) if stop(ids[:n])]
    assert said and said[0] < len(ids)  # stopped before the fifth copy ended
    first = said[0]
    assert ends_in_loop(words_before_last(first)) and has_loop(tokenizer.decode(specials.text_tokens(ids)))
    assert not any(ends_in_loop(words_before_last(n)) for n in range(1, first))
    plain = tokenizer(
        " It was a bright cold day in April, and the clocks were striking thirteen.", add_special_tokens=False
    )
    fresh = LoopStop(decode_with(tokenizer), lambda t: t < specials.eot)
    assert not any(fresh(plain["input_ids"][:n]) for n in range(1, len(plain["input_ids"]) + 1))


def test_best_of_ranks_by_mean_logprob_and_never_prefers_a_loop():
    eot = 9
    a = ([1, 2, 3, eot], [-0.5, -0.5, -0.5, -0.3])  # sum -1.8 / 3 tokens = -0.6
    b = ([1, 2, eot], [-0.4, -0.4, -0.6])  # -1.4 / 2 = -0.7
    c = ([4, 4, 4, 4, 4, 4], [-0.05] * 6)  # no end token: the length limit, -0.05: the loop
    assert rank_samples([a, b], eot) == 0
    assert rank_samples([a, b, c], eot) == 2  # openai-whisper's ranker alone takes the loop
    assert rank_samples([a, b, c], eot, [True, True, False]) == 0
    assert rank_samples([c, b], eot, [False, False]) == 0  # all loop: likelihood decides
    with pytest.raises(ValueError):
        rank_samples([], eot)


def test_a_window_the_vad_hears_speech_in_is_never_skipped_as_silence():
    """A window that starts in a loop: low logprob and a high no-speech probability, which Whisper's rule takes for
    silence (30 s of speech lost). With the VAD gate hearing speech there it is decoded again hotter, and at the last
    temperature kept (the best attempt)."""
    rules = FallbackRules((0.0, 0.4))
    looped = "the bell rang the bell rang the bell rang the bell rang"
    args = ([5, 6, 7, 8], [-1.5] * 4, 0.8)
    assert judge(*args, 0, rules, VOCAB, text=looped).verdict is Verdict.SKIP
    assert judge(*args, 0, rules, VOCAB, text=looped, heard_speech=True).verdict is Verdict.RETRY
    last = judge(*args, 1, rules, VOCAB, text=looped, heard_speech=True)
    assert last.verdict is Verdict.ACCEPT and last.needs_fallback


def test_samples_and_prompt_reset_follow_the_rules():
    openai, hf = FallbackRules(), FallbackRules(decoding_rules="hf")
    assert [openai.samples_at(t) for t in (0.0, 0.2, 1.0)] == [1, 5, 5]
    assert [hf.samples_at(t) for t in (0.0, 0.2)] == [1, 1]
    assert openai.conditions_after(0.5) and not openai.conditions_after(0.6)  # faster-whisper: reset above 0.5
    assert not hf.conditions_after(0.5) and hf.conditions_after(0.4)  # HF: conditioned below 0.5 only
    with pytest.raises(ValueError, match="best_of"):
        FallbackRules(best_of=0)
    with pytest.raises(ValueError, match="decoding_rules"):
        FallbackRules(decoding_rules="whisperx")


# --- clips: clip_timestamps, the VAD gate, the detection windows ----------------------------------------------


def test_clip_timestamps_are_openai_whispers():
    assert parse_clip_timestamps([], 5000) == [(0, 5000)]
    assert parse_clip_timestamps([1.0, 2.5, 30.004], 5000) == [(100, 250), (3000, 5000)]  # odd: to the end
    assert parse_clip_timestamps([10.0, 80.0], 5000) == [(1000, 5000)]  # cut at the audio's end
    assert parse_clip_timestamps([60.0], 5000) == []  # after the audio
    for bad in ([2.0, 1.0], [0.0, 2.0, 1.0, 3.0], [float("inf")], [-0.5, 1.0]):
        with pytest.raises(ValueError):
            parse_clip_timestamps(bad, 5000)


def test_gate_merges_short_silences_and_leaves_long_ones_out():
    sr = 16000
    regions = [(1 * sr, 5 * sr), (6 * sr, 9 * sr), (30 * sr, 31 * sr)]  # 1 s apart, then 21 s of silence
    clips = gate_clips(regions, 40 * sr, min_silence_s=3.0, pad_s=0.4)
    assert clips == [(0, 940), (2960, 3140)]  # the 0.6 s before the first region is no gap: kept
    assert gate_clips(regions, 40 * sr, min_silence_s=30.0, pad_s=0.0) == [(0, 4000)]  # nor the 9 s after the last
    assert gate_clips(regions, 40 * sr, min_silence_s=0.5, pad_s=0.4) == [(60, 940), (2960, 3140)]  # 0.6 s >= 0.5 s
    late = [(8 * sr, 9 * sr), (30 * sr, 31 * sr)]  # 8 s before the first region: left out
    assert gate_clips(late, 40 * sr, min_silence_s=3.0, pad_s=0.4) == [(760, 940), (2960, 3140)]
    assert gate_clips([], 40 * sr) == []
    assert intersect_clips([(0, 500), (2000, 3500)], clips) == [(0, 500), (2960, 3140)]
    # language detection hears the first windows of speech, not the long silence before it
    late_clips = gate_clips(late, 40 * sr, min_silence_s=3.0, pad_s=0.4)
    assert speech_windows(late_clips, 40 * sr, 2) == [(760 * 160, 180 * 160), (2960 * 160, 180 * 160)]
    assert speech_windows(None, 40 * sr, 5) == [(0, 30 * sr), (30 * sr, 10 * sr)]


# --- the loop under openai rules -------------------------------------------------------------------------------


def _state(specials, tokenizer, seconds, **options):
    return LongFormState(specials, 16000 * seconds, LongFormOptions(**options), decode=decode_with(tokenizer))


def test_windows_stay_inside_the_clips(specials, tokenizer):
    st = _state(specials, tokenizer, 100, clips=((500, 2000), (6000, 9900)))
    ts = specials.timestamp_begin
    plan = st.next_window()
    assert (plan.seek, plan.num_frames, plan.num_samples) == (500, 1500, 1500 * 160)  # ends at the clip's end
    st.on_result([ts, 400, 401, ts + 20, specials.eot], [-0.1] * 5, 0.0)  # single timestamp ending: whole window
    plan = st.next_window()
    assert (plan.seek, plan.num_frames) == (6000, 3000)  # the silence between clips is never decoded
    st.on_result([ts, 400, ts + 20, ts + 20, 402, ts + 700, ts + 700, 403, specials.eot], [-0.1] * 9, 0.0)
    plan = st.next_window()
    assert (plan.seek, plan.num_frames) == (6000 + 1400, 2500)  # seek by the last pair, clipped at 9900
    st.on_result([ts, 400, ts + 50, specials.eot], [-0.1] * 4, 0.0)
    assert st.done and st.next_window() is None
    assert [round(s.start, 2) for s in st.segments] == [5.0, 60.0, 60.4, 74.0]
    assert [round(s.end, 2) for s in st.segments] == [5.4, 60.4, 74.0, 75.0]


def test_no_timestamps_windows_move_by_their_length(specials, tokenizer):
    st = _state(specials, tokenizer, 20, timestamps=False)
    plan = st.next_window()
    assert plan.prompt_ids[-1] == specials.no_timestamps and plan.num_frames == 2000
    st.on_result([400, 401, specials.eot], [-0.1] * 3, 0.0)
    assert st.done and [(s.start, s.end) for s in st.segments] == [(0.0, 20.0)]
    with pytest.raises(ValueError, match="needs timestamps"):
        LongFormOptions(timestamps=False, rules=FallbackRules(decoding_rules="hf"))


def test_prompt_resets_after_the_last_temperature_tried(specials, tokenizer):
    """faster-whisper: after every temperature failed, the best attempt is kept but the next prompt is reset
    (the final temperature 1.0 is over prompt_reset_on_temperature); a skipped window leaves the prompt as it is."""
    rules = FallbackRules((0.0, 1.0), logprob_threshold=-0.5, no_speech_threshold=0.6)
    st = _state(specials, tokenizer, 200, rules=rules)
    ts = specials.timestamp_begin
    st.next_window()
    st.on_result([ts, 400, 401, ts + 50, specials.eot], [-0.1] * 5, 0.0)  # accepted at 0.0
    assert st.next_window().prompt_ids[0] == specials.sot_prev
    st.on_result([ts, 402, ts + 50, specials.eot], [-2.0] * 4, 0.1)  # low logprob: retry at 1.0
    assert st.next_window().temperature == 1.0
    r = st.on_result([ts, 403, ts + 50, specials.eot], [-3.0] * 4, 0.1)  # fails too: the best (0.0) is kept
    assert r.verdict is Verdict.ACCEPT and r.judgement.temperature == 0.0
    assert st.next_window().prompt_ids[0] == specials.sot  # no previous text after a 1.0 attempt
    st.on_result([ts, 404, ts + 50, specials.eot], [-0.1] * 4, 0.0)
    assert st.next_window().prompt_ids[0] == specials.sot_prev
    r = st.on_result([ts, 405, ts + 50, specials.eot], [-2.0] * 4, 0.9)  # silence: skipped
    assert r.verdict is Verdict.SKIP and st.next_window().prompt_ids[0] == specials.sot_prev


def test_empty_segments_are_dropped(specials, tokenizer):
    st = _state(specials, tokenizer, 40)
    ts = specials.timestamp_begin
    st.next_window()
    st.on_result([ts, ts + 10, ts + 10, 400, ts + 60, specials.eot], [-0.1] * 6, 0.0)  # a pair with no text first
    assert [s.tokens[1:-1] for s in st.segments] == [[400]]


def _words(*spans, probability=0.9):
    return [WordTiming(f" w{i}", [400 + i], s, e, probability) for i, (s, e) in enumerate(spans)]


def test_word_timing_moves_the_seek_to_the_last_word(specials, tokenizer):
    st = _state(specials, tokenizer, 100, word_timestamps=True)
    ts = specials.timestamp_begin
    st.next_window()
    r = st.on_result([ts, 400, 401, ts + 100, ts + 100, 402, ts + 1400, ts + 1400, 403, specials.eot], [-0.1] * 10, 0.0)
    assert r.needs_words and len(r.segments) == 2 and st.seek == 0
    with pytest.raises(RuntimeError, match="finish_window"):
        st.next_window()
    done = st.finish_window([_words((0.1, 0.6), (0.7, 1.9)), _words((2.2, 27.31))])
    assert done.seek_advance == 2731 and st.next_window().seek == 2731  # the last word's end, not 2800
    assert [len(w) for w in done.words] == [2, 1]


def test_hallucination_after_silence_is_dropped(specials, tokenizer):
    """hallucination_silence_threshold 2 s: a window whose first segment is an anomaly (improbable words) after
    more than 2 s of silence is dropped, and decoding starts again at that segment."""
    st = _state(specials, tokenizer, 100, hallucination_silence_threshold=2.0)
    ts = specials.timestamp_begin
    st.next_window()
    r = st.on_result([ts + 500, 400, 401, ts + 600, ts + 600, specials.eot], [-0.1] * 6, 0.0)
    assert r.needs_words and r.segments[0].start == 10.0
    bad = _words((10.0, 10.05), (10.1, 10.12), probability=0.05)
    assert is_segment_anomaly(bad) and not is_segment_anomaly(_words((0.1, 0.6), (0.7, 1.2)))
    done = st.finish_window([bad])
    assert not done.segments and not st.segments and st.next_window().seek == 1000


def test_word_seek_keeps_good_speech_and_cuts_an_isolated_anomaly():
    from decoder_svc.whisper.segments import Segment

    segs = [Segment(0, 0.0, 4.0, [1]), Segment(0, 12.0, 12.5, [2])]
    words = [_words((0.1, 1.0), (1.2, 3.8)), _words((12.0, 12.02), (12.1, 12.12), probability=0.01)]
    common = dict(seek=0, num_frames=3000, next_seek=3000, single_timestamp_ending=False, content_frames=9000)
    plain = word_seek(segs, words, **common, last_speech_end=0.0, threshold=None)
    assert (plain.keep, plain.seek) == (2, 1212)
    cut = word_seek(segs, words, **common, last_speech_end=0.0, threshold=2.0)
    assert (cut.keep, cut.seek, cut.drop_window, cut.last_speech_end) == (1, 1200, False, 3.8)
