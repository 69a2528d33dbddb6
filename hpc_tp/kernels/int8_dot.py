"""Products of weights kept quantized (``kernels.quantized``) in integer arithmetic, as llama.cpp does
them, for decode steps and prefills alike: each activation row quantized to int8 per group of
QUANT_ROWS inputs (GGUF's Q8 blocks: scale = max |a| / 127), the codes dotted with AVX512-VNNI's
``vpdpbusd`` (64 byte products summed four by four into sixteen int32 lanes in one instruction), and
each group's integer dot scaled once. Tiles of 4 rows x 16 columns (and single rows past the last
whole tile) serve any number of rows: a tile's 16 columns of codes stay in cache while every row
passes them. A row's quantization is its own and both tiles do a row's float operations in one order
(``tests/test_quantized.py`` checks the bits), so a row's products are the same in a prefill of any
size as in a decode step of one row.

``vpdpbusd`` sums four neighbouring bytes of a lane, so a lane must hold four inputs of one output
column; the stored codes [K, N] have a column's inputs N bytes apart. ``interleave`` therefore writes
the codes in another layout (``QuantizedMatrix.pack``, at load, which then keeps that copy only;
float64 activations multiply blocks of it dequantized), in tiles of sixteen columns: in a tile,
for each group, its quads of inputs (k = 4q .. 4q + 3) side by side, one 64-byte vector a quad, the
whole of K contiguous, as GGUF's blocks keep a row's inputs together.
It is unsigned times signed: 8-bit weight codes are stored plus 128 (and 128 times the sum of the
activation codes taken off each group's dot); 4-bit codes are 0..15 already and stay two a byte, the
low nibbles of a group's 256 bytes its quads 0..3 and the high ones its quads 4..7.

Per output column j and row r, group g of weight scale s, minimum m (4 bits) and activation scale t:

    y[r, j] += t * s * (sum_k code_a * code_w) + m * (t * sum_k code_a)

the quantized activations dotted with the dequantized weights w = s * code_w + m (the minimum's term
from the codes' sum, as llama.cpp's Q8_1 blocks carry it, d times the sum of the codes), which adds the
rounding of ``a`` to int8 (at most half a step, max |a| / 254, per element) times w to the weights'
own error. (With the float sum of ``a`` in that term, that rounding was multiplied by w - m instead:
all of one sign across a 4-bit group's columns, and up to twice |w|; SmolLM2-135M's int4 perplexity at
windows of 256 was 1.5% above float activations' that way, 0.3% this way.) Float64 activations never
take this path (their products keep float sums).
``AVAILABLE`` is True where numba runs and the host has avx512_vnni, unless ``HPC_TP_INT8_DOT=0`` (for
an A/B, or float activations); elsewhere ``small_m``'s float kernel computes every product.
"""

from __future__ import annotations

import os

import llvmlite.binding
import numpy
from llvmlite import ir

from . import cpu_kernels, small_m, threads
from .small_m import QUANT_ROWS

LANES = 16  # int32 lanes of a 512-bit vector: output columns a tile
QUADS = QUANT_ROWS // 4  # vpdpbusd steps a group
OFFSET = 128  # 8-bit codes are stored as code + OFFSET (the unsigned operand)
AVAILABLE = (
    cpu_kernels.ENABLED
    and os.environ.get("HPC_TP_INT8_DOT", "1") != "0"
    and bool(llvmlite.binding.get_host_cpu_features().get("avx512vnni"))
)


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


def deinterleave(interleaved, bits: int, n: int):
    """``interleave``'s codes back as they were given to it: int8 [K, n], or uint8 [K/2, n] two 4-bit
    codes a byte (a checkpoint's layout, written from the one copy a model keeps)."""
    tiles, groups, _ = interleaved.shape
    quads = interleaved.reshape(tiles, groups, -1, LANES * 4)
    if bits == 4:
        quads = numpy.concatenate([quads & 15, quads >> 4], axis=2)
    # [tile, group, quad, lane, byte of quad] -> [group, quad, byte of quad, tile, lane]
    wide = quads.reshape(tiles, groups, QUADS, LANES, 4).transpose(1, 2, 4, 0, 3)
    wide = wide.reshape(groups * QUANT_ROWS, tiles * LANES)[:, :n]
    if bits == 8:
        return numpy.ascontiguousarray(wide ^ numpy.uint8(OFFSET)).view(numpy.int8)
    return wide[0::2] | (wide[1::2] << 4)


