"""The fused CPU kernels on bfloat16/float16 arrays (hpc_tp/kernels/cpu_kernels.py, half_bits.py) give
the composed half code's bits where it rounds once (rmsnorm, the residual sum and norm), and otherwise
the composed code's float32 numbers on the widened arrays, rounded once: within the stated half steps
of the composed half code (layernorm's variance summed in another order; SwiGLU and RoPE, which the
composed half code rounds at every step)."""

import numpy as np
import pytest

from hpc_tp.kernels import cpu_kernels, half_bits
from hpc_tp.kernels import functional as F

ml_dtypes = pytest.importorskip("ml_dtypes")
pytestmark = pytest.mark.skipif(not cpu_kernels.ENABLED, reason="numba is not installed (or HPC_TP_CPU_KERNELS=0)")
BF16 = np.dtype(ml_dtypes.bfloat16)
HALVES = [BF16, *([np.dtype("float16")] if half_bits.F16 else [])]
MANTISSA = {BF16: 7, np.dtype("float16"): 10}  # stored mantissa bits: a half step is 2^(exponent - these)
SHAPES = [(3, 5, 77), (2, 300), (1, 1, 576)]  # a row under, between and past numpy's pairwise blocks


def composed(call):
    cpu_kernels.ENABLED = False
    try:
        return call()
    finally:
        cpu_kernels.ENABLED = True


def same_bits(got, want):
    return (
        got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got.view(np.uint8), want.view(np.uint8))
    )


def half_steps(got, want):
    """The largest |got - want| in steps of the half format at want (its smallest normal step below)."""
    wide = want.astype(np.float32)
    exponent = np.floor(np.log2(np.maximum(np.abs(wide), np.finfo(want.dtype).tiny)))
    return float(np.max(np.abs(got.astype(np.float32) - wide) / 2.0 ** (exponent - MANTISSA[want.dtype])))


def halves(dtype, *shapes, seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * scale).astype(dtype) for shape in shapes]


