"""``flash_attention``'s kernels in numpy, tile by tile: the same grid, the same tile ranges, the same
online-softmax recurrences and the same sums, one warp's 32 lanes as one vector (``lanes`` of them,
so that tests can use small tiles and reach every partial-tile and skipped-tile case with short
sequences). It proves on the CPU the algorithm the CUDA source implements: tests hold it to the
composed attention in float64. Each function is named after its kernel and keeps its loop order;
the comments name what a loop is on the device.
"""

from __future__ import annotations

import math

import numpy

from .flash_attention import ROWS, WARPS


def visible(i, j, b, n_q, n_keys, q_offset, causal, window, key_mask):
    """Which keys ``j`` (a vector: one per lane) query ``i`` of sequence ``b`` sees (``visible``)."""
    pos = i + q_offset
    seen = (i < n_q) & (j < n_keys)
    if causal:
        seen &= j <= pos
    if window > 0:
        seen &= pos - j < window
    if key_mask is not None:
        seen &= key_mask[b, numpy.minimum(j, n_keys - 1)].astype(bool)
    return seen


def key_range(q0, q_end, n_keys, q_offset, causal, window, lanes):
    last = q_end - 1 + q_offset
    end = last + 1 if causal and last + 1 < n_keys else n_keys
    start = max(q0 + q_offset - window + 1, 0) if window > 0 else 0
    return start // lanes * lanes, end


def query_range(k0, k_end, n_q, q_offset, causal, window, lanes):
    start = max(k0 - q_offset, 0) if causal else 0
    stop = k_end - 1 + window - q_offset if window > 0 else n_q
    return start // lanes * lanes, min(stop, n_q)


def _stage(x, row0, count, wide):
    """Rows [row0, row0 + count) of x [T, d] in the wide dtype, zeros past the end (``stage``)."""
    tile = numpy.zeros((count, x.shape[-1]), dtype=wide)
    rows = x[row0 : row0 + count]
    tile[: len(rows)] = rows
    return tile


def _wide(dtype):
    return numpy.float64 if numpy.dtype(dtype) == numpy.float64 else numpy.float32


def _by_head(x):
    """[B, hk, g, T, d] -> [B, hk * g, T, d] (head h = kv head * g + member)."""
    return x.reshape(x.shape[0], -1, *x.shape[-2:])


