"""Replicas through Redis: request state records, replica registry and control, lost replicas, the encoder pool."""