if cpu_kernels.ENABLED:
    import numba

    @numba.njit
    def _narrowed(values, out):
        for i in range(values.size):
            out[i] = half_bits.narrow(values[i], out)

    @numba.njit
    def _widened(values, out):
        for i in range(values.size):
            out[i] = half_bits.wide(values[i])


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_rounding_and_widening_match_astype(dtype):
    """Every half bit pattern widens as astype(float32) does; float32 values of every class (ties,
    overflow to inf, subnormals, signed zeros, NaN) round as astype(half) does (NaN: to a NaN)."""
    view = half_bits.VIEWS[dtype]
    every = np.arange(1 << 16, dtype=np.uint16).view(view).view(dtype)
    wide = np.empty(every.size, np.float32)
    _widened(half_bits.bits(every), wide)
    want = every.astype(np.float32)
    number = ~np.isnan(want)
    assert np.array_equal(np.isnan(wide), ~number) and np.array_equal(wide[number], want[number])
    patterns = np.random.default_rng(1).integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    special = [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x477FF000, 0x477FEFFF, 0x00008000, 0x00018000, 1]
    values = np.concatenate([patterns, special, [s | 0x80000000 for s in special], [0, 0x80000000, 0x7F800000]])
    values = values.astype(np.uint32).view(np.float32)
    got = np.empty(values.size, dtype)
    _narrowed(values, half_bits.bits(got))
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and overflow are cases here
        want = values.astype(dtype)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and same_bits(got[~nan], want[~nan])
    if dtype == BF16:  # ml_dtypes' quiet NaN, sign kept
        assert same_bits(got[nan], want[nan])


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_and_the_residual_sum_give_the_composed_half_bits(dtype, shape):
    x, residual, gain = halves(dtype, shape, shape, shape[-1:], seed=2)
    assert cpu_kernels.fused(x, half=True) and not cpu_kernels.fused(x)
    y, (xhat, rrms) = F.rmsnorm_forward(x, gain, 1e-6)
    y_ref, (xhat_ref, rrms_ref) = composed(lambda: F.rmsnorm_forward(x, gain, 1e-6))
    assert same_bits(y, y_ref) and same_bits(xhat, xhat_ref) and same_bits(rrms, rrms_ref)
    got = F.add_norm_forward(x.copy(), residual, gain, None, 1e-6, False)
    want = composed(lambda: F.add_norm_forward(x.copy(), residual, gain, None, 1e-6, False))
    for g, w in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2]), strict=True):
        assert same_bits(g, w)
    # the composed backward takes the fused forward's saved tensors as its own
    dy = halves(dtype, shape, seed=3)[0]
    for g, w in zip(F.rmsnorm_backward(dy, gain, got[2]), F.rmsnorm_backward(dy, gain, want[2]), strict=True):
        assert same_bits(g, w)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_within_a_half_step_of_the_composed_half_code(dtype, shape, bias):
    """The variance is summed in numpy's pairwise order, the composed code's einsum in its own: rstd
    moves by a float32 rounding now and then, and y or xhat by one half step where that crosses a tie."""
    x, residual, gain, b = halves(dtype, shape, shape, shape[-1:], shape[-1:], seed=4)
    b = b if bias else None
    got = F.add_norm_forward(x.copy(), residual, gain, b, 1e-5, True)
    want = composed(lambda: F.add_norm_forward(x.copy(), residual, gain, b, 1e-5, True))
    assert same_bits(got[0], want[0])
    (xhat, rstd), (xhat_ref, rstd_ref) = got[2], want[2]
    assert rstd.dtype == rstd_ref.dtype == np.float32 and np.max(np.abs(rstd / rstd_ref - 1)) <= 3e-7
    assert half_steps(got[1], want[1]) <= 1 and half_steps(xhat, xhat_ref) <= 1
    assert np.mean(got[1] != want[1]) < 0.01


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 2 * 37), (1, 2 * 1536)])
def test_swiglu_rounds_the_float32_numbers_once(dtype, shape):
    """The float32 code's bits on the widened h, rounded; within 3 half steps of the composed half code,
    which rounds exp, the sum, the quotient and both products (float16's exp overflows below -11: the
    test keeps the gate above)."""
    (h,) = halves(dtype, shape, seed=5, scale=3.0 if dtype == BF16 else 2.5)
    local = shape[-1] // 2
    inner, ((gate, sig), act, up) = F.gated_forward(h, local, F.silu_forward)
    wide = composed(lambda: F.gated_forward(h.astype(np.float32), local, F.silu_forward))
    half = composed(lambda: F.gated_forward(h, local, F.silu_forward))
    for got, float32, ref in (
        (inner, wide[0], half[0]),
        (sig, wide[1][0][1], half[1][0][1]),
        (act, wide[1][1], half[1][1]),
    ):
        assert same_bits(got, float32.astype(dtype)) and half_steps(got, ref) <= 3
    assert same_bits(gate, h[..., :local]) and same_bits(up, h[..., local:])


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_float32_sums_cast_to_a_half_format_give_astype_bits(dtype):
    """``functional.cast`` (the products' float32 sums to the activations' format) in one fused pass:
    astype's bits, overflow and NaN included, and back to float32 exactly; a strided array takes astype
    itself."""
    rng = np.random.default_rng(9)
    sums = (rng.standard_normal((8, 4099)) * 4.0 ** rng.integers(-20, 20, (8, 4099))).astype(np.float32)
    sums[0, :4] = [np.inf, -np.nan, 3.0e38, -0.0]
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and overflow are cases here
        want = sums.astype(dtype)
        got = F.cast(sums, dtype)
        assert cpu_kernels.converts(sums, dtype) and same_bits(got, want)
        assert not cpu_kernels.converts(sums[:, ::2], dtype)
        assert same_bits(F.cast(sums[:, ::2], dtype), want[:, ::2].copy())
        assert cpu_kernels.converts(got, np.float32) and same_bits(F.cast(got, np.float32), want.astype(np.float32))


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_residual_sum_gives_numpys_half_bits(dtype):
    """The block's last residual sum ``m += x1`` in one fused pass: numpy's half sum, bit for bit."""
    m, x1 = halves(dtype, (8, 1, 576), (8, 1, 576), seed=11)
    want = m.copy()
    want += x1
    got = F.add_into(m, x1)
    assert got is m and same_bits(got, want)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_rope_scale_rounds_as_numpy_multiplies_after(dtype):
    """The query scale inside the rotation: the rotated half values, rounded, times the scale in the
    half format, rounded, as ``q *= scale`` on the rotation gives them."""
    (q,) = halves(dtype, (2, 3, 4, 8), seed=10)
    cos, sin = F.rope_tables(np.arange(4) + 7, 1.0 / 10000 ** (np.arange(0, 8, 2) / 8), dtype)
    for scale in (0.125, 0.3):
        want = F.rope_apply(q, cos, sin)
        want *= scale
        assert same_bits(F.rope_apply(q, cos, sin, scale=scale), want)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("per_row", [False, True])