def narrow_columns(*arrays):
    """``interleave_columns``' arrays as float16 bits (uint16) where every value is a float16 exactly
    (GGUF's scales and minimums are), else as they are: the kernels widen either to the same float32
    numbers, and half-width scales and minimums are a sixth fewer bytes a 4-bit product streams. All
    or none narrowed: one compiled kernel a combination."""
    halves = [values.astype(numpy.float16) for values in arrays]
    if all(numpy.array_equal(half.astype(numpy.float32), values) for half, values in zip(halves, arrays)):
        return [half.view(numpy.uint16) for half in halves]
    return list(arrays)


def deinterleave_columns(values, n: int):
    """``interleave_columns``' values (or ``narrow_columns``') back as float32 [K / QUANT_ROWS, n]."""
    if values.dtype == numpy.uint16:
        values = values.view(numpy.float16).astype(numpy.float32)
    tiles, groups, _ = values.shape
    return numpy.ascontiguousarray(values.transpose(1, 0, 2).reshape(groups, tiles * LANES)[:, :n])


def dequantize(interleaved, scales, lows, bits: int, n: int, first_group: int, stop_group: int):
    """Weight rows of groups [first_group, stop_group) as float32 [rows, n] from the interleaved
    operands, each w = code * scale (+ min) rounded as ``QuantizedMatrix.dequantize`` rounds it (the
    product, then the sum), with no other copy of the codes kept: ``QuantizedMatrix.dequantize``'s
    float32 blocks (``quantized.dequantized_matmul``'s, which ``benchmarks/quantized_prefill.py`` times
    against the integer path)."""
    out = numpy.empty(((stop_group - first_group) * QUANT_ROWS, n), numpy.float32)
    args = (interleaved, scales, lows, bits, out, first_group)
    threads.run(_dequantize, _dequantize_over, args, threads.columns(n, LANES))
    return out


def matmul(a, interleaved, scales, lows, bits: int, n: int, start: int = 0, stop: int | None = None, out=None):
    """``a @ W`` columns [start, stop) into ``out`` (float32 [M, n], allocated when None) for float32
    ``a`` [M, K] (C-contiguous) and W given by ``interleave``'s codes and ``interleave_columns``'s
    scales and minimums, or ``narrow_columns``' (``lows`` empty for 8 bits)."""
    if out is None:
        out = numpy.empty((a.shape[0], n), numpy.float32)
    stop = n if stop is None else stop
    args = (*_quantized(a), interleaved, scales, lows, bits, out)
    threads.share(_product, _product_over, args, start, stop, small_m.COLUMN_ALIGN, a.shape[1] * bits // 8)
    return out


if cpu_kernels.ENABLED:
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    _jit = cpu_kernels.numba.njit(cache=True, nogil=True, fastmath={"contract", "reassoc", "nsz", "arcp"})
    # Rounding to the nearest code as numpy does it: no reciprocal in place of the division.
    _exact_jit = cpu_kernels.numba.njit(cache=True, nogil=True)
else:  # never called: ``AVAILABLE`` is False without numba
    intrinsic = _jit = _exact_jit = cpu_kernels._jit


def _column_values(builder, element, array_type, i, at):
    """The LANES float32 values at element ``at`` of array argument ``i`` (scales or minimums, of
    ``array_type``): float32 loaded as they are, float16 bits (``narrow_columns``) widened exactly."""
    f32x16 = ir.VectorType(ir.FloatType(), LANES)
    if array_type.dtype == types.uint16:
        bits = builder.load(element(i, at, ir.VectorType(ir.IntType(16), LANES)), align=2)
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), f32x16)
    return builder.load(element(i, at, f32x16), align=4)


