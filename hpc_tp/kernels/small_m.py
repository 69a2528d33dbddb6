"""Products of a few rows against a weight (decoding): ``out = a @ w`` for ``a`` [M <= 64, K], each
weight element read from memory once for all M rows.

A decode step multiplies one row per sequence by every weight: a few flops per weight byte, so the
step runs at the speed weights stream from memory. MKL's GEMM packs ``w`` into blocks before it
multiplies; for a few rows that packing is the work, and [8, 576] @ [576, 3072] took 1.11 ms
against 0.17 ms for one row. The kernels here read ``w`` as it is stored:

* ``w`` row-major [K, N] (the linear layers' weights): a block of output columns is accumulated in
  cache over the rows of ``w``, four at a time, so each weight row segment is used by every
  input row while it is in L1;
* ``w`` a transposed view of a row-major [N, K] (the tied LM head ``h @ E.T``): four rows of ``E``
  at a time, each dotted with every input row (``a`` stays in L1).

Weights may also be kept in half precision (``bfloat16`` from ml_dtypes, or ``float16``): the
kernel widens each group of weight rows to float32 in cache as it reads them (a bfloat16 is the
upper half of a float32; a float16 is rebuilt from its bits, subnormals and inf included), so
memory holds and moves half the bytes and every sum runs in float32. Sums run in the output's
precision (float32, or float64 for float64 weights), in another order than BLAS's: the result
matches numpy's product to rounding.

Weights kept quantized (``kernels.quantized``: 8-bit codes, or 4-bit codes two a byte, with a
float32 scale, and for 4 bits a minimum, per group of QUANT_ROWS weight rows and column) are read the
same way by ``_rows_by_quantized``: the codes are widened in registers and summed per group, each
group's sums scaled once per column (``quantized_matmul``), so memory moves one byte (or half of one)
per weight and no float copy of a weight row is written.

Threads (``kernels.threads``): each product's output columns (the head's vocabulary rows) are cut into
one range a thread, each column summed in the same order at any count.

Without numba (or with ``HPC_TP_CPU_KERNELS=0``) ``takes`` answers False and ``kernels.blas`` keeps its
BLAS path (half weights: ``blas.widened_matmul``). bfloat16 activations by bfloat16 weights go to
``kernels.bf16_dot`` instead where the CPU has AVX512_BF16, and float32 ones to ``kernels.f32_dot``
where it has AVX-512 (``blas.matmul`` asks them first).
"""

from __future__ import annotations

import numpy

from . import cpu_kernels, threads

# Rows it takes: for float32/float64 weights MKL's GEMV is as fast for one row and its GEMM for many
# (the ranges are where these kernels were faster, measured on the 135M model's shapes); half weights
# have no BLAS, so these kernels take every product up to MAX_ROWS rows.
MIN_FULL_ROWS, MAX_FULL_ROWS, MAX_ROWS = 4, 32, 64
# Weights smaller than this (elements) stay in cache between calls: BLAS's product is as fast.
MIN_WEIGHT = 1 << 15
TILE_ROWS = 4  # input rows per pass (the rows past the last whole tile: one per pass)
GROUP = 4  # weight rows (row-major) or columns (transposed) per pass: 4 products per accumulator load
FULL, BF16, F16 = 0, 1, 2
QUANT_ROWS = 32  # weight rows sharing a scale (and a minimum): GGUF's block; a multiple of GROUP
# A thread's columns, and every block of them but the last, start at a multiple of this (AVX-512's 16
# float32 lanes, unrolled 4 times), so that a column is summed by the same vector code whatever the
# thread count (tests/test_small_m.py checks the bits).
COLUMN_ALIGN = 64
_F16_SCALE = numpy.float32(2.0**112)  # moves a float16 exponent (bias 15) to float32's (bias 127)
_NO_BITS = numpy.empty(0, numpy.uint16)  # the operand a kernel call does not use
_NO_FLOATS = numpy.empty(0, numpy.float32)


