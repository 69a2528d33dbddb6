"""What the vector kernels (``kernels.bf16_dot``, ``kernels.f32_dot``) share: the LLVM IR pieces they
emit from numba ``@intrinsic``s (numba's own loops do not keep a tile of sums in registers, nor mask a
ragged edge, nor prefetch, so the inner loops are written as IR with these helpers), the head's tile
(``transposed_tile``), and the checks and row tiling around them.

numba's disk cache of a kernel is keyed on its own module's source: after changing the IR emitted here,
remove the kernels' cached files (``__pycache__/*.nbi``, ``*.nbc``) so they are compiled again.

Vectors are AVX-512's: ``LANES`` float32 lanes. Masked loads and stores touch no memory on lanes
that are off, so a tile at an array's edge reads and writes only the array's elements.
"""

from __future__ import annotations

import os

import numpy
from llvmlite import ir

from . import cpu_kernels, half_bits

if cpu_kernels.ENABLED:
    from numba import types
    from numba.core.extending import intrinsic

LANES = 16
F32, I1, I16, I32, I64 = ir.FloatType(), ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.IntType(64)
FLOATS = ir.VectorType(F32, LANES)


def host_has(feature: str, switch: str) -> bool:
    """True where numba's kernels run and the host CPU has ``feature`` (llvmlite's name), unless the
    environment variable ``switch`` is "0" (an A/B against the path it replaces)."""
    if not cpu_kernels.ENABLED or os.environ.get(switch, "1") == "0":
        return False
    return half_bits.host_has(feature)


def fits(out, a, w) -> bool:
    """True when ``out`` may receive ``a @ w`` from a kernel: None (allocated then), or float32 [M, N],
    C-contiguous, writeable and apart from both operands."""
    return out is None or (
        isinstance(out, numpy.ndarray)
        and out.dtype == numpy.float32
        and out.flags.c_contiguous
        and out.flags.writeable
        and out.shape == (a.shape[0], w.shape[1])
        and not numpy.may_share_memory(out, a)
        and not numpy.may_share_memory(out, w)
    )


def tile_rows(left):
    """Rows of the next tile of a row-major kernel when ``left`` rows remain: 8 (a decode batch of 8 in
    one pass over the weight) where 8 to 11 remain, else 6 (the widest tile's), 4, 2 or 1."""
    if 8 <= left < 12:
        return 8
    return 6 if left >= 6 else 4 if left >= 4 else 2 if left >= 2 else 1


if cpu_kernels.ENABLED:  # called from the kernels' numba loops
    tile_rows = cpu_kernels.numba.njit(cache=True, nogil=True)(tile_rows)


def literal(value):
    """The value of a numba integer literal type, None for a plain integer type."""
    return getattr(value, "literal_value", None)


def declare(builder, name, result, arguments):
    """The function ``name`` (an LLVM intrinsic) in the builder's module, declared on first use."""
    module = builder.module
    function = module.globals.get(name)
    return function if function is not None else ir.Function(module, ir.FunctionType(result, arguments), name)


def data(context, builder, array_type, array):
    """Pointer to the first element of a numba array argument."""
    return context.make_array(array_type)(context, builder, array).data


def mask(builder, valid, width):
    """<width x i1>: the first ``valid`` (an i64, clamped to [0, width]) lanes set."""
    clamped = builder.select(builder.icmp_signed("<", valid, I64(0)), I64(0), valid)
    clamped = builder.select(builder.icmp_signed(">", clamped, I64(width)), I64(width), clamped)
    bits = builder.sub(builder.shl(I64(1), clamped), I64(1))  # width <= 32: no shift by 64
    return builder.bitcast(builder.trunc(bits, ir.IntType(width)), ir.VectorType(I1, width))


def _element_name(vector):
    return "f32" if vector.element == F32 else f"i{vector.element.width}"


def load(builder, pointer, lanes, vector):
    """Masked load of ``vector`` from ``pointer``: lanes off in ``lanes`` read as zeros and touch no memory."""
    name = f"llvm.masked.load.v{vector.count}{_element_name(vector)}.p0"
    function = declare(builder, name, vector, [pointer.type, I32, lanes.type, vector])
    align = 4 if vector.element == F32 else vector.element.width // 8
    return builder.call(function, [pointer, I32(align), lanes, vector(None)])


def store(builder, value, pointer, lanes):
    """Masked store of float32 ``value`` at ``pointer``: lanes off in ``lanes`` are not written."""
    name = f"llvm.masked.store.v{value.type.count}f32.p0"
    function = declare(builder, name, ir.VoidType(), [value.type, pointer.type, I32, lanes.type])
    builder.call(function, [value, pointer, I32(4), lanes])


