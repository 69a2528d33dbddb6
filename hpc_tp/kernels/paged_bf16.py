"""Attention over a bfloat16 paged KV cache at the rate of AVX512_BF16's ``vdpbf16ps``: the bfloat16
branch of ``kernels.paged_attention.decode`` where the CPU has the instruction, and a prefill's
(``prefill``: a prompt's query rows, each a query head at a position, in tiles of 4 over the keys the
tile's positions see, each row's softmax over its own keys).

Per (row, KV head) pair, as the widening kernel does, but each step on 16 float32 lanes:

* scores: ``vdpbf16ps`` sums pairs of a query's and a key's bfloat16 elements along the head
  dimension straight from the pool's bits (no widening), a tile of up to 4 query heads x 4 keys in
  16 vectors reduced to 16 sums at the end (``vector_ir.add_reduced``); each key's line is read once
  for the group's query heads (grouped-query attention);
* softmax: the largest score and exp(score - largest) 16 scores a step (exp as Cephes' ``expf``:
  a polynomial on [-ln2/2, ln2/2] and the power of two in the exponent's bits, within one float32 ulp
  of exp on [-87, 0]); differences below -87 are taken as -87 (a weight under 2e-38 of the largest's);
* weighted values: each V row's bits widened to float32 in registers (a shift) and added into up to
  4 heads x 64 columns of float32 sums with FMAs, weighted by the float32 softmax (as the composed
  path's float32 P @ V; ``vdpbf16ps`` would round the weights to bfloat16).

Products of two bfloat16 values are exact in float32, so the result is the float32 attention of the
same values up to the order of the sums and exp's last bits, as the widening kernel's is. The
instruction treats subnormal bfloat16 inputs (below 1.2e-38) as zero.
"""

from __future__ import annotations

import numpy

from . import bf16_dot, cpu_kernels, half_bits, threads, vector_ir

AVAILABLE = bf16_dot.AVAILABLE
QUERY_TILE = 4  # query heads of one score or value tile (16 vectors of sums at most)
KEY_TILE = vector_ir.TILE  # keys of one score tile
VALUE_COLUMNS = 4 * vector_ir.LANES  # head-dimension columns of one value tile
PREFILL_QUERIES = 16  # a prefill's queries of one row and KV head that a thread takes together
# Keys ahead of a score tile whose K rows it asks for. Workload B's decode attention cycling through 30
# layers' pools (out of cache, as in a step), four runs at load 4-5, each alternating in one process:
# 0.09-0.25 ms a layer (the runs' fastest rounds) asking for nothing, 0.08-0.15 asking 16 keys ahead
# (8, 12, 24 and 32 no faster); one layer's pools in cache: 0.071 against 0.074-0.075.
AHEAD = 16
# exp(x) = 2^n exp(r), x = n ln2 + r: ln2 in two parts (Cody and Waite) so that r is exact
_LOG2E, _LN2_HIGH, _LN2_LOW = 1.44269504088896341, 0.693359375, -2.12194440e-4
_EXP_POLYNOMIAL = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_LOWEST = -87.0  # x below it taken as it: 2^n stays a normal float32 (n >= -126)


def decode(q_bits, k_bits, v_bits, slots, counts, out, window, bounds):
    """``paged_attention.decode`` on bfloat16 bits: the queries' [B, hk, g, d] (C-contiguous), the
    pools' [hk, slots, d], the output's [B, hk, g, d] (any strides: the layer's view), each value
    rounded to nearest even once (``half_bits.narrow``, as numpy's cast); each range of ``bounds`` a
    thread's (row, KV head) pairs."""
    threads.run(_decode, _decode_over, (q_bits, k_bits, v_bits, slots, counts, out, window), bounds)


def prefills(q, pool) -> bool:
    """True where ``prefill`` takes these queries and pool: numpy bfloat16 both, on a CPU with the instruction."""
    return AVAILABLE and all(isinstance(a, numpy.ndarray) and a.dtype == bf16_dot._BF16 for a in (q, pool))


