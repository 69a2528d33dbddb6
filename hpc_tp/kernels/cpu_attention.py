"""The attention core fused on the CPU: one numba loop over heads and query blocks that multiplies
each tile with MKL (``mkl_jit``) and runs the softmax, or its backward, on the tile while it is
still in cache.

The composed path in ``attention`` runs QK^T, the mask, the softmax passes and P V each as one
sweep over [batch, heads, rows, keys] for all heads at once; its products reach 45-65 GFLOP/s where
MKL runs the same tiles at 100-140 alone, and each softmax pass goes out to memory. Here a tile of
64 queries x its keys (at most 64 KiB in float32) is made, normalized and used before the next one.
The causal and key-padding masks are applied in the loop, so no [T, keys] bias is built, and the
backward accumulates dK and dV straight into the QKV gradient (beta = 1).

Each block's tile spans the keys ``query_blocks`` gives it, from the first its window lets its
first query see (0 without a window) to its last query's position; keys a row's window or the
causal mask hides inside the tile are zeros of its softmax, as the composed path makes them.

Same query blocks as ``attention.query_blocks`` and the same saved softmax outputs
(``saved_score_elements`` per head, here one flat buffer): the layer's memory does not change.
Fully masked rows give zeros, as the composed softmax does. Attention dropout multiplies each
tile by its block of the keep mask on its way into P V (and the backward likewise), as the composed
path does. Used for float32/float64 numpy arrays where ``mkl_jit.AVAILABLE``; otherwise the
composed path runs.

Threads (``kernels.threads``): forward's tiles are independent and split into ranges of about equal
work (rows x keys seen); backward's tiles of one kv head all add into its dK and dV, so a thread
takes whole kv heads and sums their tiles in the one-thread order. Each thread runs MKL sequentially
(``mkl_jit.local_threads``): a tile's product is too small to share, and MKL would open its OpenMP
region, waking its sleeping threads, for every one. The same bits at any thread count.

Selective recomputation (``forward(..., statistics=True)``, ``backward_recompute``) keeps no
softmax tile: forward makes each tile in one scratch tile and keeps only its rows' log-sum-exp
(``lse``, [B, hk, g, T]: the largest visible score plus the log of the row's sum, +inf for a fully
masked row); backward makes each tile again right before using it, with the same MKL product and
masks, as exp(S + key bias - lse) (the FlashAttention backward's statistics; no row maxima or sums
to recompute), so neither pass holds more than a few tiles besides Q, K, V and the dropout mask.
"""

from __future__ import annotations

import math

import numpy

from . import mkl_jit, threads
from .cpu_kernels import DTYPES, _jit, _softmax_normalize, numba
from .mkl import NO_TRANS, TRANS
from .mkl_jit import exp, gemm


def supported(*arrays) -> bool:
    """True when the fused core can take these Q, K, V (and output) views as they are: one float
    dtype, rows of unit stride that do not overlap (MKL's leading dimension is at least the row
    length), no negative strides."""
    if not mkl_jit.AVAILABLE:
        return False
    first = arrays[0]
    return all(
        isinstance(a, numpy.ndarray)
        and a.dtype == first.dtype
        and a.dtype in DTYPES
        and a.strides[-1] == a.itemsize
        and a.strides[-2] >= a.shape[-1] * a.itemsize
        and all(s % a.itemsize == 0 and s >= 0 for s in a.strides)
        for a in arrays
    )


def _block_tables(blocks):
    """(first query of each block plus the end, first key each block sees and the key after its
    last, offset of each block's softmax tile within one head's saved elements plus the total)."""
    starts = numpy.array([rows.start for rows, _ in blocks] + [blocks[-1][0].stop], dtype=numpy.int64)
    keys = numpy.array([(seen.start, seen.stop) for _, seen in blocks], dtype=numpy.int64)
    sizes = numpy.diff(starts) * (keys[:, 1] - keys[:, 0])
    return starts, keys, numpy.concatenate([[0], numpy.cumsum(sizes)]).astype(numpy.int64)


@_jit
def _largest_tile(tiles):
    return numpy.max(tiles[1:] - tiles[:-1])


def _none(dtype, ndim: int):
    """An empty array for an absent mask: the kernels' arguments keep one type either way."""
    return numpy.zeros((0,) * ndim, dtype)


