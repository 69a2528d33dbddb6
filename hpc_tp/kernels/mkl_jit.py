"""MKL's GEMM, vector exp and per-thread thread count, callable from numba kernels (``cpu_attention``,
and ``blas``'s few-row products).

A kernel that multiplies small tiles pays a Python call, a ctypes call and numpy's checks per tile
when it runs from Python; from inside one numba loop it pays only MKL's own call. The symbols are
bound by name (llvmlite loads the libmkl_rt ``kernels.mkl`` opened into the JIT's symbol table and numba calls
an ``ExternalFunction``) rather than by a ctypes address baked into the machine code, so the
kernels that use them stay cacheable on disk like the rest of ``cpu_kernels``.

``gemm`` takes arrays and element offsets into them (the tile's first element), so a kernel can
address any row-major tile of a strided view; numba picks the single or double precision routine
from the output array's dtype when it compiles. Row-major, and the same integer layer (LP64) that
``kernels.mkl`` sets at load.

``local_threads(1)`` makes MKL sequential on the calling thread only: a kernel that calls MKL per small
tile, or runs its tiles on threads of its own, would otherwise open MKL's OpenMP region (and wake its
sleeping threads) for every tile. It returns the count it replaces (0: the process's), which the
kernel gives back when it is done.

``AVAILABLE`` is False without numba, without MKL (``HPC_TP_BLAS=numpy`` included) or with
``HPC_TP_CPU_KERNELS=0``; callers then take their composed numpy path.
"""

from __future__ import annotations

import numpy

from . import cpu_kernels, threads
from .mkl import LIBRARY, ROW_MAJOR

AVAILABLE = cpu_kernels.ENABLED and LIBRARY is not None

if AVAILABLE:
    import llvmlite.binding
    from numba import types
    from numba.extending import overload

    llvmlite.binding.load_library_permanently(LIBRARY)
    _i32, _pointer = types.int32, types.uintp  # pointers travel as addresses: same register, same ABI

    def _gemm_symbol(name, scalar):
        return types.ExternalFunction(
            name,
            types.void(
                _i32, _i32, _i32, _i32, _i32, _i32, scalar, _pointer, _i32, _pointer, _i32, scalar, _pointer, _i32
            ),
        )

    _GEMM = {
        "float32": _gemm_symbol("cblas_sgemm", types.float32),
        "float64": _gemm_symbol("cblas_dgemm", types.float64),
    }
    _EXP = {
        "float32": types.ExternalFunction("vsExp", types.void(_i32, _pointer, _pointer)),
        "float64": types.ExternalFunction("vdExp", types.void(_i32, _pointer, _pointer)),
    }
    _THREADS_LOCAL = types.ExternalFunction("MKL_Set_Num_Threads_Local", _i32(_i32))


def gemm(trans_a, trans_b, m, n, k, alpha, a, a_at, lda, b, b_at, ldb, beta, c, c_at, ldc):
    """C = alpha op(A) op(B) + beta C on the tiles starting at elements ``a_at``, ``b_at``, ``c_at`` of
    arrays ``a``, ``b``, ``c`` (numba kernels only; the body is ``_gemm_for``'s)."""
    raise NotImplementedError("mkl_jit.gemm runs inside numba kernels only")


def exp(n, x, x_at, out, out_at):
    """out[out_at:out_at+n] = exp(x[x_at:x_at+n]) with MKL's vector exp (numba kernels only)."""
    raise NotImplementedError("mkl_jit.exp runs inside numba kernels only")


def column_blocks(trans_a, trans_b, m, n, k, a, lda, b, ldb, b_step, beta, c, ldc, block):
    """C = op(A) op(B) + beta C, ``block`` columns of B and C at a time (``b_step``: elements between
    B's columns); ``blas`` sends few-row products against a large B here. Each thread takes a range
    of whole blocks, each block one sequential MKL call: the same calls, so the same bits, at any
    thread count, and no OpenMP region opened per block."""
    args = (trans_a, trans_b, m, k, a, lda, b, ldb, b_step, beta, c, ldc, block)
    threads.run(_column_blocks, _column_blocks_over, args, threads.columns(n, block))


def local_threads(count):
    """MKL's thread count for the calling thread only (0: back to the process's); returns the count
    it replaces (numba kernels only)."""
    raise NotImplementedError("mkl_jit.local_threads runs inside numba kernels only")


if AVAILABLE:

    @cpu_kernels.numba.njit(cache=True, inline="always")
    def _address(array, at):
        """The address of element ``at`` of ``array`` (a strided view's first element plus ``at``)."""
        return array.ctypes.data + numpy.uintp(at * array.itemsize)

    @overload(gemm, jit_options={"cache": True})
    def _gemm_for(trans_a, trans_b, m, n, k, alpha, a, a_at, lda, b, b_at, ldb, beta, c, c_at, ldc):
        routine = _GEMM[c.dtype.name]

        def call(trans_a, trans_b, m, n, k, alpha, a, a_at, lda, b, b_at, ldb, beta, c, c_at, ldc):
            routine(
                ROW_MAJOR,
                trans_a,
                trans_b,
                m,
                n,
                k,
                alpha,
                _address(a, a_at),
                lda,
                _address(b, b_at),
                ldb,
                beta,
                _address(c, c_at),
                ldc,
            )

        return call

    @cpu_kernels.numba.njit(cache=True, nogil=True)
    def _column_blocks(trans_a, trans_b, m, k, a, lda, b, ldb, b_step, beta, c, ldc, block, start, stop):
        """Columns ``start`` to ``stop`` of ``column_blocks``, MKL sequential on this thread meanwhile."""
        previous = local_threads(1)
        for first in range(start, stop, block):
            gemm(
                trans_a,
                trans_b,
                m,
                min(block, stop - first),
                k,
                1.0,
                a,
                0,
                lda,
                b,
                first * b_step,
                ldb,
                beta,
                c,
                first,
                ldc,
            )
        local_threads(previous)

    @threads.parallel_jit
    def _column_blocks_over(trans_a, trans_b, m, k, a, lda, b, ldb, b_step, beta, c, ldc, block, bounds):
        for part in threads.prange(bounds.shape[0] - 1):
            _column_blocks(
                trans_a, trans_b, m, k, a, lda, b, ldb, b_step, beta, c, ldc, block, bounds[part], bounds[part + 1]
            )

    @overload(exp, jit_options={"cache": True})
    def _exp_for(n, x, x_at, out, out_at):
        routine = _EXP[out.dtype.name]

        def call(n, x, x_at, out, out_at):
            routine(n, _address(x, x_at), _address(out, out_at))

        return call

    @overload(local_threads, jit_options={"cache": True})
    def _local_threads_for(count):
        def call(count):
            return _THREADS_LOCAL(numpy.int32(count))

        return call
