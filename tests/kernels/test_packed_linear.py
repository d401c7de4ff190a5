"""kernels/packed_linear.py (C: AVX2/FMA and AVX-512 micro-kernels) against its torch reference ``F.linear``, on
irregular shapes; each instruction set this CPU has is tested, and they must agree bit for bit. bfloat16 weights
(AVX-512 BF16) against ``reference_linear_bf16`` and against the VDPBF16PS summation order, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import packed_linear as packed_linear_module
from kernels.packed_linear import (
    ISAS,
    MAX_ROWS,
    PackedWeight,
    bf16_available,
    is_available,
    isa,
    isas_present,
    packed_linear,
    reference_linear,
    reference_linear_bf16,
    use_isa,
)
from shared.device import cpu_flags
from shared.models.linear import (
    Linear,
    fused_products,
    linear,
    linear_add,
    pack_fused,
    pack_projection,
    vocab_projection,
)

pytestmark = pytest.mark.skipif(
    not is_available(),
    reason="kernels/_cpu_kernels*.so not built (no C compiler at install, not x86-64 Linux) or no AVX2/FMA",
)


ISA_FLAGS = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f"}}  # what each micro-kernel needs


@pytest.fixture(params=list(ISAS))
def each_isa(request):
    """Runs the test on each micro-kernel this CPU can run (the others skipped, named)."""
    missing = ISA_FLAGS[request.param] - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))}: the {request.param} micro-kernel cannot run here")
    assert use_isa(request.param) == request.param == isa()
    yield request.param
    use_isa(None)


def test_isas_present_are_the_ones_the_cpu_flags_allow_and_the_one_in_use_stays(each_isa):
    assert isas_present() == [name for name, needed in ISA_FLAGS.items() if needed <= cpu_flags()]
    assert isa() == each_isa


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return (y + b.double() if b is not None else y).float()


# rows: 1, under / at / over the 6-row micro-kernel, MAX_ROWS; features: under / at / over a 16-wide panel
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 32, MAX_ROWS])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (15, 7), (16, 64), (17, 33), (1000, 384), (4099, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(rows, out_features, in_features, with_bias, each_isa):
    g = torch.Generator().manual_seed(rows * 7919 + out_features * 31 + in_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if with_bias else None
    got = packed_linear(x, PackedWeight.pack(w), b)
    ref = reference_linear(x, w, b)
    assert got.shape == ref.shape == (rows, out_features) and got.is_contiguous()
    # One running fp32 sum per output: as close to the exact value as F.linear's blocked sums are.
    tol = 2 * (ref - _exact(x, w, b)).abs().max().item() + 4e-6 * in_features
    assert (got - _exact(x, w, b)).abs().max().item() <= tol


# in_features % 1024 == 0: rows of x 4 KiB apart, which the AVX-512 kernel reads from a copy with rows an odd number
# of cache lines apart for 24 rows or more and weights of 2**21 elements or more (packed_linear.c X_COPY_MIN_WEIGHT);
# fewer rows (each row alone), a smaller weight and the AVX2 kernel read x as it is.
@pytest.mark.parametrize("rows", [2, 23, 24, 37, MAX_ROWS])
@pytest.mark.parametrize("out_features,in_features", [(2048, 1024), (683, 3072), (40, 2048)])
def test_rows_4_kib_apart_match_reference_each_row_alone_and_the_other_isa(rows, out_features, in_features, each_isa):
    g = torch.Generator().manual_seed(rows * 131 + in_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    packed = PackedWeight.pack(w)
    got = packed_linear(x, packed, b)
    tol = 2 * (reference_linear(x, w, b) - _exact(x, w, b)).abs().max().item() + 4e-6 * in_features
    assert (got - _exact(x, w, b)).abs().max().item() <= tol
    for i in range(rows):
        assert torch.equal(got[i], packed_linear(x[i : i + 1], packed, b)[0]), i
    other = next(name for name in ISAS if name != each_isa)
    if not ISA_FLAGS[other] - cpu_flags():
        use_isa(other)
        assert torch.equal(got, packed_linear(x, packed, b)), other


@pytest.mark.parametrize("num_threads", [1, 2, 3, 64])
def test_thread_split_is_bitwise_the_same(num_threads):
    """Threads split whole 16-feature panels, so every output is the same sum whatever the split."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(9, 48, generator=g), torch.randn(333, 48, generator=g)
    packed = PackedWeight.pack(w)
    assert torch.equal(packed_linear(x, packed, num_threads=num_threads), packed_linear(x, packed, num_threads=1))