def _per_sequence(key_bias, batch: int, keys: int, dtype):
    """[B, keys] as the kernel indexes it: a [1, keys] mask broadcast, a wrong shape refused as the
    composed path's broadcasting refuses it (the kernel itself does not check bounds)."""
    return numpy.ascontiguousarray(numpy.broadcast_to(key_bias, (batch, keys)), dtype=dtype)


def forward(
    q, k, v, out, blocks, q_offset: int, causal: bool, key_bias=None, keep=None, statistics=False, window: int = 0
):
    """Softmax(Q K^T + masks) V into ``out`` ([B, hk, g, T, d] views; K, V [B, hk, keys, d]); Q is
    already scaled. ``key_bias`` [B, keys]: 0 for real keys, -inf for padding; ``keep`` [B, hk, g,
    T, keys]: attention dropout's scaled keep mask, applied to the softmax before P V; ``window``
    > 0: a query sees only its last ``window`` keys (``blocks`` cut for it, ``query_blocks``).
    Returns the softmax outputs (before dropout), kept for ``backward``, or with ``statistics`` the
    rows' log-sum-exp [B, hk, g, T] instead, for ``backward_recompute``."""
    starts, keys, tiles = _block_tables(blocks)
    b, hk, g, t = q.shape[:4]
    lse = numpy.empty((b, hk, g, t) if statistics else (0,) * 4, dtype=q.dtype)
    probs = numpy.empty(0 if statistics else b * hk * g * int(tiles[-1]), dtype=q.dtype)
    args = (
        q,
        k,
        v,
        out,
        probs,
        starts,
        keys,
        tiles,
        q_offset,
        causal,
        _key_bias(key_bias, b, k.shape[2], q.dtype),
        _none(q.dtype, 5) if keep is None else keep,
        lse.reshape(-1),
        window,
    )
    # Every tile is its own: any split of them works; each costs about its rows x the keys it sees. One
    # thread takes them all, unweighed: a decode step calls this every layer, and weighing cost 3-6 us.
    if threads.COUNT == 1:
        _forward(*args, 0, b * hk * g * keys.shape[0])
    else:
        threads.run(_forward, _forward_over, args, threads.balanced(numpy.tile(numpy.diff(tiles), b * hk * g)))
    return lse if statistics else probs


def backward(dout, q, k, v, probs, blocks, dq, dk, dv, keep=None):
    """dQ (times 1/sqrt(d): Q was scaled in forward), and dK, dV added into their (zeroed) views;
    ``keep`` is forward's dropout mask."""
    _backward_call(dout, q, k, v, probs, blocks, dq, dk, dv, keep, _none(q.dtype, 1), 0, False, None, 0)


def backward_recompute(
    dout, q, k, v, lse, blocks, q_offset: int, causal: bool, key_bias, dq, dk, dv, keep=None, window: int = 0
):
    """``backward`` from forward's row statistics (``forward(..., statistics=True)``) instead of its
    softmax: each tile is made again from Q K^T, forward's masks and ``lse`` where it is used."""
    _backward_call(
        dout, q, k, v, _none(q.dtype, 1), blocks, dq, dk, dv, keep, lse.reshape(-1), q_offset, causal, key_bias, window
    )


def _backward_call(dout, q, k, v, probs, blocks, dq, dk, dv, keep, lse, q_offset, causal, key_bias, window):
    starts, keys, tiles = _block_tables(blocks)
    args = (
        dout,
        q,
        k,
        v,
        probs,
        starts,
        keys,
        tiles,
        1.0 / math.sqrt(q.shape[-1]),
        dq,
        dk,
        dv,
        _none(dout.dtype, 5) if keep is None else keep,
        lse,
        q_offset,
        causal,
        _key_bias(key_bias, q.shape[0], k.shape[2], dout.dtype),
        window,
    )
    # Every tile of a kv head adds into the head's dK and dV: a thread takes whole kv heads, and sums
    # each one's tiles in the one-thread order.
    threads.run(_backward, _backward_over, args, threads.columns(q.shape[0] * q.shape[1], 1))


def _key_bias(key_bias, batch: int, keys: int, dtype):
    return _none(dtype, 2) if key_bias is None else _per_sequence(key_bias, batch, keys, dtype)


