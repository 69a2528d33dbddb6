"""Decode attention over a paged KV cache on the CPU: each row's one new query against its own slots.

In a continuous batch's decode step every row is a request at its own length, its K/V in blocks
scattered through one pool [kv heads, slots, head_dim] (``serve.kv_cache.PagedKVCache``). The
composed path gathers every row's slots into [B, heads, longest, d] (a copy of all the K/V it reads,
the shorter rows padded to the longest and masked) before the attention core. This numba loop reads
each row's slots in place, up to its own length (and from the first its sliding window sees): per
row and KV head, the scores of the group's query
heads, their softmax and the weighted sum of V, in the arrays' dtype (as MKL's products are). Used for float32 and
float64 numpy arrays when the fused CPU kernels are on (``cpu_kernels.ENABLED``).
"""

from __future__ import annotations

import math

import numpy

from .cpu_kernels import DTYPES, ENABLED, _jit


def supported(q, pool) -> bool:
    return ENABLED and isinstance(pool, numpy.ndarray) and pool.dtype in DTYPES and q.dtype == pool.dtype


def decode(q, k_pool, v_pool, slots, counts, out, window: int = 0):
    """``out`` [B, hk, g, 1, d] = the attention of the (scaled) queries ``q`` [B, hk, g, 1, d] over
    row b's first ``counts[b]`` slots of ``slots`` [B, W] (int64 indices into the pools' slot axis),
    with a sliding ``window`` over only the last ``window`` of them (0: all)."""
    # contiguous [B, hk, g, d] for the loop (views of any strides keep LLVM from vectorizing it)
    result = numpy.empty(q.shape[:3] + q.shape[4:], dtype=q.dtype)
    _decode(numpy.ascontiguousarray(q[:, :, :, 0]), k_pool, v_pool, slots, counts, result, window)
    out[:, :, :, 0] = result


@_jit
def _decode(q, k, v, slots, counts, out, window):
    """Per row and KV head: each key's row of K loaded once for the group's query heads, then the
    softmax of their scores, then each row of V added into the group's sums."""
    rows, heads, group, d = q.shape
    scores = numpy.empty((group, slots.shape[1]), q.dtype)
    sums = numpy.empty((group, d), q.dtype)
    tops, totals = numpy.empty(group, q.dtype), numpy.empty(group, q.dtype)
    for b in range(rows):
        n = counts[b]
        first = max(0, n - window) if window else 0
        for h in range(heads):
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