def test_leading_dims_and_non_contiguous_inputs():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 40, generator=g).T.contiguous().T[:, :20]  # [64, 20] view with strides (1, 64)
    x = torch.randn(2, 3, 40, generator=g)[..., ::2]  # [2, 3, 20], non-contiguous
    got = packed_linear(x, PackedWeight.pack(w))
    torch.testing.assert_close(got, reference_linear(x, w), rtol=1e-5, atol=1e-5)
    assert got.shape == (2, 3, 64)


def test_bad_inputs_are_refused():
    w = torch.randn(20, 8)
    packed = PackedWeight.pack(w)
    with pytest.raises(ValueError, match="float32 CPU"):
        packed_linear(torch.randn(2, 8, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        packed_linear(torch.randn(2, 9), packed)
    with pytest.raises(ValueError, match="bias"):
        packed_linear(torch.randn(2, 8), packed, torch.randn(19))
    with pytest.raises(ValueError, match="2-D float32 CPU"):
        PackedWeight.pack(w.half())
    with pytest.raises(
        ValueError, match="build it with PackedWeight.pack"
    ):  # the kernel would read past a short buffer
        PackedWeight(torch.empty(0), 100_000, 8)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 15, 7), (7, 17, 33), (32, 3072, 96)])
def test_fused_activations_match_torch(activation, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows + out_features)
    x, w, b = (
        torch.randn(rows, in_features, generator=g),
        torch.randn(out_features, in_features, generator=g) * 0.3,
        torch.randn(out_features, generator=g),
    )
    packed = PackedWeight.pack(w)
    for bias in (None, b):  # the partial last panel too (15, 17 features)
        torch.testing.assert_close(
            packed_linear(x, packed, bias, activation=activation),
            reference_linear(x, w, bias, activation),
            rtol=1e-5,
            atol=1e-5,
        )


