"""float32 products of a few rows against a weight at the rate the weight streams from memory:
``out = a @ w`` for float32 ``a`` [M <= MAX_ROWS, K] and a float32 weight, with AVX-512 FMAs on
sums held in registers.

A decode step multiplies a few rows by every weight, so its time is the weight's bytes over the
memory's rate, if the arithmetic keeps up. ``kernels.small_m``'s numba loops keep their sums in an L1
array, loaded and stored around every four multiply-adds: they ran [8, 576] @ [576, 3072] at 8-12
GB/s, where the weights stream at ~22. Here the sums of a whole tile stay in vector registers:

* ``w`` row-major [K, N] (the linear layers): a tile of 8 rows x 32 columns (16 vectors of sums; 6 x
  64, 4 x 64, 2 x 128 or 1 x 64 for other row counts) takes one weight row's strip per step, each
  ``a[r, p]`` broadcast to every lane, so each weight element is loaded once for all of the tile's
  rows. The tiles sweep a chunk of K_CHUNK weight rows across the columns, then the next chunk. A
  tile's strip is a line or two every row, a row's length apart, which the hardware's prefetchers
  do not stream (walking down K in one tile, or asking for the lines of the tiles to its right,
  read 8-12 GB/s); so each step also asks for lines of the next chunk in the order they are stored,
  as many as it reads, and the next chunk streams in at the memory's rate while this one is summed.
* ``w`` the transposed view of a row-major [N, K] (the tied LM head ``h @ E.T``): each lane sums one
  row of ``a`` against one row of ``E`` along K, 4 x 4 (rows x vocabulary rows) vectors a tile,
  reduced to 16 sums by a tree of shuffles at the end (``vector_ir.transposed_tile``); the rows of
  ``E`` HEAD_PREFETCH_TILES tiles further are asked for as it goes.

Sums are exact FMAs in a fixed order (a column's along K in chunks, whatever the tile or the thread):
the result matches numpy's product to float32 rounding, and is the same bits at any thread count.
``AVAILABLE`` is True where numba runs and the host CPU has AVX-512 (``avx512f``), unless
``HPC_TP_F32_DOT=0``; elsewhere ``kernels.blas`` keeps ``small_m`` and BLAS. Float64 stays there too.
"""

from __future__ import annotations

import numpy

from . import cpu_kernels, small_m, threads, vector_ir

AVAILABLE = vector_ir.host_has("avx512f", "HPC_TP_F32_DOT")
# Rows it takes: up to 64 it was faster than small_m and MKL on the 135M model's shapes, but one row by
# a row-major weight stays BLAS's GEMV, which streams it faster (26 against 20 GB/s; docs/performance.md).
MAX_ROWS = 64
COLUMN_ALIGN = 64  # a thread's range of columns starts at a multiple of the widest tile
# Weight rows a tile sums in registers before it is added to ``out``: the row-major kernel sweeps
# these rows across its columns, then the next ones (8 rows by [576, 3072] from memory: 16 rows
# 0.39-0.46 ms, 32 0.34-0.37, 64 0.53-0.54 on a loaded machine).
K_CHUNK = 32
_LANES = vector_ir.LANES  # float32 lanes of a vector
# The head's kernel asks (into L2) for the rows of the tile this many tiles further while it sums its
# own: 8 rows by [576, 49152] from memory took 8.7-9.6 ms at 1 and 4 tiles, 5.7-6.3 at 16.
HEAD_PREFETCH_TILES = 16
_FLOAT32 = numpy.dtype(numpy.float32)


def takes(a, w, out=None) -> bool:
    """True when ``matmul`` computes ``a @ w`` (into ``out``) here: AVX-512 on this CPU, both operands
    2-D numpy float32, 1 to MAX_ROWS rows (2 or more for a row-major weight), a weight of ``small_m.MIN_WEIGHT`` elements or more
    (smaller ones stay in cache, where BLAS is as fast) stored row-major or as the transposed view of a
    row-major array, ``out`` None or float32 [M, N] C-contiguous apart from both."""
    return (
        AVAILABLE
        and isinstance(a, numpy.ndarray)
        and isinstance(w, numpy.ndarray)
        and a.dtype == _FLOAT32
        and w.dtype == _FLOAT32
        and a.ndim == 2
        and w.ndim == 2
        and 1 <= a.shape[0] <= MAX_ROWS
        and a.shape[1] == w.shape[0]
        and w.size >= small_m.MIN_WEIGHT
        and (w.T.flags.c_contiguous if a.shape[0] == 1 else small_m.layout(w) is not None)
        and vector_ir.fits(out, a, w)
    )


