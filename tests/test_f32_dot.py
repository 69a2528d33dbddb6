"""kernels.f32_dot: float32 few-row products with AVX-512 FMAs equal numpy's float32 product to
rounding for both weight layouts, odd shapes and every row tile, a column range and accumulation, the
same bits at any thread count; kernels.blas sends it the few-row float32 products, and keeps its own
path without AVX-512 (forced here). Its switch and warm-up: tests/test_vector_kernels.py."""

import numpy as np
import pytest
from test_half_inference import _logits as model_logits
from test_threads import thread_count as thread_count  # noqa: F401, PLC0414 (the fixture, used by its name)
from tp_helpers import max_rel_err, tp_and_reference

from hpc_tp.kernels import blas, f32_dot

needs_avx512 = pytest.mark.skipif(not f32_dot.AVAILABLE, reason="needs numba and a CPU with AVX-512")
rng = np.random.default_rng(0)
# Relative to the sum of |terms| of each entry: float32 sums of up to ~700 products, rounded at each FMA.
TOLERANCE = 1e-5


def _operands(m, k, n, layout):
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n) if layout == "row-major" else (n, k)).astype(np.float32)
    return a, (w if layout == "row-major" else w.T)


def _assert_product(got, a, w, columns=slice(None)):
    """``got`` is a @ w[:, columns] to float32 rounding, and numpy's float32 product to the same."""
    wide_a, wide_w = a.astype(np.float64), w.astype(np.float64)[:, columns]
    exact, magnitude = wide_a @ wide_w, np.abs(wide_a) @ np.abs(wide_w)
    assert got.dtype == np.float32
    assert (np.abs(got - exact) <= TOLERANCE * magnitude).all()
    assert (np.abs(got - a @ w[:, columns]) <= 2 * TOLERANCE * magnitude).all()


@needs_avx512
@pytest.mark.parametrize("layout", ["row-major", "transposed view"])
def test_matches_numpy_on_odd_shapes(layout):
    shape_rng = np.random.default_rng(1)
    for m in (1, 2, 3, 5, 6, 8, 11, 13, 64):  # every row tile and its tails
        k, n = (int(x) for x in shape_rng.integers(100, 700, 2) | 1)  # odd: no whole vector, tile or chunk
        a, w = _operands(m, k, n, layout)
        _assert_product(f32_dot.matmul(a, w), a, w)


@needs_avx512
@pytest.mark.parametrize("layout", ["row-major", "transposed view"])
def test_column_ranges_and_accumulate(layout):
    """Each range writes its columns only (any start, tiles' tails inside), and accumulate adds to
    what ``out`` holds."""
    a, w = _operands(9, 301, 517, layout)
    out = np.full((9, 517), 7.0, np.float32)
    for start, stop in ((0, 37), (37, 300), (300, 517)):
        f32_dot.matmul(a, w, out, start=start, stop=stop)
        assert (out[:, stop:] == 7).all()
    _assert_product(out, a, w)
    f32_dot.matmul(a, w, out, accumulate=True, start=64, stop=128)
    _assert_product(out[:, 64:128] / 2, a, w, slice(64, 128))
    _assert_product(out[:, 128:], a, w, slice(128, None))


@needs_avx512
def test_special_values_reach_their_entries_only():
    """inf and nan in the weight reach the entries they are summed into; masked lanes at the ragged
    edges read nothing past the arrays (no stray 0 x inf)."""
    a = np.ones((3, 35), np.float32)
    w = np.zeros((35, 40), np.float32)
    w[34, 0], w[34, 1], w[1, 39] = np.inf, -np.inf, np.nan
    for weight in (w, np.ascontiguousarray(w.T).T):
        got = f32_dot.matmul(a, weight)
        assert (got[:, 0] == np.inf).all() and (got[:, 1] == -np.inf).all() and np.isnan(got[:, 39]).all()
        assert (got[:, 2:39] == 0).all()


@needs_avx512
@pytest.mark.parametrize("layout", ["row-major", "transposed view"])
@pytest.mark.parametrize("m", [7, 8, 13])
def test_threads_split_the_outputs_without_changing_a_bit(layout, m, thread_count):
    """Each column is summed in the same order whatever its thread: the same bits at 1, 2 and 3
    threads, with ranges of uneven widths and the tiles' tails inside them."""
    a, w = _operands(m, 320, 1999, layout)
    results = []
    for count in (1, 2, 3):
        thread_count(count)
        results.append(f32_dot.matmul(a, w))
    assert all(np.array_equal(results[0], result) for result in results[1:])


@needs_avx512
def test_blas_sends_it_the_few_row_float32_products(monkeypatch):
    taken = []
    kernel = f32_dot.matmul
    monkeypatch.setattr(f32_dot, "matmul", lambda a, *args: taken.append(a.shape[0]) or kernel(a, *args))
    for layout in ("row-major", "transposed view"):
        for m in (1, 2, 8, f32_dot.MAX_ROWS, f32_dot.MAX_ROWS + 1):
            a, w = _operands(m, 256, 512, layout)
            _assert_product(blas.matmul(a, w), a, w)
    # one row by a row-major weight: BLAS's GEMV
    assert taken == [2, 8, f32_dot.MAX_ROWS] + [1, 2, 8, f32_dot.MAX_ROWS]
    a, w = _operands(8, 256, 512, "row-major")
    blas.matmul(a.astype(np.float64), w.astype(np.float64))  # float64 stays on small_m (the tp equality runs there)
    blas.matmul(a[:, :16], w[:16, :16].copy())  # a weight that stays in cache: BLAS
    assert len(taken) == 7


@needs_avx512
@pytest.mark.mpi(min_size=1)
def test_a_float32_model_at_tp_gives_one_process_logits(monkeypatch):
    """A float32 model's prefill and decode logits at tp = the world size are one process's to float32
    rounding, where one process's decode products (its head, its MLP's first weight) run here and the
    split ones, under MIN_WEIGHT at tp >= 2, through small_m and BLAS."""
    taken = []
    kernel = f32_dot.matmul
    monkeypatch.setattr(f32_dot, "matmul", lambda a, *args: taken.append(a.shape[0]) or kernel(a, *args))
    tp, one = tp_and_reference()
    for step, (got, want) in enumerate(zip(model_logits(tp, "float32"), model_logits(one, "float32"))):
        assert max_rel_err(got, want) <= 1e-5, f"step {step}"
    assert taken  # every rank's one-process reference took the kernel


@pytest.mark.parametrize("layout", ["row-major", "transposed view"])
def test_without_avx512_blas_keeps_its_path(monkeypatch, layout):
    """Where ``AVAILABLE`` is False ``takes`` answers False and blas gives the product through
    ``kernels.small_m`` or BLAS."""
    monkeypatch.setattr(f32_dot, "AVAILABLE", False)
    for m in (1, 8, 64):
        a, w = _operands(m, 256, 512, layout)
        assert not f32_dot.takes(a, w)
        _assert_product(blas.matmul(a, w), a, w)
