"""kernels.bf16_dot: bfloat16 products through ``vdpbf16ps`` equal the float32 product of the same
bfloat16 values to rounding, for both weight layouts, odd shapes, few rows and many, a column range
and accumulation; kernels.blas sends it bfloat16 by bfloat16 products where the CPU has the
instruction, and the widening path keeps them where it has not (forced here). Its switch and warm-up:
tests/test_vector_kernels.py."""

import numpy as np
import pytest

from hpc_tp.kernels import bf16_dot, blas, threads

ml_dtypes = pytest.importorskip("ml_dtypes")
needs_bf16 = pytest.mark.skipif(not bf16_dot.AVAILABLE, reason="needs numba and a CPU with avx512_bf16")
rng = np.random.default_rng(0)
# Relative to the sum of |terms| of each entry: float32 sums of up to ~1500 exact products.
TOLERANCE = 1e-6


def _operands(m, k, n, layout):
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((k, n) if layout == "row-major" else (n, k)).astype(ml_dtypes.bfloat16)
    return a, (w if layout == "row-major" else w.T)


def _assert_float32_product(got, a, w, columns=slice(None)):
    """``got`` is a @ w's float32 product of the same bfloat16 values, to rounding of each entry's sum."""
    wide_a, wide_w = a.astype(np.float64), w.astype(np.float64)[:, columns]
    exact, magnitude = wide_a @ wide_w, np.abs(wide_a) @ np.abs(wide_w)
    assert got.dtype == np.float32
    assert (np.abs(got - exact) <= TOLERANCE * magnitude + 1e-30).all()


@needs_bf16
@pytest.mark.parametrize("layout", ["row-major", "transposed view"])
def test_matches_the_float32_product_on_odd_shapes(layout):
    shape_rng = np.random.default_rng(1)
    for m in (1, 2, 3, 5, 8, 13, 64, 150):  # every row tile and its tails; 150: a prefill
        k, n = (int(x) for x in shape_rng.integers(1, 700, 2) | 1)  # odd: no whole pair, vector or tile
        a, w = _operands(m, k, n, layout)
        assert bf16_dot.takes(a, w)
        _assert_float32_product(bf16_dot.matmul(a, w), a, w)


@needs_bf16
@pytest.mark.parametrize("layout", ["row-major", "transposed view"])
def test_column_range_and_accumulate(layout):
    """A column range writes those columns only; accumulate adds to what ``out`` holds."""
    a, w = _operands(9, 301, 517, layout)
    out = np.full((9, 517), 7.0, np.float32)
    bf16_dot.matmul(a, w, out, start=37, stop=300)
    assert (out[:, :37] == 7).all() and (out[:, 300:] == 7).all()
    _assert_float32_product(out[:, 37:300], a, w, slice(37, 300))
    bf16_dot.matmul(a, w, out, accumulate=True, start=37, stop=300)
    _assert_float32_product(out[:, 37:300] / 2, a, w, slice(37, 300))


@needs_bf16
@pytest.mark.parametrize("layout", ["row-major", "transposed view"])
@pytest.mark.parametrize("m", [1, 8, 13, 150])
def test_threads_split_the_outputs_without_changing_a_bit(layout, m):
    """Each column is summed in the same order whichever thread takes its range: the same bits at 1, 2
    and 3 threads, with ranges of uneven widths and the tiles' tails inside them (150 rows: a prefill's
    blocks)."""
    a, w = _operands(m, 321, 1999, layout)
    before, results = threads.COUNT, []
    try:
        for count in (1, 2, 3):
            threads.use(count)
            assert count == 1 or len(threads.shared(1999, bf16_dot.COLUMN_ALIGN, 2 * 321)) - 1 > count
            results.append(bf16_dot.matmul(a, w))
    finally:
        threads.use(before)
    assert all(np.array_equal(results[0], result) for result in results[1:])


@needs_bf16
def test_special_values_pass_through():
    """inf and nan in the weight reach the entries they are summed into, and an odd K's last row
    sums alone (not with a stray 0 x inf)."""
    a = np.ones((2, 3), ml_dtypes.bfloat16)
    w = np.zeros((3, 40), np.float32)
    w[2, 0], w[2, 1], w[1, 2] = np.inf, -np.inf, np.nan
    w = w.astype(ml_dtypes.bfloat16)
    for weight in (w, np.ascontiguousarray(w.T).T):
        got = bf16_dot.matmul(a, weight)
        assert (got[:, 0] == np.inf).all() and (got[:, 1] == -np.inf).all() and np.isnan(got[:, 2]).all()
        assert (got[:, 3:] == 0).all()


@needs_bf16
def test_blas_sends_bfloat16_products_here(monkeypatch):
    calls = []
    kernel = bf16_dot.matmul
    monkeypatch.setattr(bf16_dot, "matmul", lambda *args: calls.append(args) or kernel(*args))
    for m in (4, 200):  # decoding's few rows and a prefill's many
        a, w = _operands(m, 96, 130, "row-major")
        _assert_float32_product(blas.matmul(a, w), a, w)
    assert len(calls) == 2
    blas.matmul(a.astype(np.float32), w)  # float32 activations: the widening path, not rounded to bfloat16
    blas.matmul(a, w, out=np.empty((200, 130), np.float64))
    assert len(calls) == 2


@pytest.mark.parametrize("layout", ["row-major", "transposed view"])
def test_forced_fallback_keeps_the_widening_path(monkeypatch, layout):
    """Without the instruction ``takes`` answers False and blas gives the same product through
    ``kernels.small_m`` or its blockwise widening."""
    monkeypatch.setattr(bf16_dot, "AVAILABLE", False)
    for m in (3, 200):
        a, w = _operands(m, 301, 517, layout)
        assert not bf16_dot.takes(a, w)
        _assert_float32_product(blas.matmul(a, w), a, w)