@_jit
def _at(x, i0, i1, i2, row):
    """Element offset of ``x[i0, i1, i2, row, 0]`` (5-D) or ``x[i0, i1, row, 0]`` (4-D, i2 ignored)."""
    s, item = x.strides, x.itemsize
    if x.ndim == 5:
        return (i0 * s[0] + i1 * s[1] + i2 * s[2] + row * s[3]) // item
    return (i0 * s[0] + i1 * s[1] + row * s[2]) // item


@_jit
def _ld(x):
    """Row stride (leading dimension) of the [T, d] matrices of ``x``, in elements."""
    return x.strides[-2] // x.itemsize


def _row_max(row, n):
    """max(row[:n]) over eight running maxima, which LLVM packs into one vector register (a single
    running max stays a scalar chain, 5x slower here). A NaN score still reaches the output
    through the subtraction and exp that follow, whatever max makes of it."""
    if n == 0:
        return -numpy.inf
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = row[0]
    whole = n - n % 8
    for j in range(0, whole, 8):
        m0, m1, m2, m3 = max(m0, row[j]), max(m1, row[j + 1]), max(m2, row[j + 2]), max(m3, row[j + 3])
        m4, m5, m6, m7 = max(m4, row[j + 4]), max(m5, row[j + 5]), max(m6, row[j + 6]), max(m7, row[j + 7])
    top = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
    for j in range(whole, n):
        top = max(top, row[j])
    return top


if numba is not None:
    _row_max = numba.njit(cache=True, nogil=True, fastmath={"nnan", "nsz"})(_row_max)


@_jit
def _visible(first_query, r, first_key, seen, causal, window):
    """The tile columns [low, limit) that query row r sees: its keys sit at absolute positions
    ``first_key + j``, the query at ``first_query + r``, which sees the keys up to it when
    ``causal`` and only its last ``window`` of them when ``window`` > 0."""
    position = first_query + r - first_key
    limit = min(seen, position + 1) if causal else seen
    low = min(max(0, position - window + 1), limit) if window else 0
    return low, limit


@_jit
def _exp_tile(p, at, rows, seen, first_query, first_key, causal, window, key_bias, batch, lse, lse_at, recompute):
    """exp(S + key bias - shift) of the [rows, seen] tile of scores at ``p[at:]``, in place, 0 where
    the causal mask or the window hides a key (``_visible``). Each row's shift is its largest
    visible score (0 when there is none), stored at ``lse[lse_at + r]`` when ``lse`` is not empty;
    with ``recompute`` it is read from there instead (forward's log-sum-exp: the tile is then
    forward's softmax again).
    (Loops index views from 0: offsets that LLVM cannot prove non-negative keep it from vectorizing.)"""
    tile = p[at : at + rows * seen].reshape((rows, seen))
    for r in range(rows):
        low, limit = _visible(first_query, r, first_key, seen, causal, window)
        row = tile[r, low:limit]
        if key_bias.shape[0]:
            bias = key_bias[batch, first_key + low : first_key + limit]
            for j in range(row.size):
                row[j] += bias[j]
        if recompute:
            shift = lse[lse_at + r]  # +inf for a fully masked row: every exp is 0, as forward made it
        else:
            top = _row_max(row, row.size)
            shift = top if math.isfinite(top) else 0.0
            if lse.size:
                lse[lse_at + r] = shift
        for j in range(row.size):
            row[j] -= shift
        # exp(0) runs on the fast path, exp(-inf) does not (VML: 1.7x slower): hidden keys are 0 until after exp
        tile[r, :low] = 0.0
        tile[r, limit:] = 0.0
    exp(rows * seen, p, at, p, at)
    if causal:
        for r in range(rows):
            low, limit = _visible(first_query, r, first_key, seen, causal, window)
            tile[r, :low] = 0.0
            tile[r, limit:] = 0.0


@_jit
def _softmax_tile(p, at, rows, seen, first_query, first_key, causal, window, key_bias, batch, lse, lse_at):
    """Row-wise softmax of the tile (``_exp_tile``'s arguments), in place; with ``lse`` not empty
    each row's log-sum-exp into it (+inf for a fully masked row, whose outputs are 0)."""
    _exp_tile(p, at, rows, seen, first_query, first_key, causal, window, key_bias, batch, lse, lse_at, False)
    tile = p[at : at + rows * seen].reshape((rows, seen))
    if lse.size:
        for r in range(rows):
            total = 0.0
            for j in range(seen):
                total += tile[r, j]
            lse[lse_at + r] = lse[lse_at + r] + math.log(total) if total > 0.0 else math.inf
    _softmax_normalize(tile)


