"""Triton paged attention against its torch references, and the attention_backend switch end to end.

Without a GPU the kernels run under ``TRITON_INTERPRET=1``, which must be set
before ``@triton.jit`` builds them and stay set while they run: this module
sets it before importing ``kernels.triton_paged_attention``, and so does
tests/conftest.py before any test module is collected (transformers' generation
utilities import triton through torch._inductor; the variable affects nothing
but triton). The
interpreter's cost grows with program instances (one per query token and
head) and key tiles, so shapes stay tiny. On a CUDA machine the same tests
run the compiled kernels on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels import attention_backend
from kernels.cross_attention import contiguous_cross_attention as ref_cross
from kernels.paged_attention import paged_attention as ref_paged
from kernels.paged_attention import write_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Stays set for the session: the interpreter re-reads it at every launch. It only affects triton.
    os.environ["TRITON_INTERPRET"] = "1"
tri = pytest.importorskip(
    "kernels.triton_paged_attention", reason="triton is not importable (pip install '.[test]' installs it)"
)
if DEVICE == "cpu" and not tri._INTERPRET:
    pytest.skip(
        "kernels.triton_paged_attention was imported in this process before TRITON_INTERPRET=1 was set; "
        "run this file in its own pytest process",
        allow_module_level=True,
    )

H, D = 3, 8
ATOL = 1e-5  # fp32: both sides accumulate in float32


def paged_case(q_lens, ctx_lens, block_size, heads=H, head_dim=D, dtype=torch.float32, seed=0):
    """Each sequence's K/V written into shuffled (non-contiguous) blocks of a junk-filled cache.

    The query is a strided view (one third of a fused q,k,v projection) and the
    caches are slices of a ``[2, num_blocks, ...]`` tensor, as at the model call sites.
    """
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-c // block_size) for c in ctx_lens]
    total = sum(n_blocks) + 3
    perm = torch.randperm(total, generator=g).tolist()
    kv = torch.randn(2, total, block_size, heads, head_dim, generator=g).to(dtype)  # junk everywhere
    tables, keys, values, slots = [], [], [], []
    for c, nb in zip(ctx_lens, n_blocks):
        blocks = [perm.pop() for _ in range(nb)]
        tables.append(blocks)
        keys.append(torch.randn(c, heads, head_dim, generator=g).to(dtype))
        values.append(torch.randn(c, heads, head_dim, generator=g).to(dtype))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(c)]
    write_kv(kv[0], kv[1], torch.cat(keys), torch.cat(values), torch.tensor(slots, dtype=torch.long))
    width = max(1, max(n_blocks))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    qkv = torch.randn(sum(q_lens), 3, heads, head_dim, generator=g).to(dtype)
    query = qkv.unbind(1)[0]  # [T, H, D], token stride 3*H*D
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return to(query), to(kv[0]), to(kv[1]), to(block_tables), to(torch.tensor(ctx_lens)), to(qsl)


CASES = {
    # name: (q_lens, ctx_lens, block_size)
    "decode_mixed_lengths": ([1, 1, 1, 1], [1, 17, 5, 33], 4),  # lengths not dividing the block size
    "mixed_prefill_decode": ([5, 1, 9, 1, 2], [5, 40, 9, 7, 13], 6),
    "chunked_prefill": ([4, 3], [11, 20], 5),  # queries continue a cached context
    "block_size_one": ([2, 1], [4, 3], 1),
    "longer_than_one_tile": ([1, 2], [150, 70], 16),  # several 64-key tiles on a GPU
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mode", ["causal", "causal_bias", "cross"])
def test_paged_attention_matches_reference(name, mode):
    q_lens, ctx_lens, bs = CASES[name]
    query, kc, vc, bt, ctx, qsl = paged_case(q_lens, ctx_lens, bs, seed=len(name))
    bias = torch.randn(H, 7, generator=torch.Generator().manual_seed(1)).to(DEVICE) if mode == "causal_bias" else None
    kw = dict(causal=mode != "cross", scale=D**-0.5, position_bias=bias)
    ref = ref_paged(query, kc, vc, bt, ctx, qsl, **kw)
    got = tri.paged_attention(query, kc, vc, bt, ctx, qsl, **kw)
    assert got.dtype == query.dtype and got.shape == query.shape
    assert (got - ref).abs().max().item() < ATOL


def test_t5_bias_clamps_at_last_bucket_and_scale_one():
    """T5 runs with scale 1.0; distances past the bias width read its last column."""
    query, kc, vc, bt, ctx, qsl = paged_case([3, 1], [12, 9], 4, seed=3)
    bias = torch.randn(H, 4).to(DEVICE)  # N = 4 < the longest distance (11)
    ref = ref_paged(query, kc, vc, bt, ctx, qsl, causal=True, scale=1.0, position_bias=bias)
    got = tri.paged_attention(query, kc, vc, bt, ctx, qsl, causal=True, scale=1.0, position_bias=bias)
    assert (got - ref).abs().max().item() < ATOL
    with pytest.raises(ValueError, match="causal"):
        tri.paged_attention(query, kc, vc, bt, ctx, qsl, causal=False, scale=1.0, position_bias=bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_cache(dtype):
    query, kc, vc, bt, ctx, qsl = paged_case([2, 1], [10, 21], 4, dtype=dtype, seed=5)
    ref = ref_paged(query, kc, vc, bt, ctx, qsl, causal=True, scale=0.3)
    got = tri.paged_attention(query, kc, vc, bt, ctx, qsl, causal=True, scale=0.3)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_empty_sequence_slot_zero_context_and_empty_batch():
    query, kc, vc, bt, ctx, qsl = paged_case([2, 1], [2, 6], 4, seed=7)
    # An empty sequence (no queries, no keys) between the two.
    bt3 = torch.stack([bt[0], torch.zeros_like(bt[0]), bt[1]])
    ctx3 = torch.tensor([2, 0, 6], device=DEVICE)
    qsl3 = torch.tensor([0, 2, 2, 3], device=DEVICE)
    ref = ref_paged(query, kc, vc, bt3, ctx3, qsl3, causal=True, scale=0.5)
    got = tri.paged_attention(query, kc, vc, bt3, ctx3, qsl3, causal=True, scale=0.5)
    assert (got - ref).abs().max().item() < ATOL
    # A query over zero keys gets zeros, not NaN.
    out = tri.paged_attention(
        query[:1],
        kc,
        vc,
        bt[:1],
        torch.tensor([0], device=DEVICE),
        torch.tensor([0, 1], device=DEVICE),
        causal=False,
        scale=0.5,
    )
    assert torch.equal(out, torch.zeros_like(out))
    assert tri.paged_attention(query[:0], kc, vc, bt, ctx, qsl[:1].repeat(3), causal=True, scale=0.5).shape == (0, H, D)


@pytest.mark.parametrize("block_size", [1, 4, 7])
def test_contiguous_cross_attention_matches_reference(block_size):
    """Spans start at arbitrary slots (also mid-block) and mix prefill and decode queries."""
    g = torch.Generator().manual_seed(block_size)
    num_blocks = -(-48 // block_size)
    kc, vc = torch.randn(2, num_blocks, block_size, H, D, generator=g).to(DEVICE)
    q_lens, kv_lens, firsts = [3, 1, 2], [13, 1, 29], [block_size, 3 * block_size + 2, 17]
    query = torch.randn(sum(q_lens), H, D, generator=g).to(DEVICE)
    starts = [0, 3, 4, 6]
    spans = [(starts[b], starts[b + 1], firsts[b], kv_lens[b]) for b in range(3)]
    ref = ref_cross(query, kc, vc, spans, scale=D**-0.5)
    got = tri.contiguous_cross_attention(query, kc, vc, spans, scale=D**-0.5)
    assert (got - ref).abs().max().item() < ATOL


def test_backend_switch_dispatches_and_validates(monkeypatch):
    query, kc, vc, bt, ctx, qsl = paged_case([2, 1], [9, 4], 4, seed=11)
    ref = ref_paged(query, kc, vc, bt, ctx, qsl, causal=True, scale=0.4)
    got = attention_backend.paged_attention(query, kc, vc, bt, ctx, qsl, causal=True, scale=0.4, backend="triton")
    assert (got - ref).abs().max().item() < ATOL
    with pytest.raises(ValueError, match="torch, triton"):
        attention_backend.paged_attention(query, kc, vc, bt, ctx, qsl, causal=True, scale=0.4, backend="cuda")

    from shared.config import DecoderServiceConfig

    with pytest.raises(ValueError, match="torch, triton"):
        DecoderServiceConfig(attention_backend="flash")
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            DecoderServiceConfig(attention_backend="triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    # On a GPU the decoder config accepts triton only with the model and KV cache there (and shm needs a CPU pool).
    gpu = {"device": "cuda", "kv_transport": "cuda_ipc"} if DEVICE == "cuda" else {}
    assert DecoderServiceConfig(attention_backend="triton", **gpu).attention_backend == "triton"
    assert DecoderServiceConfig().attention_backend == "torch"
    if DEVICE == "cuda":  # compiled kernels: a CPU KV cache is refused up front
        with pytest.raises(ValueError, match="KV cache is on cpu"):
            attention_backend.check_attention_backend("triton", "cpu")


def test_whisper_engine_triton_backend_same_greedy_tokens(whisper_model_dir, whisper_features, monkeypatch):
    """One short clip through the decoder engine with each backend: same greedy tokens.

    (The torch backend's tokens equal HF's: tests/decoder/test_engine_whisper.py.)
    """
    from decoder_svc.core.engine import DecoderEngine
    from shared.models.registry import load_model
    from shared.models.whisper import load_tokenizer

    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    clip, enc_len, bs = "short.wav", 1500, 16
    model = load_model(whisper_model_dir).to(DEVICE)
    tokenizer = load_tokenizer(whisper_model_dir)
    with torch.inference_mode():
        kv = model.compute_cross_kv(model.encode(whisper_features[clip][None].to(DEVICE)))[
            :, :, 0
        ]  # [L, 2, 1500, H, Dh]
    c = model.config
    tokens = {}
    for backend in ("torch", "triton"):
        n_cross = -(-enc_len // bs)
        cross = torch.zeros(c.decoder_layers, 2, n_cross, bs, c.num_heads, c.head_dim, device=DEVICE)
        engine = DecoderEngine(model, tokenizer, cross, 28, bs, attention_backend=backend)  # 448 positions
        assert engine.model_runner.attention_backend == backend
        engine.add_request("r", enc_len)
        out_tokens, finished = [], False
        while not finished:
            out = engine.step()
            for _, blocks in out.to_encode:
                for j, b in enumerate(blocks):  # the encoder service's write, done in place here
                    seg = kv[:, :, j * bs : (j + 1) * bs]
                    cross[:, :, b, : seg.shape[2]] = seg
                engine.mark_encoded("r")
            for o in out.outputs:
                out_tokens += o.new_token_ids
                finished = o.finished
        tokens[backend] = out_tokens
    assert len(tokens["torch"]) > 3 and tokens["torch"][-1] == 50256
    assert tokens["triton"] == tokens["torch"]


def test_t5_engine_triton_backend_same_greedy_tokens(tmp_path, monkeypatch):
    """Tiny random T5 (relative position bias) through the engine: a batch of two sources, each backend.

    Exercises the bias in the self-attention kernel and the paged cross-attention
    kernel (T5 reads cross K/V through block tables) inside the real model.
    """
    from helpers.text_checkpoints import build_t5
    from helpers.text_paged import encode_batch

    from decoder_svc.core.engine import DecoderEngine
    from decoder_svc.core.sampling_params import SamplingParams
    from shared.models.registry import load_model, load_tokenizer

    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = build_t5(tmp_path / "t5", v1_1=False)
    model = load_model(path).to(DEVICE)
    tokenizer = load_tokenizer(path)
    sources = [[5, 9, 14, 3, 22, 1], [30, 31, 32, 33, 34, 35, 36, 37, 38, 1]]  # 2 and 3 cross blocks of 4
    with torch.inference_mode():
        kvs = encode_batch(model, sources)  # each [L, 2, S_i, H, Dh]
    c, bs = model.config, 4
    params = SamplingParams(max_tokens=8, min_tokens=8)  # self KV spans 2 blocks
    tokens = {}
    for backend in ("torch", "triton"):
        cross = torch.zeros(c.decoder_layers, 2, 8, bs, c.num_heads, c.head_dim, device=DEVICE)
        engine = DecoderEngine(model, tokenizer, cross, 24, bs, attention_backend=backend)
        for i, s in enumerate(sources):
            engine.add_request(f"r{i}", len(s), params)
        out_tokens = {f"r{i}": [] for i in range(len(sources))}
        while engine.has_unfinished_requests():
            out = engine.step()
            for rid, blocks in out.to_encode:
                kv = kvs[int(rid[1:])]
                for j, b in enumerate(blocks):
                    seg = kv[:, :, j * bs : (j + 1) * bs]
                    cross[:, :, b, : seg.shape[2]] = seg
                engine.mark_encoded(rid)
            for o in out.outputs:
                out_tokens[o.request_id] += o.new_token_ids
        tokens[backend] = out_tokens
    assert all(len(t) == 8 for t in tokens["torch"].values())
    assert tokens["triton"] == tokens["torch"]
