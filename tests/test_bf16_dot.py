"""kernels.bf16_dot: bfloat16 products through ``vdpbf16ps`` equal the float32 product of the same
bfloat16 values to rounding, for every weight layout (row-major, a transposed view, and either packed
in panels: ``kernels.bf16_panels``), odd shapes, few rows and many, a column range and accumulation,
the same bits at any thread count; panels give back the values they were packed from, and a
transposed weight's panels the rows of the array it viewed; kernels.blas sends it bfloat16 by
bfloat16 products where the CPU has the instruction, and the widening path keeps them where it has
not (forced here). Its switch and warm-up: tests/test_vector_kernels.py."""

import subprocess
import sys

import numpy as np
import pytest

from hpc_tp.kernels import bf16_dot, bf16_panels, blas, threads

ml_dtypes = pytest.importorskip("ml_dtypes")
needs_bf16 = pytest.mark.skipif(not bf16_dot.AVAILABLE, reason="needs numba and a CPU with avx512_bf16")
rng = np.random.default_rng(0)
# Relative to the sum of |terms| of each entry: float32 sums of up to ~1500 exact products.
TOLERANCE = 1e-6


LAYOUTS = ["row-major", "transposed view", "panels", "panels of a transposed view"]


def _operands(m, k, n, layout):
    """(a, w, what the kernel is given for w: w itself or its panels)."""
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    transposed = "transposed" in layout
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype(ml_dtypes.bfloat16)
    w = w.T if transposed else w
    return a, w, (bf16_panels.PanelMatrix(w) if layout.startswith("panels") else w)


def _assert_float32_product(got, a, w, columns=slice(None)):
    """``got`` is a @ w's float32 product of the same bfloat16 values, to rounding of each entry's sum."""
    wide_a, wide_w = a.astype(np.float64), w.astype(np.float64)[:, columns]
    exact, magnitude = wide_a @ wide_w, np.abs(wide_a) @ np.abs(wide_w)
    assert got.dtype == np.float32
    assert (np.abs(got - exact) <= TOLERANCE * magnitude + 1e-30).all()


@needs_bf16
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_the_float32_product_on_odd_shapes(layout):
    shape_rng = np.random.default_rng(1)
    for m in (1, 2, 3, 5, 8, 13, 64, 150):  # every row tile and its tails; 150: a prefill
        k, n = (int(x) for x in shape_rng.integers(1, 700, 2) | 1)  # odd: no whole pair, vector or tile
        a, w, operand = _operands(m, k, n, layout)
        assert bf16_dot.takes(a, operand)
        _assert_float32_product(bf16_dot.matmul(a, operand), a, w)


@needs_bf16
@pytest.mark.parametrize("layout", LAYOUTS)
def test_column_range_and_accumulate(layout):
    """A column range writes those columns only; accumulate adds to what ``out`` holds."""
    a, w, operand = _operands(9, 301, 517, layout)
    out = np.full((9, 517), 7.0, np.float32)
    bf16_dot.matmul(a, operand, out, start=64, stop=300)  # a packed weight's range starts at a panel
    assert (out[:, :64] == 7).all() and (out[:, 300:] == 7).all()
    _assert_float32_product(out[:, 64:300], a, w, slice(64, 300))
    bf16_dot.matmul(a, operand, out, accumulate=True, start=64, stop=300)
    _assert_float32_product(out[:, 64:300] / 2, a, w, slice(64, 300))
    if operand is not w:
        with pytest.raises(ValueError, match="starts at a panel"):
            bf16_dot.matmul(a, operand, out, start=37, stop=300)
        return
    out = np.full((9, 517), 7.0, np.float32)
    bf16_dot.matmul(a, w, out, start=37, stop=300)
    assert (out[:, :37] == 7).all() and (out[:, 300:] == 7).all()
    _assert_float32_product(out[:, 37:300], a, w, slice(37, 300))
    bf16_dot.matmul(a, w, out, accumulate=True, start=37, stop=300)
    _assert_float32_product(out[:, 37:300] / 2, a, w, slice(37, 300))


@needs_bf16
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m", [1, 8, 13, 64, 150])
def test_threads_split_the_outputs_without_changing_a_bit(layout, m):
    """Each column is summed in the same order whichever thread takes its range: the same bits at 1, 2
    and 3 threads, with ranges of uneven widths and the tiles' tails inside them (150 rows: a prefill's
    blocks)."""
    a, _, operand = _operands(m, 321, 1999, layout)
    before, results = threads.COUNT, []
    try:
        for count in (1, 2, 3):
            threads.use(count)
            assert count == 1 or len(threads.shared(1999, bf16_dot.COLUMN_ALIGN, 2 * 321)) - 1 > count
            results.append(bf16_dot.matmul(a, operand))
    finally:
        threads.use(before)
    assert all(np.array_equal(results[0], result) for result in results[1:])


