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