def prefetch(builder, pointer, level=1):
    """Ask for the cache line at ``pointer`` into cache ``level`` (1: L1, 2: L2; a hint, never a fault)."""
    function = declare(builder, "llvm.prefetch.p0", ir.VoidType(), [pointer.type, I32, I32, I32])
    builder.call(function, [pointer, I32(0), I32(4 - level), I32(1)])  # LLVM's locality 3: L1


def ask_along(builder, base, at, col, lines: int, line: int, width, span, wrap):
    """One step of a walk through a weight in storage order, asking for ``lines`` cache lines of ``line``
    elements each (into L2) from element ``at`` of ``base``: the walk runs along rows of ``span``
    elements, ``col`` its column in the current one, ``width`` elements a step, ``wrap`` elements from a
    row's end to the next row's start. Returns the next (at, col). The row-major kernels point it at the
    chunk of K after the one they sum, so the memory streams it while they compute."""
    for index in range(lines):
        prefetch(builder, builder.gep(base, [builder.add(at, I64(line * index))]), 2)
    col = builder.add(col, width)
    past = builder.icmp_signed(">=", col, span)
    at = builder.add(builder.add(at, width), builder.select(past, wrap, I64(0)))
    return at, builder.select(past, builder.sub(col, span), col)


def splat(builder, value, count):
    """A vector of ``count`` lanes, each ``value`` (a scalar)."""
    one = builder.insert_element(ir.VectorType(value.type, count)(None), value, I32(0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(I32, count), [0] * count))


def add_into(builder, out, at, value, lanes):
    """out[at : at + len(value)] += value on the lanes of ``lanes``."""
    pointer = builder.gep(out, [at])
    store(builder, builder.fadd(load(builder, pointer, lanes, value.type), value), pointer, lanes)


def add_tile(builder, out, pitch, sums, rows, cols):
    """out[r, j] += the tile ``sums`` (``rows`` rows of float32 vectors, row-major) for j < ``cols``
    (an i64): ``out`` a pointer to the tile's first element, ``pitch`` elements a row."""
    vectors = len(sums) // rows
    for r in range(rows):
        row = builder.mul(I64(r), pitch)
        for v in range(vectors):
            lanes = mask(builder, builder.sub(cols, I64(LANES * v)), LANES)
            add_into(builder, out, builder.add(row, I64(LANES * v)), sums[r * vectors + v], lanes)


def loop(builder, count, carried, body):
    """for i in range(count): carried = body(i, carried) (lists of LLVM values); the final ``carried``."""
    entry = builder.block
    header = builder.append_basic_block("dot.header")
    step = builder.append_basic_block("dot.body")
    done = builder.append_basic_block("dot.done")
    builder.branch(header)
    builder.position_at_end(header)
    index = builder.phi(I64)
    index.add_incoming(I64(0), entry)
    phis = []
    for value in carried:
        phi = builder.phi(value.type)
        phi.add_incoming(value, entry)
        phis.append(phi)
    builder.cbranch(builder.icmp_signed("<", index, count), step, done)
    builder.position_at_end(step)
    updated = body(index, phis)
    index.add_incoming(builder.add(index, I64(1)), builder.block)
    for phi, value in zip(phis, updated):
        phi.add_incoming(value, builder.block)
    builder.branch(header)
    builder.position_at_end(done)
    return phis


def _fold(builder, x, y, bit):
    """One level of the reduction tree: lanes with ``bit`` clear hold x's lanes l + l ^ bit, the
    others y's: two vectors of partial sums become one with half as many lanes per sum."""
    lanes = range(LANES)
    keep = [lane if lane & bit == 0 else LANES + (lane ^ bit) for lane in lanes]
    swap = [lane ^ bit if lane & bit == 0 else LANES + lane for lane in lanes]
    index = ir.VectorType(I32, LANES)
    return builder.fadd(
        builder.shuffle_vector(x, y, ir.Constant(index, keep)),
        builder.shuffle_vector(x, y, ir.Constant(index, swap)),
    )


def _reduce(builder, vectors):
    """One vector whose lanes hold the lane sums of ``vectors`` (at most 16): (vector, owners),
    ``owners[l]`` the index of the vector whose sum lane l holds. Every vector's lanes are summed by
    the same tree, however many vectors there are (a tile's tail rows give its whole rows' bits)."""
    items = [(v, [i] * LANES) for i, v in enumerate(vectors)]
    bit = LANES // 2
    while bit:
        pairs = zip(items[0::2], items[1::2]) if len(items) > 1 else [(items[0], items[0])]
        items = [
            (_fold(builder, x, y, bit), [xo[lane] if lane & bit == 0 else yo[lane] for lane in range(LANES)])
            for (x, xo), (y, yo) in pairs
        ]
        bit //= 2
    return items[0]