def warm_up(dtype):
    """Compile (or load from numba's cache) both kernels at the rank's thread count, for a float32
    model on an AVX-512 CPU, before a server's first request would wait for them."""
    if not AVAILABLE or numpy.dtype(dtype) != _FLOAT32:
        return
    k = 2 * COLUMN_ALIGN
    n = threads.split_columns(k * _FLOAT32.itemsize, COLUMN_ALIGN)  # more than one range: the drivers too
    a, w = numpy.ones((8, k), numpy.float32), numpy.ones((k, n), numpy.float32)
    matmul(a, w)
    matmul(a, numpy.ascontiguousarray(w.T).T)


def matmul(a, w, out=None, accumulate: bool = False, start: int = 0, stop: int | None = None):
    """``out[:, start:stop] = a @ w[:, start:stop]`` (``+=`` with ``accumulate``) for operands ``takes``
    accepts; ``out`` allocated when None; its other columns are left as they are."""
    m, n = a.shape[0], w.shape[1]
    stop = n if stop is None else stop
    if out is None:
        out = numpy.empty((m, n), numpy.float32)
    a = numpy.ascontiguousarray(a)
    split = (start, stop, COLUMN_ALIGN, w.shape[0] * _FLOAT32.itemsize)
    if w.flags.c_contiguous:
        threads.share(_rows_by_matrix, _rows_by_matrix_over, (a, w, out, accumulate), *split)
    else:
        threads.share(_rows_by_transposed, _rows_by_transposed_over, (a, w.T, out, accumulate), *split)
    return out


if AVAILABLE:
    from numba import types
    from numba.core.extending import intrinsic

    from .vector_ir import FLOATS, I64, LANES

    def _fma(builder, acc, x, y):
        """acc + x * y, lane by lane, rounded once."""
        fma = vector_ir.declare(builder, "llvm.fma.v16f32", FLOATS, [FLOATS, FLOATS, FLOATS])
        return builder.call(fma, [x, y, acc])

    @intrinsic(prefer_literal=True)
    def _matrix_tile(typingctx, a, w, out, at, rows):
        """out[r, j] += sum over p < steps of a[r, p] w[p, j] for r < ``rows`` (a literal) and j < cols
        (at most ``_tile_columns(rows)``), ``at`` = (a_at, a_pitch, w_at, w_pitch, out_at, out_pitch,
        steps, cols, ahead_at, ahead_col, span): each array from element ``*_at`` with ``*_pitch``
        elements a row. Where ``span`` > 0 each step also asks for as many lines of ``w`` as it reads
        (into L2), from element ``ahead_at`` on, a walk along rows of ``span`` elements from their column
        ``ahead_col`` (``_matrix_tiles`` points it at the lines the next chunk of K will read)."""
        count = vector_ir.literal(rows)
        if count is None:
            return None
        vector_count = _tile_columns.py_func(count) // LANES

        def codegen(context, builder, signature, args):
            fields = [builder.extract_value(args[3], i) for i in range(11)]
            a_at, a_pitch, w_at, w_pitch, out_at, out_pitch, steps, cols, ahead_at, ahead_col, span = fields
            a_data, w_base, out_data = (vector_ir.data(context, builder, signature.args[i], args[i]) for i in range(3))
            a_data, w_data, out_data = (
                builder.gep(a_data, [a_at]),
                builder.gep(w_base, [w_at]),
                builder.gep(out_data, [out_at]),
            )
            masks = [vector_ir.mask(builder, builder.sub(cols, I64(LANES * v)), LANES) for v in range(vector_count)]
            width = I64(LANES * vector_count)
            wrap = builder.sub(w_pitch, span)  # from the end of a walk's row to the start of the next

            def step(index, sums):
                row = builder.gep(w_data, [builder.mul(index, w_pitch)])
                weights = [
                    vector_ir.load(builder, builder.gep(row, [I64(LANES * v)]), lanes, FLOATS)
                    for v, lanes in enumerate(masks)
                ]
                updated = []
                for r in range(count):
                    value = builder.load(builder.gep(a_data, [builder.add(builder.mul(I64(r), a_pitch), index)]))
                    x = vector_ir.splat(builder, value, LANES)
                    updated += [_fma(builder, sums[r * vector_count + v], x, weights[v]) for v in range(vector_count)]
                return updated

            def asking(index, carried):
                """``step``, and the step's lines of the walk asked for."""
                ahead = vector_ir.ask_along(builder, w_base, *carried[-2:], vector_count, LANES, width, span, wrap)
                return step(index, carried[:-2]) + list(ahead)

            zeros = [FLOATS(None)] * (count * vector_count)
            # two loops, not a branch in one: a test in the loop made 8 rows by [576, 3072] 1.2 times as long
            with builder.if_else(builder.icmp_signed(">", span, I64(0))) as (then, otherwise):
                with then:
                    sums = vector_ir.loop(builder, steps, zeros + [ahead_at, ahead_col], asking)[:-2]
                    vector_ir.add_tile(builder, out_data, out_pitch, sums, count, cols)
                with otherwise:
                    vector_ir.add_tile(
                        builder, out_data, out_pitch, vector_ir.loop(builder, steps, zeros, step), count, cols
                    )
            return context.get_dummy_value()

        return types.void(a, w, out, at, rows), codegen

    _transposed_tile = vector_ir.transposed_tile(FLOATS, _fma, HEAD_PREFETCH_TILES, 2)