@_jit
def _softmax_tile_backward(ds, p, at, rows, seen):
    """dS = P (dP - rowsum(dP P)) in place of dP (``ds``), with P the tile at ``p[at:]``. This is
    ``cpu_kernels._softmax_rows_backward`` on one tile; called in place (dP and dS one array passed
    twice) that one measured 1 ms per layer slower at W1, LLVM unable to prove its arrays apart."""
    tile = p[at : at + rows * seen].reshape((rows, seen))
    grad = ds[: rows * seen].reshape((rows, seen))
    for r in range(rows):
        dot = 0.0
        for j in range(seen):
            dot += grad[r, j] * tile[r, j]
        for j in range(seen):
            grad[r, j] = tile[r, j] * (grad[r, j] - dot)


@_jit
def _tile(index, q, starts, keys, tiles):
    """The ``index``-th (batch, kv head, query head of its group, query block) of the loop, with the
    block's rows, its first key and how many it sees, where its softmax tile is kept and where its
    rows' statistics are."""
    _, nk, ng, t, _ = q.shape
    block, head = index % keys.shape[0], index // keys.shape[0]
    b, h, g = head // (nk * ng), (head // ng) % nk, head % ng
    first, first_key = starts[block], keys[block, 0]
    return (
        b,
        h,
        g,
        first,
        starts[block + 1] - first,
        first_key,
        keys[block, 1] - first_key,
        head * tiles[-1] + tiles[block],
        head * t + first,
    )


@_jit
def _drop(p, at, rows, seen, keep, b, h, g, first, first_key, out, out_at):
    """out[out_at:] = the [rows, seen] tile at ``p[at:]`` times its block of the keep mask."""
    for r in range(rows):
        mask = keep[b, h, g, first + r, first_key:]
        for j in range(seen):
            out[out_at + r * seen + j] = p[at + r * seen + j] * mask[j]


@_jit
def _scores(q, k, b, h, g, first, rows, first_key, seen, p, at):
    """S = Q K^T of one tile into ``p[at:]`` (Q already scaled)."""
    gemm(
        NO_TRANS,
        TRANS,
        rows,
        seen,
        q.shape[-1],
        1.0,
        q,
        _at(q, b, h, g, first),
        _ld(q),
        k,
        _at(k, b, h, 0, first_key),
        _ld(k),
        0.0,
        p,
        at,
        seen,
    )


@_jit
def _forward(q, k, v, out, probs, starts, keys, tiles, q_offset, causal, key_bias, keep, lse, window, start, stop):
    """Tiles ``start`` to ``stop`` (``_tile``'s indices), MKL sequential on this thread meanwhile. Without
    ``probs`` (only the rows' statistics kept) every tile is made in one scratch tile of the thread's."""
    previous = mkl_jit.local_threads(1)
    d, largest = q.shape[-1], _largest_tile(tiles)
    scratch = numpy.empty(largest * ((probs.size == 0) + (keep.size > 0)), dtype=q.dtype)
    for index in range(start, stop):
        b, h, g, first, rows, first_key, seen, at, lse_at = _tile(index, q, starts, keys, tiles)
        p = probs
        if probs.size == 0:
            p, at = scratch, scratch.size - largest
        _scores(q, k, b, h, g, first, rows, first_key, seen, p, at)
        _softmax_tile(p, at, rows, seen, first + q_offset, first_key, causal, window, key_bias, b, lse, lse_at)
        weights, weights_at = p, at
        if keep.size:
            _drop(p, at, rows, seen, keep, b, h, g, first, first_key, scratch, 0)
            weights, weights_at = scratch, 0
        gemm(
            NO_TRANS,
            NO_TRANS,
            rows,
            d,
            seen,
            1.0,
            weights,
            weights_at,
            seen,
            v,
            _at(v, b, h, 0, first_key),
            _ld(v),
            0.0,
            out,
            _at(out, b, h, g, first),
            _ld(out),
        )
    mkl_jit.local_threads(previous)


