"""Fused CPU kernels (numba) for the memory-bound pieces of a block; ``functional`` dispatches here
for numpy arrays, as it does to ``cuda_kernels`` for cupy ones.

On the CPU these ops are bound by memory traffic, not arithmetic: numpy makes one full read and
write per operation (layernorm forward is 6 passes over [tokens, hidden], GELU's backward 10),
while the matrix products next to them run at the core's peak. Each kernel here makes one pass per
row or element (GELU and softmax forward three: numba has no vector tanh or exp without Intel's
SVML, so numpy's vectorized one runs between two fused passes; GELU a cache-sized chunk at a time). Their saved tensors
are exactly what ``functional``'s composed backward expects, so either path can follow the other.

Row sums accumulate in float64 (a float32 row of 768 sums to within 1e-7 of the exact value);
``fastmath`` lets LLVM vectorize those sums and contract multiply-adds, which changes the last bit
against numpy, never the numbers across tp (every row is whole on every rank).

The decode step's small pieces (a residual sum and the next norm; SwiGLU's gate and up; RoPE's rotation;
K/V written into a paged pool) are each one call here: at a few rows their cost is the calls and
temporaries of the composed code, not the arithmetic. Those marked exact (``_exact``: no fastmath) make
the same IEEE operations as the numpy code they replace, in the same order, so they give its bits and
training keeps its numbers.

Without numba (or with ``HPC_TP_CPU_KERNELS=0``, e.g. for an A/B benchmark) ``fused`` is False and
the composed numpy code runs. Kernels compile on first use and are cached on disk beside this file.
"""

from __future__ import annotations

import math
import os

import numpy

try:
    import numba
except ImportError:  # optional: the numpy path in ``functional`` does the same work
    numba = None

DTYPES = (numpy.dtype("float32"), numpy.dtype("float64"))
ENABLED = numba is not None and os.environ.get("HPC_TP_CPU_KERNELS", "1") != "0"
CHUNK = (
    1 << 16
)  # elements per GELU chunk: x, t and y of one chunk stay in L2 between the passes (fastest of 2^12..2^18)
_C = math.sqrt(2.0 / math.pi)
_K = 0.044715


def fused(x, row: bool = False) -> bool:
    """True for a C-contiguous float32/float64 numpy array when numba is there."""
    return ENABLED and isinstance(x, numpy.ndarray) and x.dtype in DTYPES and x.flags.c_contiguous


def _jit(function):
    return (
        numba.njit(cache=True, nogil=True, fastmath={"contract", "reassoc", "nsz", "arcp"})(function)
        if (numba is not None)
        else function
    )


def _jit_exact(function):
    """Compiled without fastmath (no contraction or reordering: numpy's bits); numpy's error model, so
    that a division does not test for zero and its loop vectorizes."""
    return numba.njit(cache=True, nogil=True, error_model="numpy")(function) if (numba is not None) else function


def _rows(x):
    return x.reshape(-1, x.shape[-1])


def _c(x):
    return numpy.ascontiguousarray(x)


# -- layernorm / rmsnorm ---------------------------------------------------------------------------


@_jit
def _norm_rows(x, residual, gain, bias, eps, center, y, xhat, rstd):
    """y, xhat, rstd of each row of x; ``residual`` (no rows: none) is added into x first, row by row
    (a block's residual sum and the norm after it in one pass); ``bias`` empty: none."""
    rows, n = x.shape
    for r in range(rows):
        if residual.shape[0]:
            for i in range(n):
                x[r, i] += residual[r, i]
        mean = 0.0
        if center:
            for i in range(n):
                mean += x[r, i]
            mean /= n
        var = 0.0
        for i in range(n):
            d = x[r, i] - mean
            xhat[r, i] = d
            var += d * d
        scale = 1.0 / math.sqrt(var / n + eps)
        rstd[r, 0] = scale
        if bias.shape[0]:
            for i in range(n):
                h = xhat[r, i] * scale
                xhat[r, i] = h
                y[r, i] = h * gain[i] + bias[i]
        else:
            for i in range(n):
                h = xhat[r, i] * scale
                xhat[r, i] = h
                y[r, i] = h * gain[i]