# A packed weight whose panels end at a page that may not be read: every row tile (1 to 4 panels wide)
# at the right edge of 3 panels must read none past them (a read there faults, and the process dies).
_GUARDED = """
import ctypes, mmap, numpy, ml_dtypes
from hpc_tp.kernels import bf16_dot, bf16_panels
matrix = bf16_panels.PanelMatrix(numpy.ones((64, 70), ml_dtypes.bfloat16))
size, page = matrix.panels.nbytes, mmap.PAGESIZE
span = -(-size // page) * page
memory = mmap.mmap(-1, span + page)
base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(base + span), ctypes.c_size_t(page), 0) == 0
guarded = numpy.frombuffer(memory, numpy.uint16, count=size // 2, offset=span - size)
guarded[:] = matrix.panels.reshape(-1)
matrix.panels = guarded.reshape(matrix.panels.shape)
for rows in (1, 2, 4, 6, 8):
    assert (bf16_dot.matmul(numpy.ones((rows, 64), ml_dtypes.bfloat16), matrix) == 64).all(), rows
print("read none past the panels")
"""


@needs_bf16
@pytest.mark.skipif(sys.platform != "linux", reason="protects a page through the C library's mprotect")
def test_tiles_at_the_edge_read_nothing_past_the_panels():
    result = subprocess.run([sys.executable, "-c", _GUARDED], capture_output=True, text=True)
    assert result.returncode == 0 and "read none" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("k, n", [(1, 1), (7, 33), (64, 64), (301, 517)])
def test_panels_give_back_what_they_were_packed_from(k, n):
    """``values`` writes W (or W.T) out of the panels, a transposed weight's ``rows_of_transpose`` are
    the rows of the array it viewed, and ``PanelValues`` reads as the Parameter it stands for."""
    _, w, _ = _operands(1, k, n, "row-major")
    e = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
    ids = rng.integers(0, n, (3, 5))
    for plain, matrix in ((w, bf16_panels.PanelMatrix(w)), (e.T, bf16_panels.PanelMatrix(e.T))):
        assert matrix.panels.ctypes.data % 64 == 0  # panels start on a cache line
        assert _same_bits(matrix.values(), plain) and _same_bits(matrix.values(transposed=True), plain.T)
        assert _same_bits(matrix.rows_of_transpose(ids), plain.T[ids])
        whole, columns = bf16_panels.PanelValues(matrix), bf16_panels.PanelValues(matrix, slice(n // 3, n))
        assert whole.shape == plain.shape and whole.nbytes == plain.nbytes and whole.dtype == plain.dtype
        assert _same_bits(np.asarray(columns), plain[:, n // 3 :]) and columns.shape == plain[:, n // 3 :].shape
        transposed = bf16_panels.PanelValues(matrix, transposed=True)
        assert transposed.shape == plain.T.shape and _same_bits(transposed[ids], plain.T[ids])
        assert _same_bits(transposed[(slice(0, 2), slice(None))], plain.T[:2])


def _same_bits(x, y):
    return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x.view(np.uint16), y.view(np.uint16))


@needs_bf16
def test_special_values_pass_through():
    """inf and nan in the weight reach the entries they are summed into, and an odd K's last row
    sums alone (not with a stray 0 x inf)."""
    a = np.ones((2, 3), ml_dtypes.bfloat16)
    w = np.zeros((3, 40), np.float32)
    w[2, 0], w[2, 1], w[1, 2] = np.inf, -np.inf, np.nan
    w = w.astype(ml_dtypes.bfloat16)
    for weight in (w, np.ascontiguousarray(w.T).T, bf16_panels.PanelMatrix(w)):
        got = bf16_dot.matmul(a, weight)
        assert (got[:, 0] == np.inf).all() and (got[:, 1] == -np.inf).all() and np.isnan(got[:, 2]).all()
        assert (got[:, 3:] == 0).all()


@needs_bf16
def test_blas_sends_bfloat16_products_here(monkeypatch):
    calls = []
    kernel = bf16_dot.matmul
    monkeypatch.setattr(bf16_dot, "matmul", lambda *args: calls.append(args) or kernel(*args))
    for m in (4, 200):  # decoding's few rows and a prefill's many
        for layout in ("row-major", "panels"):
            a, w, operand = _operands(m, 96, 130, layout)
            _assert_float32_product(blas.matmul(a, operand), a, w)
    assert len(calls) == 4
    blas.matmul(a.astype(np.float32), w)  # float32 activations: the widening path, not rounded to bfloat16
    blas.matmul(a, w, out=np.empty((200, 130), np.float64))
    assert len(calls) == 4


@pytest.mark.parametrize("layout", ["row-major", "transposed view"])
def test_forced_fallback_keeps_the_widening_path(monkeypatch, layout):
    """Without the instruction ``takes`` answers False and blas gives the same product through
    ``kernels.small_m`` or its blockwise widening."""
    monkeypatch.setattr(bf16_dot, "AVAILABLE", False)
    for m in (3, 200):
        a, w, _ = _operands(m, 301, 517, layout)
        assert not bf16_dot.takes(a, w)
        _assert_float32_product(blas.matmul(a, w), a, w)