def flash_fwd(q, k, v, q_offset, causal, key_mask=None, window=0, rows=ROWS, lanes=32):
    """(output like ``q``, lse [B, hk, g, T]) for Q [B, hk, g, T, d] (scaled), K, V [B, hk, keys, d]."""
    wide = _wide(q.dtype)
    qh, out = _by_head(q), numpy.zeros(_by_head(q).shape, q.dtype)
    batch, heads, n_q, d = qh.shape
    group, n_keys, bq = q.shape[2], k.shape[2], WARPS * rows
    lse = numpy.zeros((batch, heads, n_q), wide)
    for b, h, q0 in numpy.ndindex(batch, heads, -(-n_q // bq)):  # the grid
        q0 *= bq
        kvh, q_end = h // group, min(q0 + bq, n_q)
        qs = _stage(qh[b, h], q0, bq, wide)
        m, l_, acc = numpy.full(bq, -numpy.inf, wide), numpy.zeros(bq, wide), numpy.zeros((bq, d), wide)
        first, end = key_range(q0, q_end, n_keys, q_offset, causal, window, lanes)
        for k0 in range(first, end, lanes):
            ks, vs = _stage(k[b, kvh], k0, lanes, wide), _stage(v[b, kvh], k0, lanes, wide)
            j = k0 + numpy.arange(lanes)
            for row in range(bq):  # each warp its ROWS rows, a lane per key
                seen = visible(q0 + row, j, b, n_q, n_keys, q_offset, causal, window, key_mask)
                s = numpy.where(seen, ks @ qs[row], -numpy.inf)
                m_new = max(m[row], s.max())
                shift = 0.0 if m_new == -numpy.inf else m_new
                p, rescale = numpy.exp(s - shift), numpy.exp(m[row] - shift)
                l_[row] = l_[row] * rescale + p.sum()
                acc[row] = acc[row] * rescale + p @ vs  # ``accumulate``: lane j's p times V's row j
                m[row] = m_new
        live = slice(0, q_end - q0)
        with numpy.errstate(divide="ignore"):
            inv = numpy.where(l_ > 0, 1 / numpy.where(l_ > 0, l_, 1), 0)
            lse[b, h, q0:q_end] = numpy.where(l_ > 0, m + numpy.log(numpy.where(l_ > 0, l_, 1)), numpy.inf)[live]
        out[b, h, q0:q_end] = (acc * inv[:, None])[live]
    return out.reshape(q.shape), lse.reshape(q.shape[:4])


def _delta(dout, out, wide):
    """rowsum(dO * O): what ``backward`` computes before the two kernels."""
    return (_by_head(dout).astype(wide) * _by_head(out).astype(wide)).sum(axis=-1)


def flash_dq(q, k, v, dout, lse, delta, q_offset, causal, key_mask=None, window=0, rows=ROWS, lanes=32):
    """dQ like ``q`` (times 1/sqrt(d))."""
    wide = _wide(q.dtype)
    qh, gh, lse = _by_head(q), _by_head(dout), lse.reshape(delta.shape)
    batch, heads, n_q, d = qh.shape
    group, n_keys, bq = q.shape[2], k.shape[2], WARPS * rows
    dq = numpy.zeros(qh.shape, q.dtype)
    for b, h, q0 in numpy.ndindex(batch, heads, -(-n_q // bq)):
        q0 *= bq
        kvh, q_end = h // group, min(q0 + bq, n_q)
        qs, gs = _stage(qh[b, h], q0, bq, wide), _stage(gh[b, h], q0, bq, wide)
        row_lse = _stage(lse[b, h, :, None], q0, bq, wide)[:, 0]
        row_lse[q_end - q0 :] = numpy.inf
        row_delta = _stage(delta[b, h, :, None], q0, bq, wide)[:, 0]
        grad = numpy.zeros((bq, d), wide)
        first, end = key_range(q0, q_end, n_keys, q_offset, causal, window, lanes)
        for k0 in range(first, end, lanes):
            ks, vs = _stage(k[b, kvh], k0, lanes, wide), _stage(v[b, kvh], k0, lanes, wide)
            j = k0 + numpy.arange(lanes)
            for row in range(bq):
                seen = visible(q0 + row, j, b, n_q, n_keys, q_offset, causal, window, key_mask)
                p = numpy.exp(numpy.where(seen, ks @ qs[row] - row_lse[row], -numpy.inf))
                ds = numpy.where(seen, p * (vs @ gs[row] - row_delta[row]), 0)
                grad[row] += ds @ ks
        dq[b, h, q0:q_end] = (grad * (1 / math.sqrt(d)))[: q_end - q0]
    return dq.reshape(q.shape)


def flash_dkdv(q, k, v, dout, lse, delta, q_offset, causal, key_mask=None, window=0, rows=ROWS, lanes=32):
    """(dK, dV) like ``k``: a block per tile of WARPS * rows keys of one KV head, every query head of its
    group, query tiles of ``lanes`` (a lane per query)."""
    wide = _wide(q.dtype)
    qh, gh, lse = _by_head(q), _by_head(dout), lse.reshape(delta.shape)
    batch, heads, n_q, d = qh.shape
    group, n_keys, bk = q.shape[2], k.shape[2], WARPS * rows
    dk, dv = numpy.zeros(k.shape, k.dtype), numpy.zeros(v.shape, v.dtype)
    for b, kvh, k0 in numpy.ndindex(batch, heads // group, -(-n_keys // bk)):
        k0 *= bk
        k_end = min(k0 + bk, n_keys)
        ks, vs = _stage(k[b, kvh], k0, bk, wide), _stage(v[b, kvh], k0, bk, wide)
        gk, gv = numpy.zeros((bk, d), wide), numpy.zeros((bk, d), wide)
        first, end = query_range(k0, k_end, n_q, q_offset, causal, window, lanes)
        for g in range(group):
            h = kvh * group + g
            for q0 in range(first, end, lanes):
                qs, gs = _stage(qh[b, h], q0, lanes, wide), _stage(gh[b, h], q0, lanes, wide)
                lse_s = _stage(lse[b, h, :, None], q0, lanes, wide)[:, 0]
                lse_s[max(n_q - q0, 0) :] = numpy.inf
                delta_s = _stage(delta[b, h, :, None], q0, lanes, wide)[:, 0]
                i = q0 + numpy.arange(lanes)
                for key in range(bk):  # each warp its rows keys, a lane per query
                    seen = visible(i, k0 + key, b, n_q, n_keys, q_offset, causal, window, key_mask)
                    p = numpy.exp(numpy.where(seen, qs @ ks[key] - lse_s, -numpy.inf))
                    ds = numpy.where(seen, p * (gs @ vs[key] - delta_s), 0)
                    gv[key] += p @ gs
                    gk[key] += ds @ qs
        dk[b, kvh, k0:k_end], dv[b, kvh, k0:k_end] = gk[: k_end - k0], gv[: k_end - k0]
    return dk, dv


def backward(dout, q, k, v, out, lse, q_offset, causal, key_mask=None, window=0, rows=ROWS, lanes=32):
    """(dQ, dK, dV) as ``flash_attention.backward`` makes them: delta, then the two kernels."""
    delta = _delta(dout, out, lse.dtype)
    masks = (q_offset, causal, key_mask, window, rows, lanes)
    return (flash_dq(q, k, v, dout, lse, delta, *masks), *flash_dkdv(q, k, v, dout, lse, delta, *masks))