@_jit
def _norm_rows_backward(dy, gain, xhat, rstd, center, dx, dgain, dbias):
    rows, n = dy.shape
    for r in range(rows):
        g_mean = 0.0
        g_xhat = 0.0
        for i in range(n):
            d = dy[r, i]
            g = d * gain[i]
            g_mean += g
            g_xhat += g * xhat[r, i]
            dgain[i] += d * xhat[r, i]
            dbias[i] += d
        g_mean = g_mean / n if center else 0.0
        g_xhat /= n
        scale = rstd[r, 0]
        for i in range(n):
            dx[r, i] = scale * (dy[r, i] * gain[i] - g_mean - xhat[r, i] * g_xhat)


def _norm_forward(x, gain, bias, eps, center: bool, residual=None):
    """The norm of x, or with ``residual`` of x + residual, summed into x (C-contiguous, the caller's own)."""
    x = _c(x)
    rows = _rows(x)
    y, xhat = numpy.empty_like(x), numpy.empty_like(x)
    rstd = numpy.empty(x.shape[:-1] + (1,), x.dtype)
    gain = _c(gain.astype(x.dtype, copy=False))  # the kernel takes one dtype; x's is the one computed in
    bias = gain[:0] if bias is None else _c(bias.astype(x.dtype, copy=False))
    residual = rows[:0] if residual is None else _rows(_c(residual.astype(x.dtype, copy=False)))
    _norm_rows(rows, residual, gain, bias, eps, center, _rows(y), _rows(xhat), _rows(rstd))
    return y, (xhat, rstd)


def _norm_backward(dy, gain, saved, center: bool):
    xhat, rstd = saved
    dy = _c(dy)
    dx = numpy.empty_like(dy)
    dgain, dbias = numpy.zeros(dy.shape[-1]), numpy.zeros(dy.shape[-1])  # float64 sums over every row
    _norm_rows_backward(
        _rows(dy),
        _c(gain.astype(dy.dtype, copy=False)),
        _rows(_c(xhat.astype(dy.dtype, copy=False))),
        _rows(_c(rstd.astype(dy.dtype, copy=False))),
        center,
        _rows(dx),
        dgain,
        dbias,
    )
    return dx, dgain.astype(dy.dtype), dbias.astype(dy.dtype)


def layernorm_forward(x, gain, bias, eps):
    return _norm_forward(x, gain, bias, eps, center=True)


def layernorm_backward(dy, gain, saved):
    return _norm_backward(dy, gain, saved, center=True)


def rmsnorm_forward(x, gain, eps):
    return _norm_forward(x, gain, None, eps, center=False)


def rmsnorm_backward(dy, gain, saved):
    return _norm_backward(dy, gain, saved, center=False)[:2]


def add_norm_forward(x, residual, gain, bias, eps, center: bool):
    """x += residual, then its norm (layernorm with ``center``, else rmsnorm; ``bias`` None for
    rmsnorm): one pass over each row for the two; (x, y, saved). x as ``fused_rows`` says."""
    return (x, *_norm_forward(x, gain, bias, eps, center, residual))


def fused_rows(x, residual) -> bool:
    """True where ``add_norm_forward`` takes x and residual: x C-contiguous and written in place,
    residual of its shape."""
    return fused(x) and x.flags.writeable and isinstance(residual, numpy.ndarray) and residual.shape == x.shape


# -- SwiGLU's gate and up --------------------------------------------------------------------------


@_jit_exact
def _negate(h, local, out):
    for r in range(h.shape[0]):
        gate, o = h[r, :local], out[r]
        for i in range(local):
            o[i] = -gate[i]


@_jit_exact
def _swiglu(h, local, one, sig, act, inner):
    """From sig = exp(-gate) (numpy's exp): sig = 1 / (1 + exp(-gate)), act = gate sig and
    inner = act up, the operations of ``functional.silu_forward`` and the product after it."""
    for r in range(h.shape[0]):
        gate, up, s, a, y = h[r, :local], h[r, local:], sig[r], act[r], inner[r]
        for i in range(local):
            v = one / (one + s[i])
            s[i] = v
            w = gate[i] * v
            a[i] = w
            y[i] = w * up[i]