def _half_kinds() -> dict:
    kinds = {numpy.dtype("float16"): F16}
    try:
        import ml_dtypes
    except ImportError:  # no bfloat16 arrays without it
        return kinds
    kinds[numpy.dtype(ml_dtypes.bfloat16)] = BF16
    return kinds


# By dtype object: a dtype's ``name`` is computed in Python, and this is asked on every product.
_HALF_KINDS = _half_kinds()


def half_kind(dtype) -> int:
    """FULL for float32/float64 weights, BF16 or F16 for the half types (kept as their bits)."""
    return _HALF_KINDS.get(dtype, FULL)


def result_dtype(b_dtype):
    """The dtype of ``a @ b`` here: float32 for half weights (sums in float32), else ``b``'s own."""
    return numpy.dtype("float32") if half_kind(b_dtype) != FULL else numpy.dtype(b_dtype)


def layout(b):
    """ "rows" for a row-major [K, N], "transposed" for the transposed view of a row-major [N, K], else None."""
    if b.flags.c_contiguous:
        return "rows"
    if b.T.flags.c_contiguous:
        return "transposed"
    return None


def takes(a, b, out=None) -> bool:
    """True when the few-row kernels compute ``a @ b`` (into ``out``): numpy 2-D operands, a number
    of rows in the ranges above, a weight of MIN_WEIGHT elements or more stored whole (row-major, or
    a transposed view of one), float32/float64 (``a`` of ``b``'s dtype) or half weights."""
    if not cpu_kernels.ENABLED or not (isinstance(a, numpy.ndarray) and isinstance(b, numpy.ndarray)):
        return False
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or b.size < MIN_WEIGHT:
        return False
    if half_kind(b.dtype) == FULL:
        if b.dtype not in cpu_kernels.DTYPES or a.dtype != b.dtype or not MIN_FULL_ROWS <= a.shape[0] <= MAX_FULL_ROWS:
            return False
    elif a.dtype.kind not in "fV" or a.shape[0] > MAX_ROWS:
        return False
    if out is not None and (
        out.dtype != result_dtype(b.dtype) or not out.flags.c_contiguous or out.shape != (a.shape[0], b.shape[1])
    ):
        return False
    return layout(b) is not None


