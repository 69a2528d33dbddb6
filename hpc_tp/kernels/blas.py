"""Matrix products of the linear layers: Intel MKL's GEMM where it is installed, numpy's otherwise.

numpy's wheels carry OpenBLAS. On this project's CPU (AVX-512) MKL's single-threaded sgemm runs
the W1 shapes 10-18% faster (174-195 against 153-167 GFLOP/s), and the matrix
products are ~80% of a CPU step. ``pip install 'hpc_tp[mkl]'`` (the ``mkl`` wheel) or a site MKL
on the library path (an HPC module's ``libmkl_rt``) is found at import; ``HPC_TP_BLAS=numpy``
turns it off (an A/B, or a site that must use its own BLAS).

``matmul(a, b, out, accumulate)`` is ``out[...] = a @ b`` or ``out += a @ b`` for 2-D arrays: MKL
reads a transposed view as it is (no copy) and accumulates with beta = 1, so a weight gradient is
summed into its buffer without a temporary. Anything MKL cannot take as it is (other dtypes,
strided views, small products where numpy's call is cheaper) goes to numpy, which gives the same
product to rounding; cupy arrays go to cuBLAS (``kernels.cublas``).

Threads: MKL's OpenMP layer reads ``MKL_NUM_THREADS`` or ``OMP_NUM_THREADS`` as OpenBLAS reads
``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS`` (the Makefile and the tests set 1: ranks share the
cores), and threadpoolctl limits both (``hpc-tp bench --threads``). At one thread it runs as fast
as MKL's sequential layer (13.5-13.9 ms for [1024,768] @ [768,1536], either way).
"""

from __future__ import annotations

import numpy

from ..backend import xp_of
from . import bf16_dot, cublas, f32_dot, mkl_jit, small_m, threads
from .mkl import GEMMS, LIBRARY, NO_TRANS, ROW_MAJOR, TRANS

BACKEND = "mkl" if LIBRARY is not None else "numpy"

# Below this many multiply-adds numpy's own call costs less than the ctypes one (64x256x64: numpy 117-124
# GFLOP/s, MKL 89-111; 256x64x256 and up: MKL ahead).
MIN_MACS = 1 << 21
# A few rows times a matrix larger than the caches (decoding: a batch of tokens against the LM head):
# MKL packs the whole of b for them, so b travels from memory three times. Blocks of b's columns
# small enough to pack in L2 read it once: W1's head [8, 768] @ [768, 50304] 37 -> 21 ms. Smaller
# weights stay whole (they pack in cache, and blocking made them slower).
FEW_ROWS, LARGE_OPERAND, COLUMN_BLOCK = 32, 32 << 20, 256
# At 2 threads or more, products with a small left operand (prefill's: MKL packs it again for each
# block) go by the same column blocks, whole blocks on each thread and MKL sequential in each: at 93
# rows MKL's own split spent 12-16% more CPU time than one thread, the blocks at most 7%; at 1024 rows
# the two were even (docs/performance.md). The same bits at any count above one.
THREADED_LEFT = 1 << 21
_INT_LIMIT = 2**31  # MKL's 32-bit integer interface (LP64): larger sizes go to numpy


def backend_for(dtype) -> str:
    """Which library multiplies ``dtype`` arrays on the CPU: MKL has float32/float64 GEMMs only."""
    return "mkl" if numpy.dtype(dtype) in GEMMS else "numpy"


def _operand(x, itemsize: int):
    """(transpose flag, leading dimension) for a row-major matrix or a transposed view of one; None otherwise."""
    rows, cols = x.shape
    row_stride, col_stride = x.strides
    if col_stride == itemsize and row_stride % itemsize == 0 and row_stride >= cols * itemsize:
        return NO_TRANS, row_stride // itemsize
    if row_stride == itemsize and col_stride % itemsize == 0 and col_stride >= rows * itemsize:
        return TRANS, col_stride // itemsize
    return None


def _mkl_gemm(a, b, out, beta: float) -> bool:
    """C = a @ b + beta C through MKL when every operand can be passed as it is; False otherwise."""
    kernel = GEMMS.get(a.dtype)
    if kernel is None or not (
        isinstance(a, numpy.ndarray) and isinstance(b, numpy.ndarray) and isinstance(out, numpy.ndarray)
    ):
        return False
    if a.ndim != 2 or b.ndim != 2 or b.dtype != a.dtype or out.dtype != a.dtype or not out.flags.writeable:
        return False
    if not (a.flags.aligned and b.flags.aligned and out.flags.aligned):
        return False
    (m, k), n = a.shape, b.shape[1]
    if b.shape[0] != k or out.shape != (m, n) or m * k * n < MIN_MACS or min(m, k, n) < 2:
        return False
    itemsize = a.itemsize
    left, right, target = _operand(a, itemsize), _operand(b, itemsize), _operand(out, itemsize)
    if left is None or right is None or target is None or target[0] != NO_TRANS:
        return False
    if max(m, n, k, left[1], right[1], target[1]) >= _INT_LIMIT:
        return False
    if numpy.may_share_memory(out, a) or numpy.may_share_memory(out, b):
        return False
    if (m <= FEW_ROWS and b.nbytes >= LARGE_OPERAND) or (threads.COUNT > 1 and m * k <= THREADED_LEFT):
        if mkl_jit.AVAILABLE:
            # b's column j starts j elements in (row-major) or j rows in (a transposed view).
            step = right[1] if right[0] == TRANS else 1
            mkl_jit.column_blocks(
                left[0], right[0], m, n, k, a, left[1], b, right[1], step, beta, out, target[1], COLUMN_BLOCK
            )
            return True
    kernel(
        ROW_MAJOR,
        left[0],
        right[0],
        m,
        n,
        k,
        1.0,
        a.ctypes.data,
        left[1],
        b.ctypes.data,
        right[1],
        beta,
        out.ctypes.data,
        target[1],
    )
    return True


