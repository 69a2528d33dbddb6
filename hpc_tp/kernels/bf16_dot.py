"""bfloat16 products at the rate of AVX512_BF16's ``vdpbf16ps``: ``out = a @ w`` for bfloat16 ``a`` and
``w``, summed in float32.

``vdpbf16ps acc, x, y`` adds ``x[2i] y[2i] + x[2i+1] y[2i+1]`` to float32 lane i of ``acc``: 32
multiply-adds an instruction where float32's FMA does 16, and no widening of the weights first. A
product of two bfloat16 values is exact in float32, so the result is the float32 product of the same
values up to the order of the sums (the instruction treats subnormal inputs as zero: a bfloat16
below 1.2e-38 counts as 0).

The instruction pairs neighbouring elements along the summed axis. A model loaded for inference keeps
its weights packed for it (``kernels.bf16_panels``); the kernels also read a weight as it is stored
(training, a model built in process), so nothing is copied:

* ``w`` a ``PanelMatrix`` (a loaded model's linear layers, and its LM head's W.T): each pair row of a
  panel is two vectors that are the instruction's operands as they lie, and a tile of up to 8 rows x
  32-128 columns sums all of K in registers, walking its panels in the order they are stored (a
  decode streams each once from memory; a prefill's row tiles share a block's panels in L2).
* ``w`` row-major [K, N]: rows ``p`` and ``p + 1`` of 32 columns are loaded and
  interleaved in registers, and each input row's pair ``a[r, p:p + 2]`` (one 32-bit word) is
  broadcast to every lane; a tile of 6 rows x 64 columns (8 x 32 for a decode batch of 8) is summed
  in registers over a chunk of 32 rows of K, then added to ``out``; the chunk is walked across every
  column while the last row tile asks for the next chunk's lines in the order they are stored (the
  weight streams from memory when decoding, and a tile's own strip is a line a row at a row's stride).
* ``w`` the transposed view of a row-major [N, K] (an LM head ``h @ E.T``): each lane sums
  pairs of one row of ``a`` against one row of ``E`` along K, and a 4 x 4 tile's 16 vectors are
  reduced to one vector of 16 sums by a tree of shuffles and adds at the end.

The vector code is LLVM IR emitted by numba ``@intrinsic``s (``llvm.x86.avx512bf16.dpbf16ps.512``
with masked loads and stores for the ragged edges); the loops around it are numba. ``AVAILABLE`` is
True only where the host CPU has avx512bf16 (llvmlite's ``get_host_cpu_features``) and numba is
there; elsewhere, or with ``HPC_TP_BF16_DOT=0``, ``kernels.small_m`` and ``kernels.blas`` keep their
path (weights widened to float32). The kernels compile on first use, so a CPU without the
instruction never compiles them.

Every kernel takes an output-column range [start, stop): disjoint ranges write disjoint columns, so
threads may split one product by columns.
"""

from __future__ import annotations

import numpy

from . import bf16_panels, cpu_kernels, threads, vector_ir

# Ranges of output columns a thread takes start at multiples of the widest tile (64 columns).
COLUMN_ALIGN = 64

COLUMN_GROUP = 32  # columns of one interleaved pair of weight-row loads (two float32 vectors)
# Weight rows summed in registers before a tile is added to ``out``: the row-major kernel walks this
# many rows across every column of its range (they stay in L2 across the row tiles) while its last row
# tile asks for the next chunk's lines in storage order, as ``f32_dot`` does.
K_CHUNK = 32
# A prefill's products (more rows than DECODE_ROWS) are compute-bound: they sum PREFILL_CHUNK rows of K
# in registers, over blocks of PREFILL_BLOCK columns that stay in L2 across the row tiles (at 96 rows
# by [576, 3072] chunks of 32 took 1.1-1.3x as long: out is read and written 8 times as often).
DECODE_ROWS, PREFILL_CHUNK, PREFILL_BLOCK = 16, 256, 512
# A prefill's tiles ask for the weight lines of the tile this many tiles to the right (same rows) while
# they sum their own: at 2, 8 rows by [576, 3072] took 0.28-0.33 ms against 0.40-0.47 at 1; 3-6 no faster.
PREFETCH_TILES = 2
PANEL_BLOCK = 128  # columns of panels the row tiles of a packed weight's product share (in L2)


