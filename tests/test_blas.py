"""kernels.blas: the linear layers' GEMM (MKL where installed) gives numpy's product for every operand
layout it accepts, accumulates into the buffer, and hands everything else to numpy; few rows against a
large matrix go by column blocks, split over threads without changing a bit."""

import subprocess
import sys

import numpy as np
import pytest
from test_threads import thread_count as thread_count  # noqa: F401, PLC0414 (the fixture, used by its name)

from hpc_tp.kernels import blas, f32_dot, mkl_jit

rng = np.random.default_rng(0)
M, K, N = 96, 160, 144  # 2.2M multiply-adds: above MIN_MACS, so MKL takes it where installed


def _layouts(m, k, dtype):
    """[m, k] stored row-major, and as the transposed view of a [k, m] row-major array."""
    x = rng.standard_normal((m, k)).astype(dtype)
    return {"row-major": x, "transposed view": np.ascontiguousarray(x.T).T}


@pytest.mark.parametrize("dtype, tol", [("float64", 1e-12), ("float32", 2e-5)])
@pytest.mark.parametrize("a_layout", ["row-major", "transposed view"])
@pytest.mark.parametrize("b_layout", ["row-major", "transposed view"])
@pytest.mark.parametrize("count", [1, 2], ids=["1 thread", "2 threads: by column blocks"])
def test_matches_numpy_for_every_operand_layout(dtype, tol, a_layout, b_layout, count, thread_count):
    thread_count(count)
    a, b = _layouts(M, K, dtype)[a_layout], _layouts(K, N, dtype)[b_layout]
    expected = a.astype("float64") @ b.astype("float64")
    scale = np.abs(expected).max()
    got = blas.matmul(a, b)
    assert got.dtype == np.dtype(dtype) and got.shape == (M, N)
    assert np.abs(got - expected).max() <= tol * scale
    # Into a strided destination (a column block of a wider buffer), then accumulated on top of it.
    wide = np.full((M, N + 8), 3.0, dtype)
    blas.matmul(a, b, out=wide[:, 4 : N + 4])
    assert np.abs(wide[:, 4 : N + 4] - expected).max() <= tol * scale and (wide[:, :4] == 3).all()
    blas.matmul(a, b, out=wide[:, 4 : N + 4], accumulate=True)
    assert np.abs(wide[:, 4 : N + 4] - 2 * expected).max() <= 2 * tol * scale and (wide[:, N + 4 :] == 3).all()


@pytest.mark.parametrize("view", ["row-strided", "offset", "transposed slice", "Fortran order"])
def test_views_passed_as_they_are(view):
    """Views BLAS can read in place (a leading dimension, a transpose flag) give numpy's product."""
    wide = rng.standard_normal((2 * M + 3, K + 5))
    a = {
        "row-strided": wide[::2, :K],
        "offset": wide[3 : M + 3, 5:],
        "transposed slice": wide[:K, 1 : M + 1].T,
        "Fortran order": np.asfortranarray(wide[:M, :K]),
    }[view]
    b = rng.standard_normal((K, N))
    np.testing.assert_allclose(blas.matmul(a, b), a @ b, rtol=1e-12, atol=1e-12)


def test_weight_gradient_is_summed_into_its_buffer():
    x, dy = rng.standard_normal((256, 64)), rng.standard_normal((256, 192))
    grad = rng.standard_normal((64, 192))
    expected = grad + x.T @ dy
    assert blas.matmul(x.T, dy, out=grad, accumulate=True) is grad
    np.testing.assert_allclose(grad, expected, rtol=1e-12, atol=1e-12)


def _count_mkl_calls(monkeypatch):
    """The MKL GEMM calls made from here on, as (m, n, k); none where MKL is not installed. Few-row
    float32 products stay with MKL (not ``kernels.f32_dot``) for these tests."""
    monkeypatch.setattr(f32_dot, "AVAILABLE", False)
    calls = []
    for dtype, kernel in list(blas.GEMMS.items()):
        monkeypatch.setitem(blas.GEMMS, dtype, lambda *args, kernel=kernel: (calls.append(args[3:6]), kernel(*args)))
    return calls