def prefill(q, k_pool, v_pool, slots, offset: int, lengths, out, window: int):
    """A prefill's causal attention on bfloat16 arrays: the (scaled) queries ``q`` [B, hk, g, T, d] at
    positions ``offset`` .. ``offset`` + T - 1 over each row's keys, row b's key at position p in slot
    ``slots[b, p]`` of the pools [hk, slots, d] (its new ones written there), of which it holds the
    first ``lengths[b]``; each query over its last ``window`` positions (0: all). Into ``out`` [B, hk,
    g, T, d] (any strides: the layer's view), each value rounded once. Threads take ranges of blocks of
    PREFILL_QUERIES queries of about equal work."""
    batch, heads, group, count, d = q.shape
    queries = numpy.ascontiguousarray(q.transpose(0, 1, 3, 2, 4)).view(numpy.uint16)  # a query's heads together
    rows = numpy.ascontiguousarray(slots, dtype=numpy.int64)  # its tiles address the slots by offset
    positions = offset + numpy.arange(count)
    ends = numpy.minimum(positions + 1, numpy.asarray(lengths)[:, None])
    seen = numpy.maximum(ends - (numpy.maximum(0, positions + 1 - window) if window else 0), 0)
    work = numpy.add.reduceat(seen, numpy.arange(0, count, PREFILL_QUERIES), axis=1)  # [B, blocks]
    bounds = threads.balanced(numpy.repeat(work[:, None], heads, axis=1).reshape(-1))
    lengths = numpy.ascontiguousarray(lengths, dtype=numpy.int64)
    pools = (k_pool.view(numpy.uint16), v_pool.view(numpy.uint16))
    args = (queries, *pools, rows, offset, lengths, out.view(numpy.uint16), window)
    threads.run(_prefill, _prefill_over, args, bounds)


