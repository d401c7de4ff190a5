"""LocalAgreement-2: a word is final once two consecutive hypotheses of the growing buffer agree on it.

The policy of Machacek, Dabre and Bojar, "Turning Whisper into Real-Time Transcription System" (IJCNLP-AACL
2023 demo; the ``HypothesisBuffer`` of ufal/whisper_streaming): every step re-decodes the utterance's buffer
and yields a hypothesis, a list of timed words; the longest common prefix of this hypothesis and the previous
one, after the words already final, becomes final; the rest is the partial, which may still change. Words
are compared on their normalized form (lower case, punctuation and spaces stripped) so that "hello," and
" Hello" agree; the final keeps the newer hypothesis's spelling and times.

A new hypothesis starts where the buffer starts, which may lie before the end of the finals (the buffer keeps
some audio already final as context): its words that start before the last final word's end (less
``OVERLAP_S``), or end before ``floor`` (the utterance's start: by the end, since the alignment puts an
utterance's first word's start a few tenths early in one hypothesis and not in the next, and a word dropped from
one hypothesis only never becomes final), are dropped, and a head that repeats the last one to ``MAX_NGRAM``
final words is dropped too (whisper_streaming's n-gram check), so no final word is sent twice.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

OVERLAP_S = 0.1  # a word may start this much before the last final's end and still be new (whisper_streaming)
MAX_NGRAM = 5  # the longest repeated head of finals dropped from a new hypothesis (whisper_streaming)
NEAR_S = 1.0  # the repeated-head check applies to a hypothesis starting within this of the last final's end


@dataclass(frozen=True)
class TimedWord:
    """One hypothesis word.

    Attributes:
        text: as decoded, with its leading space. start, end: seconds of stream time.
        probability: mean probability of its tokens (1.0 when not timed by the alignment heads).
    """

    text: str
    start: float
    end: float
    probability: float = 1.0

    @property
    def key(self) -> str:
        """The form two hypotheses are compared on."""
        return normalize(self.text)


def normalize(word: str) -> str:
    """Lower case without punctuation, symbols or spaces (Unicode categories P*, S*, Z*)."""
    return "".join(c for c in word.lower() if unicodedata.category(c)[0] not in "PSZ")


class LocalAgreement:
    """One utterance's finals and partial (see the module docstring).

    Attributes:
        final: the words made final, in order. pending: the last hypothesis's words after them (the partial).
    """

    def __init__(self) -> None:
        self.final: list[TimedWord] = []
        self.pending: list[TimedWord] = []
        self.floor = 0.0  # stream seconds: words ending before it are context only (an earlier utterance's audio)

    def forget(self, keep: int) -> None:
        """Keeps only the last ``keep`` final words (what the time and repeated-head checks need)."""
        del self.final[: max(0, len(self.final) - keep)]

    @property
    def final_end(self) -> float:
        """Stream seconds where the last final word ends (0 before any)."""
        return self.final[-1].end if self.final else 0.0

    def _new_words(self, words: list[TimedWord]) -> list[TimedWord]:
        """``words`` without those already final (by time, then by a repeated head)."""
        if self.final or self.floor:  # not final yet, and reaching into the utterance (a first word's start wanders)
            words = [w for w in words if w.start > self.final_end - OVERLAP_S and w.end > self.floor]
        words = [w for w in words if w.key]  # a lone punctuation mark agrees with nothing
        if words and self.final and abs(words[0].start - self.final_end) < NEAR_S:
            for n in range(min(MAX_NGRAM, len(self.final), len(words)), 0, -1):
                if [w.key for w in self.final[-n:]] == [w.key for w in words[:n]]:
                    return words[n:]
        return words

    def insert(self, hypothesis: list[TimedWord]) -> list[TimedWord]:
        """Takes one step's hypothesis; returns the words it makes final (possibly none).

        Args:
            hypothesis: the step's words in order, times in stream seconds.
        """
        new = self._new_words(hypothesis)
        agreed = 0
        while agreed < min(len(new), len(self.pending)) and new[agreed].key == self.pending[agreed].key:
            agreed += 1
        made_final = new[:agreed]
        self.final += made_final
        self.pending = new[agreed:]
        return made_final

    def finalize(self, count: int) -> list[TimedWord]:
        """Makes the first ``count`` words of the partial final without a second hypothesis; returns them."""
        made_final, self.pending = self.pending[:count], self.pending[count:]
        self.final += made_final
        return made_final

    def flush(self, hypothesis: list[TimedWord] | None = None) -> list[TimedWord]:
        """The utterance ended: every word of ``hypothesis`` (the last decode of the whole buffer; None: the
        current partial) that is not final yet becomes final; returns them."""
        words = self.pending if hypothesis is None else self._new_words(hypothesis)
        self.final += words
        self.pending = []
        return words
