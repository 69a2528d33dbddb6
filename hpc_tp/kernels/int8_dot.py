"""Few-row products of weights kept quantized (``kernels.quantized``) in integer arithmetic, as
llama.cpp does them: each activation row quantized to int8 per group of QUANT_ROWS inputs (GGUF's
Q8 blocks: scale = max |a| / 127), the codes dotted with AVX512-VNNI's ``vpdpbusd`` (64 byte products
summed four by four into sixteen int32 lanes in one instruction), and each group's integer dot
scaled once.

``vpdpbusd`` sums four neighbouring bytes of a lane, so a lane must hold four inputs of one output
column; the stored codes [K, N] have a column's inputs N bytes apart. ``interleave`` therefore writes
the codes once more, at the first few-row product (``QuantizedMatrix.interleaved``), in tiles of
sixteen columns: in a tile, for each group, its quads of inputs (k = 4q .. 4q + 3) side by side, one
64-byte vector a quad, the whole of K contiguous, as GGUF's blocks keep a row's inputs together.
It is unsigned times signed: 8-bit weight codes are stored plus 128 (and 128 times the sum of the
activation codes taken off each group's dot); 4-bit codes are 0..15 already and stay two a byte, the
low nibbles of a group's 256 bytes its quads 0..3 and the high ones its quads 4..7.

Per output column j and row r, group g of weight scale s, minimum m (4 bits) and activation scale t:

    y[r, j] += t * s * (sum_k code_a * code_w) + m * sum_k a      (the last sum in float, of ``a``)

which adds the rounding of ``a`` to int8 (at most half a step, max |a| / 254, per element) to the
weights' own. Float64 activations never take this path (their products keep float sums).
``AVAILABLE`` is True where numba runs and the host has avx512_vnni; elsewhere ``small_m``'s float
kernel computes every product.
"""

from __future__ import annotations

import llvmlite.binding
import numpy
from llvmlite import ir

from . import cpu_kernels
from .small_m import QUANT_ROWS

LANES = 16  # int32 lanes of a 512-bit vector: output columns a tile
QUADS = QUANT_ROWS // 4  # vpdpbusd steps a group
OFFSET = 128  # 8-bit codes are stored as code + OFFSET (the unsigned operand)
AVAILABLE = cpu_kernels.ENABLED and bool(llvmlite.binding.get_host_cpu_features().get("avx512vnni"))


def group_bytes(bits: int) -> int:
    """Bytes of one tile's group in the interleaved layout."""
    return LANES * QUANT_ROWS * bits // 8


