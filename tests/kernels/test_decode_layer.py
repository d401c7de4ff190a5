"""kernels/decode_layer.py (one C call per layer and decode step) against its reference, the model's Python layer.

Same kernels, same order, same arguments: the outputs and the self-KV writes must be equal bit for bit, for a
pre-norm RMS layer with T5's position bias (T5 v1.0), post-norm and pre-norm LayerNorm layers with biases
(BART, mBART) and Whisper's, over float32 caches, a bfloat16 cross pool, and bfloat16 self and cross caches, with
float32 or bfloat16 packed weights (``--dtype bfloat16``); layers the C path does not serve keep ``fused = None``.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels import decode_layer
from kernels.packed_linear import bf16_available
from shared.attention_metadata import AttentionMetadata
from shared.models.linear import use_bfloat16_products
from shared.models.registry import load_model

pytestmark = pytest.mark.skipif(
    not decode_layer.is_available(), reason="kernels/_cpu_kernels*.so not built or no AVX2/FMA"
)

BLOCK = 4


# (self cache, cross pool) dtypes: float32; a float32 model over a bfloat16 cross pool; both bfloat16
CACHE_DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]


def _step(heads: int, head_dim: int, seed: int, dtypes=CACHE_DTYPES[0]):
    """A decode step of 5 sequences over shuffled blocks: metadata and random self / cross caches of one layer
    (``dtypes``: theirs)."""
    rng = random.Random(seed)
    seq_lens, enc_lens = [1, 3, 7, 4, 9], [5, 2, 8, 3, 6]
    n_self, n_cross = [-(-n // BLOCK) for n in seq_lens], [-(-n // BLOCK) for n in enc_lens]
    self_ids, cross_ids = list(range(sum(n_self) + 2)), list(range(sum(n_cross) + 2))
    rng.shuffle(self_ids)
    rng.shuffle(cross_ids)
    tables, cross_tables, slots = [], [], []
    for i in range(len(n_self)):
        tables.append(self_ids[sum(n_self[:i]) : sum(n_self[: i + 1])])
        cross_tables.append(cross_ids[sum(n_cross[:i]) : sum(n_cross[: i + 1])])
        p = seq_lens[i] - 1
        slots.append(tables[-1][p // BLOCK] * BLOCK + p % BLOCK)
    pad = lambda rows: torch.tensor([r + [0] * (max(map(len, rows)) - len(r)) for r in rows])
    md = AttentionMetadata(
        query_start_loc=torch.arange(6),
        slot_mapping=torch.tensor(slots),
        seq_lens=torch.tensor(seq_lens),
        block_tables=pad(tables),
        cross_block_tables=pad(cross_tables),
        encoder_lens=torch.tensor(enc_lens),
        logits_indices=torch.arange(5),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        max_encoder_len=max(enc_lens),
    )
    g = torch.Generator().manual_seed(seed)
    self_kv = torch.randn(2, len(self_ids), BLOCK, heads, head_dim, generator=g).to(dtypes[0])
    cross_kv = torch.randn(2, len(cross_ids), BLOCK, heads, head_dim, generator=g).to(dtypes[1])
    return md, self_kv, cross_kv


def _layers_equal(model, heads: int, head_dim: int, d: int, bias_fn=None, dtypes=CACHE_DTYPES[0]) -> int:
    """Every decoder layer: C and Python outputs and self caches equal; returns how many layers were fused."""
    fused = 0
    for i, layer in enumerate(model._decoder_layers()):
        if layer.fused is None:
            continue
        fused += 1
        md, self_kv, cross_kv = _step(heads, head_dim, seed=i, dtypes=dtypes)
        x = torch.randn(5, d, generator=torch.Generator().manual_seed(100 + i)) * 3
        extra = (bias_fn(md.max_seq_len),) if bias_fn else ()
        kv_c, kv_py = self_kv.clone(), self_kv.clone()
        got = layer.fused.run(x, md, kv_c, cross_kv, *extra)
        keep, layer.fused = layer.fused, None
        try:
            want = layer(x, md, kv_py, cross_kv, *extra)
        finally:
            layer.fused = keep
        assert got is not None and got.dtype == torch.float32 and torch.equal(got, want), f"layer {i}"
        assert torch.equal(kv_c, kv_py)  # the new tokens' K/V written to the same slots
        assert not torch.equal(kv_c, self_kv)
    return fused


def _load(path, weights: str):
    """The model with its decode-step weights packed: ``fp32``, or ``bf16`` (``--dtype bfloat16`` on the CPU:
    bfloat16 products, packed for ``packed_linear_bf16``)."""
    model = load_model(path)
    if weights == "bf16":
        if not bf16_available():
            pytest.skip("this CPU lacks avx512_bf16: bfloat16 weights are not packed")
        use_bfloat16_products(model)
    model.pack_decode_weights()
    if weights == "bf16":
        assert all(layer.fused.weights.qkv[0].dtype == torch.bfloat16 for layer in model._decoder_layers())
    return model


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
@pytest.mark.parametrize("dtypes", CACHE_DTYPES, ids=["fp32", "bf16-cross", "bf16"])
@pytest.mark.parametrize("arch", ["t5", "bart", "mbart"])
def test_text_layers_equal_the_python_layers(text_checkpoints, arch, dtypes, weights):
    model = _load(text_checkpoints[arch], weights)
    c = model.config
    heads = c.num_heads
    bias_fn = model.decoder_position_bias if arch == "t5" else None
    d = c.d_model
    assert _layers_equal(model, heads, d // heads, d, bias_fn, dtypes) == c.decoder_layers


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
@pytest.mark.parametrize("dtypes", CACHE_DTYPES, ids=["fp32", "bf16-cross", "bf16"])
def test_whisper_layers_equal_the_python_layers(whisper_model_dir, dtypes, weights):
    model = _load(whisper_model_dir, weights)
    c = model.config
    assert _layers_equal(model, c.num_heads, c.head_dim, c.d_model, dtypes=dtypes) == c.decoder_layers


def test_layers_the_c_path_does_not_serve_stay_in_python(text_checkpoints):
    gated = load_model(text_checkpoints["t5-v1_1"])  # gated GELU (tanh form): not in the packed epilogue
    gated.pack_decode_weights()
    assert all(layer.fused is None for layer in gated.decoder_layers)
    unpacked = load_model(text_checkpoints["bart"])
    assert all(layer.fused is None for layer in unpacked._decoder_layers())


def test_prefill_and_bad_block_ids_are_not_run(text_checkpoints):
    model = load_model(text_checkpoints["bart"])
    model.pack_decode_weights()
    layer = model._decoder_layers()[0]
    c = model.config
    md, self_kv, cross_kv = _step(c.num_heads, c.d_model // c.num_heads, seed=3)
    x = torch.randn(5, c.d_model)
    md.max_query_len = 2  # a prefill: the Python layer runs it
    assert layer.fused.run(x, md, self_kv, cross_kv) is None
    md.max_query_len, md.step_cache = 1, {}
    md.seq_lens = md.seq_lens[:4]  # metadata that does not describe 5 sequences is never handed to C
    assert layer.fused.run(x, md, self_kv, cross_kv) is None
    md, self_kv, cross_kv = _step(c.num_heads, c.d_model // c.num_heads, seed=3)
    assert (
        layer.fused.run(x, md, self_kv.transpose(-1, -2).contiguous(), cross_kv) is None
    )  # [.., D, H]: not this layout
    assert layer.fused.run(x, md, self_kv, cross_kv.half()) is None  # float16: not a dtype the kernels read
    md, self_kv, cross_kv = _step(c.num_heads, c.d_model // c.num_heads, seed=3)
    md.cross_block_tables[1, 0] = cross_kv.shape[1]  # one block past the cross cache
    with pytest.raises(ValueError, match="outside the KV caches"):
        layer.fused.run(x, md, self_kv, cross_kv)