def test_fused_activations_on_special_values():
    """relu / gelu of NaN, +-inf, signed zeros and the erf tails, as the float64 torch reference (the outputs are
    the bias alone). Not float32 torch: on a CPU where torch runs its AVX-512 kernels, its float32 GELU is NaN at
    +inf and 17% off the exact value at -5 (kernels/csrc/simd_math.h); the erf here is within 1.5e-7."""
    b = torch.tensor(
        [
            float("nan"),
            float("inf"),
            -float("inf"),
            0.0,
            -0.0,
            1e-30,
            -5.0,
            40.0,
            -40.0,
            3.0,
            -3.0,
            0.5,
            -0.5,
            1.0,
            -1.0,
            2.0,
            7.0,
        ]
    )
    w, x = torch.zeros(len(b), 4), torch.zeros(2, 4)
    for activation in ("relu", "gelu"):
        got = packed_linear(x, PackedWeight.pack(w), b, activation=activation)
        ref = reference_linear(x.double(), w.double(), b.double(), activation).float()
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=3e-7, equal_nan=True)
    with pytest.raises(ValueError, match="activation"):
        packed_linear(x, PackedWeight.pack(w), b, activation="silu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_dimensions_follow_f_linear(dtype):
    if dtype == torch.bfloat16 and not bf16_available():
        pytest.skip("this CPU lacks avx512_bf16")
    ref = reference_linear if dtype == torch.float32 else reference_linear_bf16
    g = torch.Generator().manual_seed(2)
    for rows, out_features, in_features in [(0, 5, 8), (3, 0, 8), (3, 17, 0)]:
        x, w, b = (
            torch.randn(rows, in_features, generator=g),
            torch.randn(out_features, in_features, generator=g),
            torch.randn(out_features, generator=g),
        )
        for bias in (None, b):
            torch.testing.assert_close(packed_linear(x, PackedWeight.pack(w, dtype), bias), ref(x, w, bias))


def test_rows_past_max_rows_run_in_chunks_and_equal_each_row_alone():
    """Batch invariance: any row count (MAX_ROWS per kernel call); each row equals that row computed alone, bit for
    bit, with the bias, activation and residual epilogue (a prefill's rows equal the same rows decoded one by one)."""
    g = torch.Generator().manual_seed(11)
    w, b = torch.randn(37, 24, generator=g), torch.randn(37, generator=g)
    packed = PackedWeight.pack(w)
    x, r = torch.randn(2 * MAX_ROWS + 7, 24, generator=g), torch.randn(2 * MAX_ROWS + 7, 37, generator=g)
    got = packed_linear(x, packed, b, activation="gelu", residual=r)
    torch.testing.assert_close(got, r + F.gelu(reference_linear(x, w, b)), rtol=1e-5, atol=1e-5)
    for i in (0, MAX_ROWS - 1, MAX_ROWS, 2 * MAX_ROWS + 6):
        assert torch.equal(
            got[i], packed_linear(x[i : i + 1], packed, b, activation="gelu", residual=r[i : i + 1])[0]
        ), i


def test_vocab_projection_uses_the_kernel_for_float32_cpu_inputs():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(777, 32, generator=g)
    packed = pack_projection(w)
    assert packed is not None and pack_projection(w.double()) is None
    few, many = torch.randn(MAX_ROWS, 32, generator=g), torch.randn(MAX_ROWS + 1, 32, generator=g)
    assert torch.equal(vocab_projection(few, w, packed), packed_linear(few, packed))
    assert torch.equal(vocab_projection(many, w, packed), packed_linear(many, packed))  # prefill-sized too
    assert torch.equal(vocab_projection(few, w, None), linear(few, w))


def test_packed_linear_module_and_fused_products():
    """``Linear.pack`` / ``pack_fused``: float32 CPU inputs of any size take the packed copy; same math."""
    g = torch.Generator().manual_seed(4)
    q, k, v = Linear(24, 16), Linear(24, 8, bias=False), Linear(24, 16)
    for m in (q, k, v):
        nn.init.normal_(m.weight, generator=g)
    assert k.pack() == k.packed.data.nbytes > 0
    few, many = torch.randn(3, 5, 24, generator=g), torch.randn(MAX_ROWS + 1, 24, generator=g)
    assert torch.equal(k(few), packed_linear(few, k.packed))
    assert torch.equal(k(many), packed_linear(many, k.packed))
    fused = pack_fused((q, k, v))
    assert fused.sizes == (16, 8, 16) and torch.equal(fused.bias[16:24], torch.zeros(8))
    for x in (few, many):
        got = fused_products(x, (q, k, v), fused)
        assert [t.shape[-1] for t in got] == [16, 8, 16]
        for t, m in zip(got, (q, k, v)):
            torch.testing.assert_close(t, F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
    assert pack_fused((k,)).bias is None
    with pytest.raises(ValueError, match="one input size"):
        pack_fused((q, Linear(8, 4)))


def test_models_pack_decode_weights_beside_the_originals():
    """What the decoder service packs (``pack_decode_weights``): the projection and each decoder layer's products."""
    from shared.models.t5 import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(
        T5Config(vocab_size=64, d_model=16, d_ff=32, num_heads=2, head_dim=8, encoder_layers=1, decoder_layers=2)
    ).eval()
    added = model.pack_decode_weights()
    layer = model.decoder_layers[0]
    expect = model.packed_projection.data.nbytes + 2 * sum(
        p.data.nbytes
        for p in (
            layer.self_attn.packed_qkv.weight,
            layer.self_attn.o.packed,
            layer.cross_attn.q.packed,
            layer.cross_attn.o.packed,
            layer.ffn.wi_0.packed,
            layer.ffn.wo.packed,
        )
    )
    assert added == expect
    assert layer.cross_attn.k.packed is None and model.encoder_layers[0].attn.q.packed is None  # encoder side


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 15, 7), (7, 17, 33), (32, 512, 96)])
def test_fused_residual_is_the_unfused_sum_bit_for_bit(activation, rows, out_features, in_features):
    """``residual=`` adds in the epilogue exactly what ``residual + packed_linear(...)`` adds (one float32 rounding),
    the partial last panel (15, 17 features) included; ``Linear`` and ``linear_add`` take it on decode steps only."""
    g = torch.Generator().manual_seed(rows * 7 + out_features)
    x, w, b = (
        torch.randn(rows, in_features, generator=g),
        torch.randn(out_features, in_features, generator=g),
        torch.randn(out_features, generator=g),
    )
    r = torch.randn(rows, out_features, generator=g) * 5
    packed = PackedWeight.pack(w)
    for bias in (None, b):
        want = r + packed_linear(x, packed, bias, activation=activation)
        assert torch.equal(packed_linear(x, packed, bias, activation=activation, residual=r), want)
    r_strided = torch.randn(out_features, rows, generator=g).t()  # non-contiguous residual
    assert torch.equal(packed_linear(x, packed, b, residual=r_strided), r_strided + packed_linear(x, packed, b))
    with pytest.raises(ValueError, match="residual"):
        packed_linear(x, packed, b, residual=r[:, :-1])
    with pytest.raises(ValueError, match="residual"):
        packed_linear(x, packed, b, residual=r.double())
    m = Linear(in_features, out_features)
    m.pack()
    many, r_many = (
        torch.randn(MAX_ROWS + 1, in_features, generator=g),
        torch.randn(MAX_ROWS + 1, out_features, generator=g),
    )
    assert torch.equal(linear_add(m, x, r), r + m(x))
    assert torch.equal(linear_add(m, many, r_many), r_many + m(many))  # prefill-sized: packed too
    plain = nn.Linear(in_features, out_features)  # a layer that is not our Linear
    assert torch.equal(linear_add(plain, x, r), r + plain(x))


