"""The Embed service (Embed, Rerank, Classify, Tokenize) for encoder-only models: ``server`` (the RPCs),
``startup`` (load, batcher, serve), ``engine`` (tokenize, packed forward, pool), ``tokenizing``
(bounded tokenization: character bound, chunks, linear pair truncation) and ``batcher`` (token-budget
batching, deadlines)."""
