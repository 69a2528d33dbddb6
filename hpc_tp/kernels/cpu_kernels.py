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


def _rows(x):
    return x.reshape(-1, x.shape[-1])


def _c(x):
    return numpy.ascontiguousarray(x)


# -- layernorm / rmsnorm ---------------------------------------------------------------------------


@_jit
def _norm_rows(x, gain, bias, eps, center, y, xhat, rstd):
    rows, n = x.shape
    for r in range(rows):
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
        for i in range(n):
            h = xhat[r, i] * scale
            xhat[r, i] = h
            y[r, i] = h * gain[i] + bias[i]


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


def _norm_forward(x, gain, bias, eps, center: bool):
    x = _c(x)
    y, xhat = numpy.empty_like(x), numpy.empty_like(x)
    rstd = numpy.empty(x.shape[:-1] + (1,), x.dtype)
    gain = _c(gain.astype(x.dtype, copy=False))  # the kernel takes one dtype; x's is the one computed in
    bias = numpy.zeros_like(gain) if bias is None else _c(bias.astype(x.dtype, copy=False))
    _norm_rows(_rows(x), gain, bias, eps, center, _rows(y), _rows(xhat), _rows(rstd))
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