AVAILABLE = vector_ir.host_has("avx512bf16", "HPC_TP_BF16_DOT")


def _bfloat16_dtype():
    try:
        import ml_dtypes
    except ImportError:  # no bfloat16 arrays without it
        return None
    return numpy.dtype(ml_dtypes.bfloat16)


_BF16 = _bfloat16_dtype()


def takes(a, w, out=None) -> bool:
    """True when ``matmul`` computes ``a @ w`` (into ``out``) here: ``vdpbf16ps`` on this CPU, ``a`` 2-D
    numpy bfloat16, ``w`` a ``bf16_panels.PanelMatrix`` or 2-D numpy bfloat16, row-major or the
    transposed view of a row-major array, ``out`` None or float32 [M, N] C-contiguous apart from both."""
    plain = (
        isinstance(w, numpy.ndarray)
        and w.dtype == _BF16
        and w.ndim == 2
        and (w.flags.c_contiguous or w.T.flags.c_contiguous)
    )
    return (
        AVAILABLE
        and isinstance(a, numpy.ndarray)
        and a.dtype == _BF16
        and a.ndim == 2
        and (plain or isinstance(w, bf16_panels.PanelMatrix))
        and a.shape[1] == w.shape[0]
        and vector_ir.fits(out, a, w)
    )


def packs(w) -> bool:
    """True when the kernels here would read the weight ``w`` (numpy bfloat16 [K, N]) from its panels
    (``bf16_panels``), which a model loaded for inference then keeps instead."""
    return AVAILABLE and isinstance(w, numpy.ndarray) and w.dtype == _BF16 and w.ndim == 2


def warm_up(dtype):
    """Compile (or load from numba's cache) the kernels at the rank's thread count, for a model of
    bfloat16 ``dtype`` where the CPU has the instruction, before a server's first request would wait."""
    if not AVAILABLE or numpy.dtype(dtype) != _BF16:
        return
    k = 2 * COLUMN_ALIGN
    n = threads.split_columns(k * _BF16.itemsize, COLUMN_ALIGN)  # more than one range: the drivers too
    a, w = numpy.ones((8, k), _BF16), numpy.ones((k, n), _BF16)
    for weight in (w, numpy.ascontiguousarray(w.T).T, bf16_panels.PanelMatrix(w)):
        matmul(a, weight)


def _padded_bits(a):
    """``a``'s bits, C-contiguous, columns zero-padded to a whole pair (the kernels read pairs)."""
    if a.shape[1] % 2 or not a.flags.c_contiguous:
        padded = numpy.zeros((a.shape[0], a.shape[1] + a.shape[1] % 2), a.dtype)
        padded[:, : a.shape[1]] = a
        a = padded
    return a.view(numpy.uint16)


def matmul(a, w, out=None, accumulate: bool = False, start: int = 0, stop: int | None = None):
    """``out[:, start:stop] = a @ w[:, start:stop]`` (``+=`` with ``accumulate``) in float32 for operands
    ``takes`` accepts; ``out`` [M, N] float32 C-contiguous, allocated when None; its other columns are
    left as they are. A packed ``w``'s range starts at a panel's first column."""
    m, n = a.shape[0], w.shape[1]
    stop = n if stop is None else stop
    if out is None:
        out = numpy.empty((m, n), numpy.float32)
    packed = isinstance(w, bf16_panels.PanelMatrix)
    if packed and start % bf16_panels.PANEL:
        raise ValueError(f"a packed weight's column range starts at a panel (of {bf16_panels.PANEL}), not at {start}")
    bits = _padded_bits(a)
    split = (start, stop, COLUMN_ALIGN, 2 * w.shape[0])
    if packed:
        threads.share(_rows_by_panels, _rows_by_panels_over, (bits, w.panels, out, accumulate), *split)
    elif w.flags.c_contiguous:
        threads.share(_rows_by_matrix, _rows_by_matrix_over, (bits, w.view(numpy.uint16), out, accumulate), *split)
    else:
        args = (bits, w.T.view(numpy.uint16), out, accumulate)
        threads.share(_rows_by_transposed, _rows_by_transposed_over, args, *split)
    return out


