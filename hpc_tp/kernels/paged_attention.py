"""Decode attention over a paged KV cache on the CPU: each row's one new query against its own slots.

In a continuous batch's decode step every row is a request at its own length, its K/V in blocks
scattered through one pool [kv heads, slots, head_dim] (``serve.kv_cache.PagedKVCache``). The
composed path gathers every row's slots into [B, heads, longest, d] (a copy of all the K/V it reads,
the shorter rows padded to the longest and masked) before the attention core. This numba loop reads
each row's slots in place, up to its own length (and from the first its sliding window sees): per
row and KV head, the scores of the group's query
heads, their softmax and the weighted sum of V, in float64 whatever the dtype. Used for float32 and
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
    _decode(q, k_pool, v_pool, slots, counts, out, window)


@_jit
def _decode(q, k, v, slots, counts, out, window):
    rows, heads, group, _, d = q.shape
    scores = numpy.empty(slots.shape[1], numpy.float64)
    acc = numpy.empty(d, numpy.float64)
    for b in range(rows):
        n = counts[b]
        first = max(0, n - window) if window else 0
        for h in range(heads):
            for j in range(group):
                top = -numpy.inf
                for t in range(first, n):
                    at = slots[b, t]
                    s = 0.0
                    for i in range(d):
                        s += q[b, h, j, 0, i] * k[h, at, i]
                    scores[t] = s
                    top = max(top, s)
                total = 0.0
                for t in range(first, n):
                    scores[t] = math.exp(scores[t] - top)
                    total += scores[t]
                acc[:] = 0.0
                for t in range(first, n):
                    at, w = slots[b, t], scores[t]
                    for i in range(d):
                        acc[i] += w * v[h, at, i]
                for i in range(d):
                    out[b, h, j, 0, i] = acc[i] / total
