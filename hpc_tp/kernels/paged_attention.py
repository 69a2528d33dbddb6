"""Decode attention over a paged KV cache on the CPU: each row's one new query against its own slots.

In a continuous batch's decode step every row is a request at its own length, its K/V in blocks
scattered through one pool [kv heads, slots, head_dim] (``serve.kv_cache.PagedKVCache``). The
composed path gathers every row's slots into [B, heads, longest, d] (a copy of all the K/V it reads,
the shorter rows padded to the longest and masked) before the attention core. This numba loop reads
each row's slots in place, up to its own length (and from the first its sliding window sees): per
row and KV head, the scores of the group's query heads, their softmax and the weighted sum of V.
Used for numpy arrays when the fused CPU kernels are on (``cpu_kernels.ENABLED``):

* float32 and float64 pools: everything in the arrays' dtype (as MKL's products are);
* half-precision pools (bfloat16 from ml_dtypes, float16): each K or V row is widened to float32 in
  L1 as it is read (a bfloat16 is the upper half of a float32's bits; a float16 is rebuilt by
  ``small_m._widen``), the queries once before the loop, and scores, softmax and sums run in float32;
  the output is rounded to the activations' dtype once, to nearest even. The composed path does the
  same for bfloat16 (numpy multiplies bfloat16 arrays through float32, the softmax of float32 scores
  is float32, and P V lands in the bfloat16 output rounded once), so the two differ only by the order
  of float32 sums: at most one bfloat16 step where a value lies near a rounding boundary. For float16
  the composed path rounds the scores and the softmax to float16 too; this kernel does not;
* bfloat16 pools where the CPU has AVX512_BF16: ``kernels.paged_bf16`` instead, the same float32
  sums with the scores on ``vdpbf16ps``, every step (exp included) on 16 lanes and the K/V rows asked
  for ahead of use.

Threads (``kernels.threads``) take ranges of (row, KV head) pairs holding about as many keys each.
"""

from __future__ import annotations

import math

import numpy

from . import cpu_kernels, paged_bf16, threads
from .cpu_kernels import DTYPES, ENABLED, _jit
from .small_m import BF16, FULL, _widen, half_kind

_NO_BITS = numpy.empty((0, 0, 0), numpy.uint16)  # the pools a full-precision call does not use
_NO_FLOATS = numpy.empty((0, 0, 0), numpy.float32)


if ENABLED:  # the per-key steps inlined into the loop: a call a key row cost more than the row's sums
    _inline = cpu_kernels.numba.njit(inline="always", fastmath={"contract", "reassoc", "nsz", "arcp"})
else:  # never called: ``supported`` answers False without numba

    def _inline(function):
        return function


def supported(q, pool) -> bool:
    return (
        ENABLED
        and isinstance(pool, numpy.ndarray)
        and q.dtype == pool.dtype
        and (pool.dtype in DTYPES or half_kind(pool.dtype) != FULL)
    )


def decode(q, k_pool, v_pool, slots, counts, out, window: int = 0):
    """``out`` [B, hk, g, 1, d] = the attention of the (scaled) queries ``q`` [B, hk, g, 1, d] over
    row b's first ``counts[b]`` slots of ``slots`` [B, W] (int64 indices into the pools' slot axis),
    with a sliding ``window`` over only the last ``window`` of them (0: all)."""
    kind = half_kind(k_pool.dtype)
    # each thread a range of (row, KV head) pairs holding about as many keys as the others
    keys = numpy.minimum(counts, window) if window else counts
    bounds = threads.balanced(numpy.repeat(keys, q.shape[1]))
    if kind == BF16 and paged_bf16.AVAILABLE:  # the queries' bits too: vdpbf16ps takes them as they are
        bits = (numpy.ascontiguousarray(a).view(numpy.uint16) for a in (q[:, :, :, 0], k_pool, v_pool))
        rows = numpy.ascontiguousarray(slots, dtype=numpy.int64)  # its tiles address the slots by offset
        paged_bf16.decode(*bits, rows, counts, out.view(numpy.uint16)[:, :, :, 0], window, bounds)
        return
    dtype = q.dtype if kind == FULL else numpy.dtype(numpy.float32)  # the sums' dtype
    if kind == FULL:
        pools = (k_pool, v_pool, _NO_BITS, _NO_BITS)
    else:  # the same bits seen as uint16 (no copy), widened by the kernel
        pools = (_NO_FLOATS, _NO_FLOATS, k_pool.view(numpy.uint16), v_pool.view(numpy.uint16))
    # contiguous [B, hk, g, d] for the loop (views of any strides keep LLVM from vectorizing it)
    result = numpy.empty(q.shape[:3] + q.shape[4:], dtype=dtype)
    queries = numpy.ascontiguousarray(q[:, :, :, 0], dtype=dtype)
    threads.run(_decode, _decode_over, (queries, *pools, kind, slots, counts, result, window), bounds)
    out[:, :, :, 0] = result  # half outputs rounded to nearest even, as numpy casts