@pytest.mark.parametrize("case", ["small", "int", "mixed dtypes", "out overlaps input", "3-D", "strided columns"])
def test_what_mkl_cannot_take_goes_to_numpy(case, monkeypatch):
    calls = _count_mkl_calls(monkeypatch)
    a, b = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    out = None
    if case == "small":
        a, b = a[:8, :8].copy(), b[:8, :8].copy()
    elif case == "int":
        a, b = (a * 10).astype(np.int64), (b * 10).astype(np.int64)
    elif case == "mixed dtypes":
        b = b.astype(np.float32)
    elif case == "3-D":
        a = a.reshape(2, M // 2, K)
    elif case == "strided columns":
        a = rng.standard_normal((M, 2 * K))[:, ::2]
    elif case == "out overlaps input":
        a = b = out = rng.standard_normal((K, K))
    expected = a @ b
    got = blas.matmul(a, b.copy() if out is not None else b, out=out)
    assert got.dtype == expected.dtype and calls == []
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_accumulate_needs_a_destination():
    with pytest.raises(ValueError, match="accumulate needs out"):
        blas.matmul(np.ones((2, 2)), np.ones((2, 2)), accumulate=True)


@pytest.mark.skipif(blas.BACKEND != "mkl", reason="MKL is not installed here (pip install 'hpc_tp[mkl]')")
def test_mkl_does_the_large_products(monkeypatch):
    calls = _count_mkl_calls(monkeypatch)
    a, b = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    np.testing.assert_allclose(blas.matmul(a.T.copy().T, b), a @ b, rtol=1e-12)
    blas.matmul(a[:8, :8], b[:8, :8])  # below MIN_MACS: numpy's
    assert calls == [(M, N, K)]
    assert blas.backend_for("float32") == blas.backend_for("float64") == "mkl" != blas.backend_for("float16")


@pytest.mark.skipif(not mkl_jit.AVAILABLE, reason="needs MKL and numba")
@pytest.mark.parametrize("dtype, tol", [("float64", 1e-12), ("float32", 2e-5)])
@pytest.mark.parametrize("b_layout", ["row-major", "transposed view"])
def test_few_rows_against_a_large_matrix_go_by_column_blocks(dtype, tol, b_layout, monkeypatch):
    """The decode path (a few rows times a matrix past the caches) in column blocks, the last one
    short, into a strided destination and accumulated, with the size threshold lowered to a test's."""
    m, k, n = blas.FEW_ROWS, 256, 2 * blas.COLUMN_BLOCK + 48  # above MIN_MACS; blocks of 256, 256 and 48
    monkeypatch.setattr(blas, "LARGE_OPERAND", k * n)
    calls = _count_mkl_calls(monkeypatch)
    blocked = _record_column_blocks(monkeypatch)
    a, b = rng.standard_normal((m, k)).astype(dtype), _layouts(k, n, dtype)[b_layout]
    expected = a.astype("float64") @ b.astype("float64")
    scale = np.abs(expected).max()
    wide = np.full((m, n + 8), 3.0, dtype)
    blas.matmul(a, b, out=wide[:, 4 : n + 4])
    blas.matmul(a, b, out=wide[:, 4 : n + 4], accumulate=True)
    assert np.abs(wide[:, 4 : n + 4] - 2 * expected).max() <= 2 * tol * scale
    assert (wide[:, :4] == 3).all() and (wide[:, n + 4 :] == 3).all()
    blas.matmul(rng.standard_normal((m + 1, k)).astype(dtype), b)  # more rows: one whole call
    assert blocked == [(m, n, k)] * 2 and calls == [(m + 1, n, k)]


@pytest.mark.skipif(not mkl_jit.AVAILABLE, reason="needs MKL and numba")
@pytest.mark.parametrize("m", [3, 96], ids=["few rows, a large matrix", "prefill's rows"])
@pytest.mark.parametrize("b_layout", ["row-major", "transposed view"])
def test_column_blocks_split_over_threads_without_changing_a_bit(m, b_layout, monkeypatch, thread_count):
    """Each thread a range of whole column blocks (5 blocks, the last one short, over 2 and 3
    threads), each block one sequential MKL call: the same bits at 2 and 3 threads, and at 1 where
    few rows against a large matrix go by blocks there too (prefill's rows go whole at 1 thread)."""
    k, n = 768, 4 * blas.COLUMN_BLOCK + 48  # above MIN_MACS; 3 rows are fewer than small_m takes
    monkeypatch.setattr(blas, "LARGE_OPERAND", k * n)
    blocked = _record_column_blocks(monkeypatch)
    # float64: float32's few rows go to f32_dot where the CPU has AVX-512
    a, b = rng.standard_normal((m, k)), _layouts(k, n, "float64")[b_layout]
    results = []
    for count in (1, 2, 3):
        thread_count(count)
        results.append(blas.matmul(a, b))
    few = m <= blas.FEW_ROWS
    assert blocked == [(m, n, k)] * (3 if few else 2)
    assert all(np.array_equal(results[1], result) for result in results[0 if few else 2 :])
    assert np.abs(results[0] - a @ b).max() <= 1e-12 * np.abs(results[0]).max()
    assert np.abs(results[1] - results[0]).max() <= 1e-12 * np.abs(results[0]).max()


def _record_column_blocks(monkeypatch):
    """A list that gets (m, n, k) of every product that goes by column blocks."""
    blocked = []
    monkeypatch.setattr(
        mkl_jit,
        "column_blocks",
        lambda *args, column_blocks=mkl_jit.column_blocks: (blocked.append(args[2:5]), column_blocks(*args))[1],
    )
    return blocked


def _backend_in_subprocess(value):
    code = "from hpc_tp.kernels import blas; print(blas.BACKEND)"
    return subprocess.run(
        [sys.executable, "-c", code], env={"HPC_TP_BLAS": value, "PATH": ""}, capture_output=True, text=True
    )


def test_environment_switch():
    result = _backend_in_subprocess("numpy")
    assert result.returncode == 0 and result.stdout.strip() == "numpy"
    # MKL's 64-bit integer layer, asked for by the environment, is overridden (it would crash the 32-bit calls).
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import numpy as np; from hpc_tp.kernels import blas; a = np.ones((256, 256)); "
            "assert (blas.matmul(a, a) == 256).all(); print(blas.BACKEND)",
        ],
        env={"MKL_INTERFACE_LAYER": "ILP64", "PATH": ""},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    result = _backend_in_subprocess("openblas")
    assert result.returncode != 0 and "HPC_TP_BLAS='openblas': expected 'mkl'" in result.stderr
