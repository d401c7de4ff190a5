"""The Embed service (Embed, Rerank, Classify, Tokenize) for encoder-only models: ``server`` (the RPCs),
``startup`` (load, batcher, serve), ``engine`` (tokenize, packed forward, pool) and ``batcher`` (token-budget batching)."""
