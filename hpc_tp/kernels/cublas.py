"""Device matrix products through cuBLAS's ``GemmStridedBatchedEx``, for what cupy's matmul cannot do.

cupy 14.2 holds bfloat16 arrays (ml_dtypes) but its batched matmul (attention's heads) takes them
for an integer type and raises (seen on an H200). cuBLAS multiplies bfloat16 with float32 sums, and
it can also write a float32 product of half-precision inputs, so a weight gradient is summed into
its float32 buffer unrounded, or add a product into its output (beta = 1) with no temporary.
``blas`` sends device products here when one of these is asked for.

cuBLAS is column-major: a row-major C = A @ B is the column-major C^T = B^T A^T, so the operands go
in swapped and a row-major matrix needs no transpose flag. ``plan`` computes the call's arguments from
shapes and strides alone (tested on the CPU against an emulation of the call); ``gemm`` makes it.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import numpy

# CUDA's library_types.h and cublas_api.h (stable ABI values; cupy does not name them all).
CUDA_TYPE = {"float16": 2, "bfloat16": 14, "float32": 0, "float64": 1}
COMPUTE_32F, COMPUTE_64F = 68, 70
OP_N, OP_T = 0, 1
GEMM_DEFAULT = -1
_TYPE_OF: dict = {}  # dtype -> CUDA_TYPE value: ``dtype.name`` costs microseconds of Python a call


def cuda_type(dtype) -> int | None:
    """cuBLAS's code for ``dtype``; None for a dtype it has no GEMM in here."""
    try:
        return _TYPE_OF[dtype]
    except KeyError:
        return _TYPE_OF.setdefault(dtype, CUDA_TYPE.get(numpy.dtype(dtype).name))


class Operand(NamedTuple):
    array: object  # what the pointer is taken from: the caller's array, or a contiguous copy of it
    op: int  # OP_N or OP_T, as cuBLAS reads the row-major matrix
    ld: int  # leading dimension, in elements
    stride: int  # elements between consecutive matrices of the batch (0: one matrix for all)


def _batch_stride(x) -> int | None:
    """Elements between the matrices of ``x`` (2-D, or 3-D with one batch dim); None where cuBLAS
    cannot step that way (a negative or misaligned stride)."""
    if x.ndim == 2 or x.shape[0] == 1:
        return 0
    stride = x.strides[0]
    return stride // x.itemsize if stride >= 0 and stride % x.itemsize == 0 else None


