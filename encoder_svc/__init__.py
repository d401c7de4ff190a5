"""Encoder service: batched encoder forward, cross-attention KV projection and hand-off.

``server`` (the ``Encode`` RPC), ``startup`` (load the model, build the writers and the
batcher, serve), ``batcher`` (``EncodeBatcher``); ``embed/`` is the Embed service of
encoder-only models, in the same shape.
"""
