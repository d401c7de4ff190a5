"""``encdec bench quality``'s parts, fast (no services, no model): the scores, the corpus builder, the tables.

The scores are checked on crafted strings and segments: WER after Whisper's normalizers, words in gaps by
segment and by word times, repetition loops that must count and must not (also where the reference holds
the repetition). The corpus builder makes ``clean`` and ``noise-only`` in a temporary folder (espeak-ng and
sox, seconds): WAV lengths equal ``seconds``, sentences and gaps lie inside the file, and two builds (one of
them with another subset beside) give the same bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import jiwer
import pytest
import soundfile as sf

from encdec.bench.quality_corpus import SAMPLE_RATE, SEED, CorpusFile, build_corpus, corpus_key, load_corpus
from encdec.bench.quality_metrics import corpus_wer, repetition_loops, tandem_runs, words_in_gaps
from encdec.bench.quality_report import quality_rows, timing_rows, verdicts
from encdec.bench.quality_systems import NAMES


# ---- WER -----------------------------------------------------------------------------------------------------
def test_wer_normalizes_both_sides_like_whisper():
    # numbers, contractions, punctuation and case: English normalizer
    assert corpus_wer([("Three new engineers won't arrive.", "3 new engineers will not arrive", "en")]) == 0
    # other languages: the basic normalizer, diacritics kept
    assert corpus_wer([("Aujourd'hui, le temps est ensoleillé!", "aujourd hui le temps est ensoleillé", "fr")]) == 0
    assert corpus_wer([("Le temps est ensoleillé.", "le temps est ensoleille", "fr")]) == pytest.approx(1 / 4)


def test_wer_is_one_corpus_and_skips_empty_references():
    pairs = [("the cat sat on the mat", "the cat sat on mat", "en"), ("a dog barked", "a dog barked loudly", "en")]
    expected = jiwer.wer(["the cat sat on the mat", "a dog barked"], ["the cat sat on mat", "a dog barked loudly"])
    assert corpus_wer(pairs) == pytest.approx(expected) == pytest.approx(2 / 9)
    assert corpus_wer([*pairs, ("", "words where none were said", "en")]) == pytest.approx(2 / 9)
    assert corpus_wer([("...", "anything", "en")]) is None
    assert corpus_wer([("one two three", "", "en")]) == 1.0  # nothing heard: every word deleted


# ---- words in gaps -------------------------------------------------------------------------------------------
GAP = [[10.0, 30.0, "silence"]]  # shrunk by 0.5 s each end: (10.5, 29.5)


def test_words_in_gaps_by_segment_times():
    inside = {"start": 12.0, "end": 14.0, "text": " Thank you for watching."}  # midpoint in the gap: all 4
    partly = {"start": 5.0, "end": 15.0, "text": " we walked along the shore and found smooth stones there"}
    before = {"start": 0.0, "end": 9.9, "text": " Speech before the gap."}
    edge = {"start": 29.0, "end": 35.0, "text": " a b c d e f"}  # overlap 0.5 of 6 s: floor(6 * 0.5 / 6) = 0
    punct = {"start": 15.0, "end": 16.0, "text": " ..."}
    assert words_in_gaps([inside], GAP, "en") == 4
    assert words_in_gaps([partly], GAP, "en") == 4  # midpoint 10 < 10.5; overlap 4.5 of 10 s: floor(4.5) = 4
    assert words_in_gaps([before, edge, punct], GAP, "en") == 0
    assert words_in_gaps([inside, partly, before], GAP, "en") == 8
    assert words_in_gaps([inside], [[10.0, 19.9, "silence"]], "en") == 0  # under 10 s: a pause, not a gap
    assert words_in_gaps([inside], [], "en") == 0


def test_words_in_gaps_by_word_times():
    words = [
        {"word": " Speech", "start": 9.0, "end": 10.0},  # midpoint 9.5: before the gap
        {"word": " ends", "start": 10.2, "end": 11.0},  # midpoint 10.6: inside the shrunk gap
        {"word": " here.", "start": 20.0, "end": 20.5},
        {"word": " ...", "start": 21.0, "end": 21.5},  # no word once normalized
        {"word": " Again", "start": 29.2, "end": 30.4},  # midpoint 29.8: after
    ]
    # the segment's own times would say "all 5 words" (midpoint 19.7); the word times decide
    seg = {"start": 9.0, "end": 30.4, "text": " Speech ends here. ... Again", "words": words}
    assert words_in_gaps([seg], GAP, "en") == 2


# ---- repetition loops ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hypothesis", "loops"),
    [
        ("we went home we went home we went home", 1),  # 3 words x 3 copies = 9
        ("We went home. We went home. We went home. And then?", 1),  # punctuation and case do not hide it
        ("no no no", 0),  # 3 copies, 3 words < 9
        ("no no no no no no no no no", 1),  # 9 copies of one word
        ("thank you thank you thank you", 0),  # 6 words < 9
        ("the boat came home the boat came home", 0),  # 2 copies
        ("go on go on go on go on go on go on", 1),  # periods 2 and 4 over the same words: one run
        ("la la la la la la la la la la then we stop", 1),
        ("so so so so so so so so so and yes yes yes yes yes yes yes yes yes", 2),  # two separate runs
        ("the river floods every spring when the snow melts", 0),
        ("", 0),
    ],
)
def test_repetition_loops(hypothesis, loops):
    assert len(repetition_loops(hypothesis, "the river floods every spring", "en")) == loops


def test_a_repetition_the_reference_holds_is_no_loop():
    ref = "he said go go go go and ran"
    assert repetition_loops("he said go go go go go go go go go go and ran", ref, "en") == []
    # the same tandem in another rotation of the phrase
    ref = "x y z x y z x y z"
    assert repetition_loops("y z x y z x y z x", ref, "en") == []
    assert len(repetition_loops("y z x y z x y z x", "x y z", "en")) == 1


def test_tandem_runs_reports_the_primitive_phrase():
    (run,) = tandem_runs("a b a b a b a b a b a b c".split())
    assert run["phrase"] == ["a", "b"] and run["copies"] == 6 and (run["start"], run["end"]) == (0, 12)


# ---- the corpus builder --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    one = build_corpus(tmp_path_factory.mktemp("one"), subsets=["clean"])
    two = build_corpus(tmp_path_factory.mktemp("two"), subsets=["noise-only", "clean"])
    return one, two


def test_corpus_files_match_their_metadata(corpora):
    _, root = corpora
    files = load_corpus(root)
    assert [f.subset for f in files] == ["clean"] * 8 + ["noise-only"]  # SUBSETS order
    for f in files:
        info = sf.info(str(root / f"{f.name}.wav"))
        assert info.samplerate == SAMPLE_RATE and info.channels == 1 and info.subtype == "PCM_16"
        assert info.frames / SAMPLE_RATE == pytest.approx(f.seconds, abs=1 / SAMPLE_RATE)
        assert len(f.sentences) == f.reference.count(".") >= 2
        ends = [t for span in f.sentences for t in span]
        assert ends == sorted(ends) and 0 <= ends[0] and ends[-1] <= f.seconds
        for start, end, kind in f.gaps:
            assert 0 < start < end < f.seconds and end - start >= 10 and kind in ("white-noise", "brown-noise")
            assert all(e <= start or s >= end for s, e in f.sentences)  # no speech inside a gap
    (noise_only,) = [f for f in files if f.gaps]
    assert len(noise_only.gaps) == 2


def test_corpus_is_deterministic_and_subsets_independent(corpora):
    one, two = corpora
    assert json.loads((one / "corpus.json").read_text()) == json.loads((two / "corpus.json").read_text())[:8]
    for f in load_corpus(one):
        assert (one / f"{f.name}.wav").read_bytes() == (two / f"{f.name}.wav").read_bytes(), f.name


def test_corpus_is_reused(corpora):
    one, _ = corpora
    stamp = (one / "corpus.json").stat().st_mtime_ns
    assert build_corpus(one, subsets=["clean"]) == one
    assert (one / "corpus.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="unknown subset"):
        build_corpus(one, subsets=["clean", "podcasts"])


def test_another_seed_builds_other_files_of_the_same_kinds(corpora, tmp_path):
    """``--corpus-seed``: held-out files to check that a change holds beyond the files it was measured on."""
    one, _ = corpora
    other = build_corpus(tmp_path, seed=SEED + 70, subsets=["clean"])
    ours, theirs = load_corpus(one), load_corpus(other)
    assert [f.name for f in ours] == [f.name for f in theirs]
    assert all(a.reference != b.reference for a, b in zip(ours, theirs, strict=True))
    assert corpus_key(SEED + 70) != corpus_key() and (other / "corpus.key").read_text().strip() == corpus_key(SEED + 70)


def test_a_negative_corpus_seed_is_refused_with_its_name(capsys):
    from encdec.bench.quality import main
    from encdec.parser import build_parser

    assert main(build_parser().parse_args(["bench", "quality", "--corpus-seed", "-1"])) == 2
    assert "--corpus-seed must be an integer >= 0, got -1" in capsys.readouterr().err


# ---- the tables ----------------------------------------------------------------------------------------------
def test_rows_timings_and_verdicts():
    corpus = [
        CorpusFile("clean-0", "clean", "en", "The dog ran home.", 3.0),
        CorpusFile("gaps-0", "gaps", "en", "Rain fell. Then it stopped.", 40.0, [[10.0, 30.0, "silence"]]),
    ]
    seg = [{"start": 0.0, "end": 2.0, "text": " Rain fell."}, {"start": 15.0, "end": 17.0, "text": " Thank you."}]
    ours = {
        "wall_s": 4.3,
        "alone": {"segment": {"wall_s": 2.0}, "word": {"wall_s": 2.5}},
        "files": {
            "clean-0": {"text": " The dog ran home.", "segments": []},
            "gaps-0": {"text": " Rain fell. Thank you. Then it stopped.", "segments": seg},
        },
    }
    fw = {
        "wall_s": 8.6,
        "files": {
            "clean-0": {"text": " A dog ran home.", "segments": []},
            "gaps-0": {"text": " Rain fell. Then it stopped.", "segments": seg[:1]},
        },
    }
    rows, per_file = quality_rows(corpus, {"ours": ours, "fw-sequential": fw})
    by = {(r["system"], r["subset"]): r for r in rows}
    o = NAMES["ours"]
    assert by[o, "clean"]["WER"] == 0 and by[o, "clean"]["words in gaps"] is None
    assert by[o, "gaps"]["WER"] == pytest.approx(2 / 5) and by[o, "gaps"]["words in gaps"] == 2
    assert by[o, "all"]["files"] == 2 and by[o, "all"]["audio s"] == 43.0
    assert by[NAMES["fw-sequential"], "clean"]["WER"] == pytest.approx(1 / 4)
    assert per_file["ours"][1]["words_in_gaps"] == 2 and per_file["ours"][1]["error"] is None
    timing = timing_rows(corpus, CorpusFile("long-1", "long", "en", "", 300.0), {"ours": ours, "fw-sequential": fw})
    assert timing[0]["x realtime"] == pytest.approx(43 / 4.3) and timing[0]["alone x realtime"] == 150
    assert timing[1]["alone s (segment)"] is None
    lines = verdicts(rows)
    assert lines[0].startswith("clean: ours WER 0 <= faster-whisper sequential 0.25: yes; loops 0 == 0: yes")
    assert lines[1].endswith("words in gaps 2 == 0: NO")


def test_subset_and_system_choice():
    from encdec.bench.quality import choose
    from encdec.parser import build_parser

    args = build_parser().parse_args(["bench", "quality"])
    assert (args.model, args.threads, args.subsets, args.systems) == ("whisper-tiny.en", 2, None, None)
    subsets, systems, _ = choose(args, is_multilingual=False)
    assert not any(s.startswith("lang-") for s in subsets) and "gaps" in subsets
    # faster-whisper's systems run where it is installed (the [test] and [bench] extras), and are left out otherwise
    has_fw = importlib.util.find_spec("faster_whisper") is not None
    assert systems == ["ours", *(["fw-sequential", "fw-batched"] if has_fw else []), "hf"]
    assert "lang-fr" in choose(args, is_multilingual=True)[0]
    skip = argparse.Namespace(**{**vars(args), "skip_ct2": True, "skip_hf": True, "subsets": "gaps,clean"})
    assert choose(skip, is_multilingual=False)[:2] == (["clean", "gaps"], ["ours"])
    with pytest.raises(ValueError, match="English-only"):
        choose(argparse.Namespace(**{**vars(args), "subsets": "clean,lang-de"}), is_multilingual=False)


def test_bench_all_passes_threads_and_skip_ct2():
    from encdec.bench.suite import _bench_args
    from encdec.parser import build_parser

    suite = build_parser().parse_args(["bench", "all", "--only", "quality", "--threads", "3", "--skip-ct2"])
    sub = _bench_args("quality", suite, "/tmp/q.json")
    assert (sub.threads, sub.skip_ct2, sub.json, sub.func.module) == (3, True, "/tmp/q.json", "quality")