if AVAILABLE:
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    from .bf16_dot import _HALVES, _dot
    from .vector_ir import F32, FLOATS, I16, I32, I64, LANES

    _WORDS = ir.VectorType(I16, LANES)
    _INTS = ir.VectorType(I32, LANES)

    def _splat(value):
        return ir.Constant(FLOATS, [value] * LANES)

    def _call(builder, name, arguments, result=FLOATS):
        """The LLVM intrinsic ``name`` on ``arguments`` (declared with their types)."""
        return builder.call(vector_ir.declare(builder, name, result, [a.type for a in arguments]), arguments)

    def _fma(builder, x, y, z):
        return _call(builder, "llvm.fma.v16f32", [x, y, z])

    def _exp(builder, x):
        """exp of float32 vector ``x`` (<= 0, >= _LOWEST): Cephes' ``expf``."""
        n = _call(builder, "llvm.floor.v16f32", [_fma(builder, x, _splat(_LOG2E), _splat(0.5))])
        r = _fma(builder, n, _splat(-_LN2_HIGH), x)
        r = _fma(builder, n, _splat(-_LN2_LOW), r)
        poly = _splat(_EXP_POLYNOMIAL[0])
        for coefficient in _EXP_POLYNOMIAL[1:]:
            poly = _fma(builder, poly, r, _splat(coefficient))
        poly = builder.fadd(_fma(builder, poly, builder.fmul(r, r), r), _splat(1.0))
        exponent = builder.add(builder.fptosi(n, _INTS), ir.Constant(_INTS, [127] * LANES))
        power = builder.bitcast(builder.shl(exponent, ir.Constant(_INTS, [23] * LANES)), FLOATS)
        return builder.fmul(poly, power)

    def _array(context, builder, signature, args, index, at):
        """Pointer to element ``args[at]`` of the array argument ``index``."""
        return builder.gep(vector_ir.data(context, builder, signature.args[index], args[index]), [args[at]])

    @intrinsic(prefer_literal=True)
    def _score_tile(typingctx, q, q_at, rows, d, k, k_at, slots, slot_at, keys, scores, s_at, s_pitch):
        """scores[r, c] += q[r] . k[slots[c]] for query rows r < ``rows`` (a literal, <= QUERY_TILE)
        from element ``q_at`` of ``q`` (``d`` elements each) and keys c < ``keys`` (<= KEY_TILE), key
        row ``slots[slot_at + c]`` of the pool ``k`` from element ``k_at`` (its KV head); the sums from
        element ``s_at`` of ``scores``, ``s_pitch`` elements a row. All bfloat16 bits but ``scores``."""
        count = vector_ir.literal(rows)
        if count is None:
            return None
        sig = types.void(q, q_at, rows, d, k, k_at, slots, slot_at, keys, scores, s_at, s_pitch)

        def codegen(context, builder, signature, args):
            d_, keys_, s_pitch_ = args[3], args[8], args[11]
            q_data, k_data = (
                _array(context, builder, signature, args, 0, 1),
                _array(context, builder, signature, args, 4, 5),
            )
            slot_data = _array(context, builder, signature, args, 6, 7)
            present = [builder.icmp_signed("<", I64(c), keys_) for c in range(KEY_TILE)]
            key_rows = []
            for c in range(KEY_TILE):  # a key past ``keys`` reads the first one's slot, and none of its row
                slot = builder.load(builder.gep(slot_data, [builder.select(present[c], I64(c), I64(0))]))
                key_rows.append(builder.gep(k_data, [builder.mul(slot, d_)]))
            none = ir.Constant(ir.VectorType(ir.IntType(1), 2 * LANES), [0] * 2 * LANES)

            def step(index, accs):
                at = builder.mul(index, I64(2 * LANES))
                lanes = vector_ir.mask(builder, builder.sub(d_, at), 2 * LANES)
                xs = [
                    vector_ir.load(
                        builder, builder.gep(q_data, [builder.add(builder.mul(I64(r), d_), at)]), lanes, _HALVES
                    )
                    for r in range(count)
                ]
                ys = [
                    vector_ir.load(builder, builder.gep(row, [at]), builder.select(present[c], lanes, none), _HALVES)
                    for c, row in enumerate(key_rows)
                ]
                return [
                    _dot(builder, accs[r * KEY_TILE + c], xs[r], ys[c]) for r in range(count) for c in range(KEY_TILE)
                ]

            steps = builder.sdiv(builder.add(d_, I64(2 * LANES - 1)), I64(2 * LANES))
            accs = vector_ir.loop(builder, steps, [FLOATS(None)] * (count * KEY_TILE), step)
            s_data = _array(context, builder, signature, args, 9, 10)
            # the reduction halves a power of two of vectors: 3 rows' 12 take 4 of zeros
            padded = accs + [FLOATS(None)] * ((1 << (len(accs) - 1).bit_length()) - len(accs))
            vector_ir.add_reduced(builder, s_data, s_pitch_, padded, count, KEY_TILE, keys_)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic(prefer_literal=True)
    def _prefetch_row(typingctx, pool, at, d, level):
        """Ask for the cache lines of ``d`` bfloat16 from element ``at`` of ``pool`` into cache ``level``."""
        if vector_ir.literal(level) is None:
            return None
        sig = types.void(pool, at, d, level)

        def codegen(context, builder, signature, args):
            row = _array(context, builder, signature, args, 0, 1)
            lines = builder.sdiv(builder.add(args[2], I64(2 * LANES - 1)), I64(2 * LANES))
            level_ = vector_ir.literal(signature.args[3])

            def ask(index, _):
                vector_ir.prefetch(builder, builder.gep(row, [builder.mul(index, I64(2 * LANES))]), level_)
                return []

            vector_ir.loop(builder, lines, [], ask)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def _softmax_row(typingctx, scores, at, count):
        """scores[at : at + count] = exp(score - the largest of them), in place; returns their sum
        (16 lanes of running sums added in one fixed order: the same bits on any thread)."""
        sig = types.float32(scores, at, count)

        def codegen(context, builder, signature, args):
            row, count_ = _array(context, builder, signature, args, 0, 1), args[2]
            vectors = builder.sdiv(builder.add(count_, I64(LANES - 1)), I64(LANES))

            def lanes_of(index):
                at = builder.mul(index, I64(LANES))
                return builder.gep(row, [at]), vector_ir.mask(builder, builder.sub(count_, at), LANES)

            def largest(index, carried):
                pointer, lanes = lanes_of(index)
                x = builder.select(lanes, vector_ir.load(builder, pointer, lanes, FLOATS), _splat(-numpy.inf))
                return [_call(builder, "llvm.maxnum.v16f32", [carried[0], x])]

            (top,) = vector_ir.loop(builder, vectors, [_splat(-numpy.inf)], largest)
            top = vector_ir.splat(builder, _call(builder, "llvm.vector.reduce.fmax.v16f32", [top], F32), LANES)

            def weigh(index, carried):
                pointer, lanes = lanes_of(index)
                x = builder.fsub(vector_ir.load(builder, pointer, lanes, FLOATS), top)
                low = builder.fcmp_ordered("<", x, _splat(_LOWEST))  # a nan stays, and reaches the output
                weights = _exp(builder, builder.select(low, _splat(_LOWEST), x))
                vector_ir.store(builder, weights, pointer, lanes)
                return [builder.fadd(carried[0], builder.select(lanes, weights, FLOATS(None)))]

            (total,) = vector_ir.loop(builder, vectors, [FLOATS(None)], weigh)
            return _call(builder, "llvm.vector.reduce.fadd.v16f32", [F32(0.0), total], F32)  # in lane order

        return sig, codegen

    @intrinsic(prefer_literal=True)
    def _value_tile(typingctx, w, w_at, w_pitch, rows, v, v_at, d, cols, slots, slot_at, keys, sums, s_at, s_pitch):
        """sums[r, i] += sum over t < ``keys`` of w[r, t] v[slots[t], i] for rows r < ``rows`` (a
        literal, <= QUERY_TILE) of float32 weights from element ``w_at`` of ``w`` (``w_pitch`` a row)
        and columns i < ``cols`` (<= VALUE_COLUMNS) of the bfloat16 pool ``v`` from element ``v_at``
        (``d`` elements a slot), each row of V widened in registers; the key row of t is
        ``slots[slot_at + t]``; float32 ``sums`` from element ``s_at``, ``s_pitch`` a row."""
        count = vector_ir.literal(rows)
        if count is None:
            return None
        sig = types.void(w, w_at, w_pitch, rows, v, v_at, d, cols, slots, slot_at, keys, sums, s_at, s_pitch)

        def codegen(context, builder, signature, args):
            w_pitch_, d_, cols_, keys_, s_pitch_ = args[2], args[6], args[7], args[10], args[13]
            w_data, v_data = (
                _array(context, builder, signature, args, 0, 1),
                _array(context, builder, signature, args, 4, 5),
            )
            slot_data = _array(context, builder, signature, args, 8, 9)
            vectors = VALUE_COLUMNS // LANES
            lanes = [vector_ir.mask(builder, builder.sub(cols_, I64(LANES * i)), LANES) for i in range(vectors)]
            shift = ir.Constant(_INTS, [16] * LANES)

            def step(t, accs):
                row = builder.gep(v_data, [builder.mul(builder.load(builder.gep(slot_data, [t])), d_)])
                values = []
                for i in range(vectors):  # a bfloat16 is the upper half of a float32's bits
                    bits = vector_ir.load(builder, builder.gep(row, [I64(LANES * i)]), lanes[i], _WORDS)
                    values.append(builder.bitcast(builder.shl(builder.zext(bits, _INTS), shift), FLOATS))
                updated = []
                for r in range(count):
                    weight = builder.load(builder.gep(w_data, [builder.add(builder.mul(I64(r), w_pitch_), t)]))
                    weight = vector_ir.splat(builder, weight, LANES)
                    updated += [_fma(builder, weight, values[i], accs[r * vectors + i]) for i in range(vectors)]
                return updated

            accs = vector_ir.loop(builder, keys_, [FLOATS(None)] * (count * vectors), step)
            s_data = _array(context, builder, signature, args, 11, 12)
            vector_ir.add_tile(builder, s_data, s_pitch_, accs, count, cols_)
            return context.get_dummy_value()

        return sig, codegen

    _jit = cpu_kernels.numba.njit(cache=True, nogil=True)
