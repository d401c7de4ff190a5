"""Decoder service: paged KV cache, continuous batching, sampling, the Generate stream."""
