"""Decode attention over a paged KV cache on the CPU: each row's one new query against its own slots.

In a continuous batch's decode step every row is a request at its own length, its K/V in blocks
scattered through one pool [kv heads, slots, head_dim] (``serve.kv_cache.PagedKVCache``). The
composed path gathers every row's slots into [B, heads, longest, d] (a copy of all the K/V it reads,
the shorter rows padded to the longest and masked) before the attention core. This numba loop reads
each row's slots in place, up to its own length (and from the first its sliding window sees): per
row and KV head, the scores of the group's query
heads, their softmax and the weighted sum of V, in the arrays' dtype (as MKL's products are). Used for float32 and
float64 numpy arrays when the fused CPU kernels are on (``cpu_kernels.ENABLED``). Threads
(``kernels.threads``) take ranges of (row, KV head) pairs holding about as many keys each.
"""

from __future__ import annotations

import math

import numpy

from . import threads
from .cpu_kernels import DTYPES, ENABLED, _jit


def supported(q, pool) -> bool:
    return ENABLED and isinstance(pool, numpy.ndarray) and pool.dtype in DTYPES and q.dtype == pool.dtype


def decode(q, k_pool, v_pool, slots, counts, out, window: int = 0):
    """``out`` [B, hk, g, 1, d] = the attention of the (scaled) queries ``q`` [B, hk, g, 1, d] over
    row b's first ``counts[b]`` slots of ``slots`` [B, W] (int64 indices into the pools' slot axis),
    with a sliding ``window`` over only the last ``window`` of them (0: all)."""
    # contiguous [B, hk, g, d] for the loop (views of any strides keep LLVM from vectorizing it)
    result = numpy.empty(q.shape[:3] + q.shape[4:], dtype=q.dtype)
    args = (numpy.ascontiguousarray(q[:, :, :, 0]), k_pool, v_pool, slots, counts, result, window)
    # each thread a range of (row, KV head) pairs holding about as many keys as the others
    keys = numpy.minimum(counts, window) if window else counts
    threads.run(_decode, _decode_over, args, threads.balanced(numpy.repeat(keys, q.shape[1])))
    out[:, :, :, 0] = result


def warm_up(dtype):
    """Compile (or load from numba's cache) the decode kernel for ``dtype`` at the rank's thread count,
    before a server's first request would wait for it."""
    dtype = numpy.dtype(dtype)
    if not ENABLED or dtype not in DTYPES:
        return
    rows, heads, d = 4, 2, 8
    q, pool = numpy.ones((rows, heads, 1, 1, d), dtype), numpy.ones((heads, rows, d), dtype)
    slots = numpy.zeros((rows, 1), numpy.int64)
    decode(q, pool, pool, slots, numpy.ones(rows, numpy.int64), numpy.empty_like(q))


@_jit
def _decode(q, k, v, slots, counts, out, window, first_pair, last_pair):
    """For (row, KV head) pairs ``first_pair`` .. ``last_pair`` - 1 (pair = row x heads + head): each
    key's row of K loaded once for the group's query heads, then the softmax of their scores, then
    each row of V added into the group's sums."""
    heads, group, d = q.shape[1], q.shape[2], q.shape[3]
    scores = numpy.empty((group, slots.shape[1]), q.dtype)
    sums = numpy.empty((group, d), q.dtype)
    tops, totals = numpy.empty(group, q.dtype), numpy.empty(group, q.dtype)
    for pair in range(first_pair, last_pair):
        b, h = pair // heads, pair % heads
        n = counts[b]
        first = max(0, n - window) if window else 0
        tops[:] = -numpy.inf
        for t in range(first, n):
            key = k[h, slots[b, t]]
            for j in range(group):
                s = q[b, h, j, 0] * key[0]  # in the arrays' dtype: float32 sums for float32
                for i in range(1, d):
                    s += q[b, h, j, i] * key[i]
                scores[j, t] = s
                tops[j] = max(tops[j], s)
        totals[:] = 0.0
        for j in range(group):
            for t in range(first, n):
                scores[j, t] = math.exp(scores[j, t] - tops[j])
                totals[j] += scores[j, t]
        sums[:] = 0.0
        for t in range(first, n):
            value = v[h, slots[b, t]]
            for j in range(group):
                w = scores[j, t]
                for i in range(d):
                    sums[j, i] += w * value[i]
        for j in range(group):
            for i in range(d):
                out[b, h, j, i] = sums[j, i] / totals[j]


@threads.parallel_jit
def _decode_over(q, k, v, slots, counts, out, window, bounds):
    for part in threads.prange(bounds.shape[0] - 1):
        _decode(q, k, v, slots, counts, out, window, bounds[part], bounds[part + 1])