def add_reduced(builder, out, pitch, sums, rows, tile, cols):
    """out[r, c] += the lane sum of ``sums[r * tile + c]`` (float32 vectors) for r < ``rows`` and
    c < ``cols`` (an i64, at most ``tile``): ``out`` a pointer to the tile's first element, ``pitch``
    elements a row."""
    reduced, owners = _reduce(builder, sums)
    index = ir.VectorType(I32, tile)
    lanes = mask(builder, cols, tile)
    for r in range(rows):
        row = builder.shuffle_vector(
            reduced, reduced, ir.Constant(index, [owners.index(r * tile + c) for c in range(tile)])
        )
        add_into(builder, out, builder.mul(I64(r), pitch), row, lanes)


TILE = 4  # rows of ``a`` and of ``e`` in ``transposed_tile``'s tiles


def transposed_tile(vector, multiply_add, ahead, level):
    """An intrinsic ``tile(a, e, out, at)``, ``at`` = (c, cols): out[:, c : c + cols] += a @ e[c : c +
    cols].T for ``cols`` <= TILE, ``e`` [N, K] and ``out`` [M, N] C-contiguous, ``a`` [M, >= K]'s
    rows read up to K. Each lane of a sum vector runs along K, ``vector`` (an LLVM vector type) of
    elements a step, and ``multiply_add(builder, acc, x, y)`` adds a step's products of ``x`` and ``y``
    to float32 ``acc``; TILE x TILE vectors a tile (rows past the last whole tile: one a tile), reduced
    at the end (``add_reduced``), so ``e``'s rows stay in L1 for every row of ``a``. The rows of ``e``
    ``ahead`` tiles further are prefetched into cache ``level`` as a tile reads its own."""

    @intrinsic
    def tile(typingctx, a, e, out, at):
        def codegen(context, builder, signature, args):
            a_arr, e_arr, out_arr = (context.make_array(signature.args[i])(context, builder, args[i]) for i in range(3))
            m, a_pitch = (builder.extract_value(a_arr.shape, i) for i in range(2))
            k, n = builder.extract_value(e_arr.shape, 1), builder.extract_value(out_arr.shape, 1)
            c, cols = (builder.extract_value(args[3], i) for i in range(2))
            e_data = builder.gep(e_arr.data, [builder.mul(c, k)])
            step_width = vector.count
            none = ir.Constant(ir.VectorType(I1, step_width), [0] * step_width)
            steps = builder.sdiv(builder.add(k, I64(step_width - 1)), I64(step_width))

            def rows(first, count):
                """The tile of ``count`` rows from row ``first``."""
                a_data = builder.gep(a_arr.data, [builder.mul(first, a_pitch)])

                def step(index, accs):
                    at = builder.mul(index, I64(step_width))
                    present = mask(builder, builder.sub(k, at), step_width)
                    xs = [
                        load(
                            builder,
                            builder.gep(a_data, [builder.add(builder.mul(I64(r), a_pitch), at)]),
                            present,
                            vector,
                        )
                        for r in range(count)
                    ]
                    ys = []
                    for j in range(TILE):
                        row = builder.add(builder.mul(I64(j), k), at)
                        lanes = builder.select(builder.icmp_signed("<", I64(j), cols), present, none)
                        ys.append(load(builder, builder.gep(e_data, [row]), lanes, vector))
                        ahead_row = builder.add(row, builder.mul(I64(ahead * TILE), k))
                        prefetch(builder, builder.gep(e_data, [ahead_row]), level)
                    return [
                        multiply_add(builder, accs[r * TILE + j], xs[r], ys[j])
                        for r in range(count)
                        for j in range(TILE)
                    ]

                accs = loop(builder, steps, [FLOATS(None)] * (count * TILE), step)
                out_data = builder.gep(out_arr.data, [builder.add(builder.mul(first, n), c)])
                add_reduced(builder, out_data, n, accs, count, TILE, cols)
                return []

            whole = builder.sdiv(m, I64(TILE))
            loop(builder, whole, [], lambda index, _: rows(builder.mul(index, I64(TILE)), TILE))
            tail = builder.mul(whole, I64(TILE))
            loop(builder, builder.sub(m, tail), [], lambda index, _: rows(builder.add(tail, index), 1))
            return context.get_dummy_value()

        return types.void(a, e, out, at), codegen

    return tile