def _as_operand(x, lead: tuple[int, ...], xp) -> Operand:
    """``x`` broadcast to ``lead`` batch dims, as cuBLAS can read it: a row-major matrix (OP_N), a
    transposed view of one (OP_T), else a contiguous copy."""
    x = xp.broadcast_to(x, lead + x.shape[-2:])
    if len(lead) > 1:  # a view where the batch dims merge into one stride, a copy where they do not
        x = x.reshape((-1,) + x.shape[-2:])
    rows, cols = x.shape[-2:]
    row_stride, col_stride = x.strides[-2:]
    size = x.itemsize
    batch = _batch_stride(x)
    if batch is not None and col_stride == size and row_stride % size == 0 and row_stride >= cols * size:
        return Operand(x, OP_N, max(row_stride // size, 1), batch)
    if batch is not None and row_stride == size and col_stride % size == 0 and col_stride >= rows * size:
        return Operand(x, OP_T, max(col_stride // size, 1), batch)
    x = xp.ascontiguousarray(x)
    return Operand(x, OP_N, max(cols, 1), rows * cols if x.ndim > 2 and x.shape[0] > 1 else 0)


class Plan(NamedTuple):
    """One ``cublasGemmStridedBatchedEx`` call, as cuBLAS sees it (column-major, operands swapped)."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    a: Operand  # cuBLAS's A: the caller's b
    b: Operand  # cuBLAS's B: the caller's a
    c: object  # the caller's C-contiguous output as (batch, rows, cols), written in place
    ldc: int  # cuBLAS's C is the caller's transposed: ldc is the caller's row length, m
    stride_c: int
    batch: int


def plan(a, b, out, xp=numpy) -> Plan:
    """The call computing ``out (+)= a @ b``: ``a`` [..., m, k], ``b`` [..., k, n] (batch dims broadcast),
    ``out`` [lead..., m, n] and C-contiguous."""
    lead = tuple(numpy.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    (m, k), n = a.shape[-2:], b.shape[-1]
    if b.shape[-2] != k or out.shape != lead + (m, n):
        raise ValueError(f"matmul: shapes {a.shape} @ {b.shape} -> {out.shape} do not match")
    if not out.flags.c_contiguous:
        raise ValueError("cublas.plan: the output must be C-contiguous")
    left, right = _as_operand(a, lead, xp), _as_operand(b, lead, xp)
    batch = int(numpy.prod(lead, dtype=numpy.int64))
    return Plan(right.op, left.op, n, m, k, right, left, out.reshape((batch, m, n)), n, m * n, batch)


class Geometry(NamedTuple):
    """A plan without its arrays: the same for any operands of the same shapes, strides and dtypes."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    stride_a: int
    ldb: int
    stride_b: int
    ldc: int
    stride_c: int
    batch: int


def _address(x) -> int:
    return x.data.ptr if hasattr(x.data, "ptr") else x.ctypes.data  # cupy, numpy


def _contiguous(x, lead, xp):
    """The copy ``_as_operand`` makes of an operand cuBLAS cannot step through as it is."""
    return xp.ascontiguousarray(xp.broadcast_to(x, lead + x.shape[-2:]))


# Geometry by (shapes, strides, dtypes), and whether each operand had to be copied: planning costs
# tens of microseconds of Python a product, as much as the call itself (cProfile of a W1 step on a GPU). Bounded,
# as decoding meets a new key length every step.
_GEOMETRIES: dict = {}
CACHE_LIMIT = 4096


def arguments(a, b, out, xp=numpy) -> tuple[Geometry, object, object]:
    """(geometry, cuBLAS's A array, cuBLAS's B array) for ``out (+)= a @ b``: ``plan``'s, or the
    geometry kept from an earlier product of operands laid out alike, with this product's arrays
    (copied where that one's were)."""
    key = (a.shape, a.strides, b.shape, b.strides, out.shape, a.dtype, b.dtype, out.dtype)
    if (kept := _GEOMETRIES.get(key)) is not None:
        geometry, lead, copy_a, copy_b = kept
        return (geometry, _contiguous(b, lead, xp) if copy_b else b, _contiguous(a, lead, xp) if copy_a else a)
    p = plan(a, b, out, xp)
    geometry = Geometry(
        p.transa, p.transb, p.m, p.n, p.k, p.a.ld, p.a.stride, p.b.ld, p.b.stride, p.ldc, p.stride_c, p.batch
    )
    if len(_GEOMETRIES) >= CACHE_LIMIT:
        _GEOMETRIES.clear()
    # A view of an operand starts at the operand's first element; a copy elsewhere.
    lead = tuple(numpy.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    _GEOMETRIES[key] = (geometry, lead, _address(p.b.array) != _address(a), _address(p.a.array) != _address(b))
    return geometry, p.a.array, p.b.array


_FLOAT32 = numpy.dtype("float32")
# alpha and beta as cuBLAS reads them (host pointers), by compute type.
_SCALARS = {
    compute: {value: numpy.array(value, dtype=dtype) for value in (0.0, 1.0)}
    for compute, dtype in ((COMPUTE_32F, numpy.float32), (COMPUTE_64F, numpy.float64))
}


@functools.cache
def _library():
    """(GemmStridedBatchedEx, SetStream) of the cuBLAS cupy loaded, called through ctypes: cupy 14's
    own wrappers refuse any cuBLAS call while a stream is being captured into a CUDA graph
    (``serve.decoding``), which cuBLAS itself supports."""
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    cupy.cuda.device.get_cublas_handle()  # cupy loads its cuBLAS with the first handle
    with open("/proc/self/maps") as maps:
        path = next(
            (line.split()[-1] for line in maps if line.split()[-1].rpartition("/")[2].startswith("libcublas.so")), None
        )
    if path is None:
        raise RuntimeError("cupy created a cuBLAS handle, yet no libcublas.so is mapped in this process")
    library = ctypes.CDLL(path)
    gemm = library.cublasGemmStridedBatchedEx
    i, p, n = ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong
    gemm.argtypes = [p, i, i, i, i, i, p, p, i, i, n, p, i, i, n, p, p, i, i, n, i, i, i]
    set_stream = library.cublasSetStream_v2
    set_stream.argtypes = [p, p]
    return gemm, set_stream


def gemm(a, b, out, accumulate: bool = False):
    """``out[...] = a @ b`` (``out += a @ b`` with ``accumulate``) on the current stream. ``a`` and ``b``
    share one dtype; ``out`` has it or float32 (half inputs, float32 sums). Returns ``out``."""
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    if a.dtype != b.dtype or out.dtype not in (a.dtype, _FLOAT32):
        raise TypeError(f"cublas.gemm: {a.dtype} @ {b.dtype} into {out.dtype} is not a product cuBLAS has here")
    target = out if out.flags.c_contiguous else cupy.empty(out.shape, out.dtype)
    if accumulate and target is not out:
        target[...] = out
    g, left, right = arguments(a, b, target, cupy)
    if g.batch and g.m and g.n:
        compute = COMPUTE_64F if a.dtype == numpy.float64 else COMPUTE_32F
        if g.k == 0:  # an empty sum: cuBLAS is not asked to scale C by beta
            if not accumulate:
                target[...] = 0
        else:
            scalars, (call, set_stream) = _SCALARS[compute], _library()
            handle = cupy.cuda.device.get_cublas_handle()
            set_stream(handle, cupy.cuda.get_current_stream().ptr)
            status = call(
                handle,
                g.transa,
                g.transb,
                g.m,
                g.n,
                g.k,
                scalars[1.0].ctypes.data,
                left.data.ptr,
                cuda_type(a.dtype),
                g.lda,
                g.stride_a,
                right.data.ptr,
                cuda_type(b.dtype),
                g.ldb,
                g.stride_b,
                scalars[1.0 if accumulate else 0.0].ctypes.data,
                target.data.ptr,
                cuda_type(out.dtype),
                g.ldc,
                g.stride_c,
                g.batch,
                compute,
                GEMM_DEFAULT,
            )
            if status:
                raise RuntimeError(f"cublasGemmStridedBatchedEx returned status {status} for {a.shape} @ {b.shape}")
    if target is not out:
        out[...] = target
    return out
