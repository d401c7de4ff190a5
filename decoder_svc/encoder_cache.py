"""Encoder-output cache: identical inputs in flight together share one request's cross-attention KV.

A request's cross-attention KV depends only on the model and its encoder
input (the audio samples after decoding and resampling, or the source token
ids after truncation), so a second request with the same input reads the
first one's cross blocks (one more reference each, ``BlockPool.incref``)
instead of being encoded again. Entries live exactly as long as some
unfinished request holds the blocks: the last holder's finish frees the
blocks and evicts the entry (no retained copies, so the cache costs no KV
memory of its own). The scheduler owns the entries (``Scheduler.cross_cache``);
this module holds the entry and the content key (pure Python, no torch).
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


def encoder_cache_key(model: str, *, pcm: bytes | None = None, input_ids: list[int] | None = None) -> str:
    """SHA-256 content key of an encoder input: the model name plus either the
    float32 PCM bytes (16 kHz mono, as sent to Encode) or the source token ids.

    Raises:
        ValueError: neither or both inputs given.
    """
    if (pcm is None) == (input_ids is None):
        raise ValueError("give exactly one of pcm and input_ids")
    h = hashlib.sha256()
    h.update(model.encode() + b"\0")
    if pcm is not None:
        h.update(b"pcm\0" + pcm)
    else:
        h.update(b"ids\0" + b",".join(str(int(t)).encode() for t in input_ids))
    return h.hexdigest()
