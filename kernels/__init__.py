"""Attention kernels, each beside its plain-torch reference."""
