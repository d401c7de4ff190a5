"""Code both services use: config, models, audio, KV transport, request state."""
