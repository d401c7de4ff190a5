"""The gateway's routes, one module per API family: ``audio``, ``completions``, ``embeddings``, ``meta``."""
