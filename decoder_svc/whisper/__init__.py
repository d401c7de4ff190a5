"""Whisper-specific decoding: logits rules (timestamps, language, no speech) and the long-form pieces built on them."""