def swiglu_forward(h, local: int):
    """silu(gate) * up for h = [gate | up] [..., 2 local]: the product, and what ``silu_backward``
    and the MLP's backward keep, (gate, sig), act, up; three passes (numpy's vectorized exp between two
    fused ones) where the composed code makes seven, each with its own temporary."""
    h = _c(h)
    rows = _rows(h)
    shape = h.shape[:-1] + (local,)
    sig, act, inner = numpy.empty(shape, h.dtype), numpy.empty(shape, h.dtype), numpy.empty(shape, h.dtype)
    _negate(rows, local, _rows(sig))
    numpy.exp(sig, out=sig)
    _swiglu(rows, local, h.dtype.type(1), _rows(sig), _rows(act), _rows(inner))
    gate, up = h[..., :local], h[..., local:]
    return inner, ((gate, sig), act, up)


# -- rotary position embedding ---------------------------------------------------------------------


@_jit_exact
def _rotate(x, cos, sin, sign, out):
    """out = x with pairs (i, i + d/2) of each [B, H, T, d] row rotated by the tables [1|B, T, d/2]
    (``sign`` -1: rotated back), as ``functional.rope_apply`` computes it. out may be x."""
    rows, heads, steps, d = x.shape
    half = d // 2
    for b in range(rows):
        tb = 0 if cos.shape[0] == 1 else b
        for h in range(heads):
            for t in range(steps):
                c, s, src, dst = cos[tb, t], sin[tb, t], x[b, h, t], out[b, h, t]
                for i in range(half):
                    x1, x2, si = src[i], src[i + half], sign * s[i]
                    dst[i] = x1 * c[i] - x2 * si
                    dst[i + half] = x2 * c[i] + x1 * si


