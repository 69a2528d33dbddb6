"""kernels.small_m: few-row products against a weight give numpy's product (computed in float64)
to rounding, for both weight layouts, odd shapes, every dtype it takes; half weights are widened
exactly; kernels.blas sends it the products it takes and nothing else."""

import numpy as np
import pytest
from test_threads import thread_count as thread_count  # noqa: F401, PLC0414 (the fixture, used by its name)

from hpc_tp.kernels import blas, cpu_kernels, f32_dot, quantized, small_m

ml_dtypes = pytest.importorskip("ml_dtypes")
needs_numba = pytest.mark.skipif(not cpu_kernels.ENABLED, reason="needs numba")
rng = np.random.default_rng(0)
# Relative to the largest |entry| of the product: float32 sums of up to ~1500 terms; float64's.
TOLERANCE = {"float32": 3e-6, "float64": 1e-13, "bfloat16": 3e-6, "float16": 3e-6}


def _weight(k, n, dtype, layout):
    w = rng.standard_normal((k, n) if layout == "row-major" else (n, k)).astype(
        ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    )
    return w if layout == "row-major" else w.T


@needs_numba
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["row-major", "transposed view"])
def test_matches_numpy_on_random_shapes(dtype, layout):
    shape_rng = np.random.default_rng(1)
    half = dtype in ("bfloat16", "float16")
    for _ in range(6):
        low, high = (1, small_m.MAX_ROWS) if half else (small_m.MIN_FULL_ROWS, small_m.MAX_FULL_ROWS)
        m = int(shape_rng.integers(low, high + 1))
        k, n = (int(x) for x in shape_rng.integers(3, 700, 2) | 1)  # odd: the kernels' tails
        n = max(n, -(-small_m.MIN_WEIGHT // k) | 1)
        w = _weight(k, n, dtype, layout)
        a = rng.standard_normal((m, k)).astype("float32" if half else dtype)
        assert small_m.takes(a, w)
        expected = a.astype("float64") @ w.astype("float64")  # half weights widen exactly
        got = small_m.matmul(a, w)
        assert got.dtype == small_m.result_dtype(w.dtype) and got.shape == (m, n)
        assert np.abs(got - expected).max() <= TOLERANCE[dtype] * np.abs(expected).max(), (m, k, n)


@needs_numba
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_half_bit_pattern_widens_exactly(dtype):
    """One row of ones times a weight holding every 16-bit pattern (once per output column, the
    rest zeros) gives each value as float32: inf and nan included, float16's subnormals too."""
    half = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    patterns = np.arange(1 << 16, dtype=np.uint16)
    w = np.zeros((2, patterns.size), np.uint16)
    w[0] = patterns
    w = w.view(half)
    got = small_m.matmul(np.array([[1.0, 0.0]], np.float32), w)[0]
    expected = patterns.view(half).astype(np.float32)
    finite = np.isfinite(expected)
    assert np.array_equal(got[finite], expected[finite])
    assert np.array_equal(np.isnan(got), np.isnan(expected)) and np.array_equal(
        got[~finite & ~np.isnan(expected)], expected[~finite & ~np.isnan(expected)]
    )


@needs_numba
def test_blas_sends_it_the_few_row_products(monkeypatch):
    monkeypatch.setattr(f32_dot, "AVAILABLE", False)  # float32 rows go there first where the CPU has AVX-512
    taken = []
    monkeypatch.setattr(
        small_m,
        "matmul",
        lambda a, b, out=None, kernel=small_m.matmul: (taken.append(a.shape[0]), kernel(a, b, out))[1],
    )
    w = _weight(256, 512, "float32", "row-major")
    for m in (1, small_m.MIN_FULL_ROWS, small_m.MAX_FULL_ROWS, small_m.MAX_FULL_ROWS + 1):
        a = rng.standard_normal((m, 256)).astype("float32")
        np.testing.assert_allclose(blas.matmul(a, w), a @ w, rtol=1e-4, atol=1e-4)
    out = np.zeros((8, 512), np.float32)
    blas.matmul(rng.standard_normal((8, 256)).astype("float32"), w, out=out, accumulate=True)  # BLAS's beta = 1
    blas.matmul(rng.standard_normal((8, 256)), w)  # float64 rows, float32 weight: numpy's promotion
    blas.matmul(rng.standard_normal((8, 16)).astype("float32"), w[:16, :16].copy())  # a weight that stays in cache
    assert taken == [small_m.MIN_FULL_ROWS, small_m.MAX_FULL_ROWS]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["row-major", "transposed view"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_many_rows_against_a_half_weight_widen_it_by_blocks(dtype, layout, accumulate):
    """Past MAX_ROWS (prefill) the weight is widened a block at a time for BLAS; float32 sums."""
    m, k, n = small_m.MAX_ROWS + 5, 301, 257
    w = _weight(k, n, dtype, layout)
    a = rng.standard_normal((m, k)).astype(w.dtype)
    out = np.ones((m, n), np.float32)
    got = blas.widened_matmul(a, w, out=out, accumulate=accumulate, block_bytes=40 * 4 * 301)  # 7-8 blocks
    expected = a.astype("float64") @ w.astype("float64") + (1 if accumulate else 0)
    assert got is out and np.abs(got - expected).max() <= 3e-6 * np.abs(expected).max()
    np.testing.assert_allclose(blas.matmul(a, w), expected - (1 if accumulate else 0), rtol=1e-4, atol=1e-3)


@needs_numba
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("layout", ["row-major", "transposed view"])
def test_threads_split_the_outputs_without_changing_a_bit(dtype, layout, thread_count):
    """Each thread's outputs are summed in the order of one thread's: the same bits at 1, 2 and 3
    threads, with ranges of uneven widths and the kernels' tails inside them."""
    if dtype.startswith("int") and layout != "row-major":
        pytest.skip("quantized weights are kept row-major")
    m, k, n = 7, 320, 1999
    a = rng.standard_normal((m, k)).astype("float64" if dtype == "float64" else "float32")
    if dtype.startswith("int"):
        w = quantized.quantize(rng.standard_normal((k, n)).astype("float32"), int(dtype[3:]))
        product = lambda: quantized.matmul(a, w)  # noqa: E731
    else:
        w = _weight(k, n, dtype, layout)
        product = lambda: small_m.matmul(a, w)  # noqa: E731
    results = []
    for count in (1, 2, 3):
        thread_count(count)
        results.append(product())
    assert all(np.array_equal(results[0], result) for result in results[1:])
