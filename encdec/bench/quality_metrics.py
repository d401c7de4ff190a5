"""The quality bench's scores: word error rate, words in gaps, repetition loops. Plain Python over strings.

* **WER**: ``jiwer`` over a group of files as one corpus (errors summed, divided by the reference words)
  after Whisper's normalizers from ``transformers.models.whisper.english_normalizer``:
  ``EnglishTextNormalizer`` for English, ``BasicTextNormalizer`` for other languages, both sides alike
  (openai/whisper's ``whisper/normalizers``, the normalization of its published WERs). The English one takes a
  British -> American spelling map, shipped as ``normalizer.json`` beside openai/whisper's HF checkpoints;
  none is at hand here (our model folders are CTranslate2 conversions without it), so it gets ``{}``: "colour"
  against "color" counts as an error. The corpus's sentences avoid such words (``quality_sentences``).
* **words in gaps**: hypothesis words that lie inside a gap of the file (a stretch of at least
  ``MIN_GAP_S`` without speech), the gap shrunk by ``GAP_MARGIN_S`` at each end so that a sentence's
  timestamps a little off do not count. Timed by segments: a segment whose midpoint is inside the shrunk gap
  brings all its words, one overlapping it partly brings the share of its words that the overlap is of its
  length, rounded down (coarse: a real sentence whose segment is given a start inside the gap counts too).
  With word timestamps: the words whose midpoint is inside.
* **repetition loops**: a phrase of ``p >= 1`` words repeated back to back at least ``MIN_COPIES`` times,
  covering at least ``MIN_LOOP_WORDS`` words (``"a b c a b c a b c"`` counts, ``"no no no"`` does not), in
  a file's normalized hypothesis, that its normalized reference does not hold as the same tandem (its
  primitive phrase, in any rotation, ``MIN_COPIES`` times back to back); each maximal run counts once. The
  looping Whisper is known for (openai/whisper discussions #679, #1505).

Words are what the normalizer leaves, split on spaces, less the tokens without a letter or digit (the
English normalizer turns "..." into "."): punctuation alone is no word, for WER as for the counts.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable

from decoder_svc.whisper.repetition import MIN_COPIES, MIN_LOOP_WORDS, find_loops

MIN_GAP_S = 10.0  # gaps shorter than this are pauses, not counted
GAP_MARGIN_S = 0.5  # each end of a gap given to the speech beside it


@functools.cache
def normalizer(language: str) -> Callable[[str], str]:
    """Whisper's text normalizer for ``language`` (ISO 639-1): English's with an empty spelling map, else the
    basic one (lower case, brackets and symbols out, diacritics kept)."""
    from transformers.models.whisper.english_normalizer import BasicTextNormalizer, EnglishTextNormalizer

    return EnglishTextNormalizer({}) if language == "en" else BasicTextNormalizer()


def words(text: str, language: str) -> list[str]:
    """``text`` normalized for ``language`` and split into words (tokens with a letter or digit)."""
    return [w for w in normalizer(language)(text).split() if _WORD.search(w)]


_WORD = re.compile(r"\w")


def wer_counts(pairs: Iterable[tuple[str, str, str]]) -> tuple[int, int]:
    """``(errors, reference_words)`` over ``(reference, hypothesis, language)`` triples, normalized per file's
    language: substitutions + deletions + insertions of ``jiwer.process_words``. Files with an empty
    normalized reference are skipped (no words to compare against; WER is undefined there)."""
    import jiwer

    refs, hyps = [], []
    for reference, hypothesis, language in pairs:
        ref = " ".join(words(reference, language))
        if ref:
            refs.append(ref)
            hyps.append(" ".join(words(hypothesis, language)))
    if not refs:
        return 0, 0
    out = jiwer.process_words(refs, hyps)
    return out.substitutions + out.deletions + out.insertions, out.substitutions + out.deletions + out.hits


def corpus_wer(pairs: Iterable[tuple[str, str, str]]) -> float | None:
    """WER of ``(reference, hypothesis, language)`` triples as one corpus (see ``wer_counts``); None when no
    reference has words."""
    errors, total = wer_counts(pairs)
    return errors / total if total else None


def _shrunk(gaps: Iterable, min_gap_s: float, margin_s: float) -> list[tuple[float, float]]:
    return [(s + margin_s, e - margin_s) for s, e, *_ in gaps if e - s >= min_gap_s]


def words_in_gaps(
    segments: list[dict], gaps: Iterable, language: str, min_gap_s: float = MIN_GAP_S, margin_s: float = GAP_MARGIN_S
) -> int:
    """Hypothesis words inside the file's ``gaps`` (module docstring).

    Args:
        segments: ``{"start", "end", "text"}`` in seconds, optionally ``"words"``: ``[{"word", "start",
            "end"}]``; a segment with words is counted by them, one without by its own times.
        gaps: ``[start_s, end_s, ...]`` each (``CorpusFile.gaps``); under ``min_gap_s`` long: left out.
        language: the normalizer that decides what a word is.
    """
    spans = _shrunk(gaps, min_gap_s, margin_s)
    count = 0
    for seg in segments:
        if seg.get("words"):
            for w in seg["words"]:
                mid = (w["start"] + w["end"]) / 2
                if words(w["word"], language) and any(s < mid < e for s, e in spans):
                    count += len(words(w["word"], language))
            continue
        n, start, end = len(words(seg["text"], language)), seg["start"], seg["end"]
        mid = (start + end) / 2
        if any(s < mid < e for s, e in spans):
            count += n
        elif end > start:
            overlap = sum(max(0.0, min(end, e) - max(start, s)) for s, e in spans)
            count += min(n, int(n * overlap / (end - start)))
    return count


def tandem_runs(seq: list[str], min_copies: int = MIN_COPIES, min_words: int = MIN_LOOP_WORDS) -> list[dict]:
    """Maximal back-to-back repeats in ``seq``: ``{"start", "end", "period", "phrase", "copies"}`` each
    (word indices, ``end`` exclusive; ``phrase``: the primitive phrase, ``period`` words). The decoder's own
    loop finder (``decoder_svc.whisper.repetition.find_loops``), with no bound on the phrase's length.
    """
    return [
        {"start": lp.start, "end": lp.end, "period": lp.period, "phrase": list(seq[lp.start : lp.phrase_end]),
         "copies": lp.copies}
        for lp in find_loops(seq, max(len(seq) // min_copies, 1), min_copies, min_words)
    ]  # fmt: skip


def _holds_tandem(seq: list[str], phrase: list[str], copies: int) -> bool:
    """Whether ``seq`` has ``phrase`` (or a rotation of it) ``copies`` times back to back."""
    text = f" {' '.join(seq)} "
    return any(f" {' '.join((phrase[r:] + phrase[:r]) * copies)} " in text for r in range(len(phrase)))


def repetition_loops(
    hypothesis: str, reference: str, language: str, min_copies: int = MIN_COPIES, min_words: int = MIN_LOOP_WORDS
) -> list[dict]:
    """The loops of one file's ``hypothesis`` (``tandem_runs`` of its normalized words) that its
    ``reference`` does not hold as the same tandem; each with ``"text"``, the looped phrase."""
    ref = words(reference, language)
    loops = []
    for run in tandem_runs(words(hypothesis, language), min_copies, min_words):
        if not _holds_tandem(ref, run["phrase"], min_copies):
            loops.append({**run, "text": " ".join(run["phrase"])})
    return loops