def interleave(codes, bits: int):
    """Codes [K, N] (int8, or uint8 [K/2, N] two 4-bit codes a byte) as the kernel reads them: uint8
    [tiles, K / QUANT_ROWS, group_bytes(bits)], columns past N zero (their outputs are not written)."""
    k = codes.shape[0] * (8 // bits)
    n = codes.shape[1]
    tiles = -(-n // LANES)
    if bits == 8:
        wide = (codes.view(numpy.uint8) ^ OFFSET).astype(numpy.uint8)
    else:
        wide = numpy.empty((k, n), numpy.uint8)
        wide[0::2], wide[1::2] = codes & 15, codes >> 4
    padded = numpy.zeros((k, tiles * LANES), numpy.uint8)
    padded[:, :n] = wide
    # [group, quad, byte of quad, tile, lane] -> [tile, group, quad, lane, byte of quad]
    quads = padded.reshape(k // QUANT_ROWS, QUADS, 4, tiles, LANES).transpose(3, 0, 1, 4, 2)
    quads = quads.reshape(tiles, k // QUANT_ROWS, QUADS, LANES * 4)
    if bits == 4:
        half = QUADS // 2
        quads = quads[:, :, :half] | (quads[:, :, half:] << 4)
    return numpy.ascontiguousarray(quads).reshape(tiles, k // QUANT_ROWS, group_bytes(bits))


def interleave_columns(values):
    """Per-group float32 values [K / QUANT_ROWS, N] (scales, minimums) as [tiles, groups, LANES]."""
    groups, n = values.shape
    tiles = -(-n // LANES)
    padded = numpy.zeros((groups, tiles * LANES), numpy.float32)
    padded[:, :n] = values
    return numpy.ascontiguousarray(padded.reshape(groups, tiles, LANES).transpose(1, 0, 2))


def quantize_rows(a):
    """float32 rows [M, K] (K whole groups) as int8 codes [M, K], their scales [M, K / QUANT_ROWS]
    (max |a| / 127 of the group), the sums of each group's codes (int32) and of its values (float32)."""
    rows, k = a.shape
    codes = numpy.empty((rows, k), numpy.int8)
    scales = numpy.empty((rows, k // QUANT_ROWS), numpy.float32)
    code_sums = numpy.empty((rows, k // QUANT_ROWS), numpy.int32)
    sums = numpy.empty((rows, k // QUANT_ROWS), numpy.float32)
    _quantize_rows(a, codes, scales, code_sums, sums)
    return codes, scales, code_sums, sums


def matmul(a, interleaved, scales, lows, bits: int, n: int, start: int = 0, stop: int | None = None, out=None):
    """``a @ W`` columns [start, stop) into ``out`` (float32 [M, n], allocated when None) for float32
    ``a`` [M, K] and W given by ``interleave``'s codes and ``interleave_columns``'s scales and
    minimums (``lows`` empty for 8 bits)."""
    if out is None:
        out = numpy.empty((a.shape[0], n), numpy.float32)
    codes, a_scales, code_sums, sums = quantize_rows(a)
    stop = n if stop is None else stop
    flat = (codes.view(numpy.uint32), a_scales, code_sums * OFFSET, sums, interleaved, scales, lows)
    _rows_by_interleaved(*(x.reshape(-1) for x in flat), bits, a_scales.shape[1], start, stop, out)
    return out


if cpu_kernels.ENABLED:
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    _jit = cpu_kernels.numba.njit(cache=True, nogil=True, fastmath={"contract", "reassoc", "nsz", "arcp"})
    # Rounding to the nearest code as numpy does it: no reciprocal in place of the division.
    _exact_jit = cpu_kernels.numba.njit(cache=True, nogil=True)
else:  # never called: ``AVAILABLE`` is False without numba
    intrinsic = _jit = _exact_jit = cpu_kernels._jit


def _tile_row(bits: int):
    """An intrinsic ``tile_row(weights, w_at, acts, a_at, a_scales, compensation, sums, s_at, scales,
    lows, c_at, groups, out)``: out[:LANES] = one activation row times one tile of W, all flat 1-D
    arrays: the tile's codes (uint8 ``weights`` from ``w_at``, ``group_bytes(bits)`` a group), the
    row's quads (uint32 ``acts`` from ``a_at``), its per-group scales, compensations and sums (from
    ``s_at``), the tile's per-group scales and minimums (LANES float32 a group from ``c_at``). The
    sums stay in registers over the groups: one vpdpbusd a quad and a multiply-add a group."""

    @intrinsic
    def tile_row(
        typingctx, weights, w_at, acts, a_at, a_scales, compensation, sums, s_at, scales, lows, c_at, groups, out
    ):
        def codegen(context, builder, signature, args):
            i32, f32 = ir.IntType(32), ir.FloatType()
            i8x64, i32x16, f32x16 = (
                ir.VectorType(ir.IntType(8), 64),
                ir.VectorType(i32, LANES),
                ir.VectorType(f32, LANES),
            )
            dpbusd = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(i32x16, [i32x16, i8x64, i8x64]), "llvm.x86.avx512.vpdpbusd.512"
            )
            w_at, a_at, s_at, c_at, groups = (args[i] for i in (1, 3, 7, 10, 11))
            zeros = ir.Constant(i32x16, None)

            def element(i, index):  # pointer to element ``index`` of flat array argument i
                data = context.make_array(signature.args[i])(context, builder, args[i]).data
                return builder.gep(data, [index])

            def vector(i, index, vector_type):
                return builder.load(builder.bitcast(element(i, index), vector_type.as_pointer()), align=1)

            def splat(value, vector_type):
                one = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, i32(0))
                return builder.shuffle_vector(one, one, zeros)

            def step(acc, weight, at):  # acc += the dots of ``weight`` with activation quad ``at``
                quad = builder.load(element(2, at), align=4)
                return builder.call(dpbusd, [acc, weight, builder.bitcast(splat(quad, i32x16), i8x64)])

            total = cgutils.alloca_once_value(builder, ir.Constant(f32x16, None))
            with cgutils.for_range(builder, groups) as loop:
                g = loop.index
                first_byte = builder.add(w_at, builder.mul(g, g.type(group_bytes(bits))))
                first_quad = builder.add(a_at, builder.mul(g, g.type(QUADS)))
                acc = zeros
                if bits == 8:
                    for q in range(QUADS):
                        weight = vector(0, builder.add(first_byte, g.type(64 * q)), i8x64)
                        acc = step(acc, weight, builder.add(first_quad, g.type(q)))
                else:  # quads q and q + QUADS/2 share the bytes of vector q: low and high nibbles
                    nibble = ir.Constant(i8x64, [15] * 64)
                    for q in range(QUADS // 2):
                        both = vector(0, builder.add(first_byte, g.type(64 * q)), i8x64)
                        high = builder.and_(builder.lshr(both, ir.Constant(i8x64, [4] * 64)), nibble)
                        acc = step(acc, builder.and_(both, nibble), builder.add(first_quad, g.type(q)))
                        acc = step(acc, high, builder.add(first_quad, g.type(q + QUADS // 2)))
                row_group, column_group = builder.add(s_at, g), builder.add(c_at, builder.mul(g, g.type(LANES)))
                if bits == 8:  # the codes were stored plus OFFSET: take OFFSET times the activation codes' sum
                    acc = builder.sub(acc, splat(builder.load(element(5, row_group)), i32x16))
                scale = builder.fmul(
                    vector(8, column_group, f32x16), splat(builder.load(element(4, row_group)), f32x16)
                )
                part = builder.fmul(builder.sitofp(acc, f32x16), scale)
                if bits == 4:
                    low_sum = builder.fmul(
                        vector(9, column_group, f32x16), splat(builder.load(element(6, row_group)), f32x16)
                    )
                    part = builder.fadd(part, low_sum)
                builder.store(builder.fadd(builder.load(total), part), total)
            builder.store(
                builder.load(total), builder.bitcast(element(12, ir.IntType(64)(0)), f32x16.as_pointer()), align=4
            )
            return context.get_dummy_value()

        arg_types = (weights, w_at, acts, a_at, a_scales, compensation, sums, s_at, scales, lows, c_at, groups, out)
        return types.void(*arg_types), codegen

    return tile_row


_tile_row8, _tile_row4 = _tile_row(8), _tile_row(4)


@_exact_jit
def _quantize_rows(a, codes, scales, code_sums, sums):
    rows, groups = scales.shape
    for r in range(rows):
        for g in range(groups):
            values = a[r, g * QUANT_ROWS : (g + 1) * QUANT_ROWS]
            scale = numpy.float32(numpy.abs(values).max() / numpy.float32(127))
            scales[r, g] = scale
            safe = scale if scale > 0 else numpy.float32(1)  # an all-zero group: every code 0
            total, code_total = numpy.float32(0), 0
            for i in range(QUANT_ROWS):
                code = numpy.rint(values[i] / safe)
                codes[r, g * QUANT_ROWS + i] = numpy.int8(code)
                code_total += numpy.int32(code)
                total += values[i]
            code_sums[r, g], sums[r, g] = code_total, total


@_jit
def _rows_by_interleaved(acts, a_scales, compensation, sums, weights, scales, lows, bits, groups, start, stop, out):
    """out[:, start:stop] = a @ W for ``a`` given by ``quantize_rows`` (its codes as uint32 quads) and W
    by ``interleave`` and ``interleave_columns``, every array flat."""
    rows = a_scales.shape[0] // groups
    tile_bytes = groups * LANES * QUANT_ROWS * bits // 8
    tile_out = numpy.empty(LANES, numpy.float32)
    for tile in range(start // LANES, -(-stop // LANES)):
        first, last = max(start, tile * LANES), min(stop, (tile + 1) * LANES)
        for r in range(rows):  # the tile's codes stay in cache for every row after the first
            at = (tile * tile_bytes, r * groups * QUADS, r * groups, tile * groups * LANES)
            if bits == 4:
                _tile_row4(
                    weights,
                    at[0],
                    acts,
                    at[1],
                    a_scales,
                    compensation,
                    sums,
                    at[2],
                    scales,
                    lows,
                    at[3],
                    groups,
                    tile_out,
                )
            else:
                _tile_row8(
                    weights,
                    at[0],
                    acts,
                    at[1],
                    a_scales,
                    compensation,
                    sums,
                    at[2],
                    scales,
                    lows,
                    at[3],
                    groups,
                    tile_out,
                )
            out[r, first:last] = tile_out[first - tile * LANES : last - tile * LANES]
