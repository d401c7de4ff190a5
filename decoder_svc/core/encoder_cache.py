"""Encoder-output cache: identical inputs in flight together share one request's cross-attention KV.

A request's cross-attention KV depends only on the model and its encoder
input (the audio samples after decoding and resampling, or the source token
ids after truncation), so a second request with the same input reads the
first one's cross blocks (one more reference each, ``BlockPool.incref``)
instead of being encoded again. Entries live exactly as long as some
unfinished request holds the blocks: the last holder's finish frees the
blocks and evicts the entry (no retained copies, so the cache costs no KV
memory of its own). ``EncoderCache`` keeps the entries and keys by request
id; the scheduler moves the sequences and their block references
(``Scheduler.encoder_cache``). Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass
class CrossKVEntry:
    """One encoder input's cross-attention KV in the pool.

    Attributes:
        block_ids: the cross blocks (the leader's allocation).
        encoder_len: cross-attention KV length.
        leader: request whose Encode fills the blocks.
        ready: the leader's Encode has written them (``mark_encoded``).
        holders: unfinished requests referencing the blocks, leader included.
    """

    block_ids: list[int]
    encoder_len: int
    leader: str
    ready: bool = False
    holders: set[str] = field(default_factory=set)


class EncoderCache:
    """Encoder-cache bookkeeping over request ids (the scheduler does the block references).

    Attributes:
        entries: content key -> ``CrossKVEntry``.
        keys: request id -> its content key (requests added with one).
        num_hits: requests that shared another's cross KV, since start.
    """

    def __init__(self) -> None:
        self.entries: dict[str, CrossKVEntry] = {}
        self.keys: dict[str, str] = {}
        self.num_hits = 0

    def lookup(self, request_id: str, encoder_len: int) -> CrossKVEntry | None:
        """The entry a new request with this key may share (same ``encoder_len``), or None."""
        entry = self.entries.get(self.keys.get(request_id, ""))
        return entry if entry is not None and entry.encoder_len == encoder_len else None

    def held_by(self, request_id: str) -> CrossKVEntry | None:
        """The entry ``request_id`` holds, or None."""
        entry = self.entries.get(self.keys.get(request_id, ""))
        return entry if entry is not None and request_id in entry.holders else None

    def attach(self, request_id: str, entry: CrossKVEntry) -> None:
        """``request_id`` now references ``entry``'s blocks (a hit)."""
        entry.holders.add(request_id)
        self.num_hits += 1

    def lead(self, request_id: str, block_ids: list[int], encoder_len: int) -> None:
        """``request_id`` got fresh cross blocks: others with its key may share them (if none yet)."""
        key = self.keys.get(request_id)
        if key is not None and key not in self.entries:
            self.entries[key] = CrossKVEntry(list(block_ids), encoder_len, request_id, holders={request_id})

    def hold(self, parent_id: str, child_id: str) -> None:
        """A forked child references its parent's blocks, hence its entry too."""
        entry = self.held_by(parent_id)
        if entry is not None:
            self.keys[child_id] = self.keys[parent_id]
            entry.holders.add(child_id)

    def mark_ready(self, request_id: str) -> list[str]:
        """``request_id``'s Encode landed; returns the other holders, now runnable too."""
        entry = self.held_by(request_id)
        if entry is None or entry.ready:
            return []
        entry.ready = True
        return sorted(entry.holders - {request_id})

    def release(self, request_id: str) -> list[str]:
        """``request_id`` finished: drops it (and the entry with its last holder).

        Returns:
            Holders that must give their references back and queue for cross
            blocks again: those attached to a leader that left before its
            Encode landed (nothing was written for them to read).
        """
        entry = self.held_by(request_id)
        key = self.keys.pop(request_id, None)
        if entry is None:
            return []
        entry.holders.discard(request_id)
        orphans: list[str] = []
        if not entry.ready and entry.leader == request_id:
            orphans = sorted(entry.holders)  # they keep their keys: one of them leads next
            entry.holders.clear()
        if not entry.holders:
            del self.entries[key]
        return orphans


def encoder_cache_key(
    model: str, *, pcm: bytes | None = None, input_ids: list[int] | None = None, features: bytes | None = None
) -> str:
    """SHA-256 content key of an encoder input: the model name plus either the
    float32 PCM bytes (16 kHz mono, as sent to Encode), the log-mel feature bytes, or the source token ids.

    Raises:
        ValueError: not exactly one input given.
    """
    if sum(x is not None for x in (pcm, input_ids, features)) != 1:
        raise ValueError("give exactly one of pcm, features and input_ids")
    h = hashlib.sha256()
    h.update(model.encode() + b"\0")
    if features is not None:
        h.update(b"features\0" + features)
    elif pcm is not None:
        h.update(b"pcm\0" + pcm)
    else:
        h.update(b"ids\0" + b",".join(str(int(t)).encode() for t in input_ids))
    return h.hexdigest()