def test_rope_rounds_the_float32_rotation_once(dtype, per_row):
    """Q heads as attention sees them (a strided view [B, hk, g, T, d]), both directions: the float32
    rotation of the widened values, rounded; the composed half code rounds both products before their
    difference, so it is within two half steps of the largest |q|, not of each (small) result."""
    b, hk, g, t, d = 3, 2, 2, 5, 8
    (qkv,) = halves(dtype, (b, t, hk * g * d + 16), seed=6)
    q = qkv[..., : hk * g * d].reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4)
    positions = np.arange(t) + 3 if not per_row else np.array([[5, 9, 2, 7, 11]]) + np.arange(b)[:, None]
    cos, sin = F.rope_tables(positions, 1.0 / 10000 ** (np.arange(0, d, 2) / d), dtype)
    if per_row:
        cos, sin = cos[:, None, None], sin[:, None, None]
    for inverse in (False, True):
        got = F.rope_apply(q, cos, sin, inverse)
        wide = [a.astype(np.float32) for a in (q, cos, sin)]
        assert got.flags.c_contiguous and same_bits(got, composed(lambda: F.rope_apply(*wide, inverse)).astype(dtype))
        error = got.astype(np.float32) - composed(lambda: F.rope_apply(q, cos, sin, inverse)).astype(np.float32)
        assert np.max(np.abs(error)) <= 2.0 ** (1 - MANTISSA[dtype]) * np.max(np.abs(q.astype(np.float32)))


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norm_backward_within_a_half_step_of_the_composed_half_code(dtype, norm):
    """From the same saved tensors: dx within one half step of the largest |dx| (the row sums run in
    float64 here, in float32 there), the gain and bias gradients float32 as the composed code's, close."""
    shape = (3, 5, 300)
    x, dy, gain, bias = halves(dtype, shape, shape, shape[-1:], shape[-1:], seed=7)
    if norm == "layernorm":
        saved = F.layernorm_forward(x, gain, bias, 1e-5)[1]
        got, want = F.layernorm_backward(dy, gain, saved), composed(lambda: F.layernorm_backward(dy, gain, saved))
    else:
        saved = F.rmsnorm_forward(x, gain, 1e-5)[1]
        got, want = F.rmsnorm_backward(dy, gain, saved), composed(lambda: F.rmsnorm_backward(dy, gain, saved))
    dx, dx_ref = got[0].astype(np.float32), want[0].astype(np.float32)
    assert got[0].dtype == dtype and np.max(np.abs(dx - dx_ref)) <= 2.0 ** -MANTISSA[dtype] * np.max(np.abs(dx_ref))
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.dtype == w.dtype == np.float32 and np.max(np.abs(g - w)) <= 1e-6 * np.max(np.abs(w))
