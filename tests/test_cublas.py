"""The cuBLAS call's arguments (``kernels.cublas.plan`` and its cache, ``arguments``) checked without a device: an emulation of
``cublasGemmStridedBatchedEx`` reads the operands' memory as cuBLAS would (column-major, leading
dimensions, batch strides) and must give ``a @ b`` for every layout the engine passes.

The call itself runs on a GPU in tests/test_gpu.py and ``make gpu-check``."""

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from hpc_tp.kernels import cublas


def _read(x, ld, stride, rows, cols, batch):
    """``batch`` column-major rows x cols matrices as cuBLAS reads them from ``x``."""
    size = x.itemsize
    return as_strided(x, (batch, rows, cols), (stride * size, size, ld * size), writeable=False)


def emulate(g, left, right, out):
    """What cuBLAS computes for geometry ``g`` on arrays ``left`` (its A) and ``right`` (its B): the
    column-major m x n C = op(A) op(B) into ``out``, for each matrix of the batch."""
    a = _read(left, g.lda, g.stride_a, *((g.m, g.k) if g.transa == cublas.OP_N else (g.k, g.m)), g.batch)
    b = _read(right, g.ldb, g.stride_b, *((g.k, g.n) if g.transb == cublas.OP_N else (g.n, g.k)), g.batch)
    op_a = a if g.transa == cublas.OP_N else a.swapaxes(-1, -2)
    op_b = b if g.transb == cublas.OP_N else b.swapaxes(-1, -2)
    size = out.itemsize
    c = as_strided(out, (g.batch, g.m, g.n), (g.stride_c * size, size, g.ldc * size))
    c[...] = op_a @ op_b


# (a, b) from a maker of random matrices: the layouts the engine multiplies -- linear layers (row-major,
# a transposed weight or activation), attention's heads (a broadcast K/V head, transposed keys,
# query-row slices).
LAYOUTS = {
    "row-major": lambda r: (r(5, 7), r(7, 3)),
    "a transposed": lambda r: (r(7, 5).T, r(7, 3)),
    "b transposed": lambda r: (r(5, 7), r(3, 7).T),
    "both transposed": lambda r: (r(7, 5).T, r(3, 7).T),
    "column slice": lambda r: (r(5, 9)[:, 1:8], r(7, 6)[:, :3]),
    "batched": lambda r: (r(2, 3, 5, 4), r(2, 3, 4, 6)),
    "broadcast weight": lambda r: (r(2, 3, 5, 4), r(4, 6)),
    "broadcast heads": lambda r: (r(2, 3, 4, 5, 8), r(2, 3, 1, 8, 6)),
    "keys transposed": lambda r: (r(2, 3, 1, 5, 8)[..., 1:4, :], r(2, 3, 1, 9, 8).swapaxes(-1, -2)[..., :7]),
    "row of one": lambda r: (r(2, 1, 4), r(2, 4, 3)),
    "strided batch": lambda r: (r(4, 5, 3)[::2], r(4, 3, 2)[::2]),
}


def layout(name, to=np.asarray, seed=0):
    """The operands of ``LAYOUTS[name]``, their buffers made by ``to`` (cupy.asarray: on the device)."""
    rng = np.random.default_rng(seed)
    return LAYOUTS[name](lambda *shape: to(rng.standard_normal(shape)))


@pytest.mark.parametrize("name", LAYOUTS)
def test_arguments_compute_a_at_b_planned_and_from_the_cache(name, monkeypatch):
    """The first product plans; a second one on other arrays laid out alike reuses the geometry with
    its own arrays (copied where the first one's were)."""
    monkeypatch.setattr(cublas, "_GEOMETRIES", {})
    for seed in (0, 1):
        a, b = layout(name, seed=seed)
        want = a @ b
        out = np.full(want.shape, np.nan)
        emulate(*cublas.arguments(a, b, out), out)
        np.testing.assert_allclose(out, want, rtol=1e-13, atol=1e-13)
        assert len(cublas._GEOMETRIES) == 1


def test_plan_keeps_views_and_copies_only_what_cublas_cannot_step():
    a, b = layout("keys transposed")
    p = cublas.plan(a, b, np.empty((2, 3, 1, 3, 7)))
    assert p.transa == cublas.OP_T and np.shares_memory(p.a.array, b)  # transposed keys: read as they are
    assert p.transb == cublas.OP_N and np.shares_memory(p.b.array, a)
    a, b = layout("broadcast heads")
    p = cublas.plan(a, b, np.empty((2, 3, 4, 5, 6)))
    assert not np.shares_memory(p.a.array, b)  # a K/V head shared by 4 query heads: one stride cannot say it


def test_plan_refuses_mismatched_shapes_and_strided_output():
    with pytest.raises(ValueError, match=r"\(5, 7\) @ \(6, 3\)"):
        cublas.plan(np.ones((5, 7)), np.ones((6, 3)), np.empty((5, 3)))
    with pytest.raises(ValueError, match="C-contiguous"):
        cublas.plan(np.ones((5, 7)), np.ones((7, 3)), np.empty((3, 5)).T)