def _operand_rows(a, dtype):
    """``a`` as the kernels read it: C-contiguous ``dtype``, columns zero-padded to whole groups
    (and half activations widened): M x K elements, small."""
    if a.shape[1] % GROUP or a.dtype != dtype or not a.flags.c_contiguous:
        padded = numpy.zeros((a.shape[0], -(-a.shape[1] // GROUP) * GROUP), dtype)
        padded[:, : a.shape[1]] = a
        a = padded
    return a


def matmul(a, b, out=None):
    """``a @ b`` into ``out`` (allocated when None) for operands ``takes`` accepts."""
    kind = half_kind(b.dtype)
    dtype = result_dtype(b.dtype)
    if out is None:
        out = numpy.empty((a.shape[0], b.shape[1]), dtype)
    a = _operand_rows(a, dtype)
    stored = b if layout(b) == "rows" else b.T
    flat = stored.reshape(-1)
    weight, bits = (flat, _NO_BITS) if kind == FULL else (_NO_FLOATS, flat.view(numpy.uint16))
    args = (a, weight, bits, kind, dtype.type(0), out)
    if stored is b:  # whole output columns to each thread, in blocks of a vector's multiple
        threads.run(_rows_by_matrix, _rows_by_matrix_over, args, threads.columns(out.shape[1], COLUMN_ALIGN))
    else:  # whole groups of vocabulary rows
        threads.run(_rows_by_transposed, _rows_by_transposed_over, args, threads.columns(out.shape[1], GROUP))
    return out


def takes_quantized(a) -> bool:
    """True when ``quantized_matmul`` takes ``a`` (a numpy 2-D float operand of at most MAX_ROWS rows)."""
    return (
        cpu_kernels.ENABLED
        and isinstance(a, numpy.ndarray)
        and a.ndim == 2
        and a.shape[0] <= MAX_ROWS
        and a.dtype.kind in "fV"
    )


def quantized_matmul(a, codes, scales, lows, dtype):
    """``a @ W`` for W [K, N] kept quantized (``kernels.quantized.QuantizedMatrix``'s arrays: ``codes``
    int8 [K, N] or, for 4 bits, uint8 [K/2, N]; ``scales`` and ``lows`` float32 [K/QUANT_ROWS, N],
    ``lows`` empty for 8 bits), as ``dtype`` (float32 or float64) sums; K a multiple of QUANT_ROWS."""
    out = numpy.empty((a.shape[0], codes.shape[1]), dtype)
    args = (_operand_rows(a, dtype), codes.reshape(-1), scales, lows, dtype.type(0), out)
    threads.run(_rows_by_quantized, _rows_by_quantized_over, args, threads.columns(out.shape[1], COLUMN_ALIGN))
    return out


def warm_up(weight_dtype):
    """Compile (or load from numba's cache) the float kernels here for weights of ``weight_dtype``, at
    the rank's thread count: a server calls it before its first request, which would otherwise wait for
    it (about half a second a kernel loaded from the cache, seconds compiled). Quantized weights' kernels:
    ``kernels.quantized.warm_up``, through the dispatch that picks them."""
    dtype = result_dtype(weight_dtype)
    if not cpu_kernels.ENABLED or dtype not in cpu_kernels.DTYPES:
        return
    a, w = numpy.ones((MIN_FULL_ROWS, 2 * QUANT_ROWS), dtype), numpy.ones((2 * QUANT_ROWS, 4 * COLUMN_ALIGN), dtype)
    matmul(a, w)
    matmul(a, numpy.ascontiguousarray(w.T).T)


if cpu_kernels.ENABLED:
    _jit = cpu_kernels.numba.njit(cache=True, nogil=True, fastmath={"contract", "reassoc", "nsz", "arcp"})
else:  # never called: ``takes`` answers False without numba

    def _jit(function):
        return function


@_jit
def _widen(bits, out, kind):
    """out[:] = the half-precision values with bit patterns ``bits`` (same length) as float32."""
    wide = out.view(numpy.uint32)
    if kind == BF16:
        for i in range(bits.shape[0]):
            wide[i] = numpy.uint32(bits[i]) << 16
        return
    # float16: exponent and mantissa shifted into place, then scaled by 2^112 (rebuilds the
    # exponent's bias, and subnormals come out normalized); inf and nan get float32's all-ones
    # exponent, and the sign its bit.
    for i in range(bits.shape[0]):
        wide[i] = (numpy.uint32(bits[i]) & 0x7FFF) << 13
    for i in range(bits.shape[0]):
        out[i] *= _F16_SCALE
    for i in range(bits.shape[0]):
        h = numpy.uint32(bits[i])
        special = numpy.uint32(0x7F800000) if (h & 0x7C00) == 0x7C00 else numpy.uint32(0)
        wide[i] |= ((h & 0x8000) << 16) | special


@_jit
def _stage_rows(weight, bits, kind, at, stride, count, width, scratch, pitch):
    """Rows ``at + g * stride`` (g < count, ``width`` elements each) of the flat weight into
    ``scratch`` rows ``g * pitch``, as float32 where they are half; the GROUP - count rows past the
    weight's end are zeros, so every group is multiplied by the same full-width code."""
    for g in range(GROUP):
        dst = scratch[g * pitch : g * pitch + width]
        first = at + g * stride
        if g >= count:
            dst[:] = 0
        elif kind == FULL:
            dst[:] = weight[first : first + width]
        else:
            _widen(bits[first : first + width], dst, kind)


@_jit
def _rows_by_matrix(a, weight, bits, kind, zero, out, first, last):
    """out[:, first:last] = a @ W[:, first:last] for W [K, N] row-major, flat in ``weight`` (or its
    half ``bits``); ``a``'s columns are padded with zeros to a multiple of GROUP."""
    rows, n = a.shape[0], out.shape[1]
    whole = rows - rows % TILE_ROWS
    k = (weight.shape[0] if kind == FULL else bits.shape[0]) // n
    # rows x block accumulators fill ~32 KiB of float32 (L1) beside the weight rows being read
    block = min(last - first, max(COLUMN_ALIGN, (8192 // rows) // COLUMN_ALIGN * COLUMN_ALIGN))
    acc = numpy.empty(rows * block, out.dtype)
    scratch = numpy.empty(GROUP * block, out.dtype)
    for start in range(first, last, block):
        width = min(block, last - start)
        acc[:] = zero
        for p in range(0, k, GROUP):
            group = min(GROUP, k - p)
            if kind == FULL and group == GROUP:
                src, at, step = weight, p * n + start, n
            else:
                _stage_rows(weight, bits, kind, p * n + start, n, group, width, scratch, block)
                src, at, step = scratch, 0, block
            # Slices, not offset indexing: numba's index arithmetic keeps LLVM from vectorizing.
            w0, w1 = src[at : at + width], src[at + step : at + step + width]
            w2, w3 = src[at + 2 * step : at + 2 * step + width], src[at + 3 * step : at + 3 * step + width]
            for r in range(0, whole, TILE_ROWS):  # each weight vector loaded once for four rows
                x0, x1, x2, x3 = a[r], a[r + 1], a[r + 2], a[r + 3]
                a00, a01, a02, a03 = x0[p], x0[p + 1], x0[p + 2], x0[p + 3]
                a10, a11, a12, a13 = x1[p], x1[p + 1], x1[p + 2], x1[p + 3]
                a20, a21, a22, a23 = x2[p], x2[p + 1], x2[p + 2], x2[p + 3]
                a30, a31, a32, a33 = x3[p], x3[p + 1], x3[p + 2], x3[p + 3]
                row0, row1 = acc[r * block : r * block + width], acc[(r + 1) * block : (r + 1) * block + width]
                row2, row3 = (
                    acc[(r + 2) * block : (r + 2) * block + width],
                    acc[(r + 3) * block : (r + 3) * block + width],
                )
                for j in range(width):
                    b0, b1, b2, b3 = w0[j], w1[j], w2[j], w3[j]
                    row0[j] += a00 * b0 + a01 * b1 + a02 * b2 + a03 * b3
                    row1[j] += a10 * b0 + a11 * b1 + a12 * b2 + a13 * b3
                    row2[j] += a20 * b0 + a21 * b1 + a22 * b2 + a23 * b3
                    row3[j] += a30 * b0 + a31 * b1 + a32 * b2 + a33 * b3
            for r in range(whole, rows):  # the rows after the last whole tile: one at a time
                x0 = a[r]
                a00, a01, a02, a03 = x0[p], x0[p + 1], x0[p + 2], x0[p + 3]
                row0 = acc[r * block : r * block + width]
                for j in range(width):
                    row0[j] += a00 * w0[j] + a01 * w1[j] + a02 * w2[j] + a03 * w3[j]
        for r in range(rows):
            out[r, start : start + width] = acc[r * block : r * block + width]


@_jit
def _rows_by_quantized(a, codes, scales, lows, zero, out, first, last):
    """out[:, first:last] = a @ W[:, first:last] for W [K, N] kept quantized (``quantized_matmul``'s
    operands). Each group of QUANT_ROWS weight rows is summed as its codes (widened in registers, each
    read once for four input rows), and the group's sums are scaled once per column; for 4 bits the group's minimum times the
    sum of ``a`` over the group's rows is added. Row 2i of a 4-bit weight is packed row i's low nibble,
    row 2i + 1 its high one. Blocks of columns and tiles of rows as ``_rows_by_matrix``'s, written out
    again: widening the codes into a scratch for its loop measured slower than in registers (NOTES.md)."""
    rows, n = a.shape[0], out.shape[1]
    groups, four_bits = scales.shape[0] // n, lows.shape[0] > 0
    whole = rows - rows % TILE_ROWS
    block = min(last - first, max(COLUMN_ALIGN, (8192 // rows) // COLUMN_ALIGN * COLUMN_ALIGN))
    acc = numpy.empty(rows * block, out.dtype)
    part = numpy.empty(rows * block, out.dtype)
    sums = numpy.empty((rows, groups), out.dtype)  # what multiplies the minimums
    for r in range(rows):
        for g in range(groups):
            sums[r, g] = a[r, g * QUANT_ROWS : (g + 1) * QUANT_ROWS].sum()
    for start in range(first, last, block):
        width = min(block, last - start)
        acc[:] = zero
        for g in range(groups):
            part[:] = zero
            for p in range(g * QUANT_ROWS, (g + 1) * QUANT_ROWS, GROUP):
                # codes of weight rows p .. p + 3 at columns start ..: four int8 rows, or two packed ones
                at = (p // 2 if four_bits else p) * n + start
                w0, w1 = codes[at : at + width], codes[at + n : at + n + width]
                w2, w3 = codes[at + 2 * n : at + 2 * n + width], codes[at + 3 * n : at + 3 * n + width]
                for r in range(0, whole, TILE_ROWS):  # each code widened once for four rows
                    x0, x1, x2, x3 = a[r], a[r + 1], a[r + 2], a[r + 3]
                    a00, a01, a02, a03 = x0[p], x0[p + 1], x0[p + 2], x0[p + 3]
                    a10, a11, a12, a13 = x1[p], x1[p + 1], x1[p + 2], x1[p + 3]
                    a20, a21, a22, a23 = x2[p], x2[p + 1], x2[p + 2], x2[p + 3]
                    a30, a31, a32, a33 = x3[p], x3[p + 1], x3[p + 2], x3[p + 3]
                    row0, row1 = part[r * block : r * block + width], part[(r + 1) * block : (r + 1) * block + width]
                    row2, row3 = (
                        part[(r + 2) * block : (r + 2) * block + width],
                        part[(r + 3) * block : (r + 3) * block + width],
                    )
                    for j in range(width):
                        if four_bits:
                            c0, c1 = numpy.float32(w0[j] & 15), numpy.float32(w0[j] >> 4)
                            c2, c3 = numpy.float32(w1[j] & 15), numpy.float32(w1[j] >> 4)
                        else:
                            c0, c1 = numpy.float32(w0[j]), numpy.float32(w1[j])
                            c2, c3 = numpy.float32(w2[j]), numpy.float32(w3[j])
                        row0[j] += a00 * c0 + a01 * c1 + a02 * c2 + a03 * c3
                        row1[j] += a10 * c0 + a11 * c1 + a12 * c2 + a13 * c3
                        row2[j] += a20 * c0 + a21 * c1 + a22 * c2 + a23 * c3
                        row3[j] += a30 * c0 + a31 * c1 + a32 * c2 + a33 * c3
                for r in range(whole, rows):  # the rows after the last whole tile: one at a time
                    x0 = a[r]
                    a00, a01, a02, a03 = x0[p], x0[p + 1], x0[p + 2], x0[p + 3]
                    row0 = part[r * block : r * block + width]
                    for j in range(width):
                        if four_bits:
                            c0, c1 = numpy.float32(w0[j] & 15), numpy.float32(w0[j] >> 4)
                            c2, c3 = numpy.float32(w1[j] & 15), numpy.float32(w1[j] >> 4)
                        else:
                            c0, c1 = numpy.float32(w0[j]), numpy.float32(w1[j])
                            c2, c3 = numpy.float32(w2[j]), numpy.float32(w3[j])
                        row0[j] += a00 * c0 + a01 * c1 + a02 * c2 + a03 * c3
            at = g * n + start
            scale, low = scales[at : at + width], lows[at : at + width] if four_bits else scales[at : at + width]
            for r in range(rows):
                total, codes_sum = acc[r * block : r * block + width], part[r * block : r * block + width]
                low_factor = sums[r, g] if four_bits else zero
                for j in range(width):
                    total[j] += scale[j] * codes_sum[j] + low[j] * low_factor
        for r in range(rows):
            out[r, start : start + width] = acc[r * block : r * block + width]


@_jit
def _rows_by_transposed(a, weight, bits, kind, zero, out, first, last):
    """out[:, first:last] = a @ E[first:last].T for E [N, K] row-major, flat in ``weight`` (or its
    half ``bits``), ``first`` a multiple of GROUP; ``a`` is padded as for ``_rows_by_matrix``."""
    rows, n = a.shape[0], out.shape[1]
    whole = rows - rows % TILE_ROWS
    k = (weight.shape[0] if kind == FULL else bits.shape[0]) // n
    scratch = numpy.empty(GROUP * k, out.dtype)
    sums = numpy.empty((TILE_ROWS, GROUP), out.dtype)
    for c in range(first, last, GROUP):
        group = min(GROUP, last - c)
        if kind == FULL and group == GROUP:
            src, at = weight, c * k
        else:
            _stage_rows(weight, bits, kind, c * k, k, group, k, scratch, k)
            src, at = scratch, 0
        e0, e1, e2, e3 = (
            src[at : at + k],
            src[at + k : at + 2 * k],
            src[at + 2 * k : at + 3 * k],
            src[at + 3 * k : at + 4 * k],
        )
        for r in range(0, whole, TILE_ROWS):  # a 4 x 4 tile: eight vector loads for sixteen multiply-adds
            x0, x1, x2, x3 = a[r][:k], a[r + 1][:k], a[r + 2][:k], a[r + 3][:k]
            s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = zero
            s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = zero
            for p in range(k):
                b0, b1, b2, b3 = e0[p], e1[p], e2[p], e3[p]
                y0, y1, y2, y3 = x0[p], x1[p], x2[p], x3[p]
                s00 += y0 * b0
                s01 += y0 * b1
                s02 += y0 * b2
                s03 += y0 * b3
                s10 += y1 * b0
                s11 += y1 * b1
                s12 += y1 * b2
                s13 += y1 * b3
                s20 += y2 * b0
                s21 += y2 * b1
                s22 += y2 * b2
                s23 += y2 * b3
                s30 += y3 * b0
                s31 += y3 * b1
                s32 += y3 * b2
                s33 += y3 * b3
            sums[0, 0], sums[0, 1], sums[0, 2], sums[0, 3] = s00, s01, s02, s03
            sums[1, 0], sums[1, 1], sums[1, 2], sums[1, 3] = s10, s11, s12, s13
            sums[2, 0], sums[2, 1], sums[2, 2], sums[2, 3] = s20, s21, s22, s23
            sums[3, 0], sums[3, 1], sums[3, 2], sums[3, 3] = s30, s31, s32, s33
            for i in range(TILE_ROWS):
                out[r + i, c : c + group] = sums[i, :group]
        for r in range(whole, rows):  # the rows after the last whole tile: one at a time
            x0 = a[r][:k]
            s00 = s01 = s02 = s03 = zero
            for p in range(k):
                s00 += x0[p] * e0[p]
                s01 += x0[p] * e1[p]
                s02 += x0[p] * e2[p]
                s03 += x0[p] * e3[p]
            sums[0, 0], sums[0, 1], sums[0, 2], sums[0, 3] = s00, s01, s02, s03
            out[r, c : c + group] = sums[0, :group]


# Each kernel's threads: one range of output columns (``threads.run``'s [start, stop)) each.
@threads.parallel_jit
def _rows_by_matrix_over(a, weight, bits, kind, zero, out, bounds):
    for part in threads.prange(bounds.shape[0] - 1):
        _rows_by_matrix(a, weight, bits, kind, zero, out, bounds[part], bounds[part + 1])


@threads.parallel_jit
def _rows_by_quantized_over(a, codes, scales, lows, zero, out, bounds):
    for part in threads.prange(bounds.shape[0] - 1):
        _rows_by_quantized(a, codes, scales, lows, zero, out, bounds[part], bounds[part + 1])


@threads.parallel_jit
def _rows_by_transposed_over(a, weight, bits, kind, zero, out, bounds):
    for part in threads.prange(bounds.shape[0] - 1):
        _rows_by_transposed(a, weight, bits, kind, zero, out, bounds[part], bounds[part + 1])