def test_instruction_sets_agree_bit_for_bit_and_the_best_is_the_default():
    """The AVX-512 micro-kernel keeps the AVX2 one's running sum per output in the same order: switching never
    changes a token. Rows cross both kernels' row blocks (6 and 12); bias, activations and the residual too."""
    if ISA_FLAGS["avx512"] - cpu_flags():
        pytest.skip("this CPU lacks avx512f: only the avx2 micro-kernel runs here")
    assert isa() == "avx512"  # the best this CPU has, chosen at load
    g = torch.Generator().manual_seed(5)
    for rows in (1, 5, 6, 7, 11, 12, 13, 25, MAX_ROWS, MAX_ROWS + 3):
        for out_features, in_features in ((17, 33), (1000, 384), (16, 64)):
            x = torch.randn(rows, in_features, generator=g)
            w = PackedWeight.pack(torch.randn(out_features, in_features, generator=g))
            b = torch.randn(out_features, generator=g)
            residual = torch.randn(rows, out_features, generator=g)
            for activation in (None, "relu", "gelu"):
                got = {}
                for name in ISAS:
                    use_isa(name)
                    got[name] = packed_linear(x, w, b, activation=activation, residual=residual)
                use_isa(None)
                assert torch.equal(got["avx2"], got["avx512"]), (rows, out_features, in_features, activation)
    with pytest.raises(ValueError, match="unknown instruction set"):
        use_isa("sse2")


# bfloat16 weights ------------------------------------------------------------------------------------------------

BF16_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}  # what the bf16 micro-kernel needs
BF16_MISSING = sorted(BF16_FLAGS - cpu_flags())
needs_bf16 = pytest.mark.skipif(
    bool(BF16_MISSING), reason=f"this CPU lacks {', '.join(BF16_MISSING)}: the bf16 micro-kernel cannot run here"
)
U = 2.0**-24  # float32 unit roundoff


def _bf16_tolerance(x, w, b, k, ref, activation):
    """Both the kernel and F.linear sum the same K (+ bias) exact products in float32, in different orders: each is
    within gamma_{K+1} * sum |x_k w_k| (+ |b|) of the exact sum (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., section 3.1), so they are within twice that of each other; GELU's slope is at most 1.13
    and its float32 forms (ours, torch's) differ by up to ~2.4e-7 at the tails (kernels/csrc/simd_math.h); a
    residual adds one rounding each (2 u |result|)."""
    s = x.bfloat16().float().abs() @ w.bfloat16().float().abs().T
    if b is not None:
        s = s + b.abs()
    slope, atol = (1.13, 5e-7) if activation == "gelu" else (1.0, 0.0)
    return slope * 2 * (k + 1) * U * s + 2 * U * ref.abs() + atol


def _vdpbf16ps_order(x, w, b):
    """x w^T + b as VDPBF16PS sums it (Intel SDM, VDPBF16PS pseudocode): the bf16 operands' products (exact in
    float32), K padded to even with a zero, each pair added odd k first, one float32 rounding per addition."""
    xb, wb = x.bfloat16().float(), w.bfloat16().float()
    if x.shape[-1] % 2:
        xb, wb = F.pad(xb, (0, 1)), F.pad(wb, (0, 1))
    acc = torch.zeros(x.shape[0], w.shape[0])
    for q in range(0, xb.shape[-1], 2):
        acc = acc + xb[:, q + 1 : q + 2] * wb[:, q + 1]
        acc = acc + xb[:, q : q + 1] * wb[:, q]
    return acc + b if b is not None else acc


def test_bf16_available_follows_the_cpu_flags():
    assert bf16_available() == (not BF16_MISSING)