def warm_up(dtype):
    """Compile (or load from numba's cache) the decode kernel for ``dtype`` at the rank's thread count,
    before a server's first request would wait for it."""
    dtype = numpy.dtype(dtype)
    rows, heads, d = 4, 2, 8
    q, pool = numpy.ones((rows, heads, 1, 1, d), dtype), numpy.ones((heads, rows, d), dtype)
    if not supported(q, pool):
        return
    slots = numpy.zeros((rows, 1), numpy.int64)
    decode(q, pool, pool, slots, numpy.ones(rows, numpy.int64), numpy.empty_like(q))


@_jit
def _decode(q, k, v, k_bits, v_bits, kind, slots, counts, out, window, first_pair, last_pair):
    """For (row, KV head) pairs ``first_pair`` .. ``last_pair`` - 1 (pair = row x heads + head): each
    key's row of K loaded once for the group's query heads, then the softmax of their scores, then
    each row of V added into the group's sums. The pools are ``k``, ``v`` (``kind`` FULL) or the half
    precision bits ``k_bits``, ``v_bits``, each row widened into ``row`` before use."""
    heads, group, d = q.shape[1], q.shape[2], q.shape[3]
    scores = numpy.empty((group, slots.shape[1]), q.dtype)
    sums = numpy.empty((group, d), q.dtype)
    tops, totals = numpy.empty(group, q.dtype), numpy.empty(group, q.dtype)
    row = numpy.empty(d, numpy.float32)
    for pair in range(first_pair, last_pair):
        b, h = pair // heads, pair % heads
        n = counts[b]
        first = max(0, n - window) if window else 0
        tops[:] = -numpy.inf
        queries = q[b, h]
        if kind == FULL:  # a branch a row, not a key: LLVM keeps each loop's body as tight as before
            for t in range(first, n):
                _score(queries, k[h, slots[b, t]], scores, tops, t)
        else:
            for t in range(first, n):
                _row(k_bits[h, slots[b, t]], row, kind)
                _score(queries, row, scores, tops, t)
        totals[:] = 0.0
        for j in range(group):
            for t in range(first, n):
                scores[j, t] = math.exp(scores[j, t] - tops[j])
                totals[j] += scores[j, t]
        sums[:] = 0.0
        if kind == FULL:
            for t in range(first, n):
                _accumulate(scores, t, v[h, slots[b, t]], sums)
        else:
            for t in range(first, n):
                _row(v_bits[h, slots[b, t]], row, kind)
                _accumulate(scores, t, row, sums)
        for j in range(group):
            for i in range(d):
                out[b, h, j, i] = sums[j, i] / totals[j]


@_inline
def _score(queries, key, scores, tops, t):
    """scores[j, t] = queries[j] . key for the group's query heads j (and each one's running top)."""
    for j in range(queries.shape[0]):
        s = queries[j, 0] * key[0]  # in the queries' dtype: float32 sums for float32 and half pools
        for i in range(1, queries.shape[1]):
            s += queries[j, i] * key[i]
        scores[j, t] = s
        tops[j] = max(tops[j], s)


@_inline
def _accumulate(weights, t, value, sums):
    """sums[j] += weights[j, t] * value for the group's query heads j."""
    for j in range(sums.shape[0]):
        w = weights[j, t]
        for i in range(sums.shape[1]):
            sums[j, i] += w * value[i]


@_inline
def _row(bits, row, kind):
    """``row`` = the half-precision values ``bits`` as float32: a bfloat16 shifted into a float32's
    upper half here, in the loop; a float16 rebuilt by ``small_m._widen``."""
    if kind == BF16:
        wide = row.view(numpy.uint32)
        for i in range(bits.shape[0]):
            wide[i] = numpy.uint32(bits[i]) << 16
    else:
        _widen(bits, row, kind)


@threads.parallel_jit
def _decode_over(q, k, v, k_bits, v_bits, kind, slots, counts, out, window, bounds):
    for part in threads.prange(bounds.shape[0] - 1):
        _decode(q, k, v, k_bits, v_bits, kind, slots, counts, out, window, bounds[part], bounds[part + 1])