else:  # never called: ``paged_attention`` keeps the widening kernel without the instruction

    def _jit(function):
        return function


@_jit
def _score_tiles(q, q_at, rows, d, k, k_at, slots, slot_at, keys, scores, s_at, s_pitch):
    """``_score_tile`` for ``rows`` (1 to QUERY_TILE, a literal at each call)."""
    if rows == 4:
        _score_tile(q, q_at, 4, d, k, k_at, slots, slot_at, keys, scores, s_at, s_pitch)
    elif rows == 3:
        _score_tile(q, q_at, 3, d, k, k_at, slots, slot_at, keys, scores, s_at, s_pitch)
    elif rows == 2:
        _score_tile(q, q_at, 2, d, k, k_at, slots, slot_at, keys, scores, s_at, s_pitch)
    else:
        _score_tile(q, q_at, 1, d, k, k_at, slots, slot_at, keys, scores, s_at, s_pitch)


@_jit
def _value_tiles(w, w_at, w_pitch, rows, v, v_at, d, cols, slots, slot_at, keys, sums, s_at, s_pitch):
    """``_value_tile`` for ``rows`` (1 to QUERY_TILE, a literal at each call)."""
    if rows == 4:
        _value_tile(w, w_at, w_pitch, 4, v, v_at, d, cols, slots, slot_at, keys, sums, s_at, s_pitch)
    elif rows == 3:
        _value_tile(w, w_at, w_pitch, 3, v, v_at, d, cols, slots, slot_at, keys, sums, s_at, s_pitch)
    elif rows == 2:
        _value_tile(w, w_at, w_pitch, 2, v, v_at, d, cols, slots, slot_at, keys, sums, s_at, s_pitch)
    else:
        _value_tile(w, w_at, w_pitch, 1, v, v_at, d, cols, slots, slot_at, keys, sums, s_at, s_pitch)