def rope_apply(x, cos, sin, inverse: bool = False):
    """``functional.rope_apply`` for x [..., T, d] (any strides) and tables of x's dtype, [T, d/2]
    or [B, 1.., T, d/2] for x [B, ..., T, d]: one pass into a new C-contiguous array."""
    t, d = x.shape[-2:]
    heads = (x.shape[0] if x.ndim > 2 else 1, -1, t, d)
    out = numpy.empty(x.shape, x.dtype)
    half = (-1, t, d // 2)
    _rotate(
        x.reshape(heads), cos.reshape(half), sin.reshape(half), x.dtype.type(-1 if inverse else 1), out.reshape(heads)
    )
    return out


# -- K/V into a paged pool -------------------------------------------------------------------------


@_jit
def _write_slots(k_pool, v_pool, slots, k, v):
    """k_pool[h, slots[b, t]] = k[b, h, t] (and v alike), for every row, head and token."""
    rows, heads, steps, d = k.shape
    for b in range(rows):
        for t in range(steps):
            slot = slots[b, t]
            if slot < 0 or slot >= k_pool.shape[1]:
                raise IndexError("slot out of range")
            for h in range(heads):
                k_pool[h, slot, :] = k[b, h, t]
                v_pool[h, slot, :] = v[b, h, t]


def can_write_slots(pool, k, v) -> bool:
    """True when ``write_slots`` takes ``k`` and ``v`` into ``pool`` (and its twin): numpy arrays of
    one dtype, the pool C-contiguous, float32/float64 or a half precision (bfloat16, float16: copied
    as their bits)."""
    dtype = pool.dtype
    return (
        ENABLED
        and all(isinstance(array, numpy.ndarray) for array in (pool, k, v))
        and pool.flags.c_contiguous
        and k.dtype == v.dtype == dtype
        and (dtype in DTYPES or (dtype.itemsize == 2 and dtype.kind in "fV"))
    )


def write_slots(k_pool, v_pool, slots, k, v):
    """One layer's new K and V [B, hk, T, d] (any strides) at the slots [B, T] of its pools
    [hk, slots, d]: one call for both, where fancy indexing makes two copies and two scatters."""
    if k_pool.dtype.itemsize == 2:  # numba has no bfloat16: a copy moves the same bits as uint16
        k_pool, v_pool, k, v = (array.view(numpy.uint16) for array in (k_pool, v_pool, k, v))
    _write_slots(k_pool, v_pool, slots, k, v)


# -- GELU (tanh approximation) ---------------------------------------------------------------------


@_jit
def _gelu_inner(x, t):
    for i in range(x.size):
        v = x[i]
        t[i] = v * (_C + _C * _K * v * v)


@_jit
def _gelu_outer(x, t, y):
    for i in range(x.size):
        y[i] = 0.5 * x[i] * (1.0 + t[i])


@_jit
def _gelu_backward(dy, x, t, dx):
    for i in range(x.size):
        v, u = x[i], t[i]
        dx[i] = dy[i] * (0.5 * (1.0 + u) + 0.5 * v * (1.0 - u * u) * (_C + 3.0 * _C * _K * v * v))


def gelu_tanh_forward(x):
    x = _c(x)
    y, t = numpy.empty_like(x), numpy.empty_like(x)
    flat_x, flat_t, flat_y = x.reshape(-1), t.reshape(-1), y.reshape(-1)
    for start in range(0, flat_x.size, CHUNK):
        part = slice(start, start + CHUNK)
        _gelu_inner(flat_x[part], flat_t[part])
        numpy.tanh(flat_t[part], out=flat_t[part])
        _gelu_outer(flat_x[part], flat_t[part], flat_y[part])
    return y, (x, t)


def gelu_tanh_backward(dy, saved):
    x, t = saved
    dy = _c(dy)
    dx = numpy.empty_like(dy)
    x, t = (_c(a.astype(dy.dtype, copy=False)).reshape(-1) for a in (x, t))  # the kernel takes one dtype
    _gelu_backward(dy.reshape(-1), x, t, dx.reshape(-1))
    return dx


# -- softmax backward ------------------------------------------------------------------------------


@_jit
def _softmax_rows_backward(dp, p, ds):
    rows, n = dp.shape
    for r in range(rows):
        dot = 0.0
        for i in range(n):
            dot += dp[r, i] * p[r, i]
        for i in range(n):
            ds[r, i] = p[r, i] * (dp[r, i] - dot)


def softmax_backward(dp, p):
    dp = _c(dp)
    ds = numpy.empty_like(dp)
    _softmax_rows_backward(_rows(dp), _rows(_c(p.astype(dp.dtype, copy=False))), _rows(ds))
    return ds


# -- softmax forward -------------------------------------------------------------------------------


@_jit
def _softmax_shift(scores, top, p):
    """p = scores - row max (a fully masked row's max, -inf, counts as 0), for numpy's exp next.
    The max comes from numpy: a max reduction does not vectorize here without fastmath's nnan,
    which would also let a NaN score pass unseen."""
    rows, n = scores.shape
    for r in range(rows):
        shift = top[r, 0] if math.isfinite(top[r, 0]) else 0.0
        for i in range(n):
            p[r, i] = scores[r, i] - shift


@_jit
def _softmax_normalize(p):
    rows, n = p.shape
    for r in range(rows):
        total = 0.0
        for i in range(n):
            total += p[r, i]
        scale = 1.0 / total if total > 0.0 else 1.0
        for i in range(n):
            p[r, i] *= scale


def softmax_forward(scores):
    scores = _c(scores)
    p = numpy.empty_like(scores)
    _softmax_shift(_rows(scores), _rows(scores.max(axis=-1, keepdims=True)), _rows(p))
    numpy.exp(p, out=p)  # vectorized; numba's exp is a scalar call without Intel's SVML
    _softmax_normalize(_rows(p))
    return p


# -- rows summed into a table (embedding gradients, MoE combine) ---------------------------------


@_jit
def _scatter_add_rows(target, rows, values):
    for t in range(rows.size):
        row = rows[t]
        if row < 0 or row >= target.shape[0]:
            raise IndexError("row index out of range")
        for i in range(values.shape[1]):
            target[row, i] += values[t, i]


def scatter_add_rows(target, rows, values):
    """numpy's ``add.at(target, rows, values)`` for 2-D rows, in the same order (repeated rows summed
    token by token, so the same bits), without its per-element indexing: 1024 rows of 768 into a
    [25152, 768] table 38 ms -> ~0.3 ms."""
    _scatter_add_rows(_rows(target), rows.reshape(-1), _rows(_c(values.astype(target.dtype, copy=False))))
