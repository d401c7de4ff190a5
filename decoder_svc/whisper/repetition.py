"""Repetition loops in a transcript: a phrase said again and again, back to back.

Whisper's classic failure (openai-whisper discussions #679, #1962): the decoder falls into a cycle and repeats
one phrase until the window's token limit. openai-whisper catches long loops with the compression ratio of the
text (> 2.4), but a short window's loop ("I'm gonna go to sleep, I'm gonna go to sleep, I'm gonna go to
sleep") compresses too little to pass that threshold. This module finds them directly: a *loop* is a phrase
of ``p >= 1`` words repeated back to back at least ``MIN_COPIES`` times, covering at least ``MIN_LOOP_WORDS``
words (so "no, no, no" is speech and "the new one, the new one, the new one" is a loop). Words are compared
after lower-casing and dropping punctuation (Unicode letters, digits and apostrophes kept).

The decoder treats a window with a loop as failed (decoded again hotter, ``decoder_svc.whisper.quality``);
the quality bench (``encdec bench quality``) counts loops with the same definition. ``LoopStop`` ends a greedy
attempt as soon as its text ends in a loop, rather than letting it repeat to the token limit (a wasted decode of
up to 224 tokens) when the verdict is already certain.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIN_COPIES = 3
MIN_LOOP_WORDS = 9
MAX_PERIOD = 40  # words; longer repeated passages are left to the compression ratio
_WORD = re.compile(r"[\w']+", re.UNICODE)


def loop_words(text: str) -> list[str]:
    """The words loops are found over: lower case, punctuation dropped."""
    return _WORD.findall(text.lower().replace("\u2019", "'"))


@dataclass(frozen=True)
class Loop:
    """One maximal back-to-back repetition: ``words[start : start + period * copies]``."""

    start: int
    period: int
    copies: int

    @property
    def phrase_end(self) -> int:
        """End of the first copy (what is kept when the loop is collapsed)."""
        return self.start + self.period

    @property
    def end(self) -> int:
        return self.start + self.period * self.copies


def find_loops(
    words: Sequence[str], max_period: int = MAX_PERIOD, min_copies: int = MIN_COPIES, min_words: int = MIN_LOOP_WORDS
) -> list[Loop]:
    """Every maximal loop in ``words``, in order, not overlapping: at each position the shortest period that
    makes a loop there wins, and the search goes on after its end.

    Args:
        max_period: longest phrase looked for, in words (``O(len(words) * max_period)``).
        min_copies, min_words: what makes a repetition a loop (module docstring).
    """
    n = len(words)
    loops: list[Loop] = []
    i = 0
    while i < n:
        found = None
        for p in range(1, min(max_period, (n - i) // min_copies) + 1):
            copies = 1
            while i + (copies + 1) * p <= n and words[i + copies * p : i + (copies + 1) * p] == words[i : i + p]:
                copies += 1
            if copies >= min_copies and p * copies >= min_words:
                found = Loop(i, p, copies)
                break
        if found is None:
            i += 1
            continue
        loops.append(found)
        i = found.end
    return loops


def has_loop(text: str) -> bool:
    """Whether ``text`` holds a loop (module docstring)."""
    return bool(find_loops(loop_words(text)))


def ends_in_loop(
    words: Sequence[str], max_period: int = MAX_PERIOD, min_copies: int = MIN_COPIES, min_words: int = MIN_LOOP_WORDS
) -> bool:
    """Whether ``words`` end in a loop: their last ``p * c`` words are ``c >= min_copies`` copies of one phrase of
    ``p <= max_period`` words, ``p * c >= min_words``. Then ``find_loops`` finds a loop in ``words`` and in any
    continuation of them (at that start, the same period repeats at least as often; a loop found further left
    only comes sooner). ``O(max_period * len(words))`` at worst, a few compares per period in practice.
    """
    n = len(words)
    for p in range(1, min(max_period, n // min_copies) + 1):
        copies = 1
        while (copies + 1) * p <= n and words[n - (copies + 1) * p : n - copies * p] == words[n - p :]:
            copies += 1
        if copies >= min_copies and p * copies >= min_words:
            return True
    return False


class LoopStop:
    """A sequence's stop criterion (``SamplingParams.stop_criterion``): True once the window's text, every word
    but the last (it may still grow), ends in a loop (``ends_in_loop``).

    The window's text is that of its text tokens (timestamps and special tokens left out), as
    ``quality.judge`` reads it, so a loop found here is one ``has_loop`` finds in the whole attempt's text:
    the attempt fails whatever it would have decoded after (the caller decides when that failure is certain).

    Args:
        decode: text ids -> text (the checkpoint's tokenizer, special tokens skipped).
        is_text: whether an id is a text token (``WhisperSpecials.is_text``-like).

    Not thread-safe; one per sequence (it keeps the text ids seen so far).
    """

    reason = "repetition loop"

    def __init__(self, decode: Callable[[Sequence[int]], str], is_text: Callable[[int], bool]) -> None:
        self.decode = decode
        self.is_text = is_text
        self._seen = 0
        self._text_ids: list[int] = []

    def __call__(self, output_token_ids: Sequence[int]) -> bool:
        """Whether the sequence whose generated ids are ``output_token_ids`` (the prompt left out) stops now."""
        new = output_token_ids[self._seen :]
        self._seen = len(output_token_ids)
        added = [t for t in new if self.is_text(t)]
        if not added:
            return False
        self._text_ids += added
        words = loop_words(self.decode(self._text_ids))[:-1]
        return ends_in_loop(words)