@_jit
def _ask_ahead(k, v, head_at, row_slots, d, start, stop):
    """Ask for the K rows AHEAD keys after keys ``start`` .. ``stop`` - 1 of ``row_slots`` (the last
    key where fewer remain) into L1, and these keys' V rows into L2 (the value pass reads them after
    every score: a pair's V rows, 20 KiB at 160 keys of 64, wait there)."""
    for c in range(start, stop):
        _prefetch_row(k, head_at + row_slots[min(c + AHEAD, row_slots.shape[0] - 1)] * d, d, 1)
        _prefetch_row(v, head_at + row_slots[c] * d, d, 2)


@_jit
def _decode(q, k, v, slots, counts, out, window, first_pair, last_pair):
    """For (row, KV head) pairs ``first_pair`` .. ``last_pair`` - 1 (pair = row x heads + head): the
    group's scores a tile of keys at a time, each row's softmax, then the weighted rows of V, divided
    by the softmax's sum once at the end."""
    heads, group, d = q.shape[1], q.shape[2], q.shape[3]
    pool, width = k.shape[1], slots.shape[1]
    scores = numpy.empty((group, width), numpy.float32)  # row j: query head j's scores, then weights
    sums = numpy.empty((group, d), numpy.float32)
    totals = numpy.empty(group, numpy.float32)
    for pair in range(first_pair, last_pair):
        b, h = pair // heads, pair % heads
        n = counts[b]
        first = max(0, n - window) if window else 0
        seen, head_at, row_slots = n - first, h * pool * d, slots[b, first:n]
        scores[:, :seen] = 0.0  # the score tiles add into them
        sums[:] = 0.0
        for c in range(min(AHEAD, seen)):  # the pair's first keys; the tiles ask for those after
            _prefetch_row(k, head_at + row_slots[c] * d, d, 1)
        for j in range(0, group, QUERY_TILE):
            rows = min(QUERY_TILE, group - j)
            q_at = ((b * heads + h) * group + j) * d
            for t in range(0, seen, KEY_TILE):
                keys = min(KEY_TILE, seen - t)
                if j == 0:
                    _ask_ahead(k, v, head_at, row_slots, d, t, t + keys)
                _score_tiles(
                    q, q_at, rows, d, k, head_at, slots, b * width + first + t, keys, scores, j * width + t, width
                )
            for r in range(j, j + rows):
                totals[r] = _softmax_row(scores, r * width, seen)
            for c in range(0, d, VALUE_COLUMNS):
                cols = min(VALUE_COLUMNS, d - c)
                at = b * width + first
                _value_tiles(
                    scores, j * width, width, rows, v, head_at + c, d, cols, slots, at, seen, sums, j * d + c, d
                )
        for r in range(group):
            for i in range(d):
                out[b, h, r, i] = half_bits.narrow(sums[r, i] / totals[r], out)


