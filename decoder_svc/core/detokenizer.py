"""Incremental streaming detokenizer.

The idea (from vLLM's ``detokenize_incrementally``): keep two offsets into the
token list. Text of ``tokens[prefix_offset:read_offset]`` was already emitted;
decoding ``tokens[prefix_offset:]`` and removing that already-emitted text
gives the new delta. Decoding a short window keeps each step O(1) rather than
re-decoding the whole output, while the few tokens of left context let the
decoder render the boundary as a full decode would. When the window ends in
U+FFFD (a character whose bytes are split across byte-level BPE tokens), the
delta is held back until the character completes.
"""

from __future__ import annotations

from collections.abc import Iterable

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas.

    Joining every delta returned by ``add_tokens`` and ``flush`` equals
    ``tokenizer.decode(all_tokens, skip_special_tokens=True)``.

    Args:
        tokenizer: a HF tokenizer (``decode(ids, skip_special_tokens=...)``).
        skip_special_tokens: drop special tokens from the text.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: Iterable[int]) -> str:
        """Appends tokens and returns the text they complete ("" when held back)."""
        self.token_ids.extend(int(t) for t in new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or an incomplete multi-byte character
        if not new_text.startswith(prefix_text):
            # The window re-rendered its own start; fall back to a full decode.
            return self._emit_full()
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.emitted += delta
        return delta

    def _emit_full(self) -> str:
        full = self._decode(self.token_ids)
        if full.endswith(REPLACEMENT_CHAR) or not full.startswith(self.emitted):
            return ""
        delta = full[len(self.emitted) :]
        self.emitted = full
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return delta

    def flush(self) -> str:
        """At the end of the stream: whatever the full decode still has beyond the emitted text.

        A trailing incomplete character is emitted here as the tokenizer
        decodes it (U+FFFD), exactly as the full decode would show it.
        """
        full = self._decode(self.token_ids)
        if not full.startswith(self.emitted):
            return ""
        delta = full[len(self.emitted) :]
        self.emitted = full
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self.emitted


class OutputText:
    """One sequence's streamed text: incremental detokenization plus stop strings.

    ``text`` is the output text so far (cut at a matched stop string);
    ``pop_delta`` hands out the part not yet streamed, minus the held-back
    tail: the longest suffix that is a proper prefix of some stop string, so
    text that may turn out to be the start of a stop string is never streamed.
    A stop string is found wherever token boundaries fall (inside one token,
    across several), because matching runs on the text, not the tokens.

    Joining every ``pop_delta`` of a sequence gives the full decode (as
    ``IncrementalDetokenizer``), cut before the first stop string match (after
    it with ``include_stop_str_in_output``).

    Args:
        tokenizer: a HF tokenizer.
        stop: stop strings (non-empty).
        include_stop_str_in_output: keep the matched stop string (or the text of
            a stop token given to ``finish``).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""
        self.sent = 0  # characters of ``text`` already streamed
        self.finished = False

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Detokenizes one more token; returns the stop string it completed (the text is cut), or None.

        ``check_stop=False`` (``min_tokens`` not reached) only extends the text.
        """
        if self.finished:
            raise RuntimeError("add_token after the text finished")
        prev = len(self.text)
        self.text += self.detokenizer.add_tokens([token_id])
        if not check_stop or len(self.text) == prev or not self.stop:
            return None
        match = self._find_stop(prev)
        if match is None:
            return None
        idx, stop = match
        self.text = self.text[: idx + len(stop) if self.include_stop_str_in_output else idx]
        self.finished = True
        return stop

    def _find_stop(self, prev: int) -> tuple[int, str] | None:
        """Earliest stop string ending in the text added after ``prev`` characters: (index, string)."""
        best = None
        for s in self.stop:
            idx = self.text.find(s, max(self.sent, prev - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        return best

    def finish(self, final_token_id: int | None = None) -> None:
        """The sequence ended without a stop string: optionally detokenize its last
        (stop) token, then release the held-back text and any trailing bytes."""
        if self.finished:
            return
        if final_token_id is not None:
            self.text += self.detokenizer.add_tokens([final_token_id])
        self.text += self.detokenizer.flush()
        self.finished = True

    def _held_back(self) -> int:
        """Characters at the end of ``text`` that might begin a stop string."""
        if self.finished or not self.stop:
            return 0
        unsent = len(self.text) - self.sent
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, unsent), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def pop_delta(self) -> str:
        """Text ready to stream since the previous call ("" while everything new is held back)."""
        end = max(self.sent, len(self.text) - self._held_back())
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
