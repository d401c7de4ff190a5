"""``torch_dist`` transport: point-to-point send/recv of cross KV over ``torch.distributed``.

For encoder and decoder on different hosts (or devices). Gloo moves CPU
tensors over TCP; NCCL moves CUDA tensors. The code is the same for both:
``backend`` and ``device`` are parameters.

Rendezvous: the decoder hosts a ``TCPStore`` (``address``, port 0 picks a free
one) and names it in ``KVTarget.segment`` as ``host:port``, beside its
``instance_id`` (also stored under ``encdec/instance_id``). On its first write
to a decoder instance an encoder takes a pair number ``n`` from the store
counter ``encdec/num_pairs`` (with the deployment's internal token it first checks the decoder's record is signed,
``encdec/instance_mac``, and then signs a hello for pair ``n``, without which the decoder never serves it; at most
``MAX_PAIRS`` pairs run, and a record another client of the store rewrote is put back: issue 34 item 2); both sides
then build a two-rank process group
(decoder rank 0, encoder rank 1) directly over ``PrefixStore("encdec/pair/n/")``
instead of ``init_process_group``, so one encoder can serve several decoders,
one decoder several encoders, and a restarted decoder (new store, new
instance id) gets fresh groups. The decoder polls the counter and serves each
pair on its own thread.

One transfer on a pair (tags keep the four message kinds apart):

1. encoder -> decoder ``header`` int64 ``[MAGIC, transfer_id, encoder_len,
   dtype_code, num_layers, num_heads, head_dim, nbytes]``;
2. decoder -> encoder ``ack`` int64 ``[status, 0]``: the decoder checks the
   header against the transfer it announced with ``expect`` (known id, pool
   layout, exactly ``len(block_ids)`` blocks' worth of positions); a malformed
   or oversized transfer is refused here, before any payload moves;
3. encoder -> decoder ``payload`` ``[num_layers, 2, encoder_len, H, D]`` in the
   pool dtype, received into a per-pair staging buffer;
4. the decoder scatters the staging buffer into the reserved block ids
   (``write_blocks``, any order of ids) and answers ``done``.

Transfers on one pair run one at a time (the encoder writes from a single
batcher thread anyway); pairs run in parallel. The payload always lands in
staging first, never straight in the pool: a transfer that times out or whose
request was cancelled can then never write late into blocks that were
already handed to another request (``cancel`` waits for an in-flight
scatter). The scatter costs one memory copy; see docs/kv_transport.md.

Faults: a dead peer closes the TCP connection and the blocked send/recv
raises; the decoder fails the announced transfer with ``UnavailableError``
and drops the pair, the encoder drops its link and the next write pairs
again. An encoder that sees a target whose ``instance_id`` differs from its
cached link's re-attaches to the new decoder.

Modules: ``protocol`` (tags, header layout, status codes, the pair group), ``pool`` (the decoder side,
``TorchDistCrossKVPool``), ``writer`` (the encoder side, ``TorchDistCrossKVWriter``).
"""

from shared.kv_transport.torch_dist.pool import TorchDistCrossKVPool
from shared.kv_transport.torch_dist.protocol import (
    BACKENDS,
    CANCELLED,
    DTYPE_CODES,
    DTYPE_NAMES,
    IDLE_TIMEOUT,
    MAGIC,
    MALFORMED,
    MAX_PAIRS,
    OK,
    OVERSIZED,
    PAIR_POLL_S,
    REASONS,
    TAG_ACK,
    TAG_DONE,
    TAG_HEADER,
    TAG_PAYLOAD,
    UNKNOWN_TRANSFER,
    check_backend,
    new_pair_group,
    parse_address,
)
from shared.kv_transport.torch_dist.writer import TorchDistCrossKVWriter

__all__ = [
    "BACKENDS",
    "CANCELLED",
    "DTYPE_CODES",
    "DTYPE_NAMES",
    "IDLE_TIMEOUT",
    "MAGIC",
    "MALFORMED",
    "MAX_PAIRS",
    "OK",
    "OVERSIZED",
    "PAIR_POLL_S",
    "REASONS",
    "TAG_ACK",
    "TAG_DONE",
    "TAG_HEADER",
    "TAG_PAYLOAD",
    "UNKNOWN_TRANSFER",
    "TorchDistCrossKVPool",
    "TorchDistCrossKVWriter",
    "check_backend",
    "new_pair_group",
    "parse_address",
]
