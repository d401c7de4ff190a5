"""The OpenAI-compatible HTTP gateway (``encdec serve-http``): FastAPI on uvicorn, holding no model.

It turns OpenAI API calls into gRPC calls to the decoder services (audio transcriptions, text
completions) and the embed service (embeddings, rerank): ``app`` (the FastAPI application and its
routes' shared parts), ``routes/`` (one module per API family), ``backends`` (the gRPC channels and
which model each serves), ``errors`` (OpenAI's error body, and the one gRPC status -> HTTP code map),
``schemas`` (pydantic request bodies), ``upload`` (the request-size limit), ``metrics`` (Prometheus).
"""
