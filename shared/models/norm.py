"""``LayerNorm``: ``nn.LayerNorm`` (same parameters, names, state dict) whose forward is ``kernels.cpu_norm.layer_norm``.

On float32 CPU inputs that is the C row kernel (a decode step's ``[32, 768]``
rows: a few microseconds instead of torch's OpenMP region); anything else
(GPU, half precision, autograd) goes to ``F.layer_norm``.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_norm import layer_norm


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over the last dim (Ba et al., 2016) with the CPU row kernel; takes ``[..., d]``, returns a new tensor.

    ``use_kernel = False`` keeps torch's own (``shared.models.quantize`` sets it for int8 models).
    """

    use_kernel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1 or not self.use_kernel:
            return super().forward(x)
        return layer_norm(x, self.weight, self.bias, self.eps)