if AVAILABLE:
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    from .vector_ir import FLOATS, I16, I32, I64, LANES

    class _BFloat(ir.Type):
        """LLVM's ``bfloat``, which llvmlite's IR builder does not name (the instruction's operand type)."""

        def _to_string(self):
            return "bfloat"

        def __eq__(self, other):
            return isinstance(other, _BFloat)

        def __hash__(self):
            return hash(_BFloat)

    _PAIRS = ir.VectorType(_BFloat(), 2 * LANES)
    _HALVES = ir.VectorType(I16, 2 * LANES)

    def _dot(builder, acc, x, y):
        """acc + the pairwise products of ``x`` and ``y`` (``<32 x i16>`` bfloat16 bits each)."""
        dot = vector_ir.declare(builder, "llvm.x86.avx512bf16.dpbf16ps.512", FLOATS, [FLOATS, _PAIRS, _PAIRS])
        return builder.call(dot, [acc, builder.bitcast(x, _PAIRS), builder.bitcast(y, _PAIRS)])

    def _broadcast_pair(builder, halves, at):
        """The 32-bit word of two bfloat16 at ``halves + at`` (elements) in every lane, as <32 x i16>."""
        word = builder.load(builder.bitcast(builder.gep(halves, [at]), I32.as_pointer()), align=2)
        return builder.bitcast(vector_ir.splat(builder, word, LANES), _HALVES)

    def _sum_pairs(builder, a_data, a_pitch, index, rows, weights, sums):
        """``sums`` (``rows`` rows of one vector per weight vector, row-major) plus each row's pair
        ``index`` of ``a`` (from ``a_data``, ``a_pitch`` elements a row) against each of ``weights``."""
        updated = []
        for r in range(rows):
            pair = _broadcast_pair(
                builder, a_data, builder.add(builder.mul(I64(r), a_pitch), builder.mul(index, I64(2)))
            )
            updated += [_dot(builder, sums[r * len(weights) + v], pair, weights[v]) for v in range(len(weights))]
        return updated

    @intrinsic(prefer_literal=True)
    def _panel_tile(typingctx, a, a_at, a_pitch, rows, w, w_at, pairs, out, out_at, out_pitch, cols, groups):
        """out[r, j] += a[r, :2 pairs] @ W[:2 pairs, j] for r < ``rows`` (a literal) and j < ``cols`` of
        the ``groups`` (a literal) panels of W from element ``w_at`` of ``w`` (``bf16_panels``' layout,
        ``pairs`` pair rows a panel): a step loads each panel's pair row as two vectors that are
        ``vdpbf16ps`` operands as they lie. Nothing is prefetched: a panel is one run of memory, which
        the hardware's prefetchers stream (asking for lines 1-4 KiB ahead made no difference)."""
        count, group_count = vector_ir.literal(rows), vector_ir.literal(groups)
        if count is None or group_count is None:
            return None
        sig = types.void(a, a_at, a_pitch, rows, w, w_at, pairs, out, out_at, out_pitch, cols, groups)

        def codegen(context, builder, signature, args):
            a_arr, a_at_, a_pitch_, _, w_arr, w_at_, pairs_, out_arr, out_at_, out_pitch_, cols_, _ = args
            kinds = signature.args
            a_data = builder.gep(vector_ir.data(context, builder, kinds[0], a_arr), [a_at_])
            w_data = builder.gep(vector_ir.data(context, builder, kinds[4], w_arr), [w_at_])
            out_data = builder.gep(vector_ir.data(context, builder, kinds[7], out_arr), [out_at_])
            panel_pitch = builder.mul(pairs_, I64(bf16_panels.PAIR_ROW))
            # a panel past ``cols`` (a tile at the right edge) is not read at all: it may not exist
            present = [
                vector_ir.mask(
                    builder, builder.select(builder.icmp_signed(">", cols_, I64(COLUMN_GROUP * g)), I64(32), I64(0)), 32
                )
                for g in range(group_count)
            ]

            def step(index, sums):
                row = builder.gep(w_data, [builder.mul(index, I64(bf16_panels.PAIR_ROW))])
                weights = []
                for g in range(group_count):
                    first = builder.gep(row, [builder.mul(I64(g), panel_pitch)])
                    for half in range(2):
                        at = builder.gep(first, [I64(half * 2 * LANES)])
                        weights.append(vector_ir.load(builder, at, present[g], _HALVES))
                return _sum_pairs(builder, a_data, a_pitch_, index, count, weights, sums)

            sums = vector_ir.loop(builder, pairs_, [FLOATS(None)] * (count * 2 * group_count), step)
            vector_ir.add_tile(builder, out_data, out_pitch_, sums, count, cols_)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic(prefer_literal=True)
    def _matrix_tile(
        typingctx, a, a_at, a_pitch, rows, w, w_at, w_pitch, pairs, out, out_at, out_pitch, cols, groups, ahead
    ):
        """out[r, j] += sum over p < 2 pairs of a[r, p] w[p, j] for r < ``rows`` (a literal, at most
        8) and j < ``cols`` (at most 32 ``groups``, a literal); ``a`` from element ``a_at``
        with ``a_pitch`` elements a row, ``w`` from ``w_at`` (``w_pitch``), ``out`` from ``out_at``
        (``out_pitch``). ``w_pitch`` 0 reads one row, its pair's second row zeros (an odd K's last row;
        ``a`` holds a zero there too). ``ahead`` = (at, col, span): where ``span`` > 0 each step also asks
        for as many lines of ``w`` as it reads (into L2), from element ``at`` on, a walk along rows of
        ``span`` elements from their column ``col`` (``_matrix_tiles`` points it at the next chunk of K)."""
        count, group_count = vector_ir.literal(rows), vector_ir.literal(groups)
        if count is None or group_count is None:
            return None
        sig = types.void(a, a_at, a_pitch, rows, w, w_at, w_pitch, pairs, out, out_at, out_pitch, cols, groups, ahead)

        def codegen(context, builder, signature, args):
            (
                a_arr,
                a_at_,
                a_pitch_,
                _,
                w_arr,
                w_at_,
                w_pitch_,
                pairs_,
                out_arr,
                out_at_,
                out_pitch_,
                cols_,
                _,
                ahead_,
            ) = args
            ahead_at, ahead_col, span = (builder.extract_value(ahead_, i) for i in range(3))
            kinds = signature.args
            w_base = vector_ir.data(context, builder, kinds[4], w_arr)
            a_data = builder.gep(vector_ir.data(context, builder, kinds[0], a_arr), [a_at_])
            w_data = builder.gep(w_base, [w_at_])
            out_data = builder.gep(vector_ir.data(context, builder, kinds[8], out_arr), [out_at_])
            group_masks = [
                vector_ir.mask(builder, builder.sub(cols_, I64(COLUMN_GROUP * g)), COLUMN_GROUP)
                for g in range(group_count)
            ]
            none = ir.Constant(group_masks[0].type, [0] * COLUMN_GROUP)
            has_second = builder.icmp_signed("!=", w_pitch_, I64(0))
            second_masks = [builder.select(has_second, mask, none) for mask in group_masks]
            low = ir.Constant(ir.VectorType(I32, 2 * LANES), [i // 2 + (i % 2) * 2 * LANES for i in range(32)])
            high = ir.Constant(ir.VectorType(I32, 2 * LANES), [LANES + i // 2 + (i % 2) * 2 * LANES for i in range(32)])
            zero = FLOATS(None)

            def step(index, accs, tiles_ahead=False):
                """One pair of weight rows into the sums; with ``tiles_ahead`` also asking for the lines of
                the tile PREFETCH_TILES tiles to the right (a prefill's blocks)."""
                first = builder.gep(w_data, [builder.mul(builder.mul(index, I64(2)), w_pitch_)])
                second = builder.gep(first, [w_pitch_])
                weights = []
                for g, (mask, second_mask) in enumerate(zip(group_masks, second_masks)):
                    top = vector_ir.load(builder, builder.gep(first, [I64(COLUMN_GROUP * g)]), mask, _HALVES)
                    bottom = vector_ir.load(builder, builder.gep(second, [I64(COLUMN_GROUP * g)]), second_mask, _HALVES)
                    weights += [builder.shuffle_vector(top, bottom, low), builder.shuffle_vector(top, bottom, high)]
                    if tiles_ahead:
                        ahead = I64(COLUMN_GROUP * (PREFETCH_TILES * group_count + g))
                        vector_ir.prefetch(builder, builder.gep(first, [ahead]))
                        vector_ir.prefetch(builder, builder.gep(second, [ahead]))
                return _sum_pairs(builder, a_data, a_pitch_, index, count, weights, accs)

            width = I64(2 * COLUMN_GROUP * group_count)  # elements a step reads: two rows of the tile
            wrap = builder.sub(w_pitch_, span)  # from the end of a walk's row to the start of the next

            def asking(index, carried):
                """``step``, and the step's lines of the walk asked for (a line: 32 bfloat16)."""
                lines = 2 * group_count
                ahead = vector_ir.ask_along(builder, w_base, *carried[-2:], lines, COLUMN_GROUP, width, span, wrap)
                return step(index, carried[:-2]) + list(ahead)

            zeros = [zero] * (count * 2 * group_count)
            # two loops, not a branch in one (as f32_dot: a test in the loop costs the tile)
            with builder.if_else(builder.icmp_signed(">", span, I64(0))) as (then, otherwise):
                with then:
                    accs = vector_ir.loop(builder, pairs_, zeros + [ahead_at, ahead_col], asking)[:-2]
                    vector_ir.add_tile(builder, out_data, out_pitch_, accs, count, cols_)
                with otherwise:
                    accs = vector_ir.loop(builder, pairs_, zeros, lambda index, sums: step(index, sums, True))
                    vector_ir.add_tile(builder, out_data, out_pitch_, accs, count, cols_)
            return context.get_dummy_value()

        return sig, codegen

    _transposed_tile = vector_ir.transposed_tile(_HALVES, _dot, 1, 1)


if AVAILABLE:
    _jit = cpu_kernels.numba.njit(cache=True, nogil=True)
else:  # never called: ``takes`` answers False without the instruction

    def _jit(function):
        return function


@_jit
def _tile_groups(rows):
    """Groups of 32 columns in a tile of ``rows`` (6, 8, 4, 2 or 1) rows: 24, 16, 16, 16 or 2
    accumulators (float32 vectors of 16)."""
    return 2 if rows == 6 or rows == 4 else 4 if rows == 2 else 1


@_jit
def _matrix_tiles(a, r, rows, w, k0, pairs, pitch, out, start, stop, walk_ahead):
    """out[r : r + rows, start:stop] += a[r : r + rows, k0 : k0 + 2 pairs] @ w[k0 : k0 + 2 pairs, start:stop]
    in tiles of ``rows`` (6, 8, 4, 2 or 1) x 64, 32, 64, 128 or 32 columns: 24, 16, 16, 16 or 2
    accumulators (float32 vectors of 16). With ``walk_ahead`` the last row tile asks for the lines of the
    next chunk's rows of these columns in the order they are stored, as ``f32_dot`` does (a tile's own
    strip, a line a row at a row's stride, streams well below the memory's rate)."""
    a_pitch, n = a.shape[1], out.shape[1]
    span = stop - start
    width = COLUMN_GROUP * _tile_groups(rows)
    for c in range(start, stop, width):
        ahead = (0, 0, 0)
        if walk_ahead and r + rows == a.shape[0]:
            walk = (c - start) * 2 * pairs  # this tile's share of the next chunk's elements, in storage order
            ahead = ((k0 + 2 * pairs + walk // span) * n + start + walk % span, walk % span, span)
        at_a, at_w, at_out = r * a_pitch + k0, k0 * n + c, r * n + c
        if rows == 6:
            _matrix_tile(a, at_a, a_pitch, 6, w, at_w, pitch, pairs, out, at_out, n, stop - c, 2, ahead)
        elif rows == 8:
            _matrix_tile(a, at_a, a_pitch, 8, w, at_w, pitch, pairs, out, at_out, n, stop - c, 1, ahead)
        elif rows == 4:
            _matrix_tile(a, at_a, a_pitch, 4, w, at_w, pitch, pairs, out, at_out, n, stop - c, 2, ahead)
        elif rows == 2:
            _matrix_tile(a, at_a, a_pitch, 2, w, at_w, pitch, pairs, out, at_out, n, stop - c, 4, ahead)
        else:
            _matrix_tile(a, at_a, a_pitch, 1, w, at_w, pitch, pairs, out, at_out, n, stop - c, 1, ahead)


@_jit
def _rows_by_matrix(a, w, out, accumulate, start, stop):
    """out[:, start:stop] (+)= a @ w[:, start:stop] for bfloat16 bits ``a`` [M, K rounded up to even]
    (zero-padded) and ``w`` [K, N] row-major; float32 ``out`` [M, N]: a decode's few rows K_CHUNK rows of
    ``w`` at a time across every column of the range, a prefill's in blocks (``PREFILL_CHUNK``)."""
    m, k, n = a.shape[0], w.shape[0], w.shape[1]
    even = k - k % 2
    if not accumulate:
        out[:, start:stop] = 0
    decode = m <= DECODE_ROWS
    chunk, block = (K_CHUNK, stop - start) if decode else (PREFILL_CHUNK, PREFILL_BLOCK)
    for first in range(start, stop, max(block, 1)):
        last = min(stop, first + block)
        for k0 in range(0, even, chunk):
            _row_tiles(a, w, k0, min(chunk, even - k0) // 2, n, out, first, last, decode)
        if k % 2:  # the last row alone (pitch 0: paired with zeros)
            _row_tiles(a, w, even, 1, 0, out, first, last, False)


@_jit
def _row_tiles(a, w, k0, pairs, pitch, out, start, stop, walk_ahead):
    """``_matrix_tiles`` for every tile of ``a``'s rows, top to bottom (``vector_ir.tile_rows``)."""
    m, r = a.shape[0], 0
    while r < m:
        rows = vector_ir.tile_rows(m - r)
        _matrix_tiles(a, r, rows, w, k0, pairs, pitch, out, start, stop, walk_ahead)
        r += rows


@_jit
def _rows_by_panels(a, w, out, accumulate, start, stop):
    """out[:, start:stop] (+)= a @ W[:, start:stop] for bfloat16 bits ``a`` [M, K rounded up to even]
    (zero-padded) and W's panels ``w`` (``bf16_panels``), ``start`` a panel's first column: in blocks
    of PANEL_BLOCK columns, each row tile summing all of K over the block's panels in registers (the
    panels stay in L2 for the next row tile; a decode's one row tile streams them from memory)."""
    m, a_pitch, n = a.shape[0], a.shape[1], out.shape[1]
    pairs = w.shape[1]
    panel = pairs * bf16_panels.PAIR_ROW  # elements
    if not accumulate:
        out[:, start:stop] = 0
    for first in range(start, stop, PANEL_BLOCK):
        last = min(stop, first + PANEL_BLOCK)
        r = 0
        while r < m:
            rows = vector_ir.tile_rows(m - r)
            for c in range(first, last, bf16_panels.PANEL * _tile_groups(rows)):
                at_a, at_w, at_out, cols = r * a_pitch, c // bf16_panels.PANEL * panel, r * n + c, last - c
                if rows == 6:
                    _panel_tile(a, at_a, a_pitch, 6, w, at_w, pairs, out, at_out, n, cols, 2)
                elif rows == 8:
                    _panel_tile(a, at_a, a_pitch, 8, w, at_w, pairs, out, at_out, n, cols, 1)
                elif rows == 4:
                    _panel_tile(a, at_a, a_pitch, 4, w, at_w, pairs, out, at_out, n, cols, 2)
                elif rows == 2:
                    _panel_tile(a, at_a, a_pitch, 2, w, at_w, pairs, out, at_out, n, cols, 4)
                else:
                    _panel_tile(a, at_a, a_pitch, 1, w, at_w, pairs, out, at_out, n, cols, 1)
            r += rows


@_jit
def _rows_by_transposed(a, e, out, accumulate, start, stop):
    """out[:, start:stop] (+)= a @ e[start:stop].T for bfloat16 bits ``a`` [M, K rounded up to even]
    and ``e`` [N, K] row-major; float32 ``out`` [M, N]."""
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
def _rows_by_panels_over(a, w, out, accumulate, bounds, taken):
    for _ in threads.prange(bounds.shape[0] - 1):
        part = threads.take(taken)
        while part < bounds.shape[0] - 1:
            _rows_by_panels(a, w, out, accumulate, bounds[part], bounds[part + 1])
            part = threads.take(taken)


@threads.parallel_jit
def _rows_by_transposed_over(a, e, out, accumulate, bounds, taken):
    for _ in threads.prange(bounds.shape[0] - 1):
        part = threads.take(taken)
        while part < bounds.shape[0] - 1:
            _rows_by_transposed(a, e, out, accumulate, bounds[part], bounds[part + 1])
            part = threads.take(taken)
