"""Tokenizing Embed / Rerank / Classify / Tokenize inputs with a bounded cost per request.

Three bounds keep one request's memory and time linear in its (bounded) size:

- a character bound per text, ``max_input_chars = max_input_length x MAX_CHARS_PER_TOKEN``, checked
  before any tokenizer work: a longer text is refused (``InvalidRequestError``) or, with ``truncate``,
  cut to that many characters first (its tokens past the cut could never be kept anyway, unless the
  text averages more than ``MAX_CHARS_PER_TOKEN`` characters per token);
- tokenizer calls over chunks of at most ``TOKENIZE_CHUNK_CHARS`` characters, the tokenizer lock held
  per chunk (so a short request's tokenization interleaves with a long one's), an over-long item
  refused as soon as its chunk is done;
- pairs with ``truncate`` are cut longest-first here, from each segment tokenized on its own. The HF
  fast tokenizer (``tokenizers`` ``truncate_encodings`` then ``merge_with``) keeps every overflow
  window of both segments and merges them pairwise: memory and time grow with the product of the two
  lengths (a 1 MB + 1 MB pair was OOM-killed). Here the cost is the two segments' lengths.

The results equal the HF tokenizer's own (``tokenizer(text, pair, truncation="longest_first",
max_length=...)``) for every input within the character bound: ``tests/encoder/test_embed_bounds.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

from shared.errors import InvalidRequestError, ResourceExhaustedError

MAX_CHARS_PER_TOKEN = 32
"""Characters allowed per token of ``max_input_length``: generous (English text averages about 4-5
characters per WordPiece / BPE token, code with indentation a few more), so only text that could never
fit is refused or cut before tokenizing."""

TOKENIZE_CHUNK_CHARS = 1 << 18
"""Most characters handed to one tokenizer call (a chunk of a request's items; one longer item alone)."""


@dataclass
class Encoded:
    """One tokenized input.

    Attributes:
        ids: token ids, special tokens included.
        type_ids: token type ids (segment A 0, segment B 1), or None when the
            tokenizer has none (RoBERTa).
        offsets: ``(start, end)`` character offsets per token (Tokenize only).
    """

    ids: list[int]
    type_ids: list[int] | None
    offsets: list[tuple[int, int]] | None = None


def longest_first(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """How many tokens of each segment a pair keeps under ``longest_first`` truncation.

    As ``tokenizers``' ``TruncationStrategy::LongestFirst``: the shorter segment keeps at most
    ``budget // 2``, the longer one the rest (on a tie the second segment keeps the odd token).

    Args:
        len_a / len_b: tokens of each segment, special tokens excluded.
        budget: tokens the two may keep together (max length minus the special tokens).
    """
    if len_a + len_b <= budget:
        return len_a, len_b
    budget = max(budget, 0)
    if len_a > len_b:
        keep_b = min(len_b, budget // 2)
        return budget - keep_b, keep_b
    keep_a = min(len_a, budget // 2)
    return keep_a, budget - keep_a


def chunks(sizes: list[int], max_chars: int) -> Iterator[list[int]]:
    """Consecutive index lists whose ``sizes`` sum to at most ``max_chars`` (an item larger alone)."""
    current: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if current and total + n > max_chars:
            yield current
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        yield current


class BoundedTokenizer:
    """The checkpoint's HF tokenizer behind the bounds above; thread safe.

    Args:
        tokenizer: an HF tokenizer (fast or slow; the linear pair truncation needs a fast one,
            a slow one truncates pairs in Python, linear already).
        max_input_length: most tokens of one sequence, special tokens included.
        with_type_ids: return token type ids (the model has more than one type).
    """

    def __init__(self, tokenizer, max_input_length: int, with_type_ids: bool | None) -> None:
        self.tokenizer = tokenizer
        self.max_input_length = max_input_length
        self.max_input_chars = max_input_length * MAX_CHARS_PER_TOKEN
        self.with_type_ids = with_type_ids
        if with_type_ids is None:  # as the HF tokenizer decides when asked for None
            self.with_type_ids = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
        # An HF fast tokenizer sets truncation on its shared Rust backend for every call, so concurrent
        # calls with different ``truncate`` would see each other's setting: serialise them.
        self.lock = threading.Lock()
        self._layouts: dict[bool, list[tuple[int | None, int, int]] | None] = {}

    # ---- bounds --------------------------------------------------------------------------------

    def bound_chars(self, texts: list[str], truncate: bool, name: str) -> list[str]:
        """Cuts (``truncate``) or refuses texts longer than ``max_input_chars``.

        Args:
            name: how an item is named in the error, formatted with its index ``i``.
        Raises:
            InvalidRequestError: a text is longer and ``truncate`` is off.
        """
        limit = self.max_input_chars
        out = texts
        for i, t in enumerate(texts):
            if len(t) <= limit:
                continue
            if not truncate:
                raise InvalidRequestError(
                    f"{name.format(i=i)} has {len(t)} characters, more than this model's limit of {limit} "
                    f"({self.max_input_length} tokens x {MAX_CHARS_PER_TOKEN} characters); shorten it or set "
                    "truncate=true"
                )
            if out is texts:
                out = list(texts)
            out[i] = t[:limit]
        return out

    # ---- tokenizing ----------------------------------------------------------------------------

    def tokenize(
        self,
        texts: list[str],
        pairs: list[str | None] | None = None,
        truncate: bool = False,
        add_special_tokens: bool = True,
        check_length: bool = True,
        offsets: bool = False,
        max_total_tokens: int | None = None,
        names: tuple[str, str] = ("input {i}", "the text_pair of input {i}"),
    ) -> list[Encoded]:
        """Tokenizes texts (and optional second segments), keeping input order.

        Args:
            truncate: cut every item to ``max_input_length`` tokens (pairs longest-first).
            check_length: refuse an item longer than ``max_input_length`` tokens (without ``truncate``).
            offsets: return character offsets per token (fast tokenizers).
            max_total_tokens: refuse the request once its items hold more tokens than this in all.
            names: how a text / a text pair is named in errors (``{i}``: its index).
        Raises:
            InvalidRequestError: an item is longer than ``max_input_chars`` characters, or (``check_length``)
                than ``max_input_length`` tokens, while ``truncate`` is off.
            ResourceExhaustedError: more than ``max_total_tokens`` tokens in all.
        """
        texts = self.bound_chars(texts, truncate, names[0])
        pairs = pairs or [None] * len(texts)
        if any(p is not None for p in pairs):
            bounded = self.bound_chars([p or "" for p in pairs], truncate, names[1])
            pairs = [b if p is not None else None for p, b in zip(pairs, bounded)]
        sizes = [len(t) + len(p or "") for t, p in zip(texts, pairs)]
        out: list[Encoded | None] = [None] * len(texts)
        total = 0
        for chunk in chunks(sizes, TOKENIZE_CHUNK_CHARS):
            singles = [i for i in chunk if pairs[i] is None]
            doubles = [i for i in chunk if pairs[i] is not None]
            for i, e in zip(
                singles, self._hf([texts[i] for i in singles], None, truncate, add_special_tokens, offsets)
            ):
                out[i] = e
            if doubles:
                a, b = [texts[i] for i in doubles], [pairs[i] for i in doubles]
                if truncate and self._layout(add_special_tokens) is not None:
                    encoded = self._truncated_pairs(a, b, add_special_tokens, offsets)
                else:
                    encoded = self._hf(a, b, truncate, add_special_tokens, offsets)
                for i, e in zip(doubles, encoded):
                    out[i] = e
            for i in chunk:
                n = len(out[i].ids)
                total += n
                if check_length and not truncate and n > self.max_input_length:
                    raise InvalidRequestError(
                        f"input {i} has {n} tokens, more than this model's limit of "
                        f"{self.max_input_length}; shorten it or set truncate=true"
                    )
            if max_total_tokens is not None and total > max_total_tokens:
                raise ResourceExhaustedError(
                    f"these {len(texts)} inputs hold more than {max_total_tokens} tokens in all, this server's "
                    "limit per request (--max-inputs-per-request x the max input length); send fewer or set "
                    "truncate=true"
                )
        return out  # type: ignore[return-value]

    def _hf(self, a: list[str], b: list[str] | None, truncate: bool, special: bool, offsets: bool) -> list[Encoded]:
        """The HF tokenizer's own call (singles, and pairs without ``truncate``)."""
        if not a:
            return []
        tok = self.tokenizer
        with self.lock:
            enc = tok(
                a,
                b,
                truncation="longest_first" if truncate else False,
                max_length=self.max_input_length if truncate else None,
                add_special_tokens=special,
                return_offsets_mapping=offsets and tok.is_fast,
                return_attention_mask=False,
                return_token_type_ids=self.with_type_ids,
                verbose=False,
            )
        types = enc.get("token_type_ids")
        offs = enc.get("offset_mapping")
        return [
            Encoded(
                list(enc["input_ids"][j]),
                list(types[j]) if types is not None else None,
                [tuple(o) for o in offs[j]] if offs is not None else None,
            )
            for j in range(len(a))
        ]

    def _layout(self, special: bool) -> list[tuple[int | None, int, int]] | None:
        """Where the post-processor puts each segment and special token in a pair, from one probe:
        ``(segment or None, token id, type id)`` per position, one entry per segment. None: no fast
        tokenizer, or a template this cannot read (then pairs go through the HF call)."""
        if special in self._layouts:
            return self._layouts[special]
        layout: list[tuple[int | None, int, int]] | None = None
        backend = getattr(self.tokenizer, "backend_tokenizer", None) if self.tokenizer.is_fast else None
        if backend is not None:
            with self.lock:
                backend.no_truncation()
                backend.no_padding()  # a tokenizer.json may pad to a length (all-MiniLM-L6-v2: 128)
                probe = backend.encode("a", "b", add_special_tokens=special)
            layout = []
            for seq, tid, typ in zip(probe.sequence_ids, probe.ids, probe.type_ids):
                if seq is None:
                    layout.append((None, tid, typ))
                elif not layout or layout[-1][0] != seq:
                    layout.append((seq, -1, typ))
            if sorted(s for s, _, _ in layout if s is not None) != [0, 1]:
                layout = None  # a segment tokenized to nothing, or split around a special token
        self._layouts[special] = layout
        return layout

    def _truncated_pairs(self, a: list[str], b: list[str], special: bool, offsets: bool) -> list[Encoded]:
        """Pairs cut longest-first to ``max_input_length``, built from each segment tokenized alone."""
        layout = self._layout(special)
        assert layout is not None
        backend = self.tokenizer.backend_tokenizer
        with self.lock:
            backend.no_truncation()
            backend.no_padding()
            enc_a = backend.encode_batch(a, add_special_tokens=False)
            enc_b = backend.encode_batch(b, add_special_tokens=False)
        budget = self.max_input_length - sum(1 for s, _, _ in layout if s is None)
        out = []
        for ea, eb in zip(enc_a, enc_b):
            keep = longest_first(len(ea.ids), len(eb.ids), budget)
            segs = ((ea, keep[0]), (eb, keep[1]))
            ids: list[int] = []
            types: list[int] = []
            offs: list[tuple[int, int]] = []
            for seq, tid, typ in layout:
                if seq is None:
                    ids.append(tid)
                    types.append(typ)
                    offs.append((0, 0))
                    continue
                e, n = segs[seq]
                ids.extend(e.ids[:n])
                types.extend([typ] * n)
                if offsets:
                    offs.extend(e.offsets[:n])
            out.append(Encoded(ids, types if self.with_type_ids else None, offs if offsets else None))
        return out
