"""Encoder service: batched encoder forward, cross-attention KV projection and hand-off."""
