"""``--dtype bfloat16`` on the CPU: bfloat16 products, float32 everything else (mixed precision).

On a CPU with AVX-512 BF16 or AMX (``shared.device.CPU_BF16_FLAGS``; the config refuses the dtype elsewhere)
the model is loaded in float32 (``shared.models.registry.load_model_in``) and then
``shared.models.linear.use_bfloat16_products`` stores every ``Linear`` weight in bfloat16. A product then
rounds its float32 input to bfloat16 (round to nearest even, torch's ``.to(torch.bfloat16)``), multiplies in oneDNN with float32 accumulation and returns float32; biases,
activations, residual adds, norms, softmax, embeddings and positions stay float32. This is the split of
torch's CPU autocast (``torch.autocast("cpu", torch.bfloat16)``: linear / matmul / conv in bfloat16,
norms and softmax in float32) with the weights cast once at load instead of per call. Keeping the
residual stream in float32 is what keeps Whisper's transcripts equal to float32's more often than a model
cast whole to bfloat16 (measured: docs/devices.md).

A GPU keeps torch's plain half precision (``load_model(dtype=...)``, everything in that dtype). This module
holds the attention of that scheme; the weight conversion lives with ``Linear``.
"""

from __future__ import annotations

import torch

__all__ = ["ATTENTION_CHUNK", "SCORE_BLOCK_BYTES", "bfloat16_attention"]

ATTENTION_CHUNK = 128  # query rows per block of scores
SCORE_BLOCK_BYTES = 3 << 20  # bfloat16 scores per block: 8 heads x 128 query rows x 1500 frames of a Whisper window


def bfloat16_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int = ATTENTION_CHUNK) -> torch.Tensor:
    """Unmasked softmax attention with bfloat16 products: ``[..., S_q, D]`` x ``[..., S_k, D]`` -> ``[..., S_q, D]`` bfloat16.

    ``softmax(q k^T / sqrt(D)) v`` with q, k and v rounded to bfloat16 (q then scaled in bfloat16: exact for a
    power-of-4 head size such as Whisper's 64), each block of scores a
    bfloat16 matmul (fp32 accumulation, scores rounded to bfloat16), the softmax computed in float32 (torch's CPU
    softmax upcasts) and its probabilities rounded to bfloat16 for the product with v. ``chunk`` query rows of a few
    heads at a time (``SCORE_BLOCK_BYTES`` of scores), so the block of scores stays in cache: torch's CPU flash
    attention does not use the BF16 instructions and runs at its float32 speed (measured: docs/devices.md).

    Raises:
        RuntimeError: as ``torch.matmul`` on mismatched shapes.
    """
    lead, s_q, s_k = q.shape[:-2], q.shape[-2], k.shape[-2]
    bf16 = torch.bfloat16
    # [N, S, D] with N the flattened leading dims (batch x heads)
    qb = (q.to(bf16) * q.shape[-1] ** -0.5).reshape(-1, s_q, q.shape[-1])
    kt = k.to(bf16).reshape(-1, s_k, k.shape[-1]).transpose(1, 2).contiguous()  # [N, D, S_k]: no copy per block
    vb = v.to(bf16).reshape(-1, s_k, v.shape[-1])
    group = max(1, SCORE_BLOCK_BYTES // (2 * chunk * max(s_k, 1)))  # heads per block
    out = []
    for g in range(0, qb.shape[0], group):
        q_g, kt_g, v_g = qb[g : g + group], kt[g : g + group], vb[g : g + group]
        blocks = [
            torch.matmul(torch.softmax(torch.matmul(q_g[:, i : i + chunk], kt_g), dim=-1), v_g)
            for i in range(0, s_q, chunk)
        ]
        out.append(torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0])
    return torch.cat(out).view(*lead, s_q, v.shape[-1])