# rows: under / at / over the 12-row micro-kernel and the 64-row chunk; K = 1, odd K, N past a 16-feature panel
@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 25, MAX_ROWS, 70])
@pytest.mark.parametrize(
    "out_features,in_features", [(1, 1), (33, 1), (15, 7), (16, 64), (17, 33), (1000, 384), (4099, 97)]
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_bf16_matches_reference(rows, out_features, in_features, with_bias, activation):
    g = torch.Generator().manual_seed(rows * 7919 + out_features * 31 + in_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if with_bias else None
    r = torch.randn(rows, out_features, generator=g)
    packed = PackedWeight.pack(w, torch.bfloat16)
    assert packed.dtype == packed.data.dtype == torch.bfloat16
    got = packed_linear(x, packed, b, activation=activation)
    ref = reference_linear_bf16(x, w, b, activation)
    assert got.shape == ref.shape == (rows, out_features) and got.is_contiguous()
    tol = _bf16_tolerance(x, w, b, in_features, ref, activation)
    assert ((got - ref).abs() <= tol).all(), ((got - ref).abs() - tol).max().item()
    with_residual = packed_linear(x, packed, b, activation=activation, residual=r)
    assert torch.equal(with_residual, r + got)  # one float32 rounding, as the float32 kernel's residual


@needs_bf16
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 1, 1), (13, 17, 33), (70, 100, 96), (3, 40, 2)])
def test_bf16_sums_in_the_vdpbf16ps_order_bit_for_bit(rows, out_features, in_features):
    """Each output is one running float32 sum of exact bf16 products in a fixed order, so it equals the emulated
    instruction bit for bit; the bias and the residual are one float32 addition each."""
    g = torch.Generator().manual_seed(rows + out_features + in_features)
    x, w = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
    b, r = torch.randn(out_features, generator=g), torch.randn(rows, out_features, generator=g)
    packed = PackedWeight.pack(w, torch.bfloat16)
    want = _vdpbf16ps_order(x, w, b)
    assert torch.equal(packed_linear(x, packed, b), want)
    assert torch.equal(packed_linear(x, packed, b, activation="relu", residual=r), r + torch.relu(want))
    assert torch.equal(packed_linear(x, packed), _vdpbf16ps_order(x, w, None))


@needs_bf16
def test_bf16_rounds_x_to_nearest_even_as_torch():
    """With a weight of 1, the output is x as the kernel rounded it: ties (1 + 2^-8 -> 1, 1 + 3 2^-8 -> 1 + 2^-6),
    values rounding up to the next binade or to inf, random values over many binades, +-inf and NaN."""
    g = torch.Generator().manual_seed(9)
    special = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 - 2**-10, 3.3e38, -3.4e38, 0.0, -0.0])
    special = torch.cat([special, torch.tensor([float("inf"), -float("inf"), float("nan")])])
    spread = torch.randn(200, generator=g) * torch.exp2(torch.randint(-100, 100, (200,), generator=g).float())
    x = torch.cat([special, spread]).unsqueeze(1)  # 211 rows: several 64-row chunks
    got = packed_linear(x, PackedWeight.pack(torch.ones(1, 1), torch.bfloat16))
    torch.testing.assert_close(got, x.bfloat16().float(), rtol=0, atol=0, equal_nan=True)


@needs_bf16
def test_bf16_packing_layout_and_sources():
    """wp[p, q, j, h] = bf16(w[16 p + j, 2 q + h]), zero past N and K; rounding in the packer is torch's (ties,
    overflow to inf); a bfloat16 weight packs to the same bytes, and to its exact float32 values as float32."""
    g = torch.Generator().manual_seed(3)
    n, k = 37, 11
    w = torch.randn(n, k, generator=g)
    w[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, -float("inf")])
    packed = PackedWeight.pack(w, torch.bfloat16)
    panels, pairs = 3, 6
    assert packed.data.numel() == panels * 16 * 2 * pairs
    grid = packed.data.view(panels, pairs, 16, 2).permute(0, 2, 1, 3).reshape(panels * 16, 2 * pairs)
    assert torch.equal(grid[:n, :k].view(torch.int16), w.bfloat16().view(torch.int16))
    assert not grid[n:].float().any() and not grid[:, k:].float().any()
    from_bf16 = PackedWeight.pack(w.bfloat16(), torch.bfloat16)
    assert torch.equal(from_bf16.data.view(torch.int16), packed.data.view(torch.int16))
    strided = torch.randn(2 * k, n, generator=g).T[:, ::2]  # non-contiguous [n, k]
    assert torch.equal(
        PackedWeight.pack(strided.bfloat16(), torch.bfloat16).data.view(torch.int16),
        PackedWeight.pack(strided, torch.bfloat16).data.view(torch.int16),
    )
    as_fp32 = PackedWeight.pack(w.bfloat16())
    assert as_fp32.dtype == torch.float32 and torch.equal(as_fp32.data, PackedWeight.pack(w.bfloat16().float()).data)