def _device_matmul(a, b, out, accumulate: bool):
    """``matmul`` for cupy arrays: one dtype per product (numpy's promotion of the two), through
    cuBLAS directly (``kernels.cublas``): cupy's matmul has no bfloat16 GEMM, would round a half product
    before it is summed into a float32 ``out``, needs a temporary to accumulate, and plans every
    call anew in Python where ``cublas`` keeps the plan of each layout it has seen."""
    xp = xp_of(a)
    dtype = a.dtype
    if b.dtype != dtype:
        dtype = numpy.result_type(a.dtype, b.dtype)
        a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
    if cublas.cuda_type(dtype) is None or a.ndim < 2 or b.ndim < 2:  # integers, vectors: cupy's own
        product = xp.matmul(a, b)
    elif out is not None and (out.dtype == dtype or (out.dtype == numpy.float32 and dtype.itemsize == 2)):
        return cublas.gemm(a, b, out, accumulate)
    else:
        lead = numpy.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        product = cublas.gemm(a, b, xp.empty(lead + (a.shape[-2], b.shape[-1]), dtype))
    if out is None:
        return product
    if accumulate:
        out += product
    else:
        out[...] = product
    return out


def matmul(a, b, out=None, accumulate: bool = False):
    """``a @ b`` into ``out`` when given (``out += a @ b`` with ``accumulate``): 2-D arrays, or batches
    of matrices over broadcast leading dims (attention's heads). MKL takes the 2-D host products it
    can, cuBLAS or cupy the device ones (``_device_matmul``), numpy the rest; ``kernels.bf16_dot``
    bfloat16 by bfloat16 where the CPU has AVX512_BF16, ``kernels.f32_dot`` float32 few-row ones
    against a weight where it has AVX-512, ``kernels.small_m`` the other few-row ones and those with
    a half-precision weight (float32 sums)."""
    if xp_of(a) is not numpy:
        return _device_matmul(a, b, out, accumulate)
    if bf16_dot.takes(a, b, out):
        return bf16_dot.matmul(a, b, out, accumulate)
    if f32_dot.takes(a, b, out):
        return f32_dot.matmul(a, b, out, accumulate)
    # -- few rows against a weight (decoding), and half-precision weights: ``kernels.small_m`` --
    if not accumulate and small_m.takes(a, b, out):
        return small_m.matmul(a, b, out)
    if (
        small_m.half_kind(b.dtype) != small_m.FULL
        and a.ndim == b.ndim == 2
        and (out is None or out.dtype == numpy.float32)
    ):
        return widened_matmul(a, b, out, accumulate)
    # --
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs out")
        if not (a.dtype in GEMMS and a.dtype == b.dtype and a.ndim == b.ndim == 2):
            return a @ b
        out = numpy.empty((a.shape[0], b.shape[1]), a.dtype)
    if _mkl_gemm(a, b, out, 1.0 if accumulate else 0.0):
        return out
    if accumulate:
        out += a @ b
    elif a.dtype == b.dtype == out.dtype:
        xp_of(a).matmul(a, b, out=out)
    else:
        out[...] = a @ b
    return out


def widened_matmul(a, b, out=None, accumulate: bool = False, block_bytes: int = 4 << 20):
    """``a @ b`` for a half-precision ``b`` with many rows (prefill) or without numba: ``b`` is widened
    to float32 a block at a time (``block_bytes`` of float32; blocks of its rows, or of its columns
    when it is a transposed view) and each block's product is summed by BLAS, so no float32 copy of
    the whole weight is made. Returns float32."""
    k, n = b.shape
    if out is None:
        out = numpy.zeros((a.shape[0], n), numpy.float32)
    elif not accumulate:
        out[...] = 0
    a = a.astype(numpy.float32, copy=False)
    if small_m.layout(b) == "transposed":  # b's columns are the stored rows: widen runs of them
        step = max(1, block_bytes // (4 * k))
        for start in range(0, n, step):
            stop = min(n, start + step)
            matmul(a, b[:, start:stop].astype(numpy.float32), out=out[:, start:stop], accumulate=True)
        return out
    step = max(1, block_bytes // (4 * n))
    return matmul_by_row_blocks(a, lambda start, stop: b[start:stop].astype(numpy.float32), k, step, out)


def matmul_by_row_blocks(a, rows, k: int, step: int, out):
    """``out += a @ B`` for B [k, n] handed over ``step`` of its rows at a time as floats by
    ``rows(start, stop)`` (widened or dequantized): one block's float copy at a time, never the whole
    weight's, and each block's product summed by BLAS (or cuBLAS)."""
    for start in range(0, k, step):
        stop = min(k, start + step)
        matmul(a[:, start:stop], rows(start, stop), out=out, accumulate=True)
    return out