@_jit
def _prefill(q, k, v, slots, offset, lengths, out, window, first_item, last_item):
    """For items ``first_item`` .. ``last_item`` - 1 (item = (row x heads + head) x blocks + block, a
    block PREFILL_QUERIES queries): the causal attention of the block's query rows (a query's heads
    side by side, [T x g] rows a pair) in tiles of QUERY_TILE rows, each row over the keys its position
    and window let it see among the row's first ``lengths[b]``: a tile's scores over the keys any of its
    rows sees, each row's softmax over its own, the others' weights zero, then the weighted rows of V.
    A query that sees no key gets zeros (as the composed softmax gives a fully masked row)."""
    heads, count, group, d = q.shape[1], q.shape[2], q.shape[3], q.shape[4]
    blocks, width = -(-count // PREFILL_QUERIES), slots.shape[1]
    scores = numpy.empty((QUERY_TILE, width), numpy.float32)
    sums = numpy.empty((QUERY_TILE, d), numpy.float32)
    totals = numpy.empty(QUERY_TILE, numpy.float32)
    starts, ends = numpy.empty(QUERY_TILE, numpy.int64), numpy.empty(QUERY_TILE, numpy.int64)
    for item in range(first_item, last_item):
        pair, block = item // blocks, item % blocks
        b, h = pair // heads, pair % heads
        head_at = h * k.shape[1] * d
        last_row = min(count, (block + 1) * PREFILL_QUERIES) * group
        for tile in range(block * PREFILL_QUERIES * group, last_row, QUERY_TILE):
            rows = min(QUERY_TILE, last_row - tile)
            low, high = width, 0
            for r in range(rows):
                position = offset + (tile + r) // group
                starts[r] = max(0, position + 1 - window) if window else 0
                ends[r] = max(starts[r], min(position + 1, lengths[b]))
                if ends[r] > starts[r]:
                    low, high = min(low, starts[r]), max(high, ends[r])
            sums[:] = 0.0
            totals[:] = 1.0
            if high > low:
                seen = high - low
                scores[:rows, :seen] = 0.0  # the score tiles add into them
                q_at = (pair * count * group + tile) * d
                for c in range(0, seen, KEY_TILE):
                    keys = min(KEY_TILE, seen - c)
                    _score_tiles(q, q_at, rows, d, k, head_at, slots, b * width + low + c, keys, scores, c, width)
                for r in range(rows):
                    if ends[r] > starts[r]:
                        totals[r] = _softmax_row(scores, r * width + starts[r] - low, ends[r] - starts[r])
                    scores[r, : max(0, starts[r] - low)] = 0.0
                    scores[r, max(0, ends[r] - low) : seen] = 0.0
                for c in range(0, d, VALUE_COLUMNS):
                    cols = min(VALUE_COLUMNS, d - c)
                    at = b * width + low
                    _value_tiles(scores, 0, width, rows, v, head_at + c, d, cols, slots, at, seen, sums, c, d)
            for r in range(rows):
                t, j = (tile + r) // group, (tile + r) % group
                for i in range(d):
                    out[b, h, j, t, i] = half_bits.narrow(sums[r, i] / totals[r], out)


@threads.parallel_jit
def _prefill_over(q, k, v, slots, offset, lengths, out, window, bounds):
    for part in threads.prange(bounds.shape[0] - 1):
        _prefill(q, k, v, slots, offset, lengths, out, window, bounds[part], bounds[part + 1])


@threads.parallel_jit
def _decode_over(q, k, v, slots, counts, out, window, bounds):
    for part in threads.prange(bounds.shape[0] - 1):
        _decode(q, k, v, slots, counts, out, window, bounds[part], bounds[part + 1])