@needs_bf16
def test_bf16_rows_are_batch_and_thread_invariant():
    """A row's outputs equal that row computed alone, whatever the batch (64-row chunks, 12-row micro-kernels) and
    the thread count, bit for bit, bias, GELU and residual included."""
    g = torch.Generator().manual_seed(12)
    w, b = torch.randn(333, 49, generator=g), torch.randn(333, generator=g)
    packed = PackedWeight.pack(w, torch.bfloat16)
    x, r = torch.randn(2 * MAX_ROWS + 7, 49, generator=g), torch.randn(2 * MAX_ROWS + 7, 333, generator=g)
    got = packed_linear(x, packed, b, num_threads=2, activation="gelu", residual=r)
    for threads in (1, 3, 64):
        assert torch.equal(packed_linear(x, packed, b, num_threads=threads, activation="gelu", residual=r), got)
    for i in (0, 11, 12, MAX_ROWS - 1, MAX_ROWS, 2 * MAX_ROWS + 6):
        alone = packed_linear(x[i : i + 1], packed, b, num_threads=1, activation="gelu", residual=r[i : i + 1])
        assert torch.equal(got[i], alone[0]), i


@needs_bf16
def test_bf16_leading_dims_and_non_contiguous():
    g = torch.Generator().manual_seed(13)
    w = torch.randn(64, 40, generator=g).T.contiguous().T[:, :21]  # [64, 21] view with strides (1, 64)
    x = torch.randn(2, 3, 42, generator=g)[..., ::2]  # [2, 3, 21], non-contiguous
    got = packed_linear(x, PackedWeight.pack(w, torch.bfloat16))
    assert got.shape == (2, 3, 64)
    assert torch.equal(got.reshape(6, 64), _vdpbf16ps_order(x.reshape(6, 21), w, None))


def test_bf16_bad_inputs_are_refused():
    w = torch.randn(20, 8)
    with pytest.raises(ValueError, match="dtype=torch.float16"):
        PackedWeight.pack(w, torch.float16)
    with pytest.raises(ValueError, match="2-D float32 CPU"):
        PackedWeight.pack(w.half(), torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be"):
        PackedWeight(torch.empty(32 * 8, dtype=torch.float16), 20, 8, torch.float16)
    with pytest.raises(ValueError, match="build it with PackedWeight.pack"):  # float32 data labelled bfloat16
        PackedWeight(torch.empty(32 * 8), 20, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="build it with PackedWeight.pack"):  # odd K: 16 * 8 pairs, not 16 * 7
        PackedWeight(torch.empty(32 * 7, dtype=torch.bfloat16), 20, 7, torch.bfloat16)
    if bf16_available():
        packed = PackedWeight.pack(w, torch.bfloat16)
        with pytest.raises(ValueError, match="float32 CPU"):
            packed_linear(torch.randn(2, 8).bfloat16(), packed)
        with pytest.raises(ValueError, match="bias"):
            packed_linear(torch.randn(2, 8), packed, torch.randn(20).bfloat16())
        with pytest.raises(ValueError, match="activation"):
            packed_linear(torch.randn(2, 8), packed, activation="silu")


def test_bf16_without_the_cpu_feature_is_refused_naming_the_flag(monkeypatch):
    """Where the CPU lacks AVX-512 BF16 (simulated: the C check answers 0), packing and products raise RuntimeError
    naming avx512_bf16 instead of running an illegal instruction; float32 packing is unaffected."""
    lib = packed_linear_module._library()
    packed = PackedWeight(torch.zeros(16 * 2, dtype=torch.bfloat16), 3, 2, torch.bfloat16)  # built before the check
    monkeypatch.setattr(lib, "packed_linear_bf16_supported", lambda: 0)
    assert not bf16_available()
    with pytest.raises(RuntimeError, match="avx512_bf16"):
        PackedWeight.pack(torch.randn(3, 2), torch.bfloat16)
    with pytest.raises(RuntimeError, match="avx512_bf16"):
        packed_linear(torch.randn(1, 2), packed)
    assert PackedWeight.pack(torch.randn(3, 2)).dtype == torch.float32
