"""The attention backends: one object per model runner runs every paged self- and cross-attention of a step.

``base.AttentionBackend`` is the interface, ``torch_backend`` and ``triton_backend`` the two implementations;
``kernels.attention_backend`` is the registry that makes one by name.
"""