@_jit
def _backward(
    dout,
    q,
    k,
    v,
    probs,
    starts,
    keys,
    tiles,
    scale,
    dq,
    dk,
    dv,
    keep,
    lse,
    q_offset,
    causal,
    key_bias,
    window,
    start,
    stop,
):
    """The tiles of kv heads ``start`` to ``stop`` (b * hk + h), MKL sequential on this thread meanwhile.
    Scratch: dP (then dS), the dropped softmax tile with ``keep``, the recomputed one with ``lse``."""
    previous = mkl_jit.local_threads(1)
    d, largest, per_head = q.shape[-1], _largest_tile(tiles), q.shape[2] * keys.shape[0]
    scratch = numpy.empty(largest * (1 + (keep.size > 0) + (lse.size > 0)), dtype=dout.dtype)
    for index in range(start * per_head, stop * per_head):
        b, h, g, first, rows, first_key, seen, at, lse_at = _tile(index, q, starts, keys, tiles)
        dout_at, q_at = _at(dout, b, h, g, first), _at(q, b, h, g, first)
        k_at, v_at = _at(k, b, h, 0, first_key), _at(v, b, h, 0, first_key)
        p = probs
        if lse.size:  # selective recomputation: forward's softmax tile again, in the scratch's last tile
            p, at = scratch, scratch.size - largest
            _scores(q, k, b, h, g, first, rows, first_key, seen, p, at)
            _exp_tile(p, at, rows, seen, first + q_offset, first_key, causal, window, key_bias, b, lse, lse_at, True)
        # dP = dO V^T (through the dropout mask), then dS = P (dP - rowsum(dP P)) in the same scratch tile
        gemm(NO_TRANS, TRANS, rows, seen, d, 1.0, dout, dout_at, _ld(dout), v, v_at, _ld(v), 0.0, scratch, 0, seen)
        weights, weights_at = p, at
        if keep.size:
            _drop(scratch, 0, rows, seen, keep, b, h, g, first, first_key, scratch, 0)
            _drop(p, at, rows, seen, keep, b, h, g, first, first_key, scratch, largest)
            weights, weights_at = scratch, largest
        _softmax_tile_backward(scratch, p, at, rows, seen)
        gemm(
            NO_TRANS,
            NO_TRANS,
            rows,
            d,
            seen,
            scale,
            scratch,
            0,
            seen,
            k,
            k_at,
            _ld(k),
            0.0,
            dq,
            _at(dq, b, h, g, first),
            _ld(dq),
        )
        gemm(
            TRANS,
            NO_TRANS,
            seen,
            d,
            rows,
            1.0,
            scratch,
            0,
            seen,
            q,
            q_at,
            _ld(q),
            1.0,
            dk,
            _at(dk, b, h, 0, first_key),
            _ld(dk),
        )
        gemm(
            TRANS,
            NO_TRANS,
            seen,
            d,
            rows,
            1.0,
            weights,
            weights_at,
            seen,
            dout,
            dout_at,
            _ld(dout),
            1.0,
            dv,
            _at(dv, b, h, 0, first_key),
            _ld(dv),
        )
    mkl_jit.local_threads(previous)


# Each kernel's threads (``threads.run``): one range of tiles, or of kv heads, each.
@threads.parallel_jit
def _forward_over(q, k, v, out, probs, starts, keys, tiles, q_offset, causal, key_bias, keep, lse, window, bounds):
    for part in threads.prange(bounds.shape[0] - 1):
        _forward(
            q,
            k,
            v,
            out,
            probs,
            starts,
            keys,
            tiles,
            q_offset,
            causal,
            key_bias,
            keep,
            lse,
            window,
            bounds[part],
            bounds[part + 1],
        )


@threads.parallel_jit
def _backward_over(
    dout, q, k, v, probs, starts, keys, tiles, scale, dq, dk, dv, keep, lse, q_offset, causal, key_bias, window, bounds
):
    for part in threads.prange(bounds.shape[0] - 1):
        _backward(
            dout,
            q,
            k,
            v,
            probs,
            starts,
            keys,
            tiles,
            scale,
            dq,
            dk,
            dv,
            keep,
            lse,
            q_offset,
            causal,
            key_bias,
            window,
            bounds[part],
            bounds[part + 1],
        )