if AVAILABLE:
    _jit = cpu_kernels.numba.njit(cache=True, nogil=True)
else:  # never called: ``takes`` answers False without AVX-512

    def _jit(function):
        return function


@_jit
def _tile_columns(rows):
    """Columns of a tile of ``rows`` (``vector_ir.tile_rows``): 16 vectors of sums, 24 for 6 rows; one row's
    four vectors run four chains of FMAs (its rate is the memory's, not the FMAs')."""
    return 32 if rows == 8 else 128 if rows == 2 else 64


@_jit
def _matrix_tiles(a, r, rows, w, k0, steps, out, start, stop):
    """out[r : r + rows, start:stop] += a[r : r + rows, k0 : k0 + steps] @ w[k0 : k0 + steps, start:stop]
    in tiles of ``rows`` (8, 6, 4, 2 or 1) x ``_tile_columns`` columns, while the tiles ask for the
    lines of the next ``steps`` rows of these columns in the order they are stored (a stream the
    memory serves at its rate, where each tile's own strip is a line or two a row at a row's stride)."""
    a_pitch, n = a.shape[1], out.shape[1]
    span = stop - start
    width = _tile_columns(rows)
    for c in range(start, stop, width):
        # Only a chunk's last row tile asks for the next chunk: the two chunks then fit L2 while the
        # other row tiles read the current one from there (every tile asking: 32 rows by [576, 3072]
        # took 2.2 times as long, and every tile asking for its own lines 1.3 times).
        if r + rows == a.shape[0]:
            walk = (c - start) * steps  # this tile's share of the next chunk's elements, in storage order
            ahead_at, ahead_col, ahead_span = (k0 + steps + walk // span) * n + start + walk % span, walk % span, span
        else:
            ahead_at, ahead_col, ahead_span = 0, 0, 0
        at = (r * a_pitch + k0, a_pitch, k0 * n + c, n, r * n + c, n, steps, stop - c, ahead_at, ahead_col, ahead_span)
        if rows == 8:
            _matrix_tile(a, w, out, at, 8)
        elif rows == 6:
            _matrix_tile(a, w, out, at, 6)
        elif rows == 4:
            _matrix_tile(a, w, out, at, 4)
        elif rows == 2:
            _matrix_tile(a, w, out, at, 2)
        else:
            _matrix_tile(a, w, out, at, 1)


@_jit
def _rows_by_matrix(a, w, out, accumulate, start, stop):
    """out[:, start:stop] (+)= a @ w[:, start:stop] for ``a`` [M, K] and ``w`` [K, N] row-major."""
    m, k = a.shape
    if not accumulate:
        out[:, start:stop] = 0
    for k0 in range(0, k, K_CHUNK):
        steps = min(K_CHUNK, k - k0)
        r = 0
        while r < m:
            rows = vector_ir.tile_rows(m - r)
            _matrix_tiles(a, r, rows, w, k0, steps, out, start, stop)
            r += rows


@_jit
def _rows_by_transposed(a, e, out, accumulate, start, stop):
    """out[:, start:stop] (+)= a @ e[start:stop].T for ``a`` [M, K] and ``e`` [N, K] row-major."""
    if not accumulate:
        out[:, start:stop] = 0
    for c in range(start, stop, vector_ir.TILE):
        _transposed_tile(a, e, out, (c, min(vector_ir.TILE, stop - c)))


# The threads' drivers (``kernels.threads.share``): each range of output columns taken by the next free thread.
@threads.parallel_jit
def _rows_by_matrix_over(a, w, out, accumulate, bounds, taken):
    for _ in threads.prange(bounds.shape[0] - 1):
        part = threads.take(taken)
        while part < bounds.shape[0] - 1:
            _rows_by_matrix(a, w, out, accumulate, bounds[part], bounds[part + 1])
            part = threads.take(taken)


@threads.parallel_jit
def _rows_by_transposed_over(a, e, out, accumulate, bounds, taken):
    for _ in threads.prange(bounds.shape[0] - 1):
        part = threads.take(taken)
        while part < bounds.shape[0] - 1:
            _rows_by_transposed(a, e, out, accumulate, bounds[part], bounds[part + 1])
            part = threads.take(taken)