def _tile_rows(bits: int, rows: int):
    """An intrinsic ``tile_rows(weights, w_at, acts, a_at, a_scales, code_sums, sums, s_at, scales,
    lows, c_at, out, o_at, o_stride)``: ``rows`` activation rows times one tile of W, row r's LANES
    values into float32 ``out`` from element o_at + r * o_stride. Offsets
    are in elements of C-contiguous arrays: the tile's codes (uint8 ``weights`` from ``w_at``,
    ``group_bytes(bits)`` a group), the first row's codes (int8 ``acts`` [M, K] from ``a_at``), its
    per-group scales, code sums and scaled code sums ([M, groups] from ``s_at``), the tile's per-group scales and
    minimums ([tiles, groups, LANES] from ``c_at``, float32 or float16 bits). Each code vector is loaded (and for 4 bits
    split into nibbles) once for all rows, and the sums stay in registers over the groups: one
    vpdpbusd a quad and row, a multiply-add a group and row."""

    @intrinsic
    def tile_rows(
        typingctx, weights, w_at, acts, a_at, a_scales, code_sums, sums, s_at, scales, lows, c_at, out, o_at, o_stride
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
            w_at, a_at, s_at, c_at = args[1], args[3], args[7], args[10]
            groups = cgutils.unpack_tuple(
                builder, context.make_array(signature.args[4])(context, builder, args[4]).shape
            )[1]
            zeros = ir.Constant(i32x16, None)

            def element(i, index, as_type=None):  # pointer to element ``index`` of array argument i
                pointer = builder.gep(context.make_array(signature.args[i])(context, builder, args[i]).data, [index])
                return pointer if as_type is None else builder.bitcast(pointer, as_type.as_pointer())

            def splat(value, vector_type):
                one = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, i32(0))
                return builder.shuffle_vector(one, one, zeros)

            k = builder.mul(groups, groups.type(QUANT_ROWS))
            totals = [cgutils.alloca_once_value(builder, ir.Constant(f32x16, None)) for _ in range(rows)]
            with cgutils.for_range(builder, groups) as loop:
                g = loop.index
                first_byte = builder.add(w_at, builder.mul(g, g.type(group_bytes(bits))))
                first_code = builder.add(a_at, builder.mul(g, g.type(QUANT_ROWS)))
                accs = [zeros] * rows

                def step(weight, q):  # every row's sums += the dots of ``weight`` with its quad q
                    for r in range(rows):
                        at = builder.add(first_code, builder.add(builder.mul(k, k.type(r)), k.type(4 * q)))
                        quad = builder.load(element(2, at, i32), align=1)
                        accs[r] = builder.call(dpbusd, [accs[r], weight, builder.bitcast(splat(quad, i32x16), i8x64)])

                for v in range(group_bytes(bits) // 64):
                    weight = builder.load(element(0, builder.add(first_byte, g.type(64 * v)), i8x64), align=1)
                    if bits == 8:
                        step(weight, v)
                    else:  # quads v and v + QUADS/2 share the bytes of vector v: low and high nibbles
                        nibble = ir.Constant(i8x64, [15] * 64)
                        step(builder.and_(weight, nibble), v)
                        step(builder.and_(builder.lshr(weight, ir.Constant(i8x64, [4] * 64)), nibble), v + QUADS // 2)
                column_group = builder.add(c_at, builder.mul(g, g.type(LANES)))
                w_scale = _column_values(builder, element, signature.args[8], 8, column_group)
                low = _column_values(builder, element, signature.args[9], 9, column_group) if bits == 4 else None
                for r in range(rows):
                    row_group = builder.add(builder.add(s_at, builder.mul(groups, groups.type(r))), g)
                    dots = accs[r]
                    if bits == 8:  # the codes were stored plus OFFSET: take OFFSET times the activation codes' sum
                        offset = builder.mul(builder.load(element(5, row_group)), i32(OFFSET))
                        dots = builder.sub(dots, splat(offset, i32x16))
                    scale = builder.fmul(w_scale, splat(builder.load(element(4, row_group)), f32x16))
                    part = builder.fmul(builder.sitofp(dots, f32x16), scale)
                    if bits == 4:
                        part = builder.fadd(part, builder.fmul(low, splat(builder.load(element(6, row_group)), f32x16)))
                    builder.store(builder.fadd(builder.load(totals[r]), part), totals[r])
            o_at, o_stride = args[12], args[13]
            for r in range(rows):
                at = builder.add(o_at, builder.mul(o_stride, o_stride.type(r)))
                builder.store(builder.load(totals[r]), element(11, at, f32x16), align=4)
            return context.get_dummy_value()

        arg_types = (
            weights,
            w_at,
            acts,
            a_at,
            a_scales,
            code_sums,
            sums,
            s_at,
            scales,
            lows,
            c_at,
            out,
            o_at,
            o_stride,
        )
        return types.void(*arg_types), codegen

    return tile_rows


def _tile_dequantize(bits: int):
    """An intrinsic ``tile(weights, w_at, scales, lows, c_at, groups, out, o_at, stride)``: ``groups``
    groups of one tile (codes from ``w_at``, scales and minimums from ``c_at``, as in ``_tile_rows``)
    as float32 rows of 16 values into ``out`` from ``o_at``, ``stride`` elements a row. Each byte
    position of a quad's vector is shuffled out for the 16 lanes, widened and scaled: a row of the tile
    a few vector instructions."""

    @intrinsic
    def tile(typingctx, weights, w_at, scales, lows, c_at, groups, out, o_at, stride):
        def codegen(context, builder, signature, args):
            i32, f32 = ir.IntType(32), ir.FloatType()
            i8x64 = ir.VectorType(ir.IntType(8), 64)
            i32x16, f32x16 = ir.VectorType(i32, LANES), ir.VectorType(f32, LANES)
            w_at, c_at, groups, o_at, stride = args[1], args[4], args[5], args[7], args[8]
            # vmulps with its rounding given (to nearest, as the default): LLVM does not fuse it with the
            # add into a multiply-add, which would round once where numpy rounds twice
            multiply = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(f32x16, [f32x16, f32x16, i32]), "llvm.x86.avx512.mul.ps.512"
            )
            nearest = i32(8)  # _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC

            def element(i, index, as_type):  # pointer to element ``index`` of array argument i
                pointer = builder.gep(context.make_array(signature.args[i])(context, builder, args[i]).data, [index])
                return builder.bitcast(pointer, as_type.as_pointer())

            with cgutils.for_range(builder, groups) as loop:
                g = loop.index
                first_byte = builder.add(w_at, builder.mul(g, g.type(group_bytes(bits))))
                column_group = builder.add(c_at, builder.mul(g, g.type(LANES)))
                scale = _column_values(builder, element, signature.args[2], 2, column_group)
                low = _column_values(builder, element, signature.args[3], 3, column_group) if bits == 4 else None
                for v in range(group_bytes(bits) // 64):
                    vector = builder.load(element(0, builder.add(first_byte, g.type(64 * v)), i8x64), align=1)
                    if bits == 8:  # stored plus OFFSET: the XOR gives the code's two's complement
                        quads = [(builder.xor(vector, ir.Constant(i8x64, [OFFSET] * 64)), v)]
                    else:
                        nibble = ir.Constant(i8x64, [15] * 64)
                        high = builder.lshr(vector, ir.Constant(i8x64, [4] * 64))
                        quads = [(builder.and_(vector, nibble), v), (builder.and_(high, nibble), v + QUADS // 2)]
                    for codes, q in quads:
                        for byte in range(4):
                            mask = ir.Constant(i32x16, [4 * lane + byte for lane in range(LANES)])
                            picked = builder.shuffle_vector(codes, codes, mask)
                            wide = builder.sext(picked, i32x16) if bits == 8 else builder.zext(picked, i32x16)
                            values = builder.call(multiply, [builder.sitofp(wide, f32x16), scale, nearest])
                            if bits == 4:
                                values = builder.fadd(values, low)
                            row = builder.add(builder.mul(g, g.type(QUANT_ROWS)), g.type(4 * q + byte))
                            at = builder.add(o_at, builder.mul(row, stride))
                            builder.store(values, element(6, at, f32x16), align=4)
            return context.get_dummy_value()

        return types.void(weights, w_at, scales, lows, c_at, groups, out, o_at, stride), codegen

    return tile


@intrinsic
def _quantize_group(typingctx, a, at, codes, scales, code_sums, sums, s_at):
    """``quantize_group(a, at, codes, scales, code_sums, sums, s_at)``: the QUANT_ROWS values of
    float32 ``a`` from element ``at`` as int8 codes into ``codes`` from the same element, their scale,
    code sum and scale times code sum into element ``s_at`` of the others (C-contiguous arrays).
    numpy's numbers to the bit in vectors: max |a| (exact in any order), scale = max / 127 and codes
    rint(a / scale) as true divisions (a reciprocal in their place moves codes next to half a step),
    and the integer code sum in any order."""
    if any(array.layout != "C" for array in (a, codes, scales, code_sums, sums)):
        return None

    def codegen(context, builder, signature, args):
        i32, f32 = ir.IntType(32), ir.FloatType()
        f32x16, i32x16 = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES)
        at, s_at = args[1], args[6]

        def element(i, index, as_type=None):  # pointer to element ``index`` of array argument i
            pointer = builder.gep(context.make_array(signature.args[i])(context, builder, args[i]).data, [index])
            return pointer if as_type is None else builder.bitcast(pointer, as_type.as_pointer())

        def intrinsic_call(name, result, *operands):
            function = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(result, [o.type for o in operands]), name
            )
            return builder.call(function, list(operands))

        halves = [builder.load(element(0, builder.add(at, at.type(h * LANES)), f32x16), align=4) for h in range(2)]
        magnitudes = [intrinsic_call("llvm.fabs.v16f32", f32x16, half) for half in halves]
        largest = intrinsic_call(
            "llvm.vector.reduce.fmax.v16f32", f32, intrinsic_call("llvm.maxnum.v16f32", f32x16, *magnitudes)
        )
        scale = builder.fdiv(largest, f32(127))
        builder.store(scale, element(3, s_at))
        safe = builder.select(builder.fcmp_ordered(">", scale, f32(0)), scale, f32(1))  # all zero: codes 0
        one = builder.insert_element(ir.Constant(f32x16, ir.Undefined), safe, i32(0))
        divisor = builder.shuffle_vector(one, one, ir.Constant(i32x16, None))
        code_total = i32(0)
        for h, half in enumerate(halves):
            wide = builder.fptosi(intrinsic_call("llvm.rint.v16f32", f32x16, builder.fdiv(half, divisor)), i32x16)
            narrow = builder.trunc(wide, ir.VectorType(ir.IntType(8), LANES))
            builder.store(narrow, element(2, builder.add(at, at.type(h * LANES)), narrow.type), align=1)
            code_total = builder.add(code_total, intrinsic_call("llvm.vector.reduce.add.v16i32", i32, wide))
        builder.store(code_total, element(4, s_at))
        builder.store(builder.fmul(scale, builder.sitofp(code_total, f32)), element(5, s_at))
        return context.get_dummy_value()

    return types.void(a, at, codes, scales, code_sums, sums, s_at), codegen


_TILE8, _TILE4 = _tile_dequantize(8), _tile_dequantize(4)
TILE_ROWS = 4  # rows a code vector serves while it is in a register
_ONE8, _FOUR8, _ONE4, _FOUR4 = (_tile_rows(bits, rows) for bits in (8, 4) for rows in (1, TILE_ROWS))


@_exact_jit
def _quantize_rows(a, codes, scales, code_sums, sums):
    rows, groups = scales.shape
    k = a.shape[1]
    for r in range(rows):
        for g in range(groups):
            _quantize_group(a, r * k + g * QUANT_ROWS, codes, scales, code_sums, sums, r * groups + g)


@_exact_jit
def _quantized(a):
    """``a`` [M, K] as int8 codes per group of QUANT_ROWS, with each group's scale, code sum and scale
    times code sum (once a product, whatever its ranges)."""
    rows, k = a.shape
    groups = k // QUANT_ROWS
    codes = numpy.empty((rows, k), numpy.int8)
    a_scales = numpy.empty((rows, groups), numpy.float32)
    code_sums = numpy.empty((rows, groups), numpy.int32)
    sums = numpy.empty((rows, groups), numpy.float32)
    _quantize_rows(a, codes, a_scales, code_sums, sums)
    return codes, a_scales, code_sums, sums


@_jit
def _product(codes, a_scales, code_sums, sums, weights, scales, lows, bits, out, start, stop):
    """out[:, start:stop] = a @ W for ``a`` as ``_quantized`` gives it (``matmul``'s operands)."""
    rows, k = codes.shape
    groups = k // QUANT_ROWS
    tile_out = numpy.empty(TILE_ROWS * LANES, numpy.float32)
    flat, n = out.reshape(-1), out.shape[1]  # whole tiles' sums stored in place, a partial one through tile_out
    for tile in range(start // LANES, -(-stop // LANES)):
        first, last = max(start, tile * LANES), min(stop, (tile + 1) * LANES)
        w_at, c_at = tile * weights.shape[1] * weights.shape[2], tile * groups * LANES
        whole = first == tile * LANES and last == first + LANES
        target, o_stride = (flat, n) if whole else (tile_out, LANES)
        r = 0
        while r < rows:  # the tile's codes stay in cache for every row after the first
            count = TILE_ROWS if r + TILE_ROWS <= rows else 1
            at = tile * LANES + r * n if whole else 0  # tile_out holds one call's rows
            operands = (weights, w_at, codes, r * k, a_scales, code_sums, sums, r * groups, scales, lows, c_at)
            if bits == 4 and count == TILE_ROWS:
                _FOUR4(*operands, target, at, o_stride)
            elif bits == 4:
                _ONE4(*operands, target, at, o_stride)
            elif count == TILE_ROWS:
                _FOUR8(*operands, target, at, o_stride)
            else:
                _ONE8(*operands, target, at, o_stride)
            for i in range(0 if whole else count):
                out[r + i, first:last] = tile_out[i * LANES + first - tile * LANES : i * LANES + last - tile * LANES]
            r += count


@_jit
def _dequantize(weights, scales, lows, bits, out, first_group, start, stop):
    """out[:, start:stop] = ``dequantize``'s rows: whole tiles written in place, a last partial one
    through a tile's scratch rows."""
    groups, n = out.shape[0] // QUANT_ROWS, out.shape[1]
    scratch = numpy.empty(QUANT_ROWS * groups * LANES, numpy.float32)
    for tile in range(start // LANES, -(-stop // LANES)):
        w_at = (tile * weights.shape[1] + first_group) * weights.shape[2]
        c_at = (tile * scales.shape[1] + first_group) * LANES
        first, last = max(start, tile * LANES), min(stop, (tile + 1) * LANES)
        if first == tile * LANES and last == first + LANES:
            if bits == 8:
                _TILE8(weights, w_at, scales, lows, c_at, groups, out, tile * LANES, n)
            else:
                _TILE4(weights, w_at, scales, lows, c_at, groups, out, tile * LANES, n)
            continue
        if bits == 8:
            _TILE8(weights, w_at, scales, lows, c_at, groups, scratch, 0, LANES)
        else:
            _TILE4(weights, w_at, scales, lows, c_at, groups, scratch, 0, LANES)
        for row in range(out.shape[0]):
            for column in range(first, last):
                out[row, column] = scratch[row * LANES + column - tile * LANES]


@threads.parallel_jit
def _dequantize_over(weights, scales, lows, bits, out, first_group, bounds):
    """``_dequantize`` over ``kernels.threads``' ranges of columns, one a thread."""
    for part in threads.prange(bounds.shape[0] - 1):
        _dequantize(weights, scales, lows, bits, out, first_group, bounds[part], bounds[part + 1])


@threads.parallel_jit
def _product_over(codes, a_scales, code_sums, sums, weights, scales, lows, bits, out, bounds, taken):
    """``_product`` over ``kernels.threads``' ranges of output columns, each taken by the next free thread."""
    for _ in threads.prange(bounds.shape[0] - 1):
        part = threads.take(taken)
        while part < bounds.shape[0] - 1:
            _product(codes, a_scales, code_sums, sums, weights, scales, lows, bits, out, bounds[part], bounds[part + 1])
            part = threads.take(taken)
