"""Elementwise and row-wise kernels with their hand-written backward passes.

Each ``*_forward`` returns the output and what its ``*_backward`` needs. They work on numpy
and cupy arrays alike (``xp_of``) and hold no state.
"""
from __future__ import annotations

import math

from ..backend import xp_of

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def layernorm_forward(x, gain, bias, eps):
    xp = xp_of(x)
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    rstd = 1.0 / xp.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)
    xhat = centered * rstd
    y = xhat * gain
    if bias is not None:
        y += bias
    return y, (xhat, rstd)


def layernorm_backward(dy, gain, saved):
    xhat, rstd = saved
    lead = tuple(range(dy.ndim - 1))
    dgain = (dy * xhat).sum(axis=lead)
    dbias = dy.sum(axis=lead)
    g = dy * gain
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, dgain, dbias


def rmsnorm_forward(x, gain, eps):
    xp = xp_of(x)
    rrms = 1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    xhat = x * rrms
    return xhat * gain, (xhat, rrms)


def rmsnorm_backward(dy, gain, saved):
    xhat, rrms = saved
    dgain = (dy * xhat).sum(axis=tuple(range(dy.ndim - 1)))
    g = dy * gain
    dx = rrms * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, dgain


def gelu_tanh_forward(x):
    xp = xp_of(x)
    t = xp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3))
    return 0.5 * x * (1.0 + t), (x, t)


def gelu_tanh_backward(dy, saved):
    x, t = saved
    dinner = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner)


def _erf(x):
    xp = xp_of(x)
    if xp.__name__ == "numpy":
        from scipy.special import erf
    else:
        from cupyx.scipy.special import erf
    return erf(x)


def gelu_erf_forward(x):
    cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))
    return x * cdf, (x, cdf)


def gelu_erf_backward(dy, saved):
    x, cdf = saved
    pdf = xp_of(x).exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return dy * (cdf + x * pdf)


def silu_forward(x):
    sig = 1.0 / (1.0 + xp_of(x).exp(-x))
    return x * sig, (x, sig)


def silu_backward(dy, saved):
    x, sig = saved
    return dy * sig * (1.0 + x * (1.0 - sig))


def softmax_forward(scores):
    """Softmax over the last axis; rows that are entirely -inf (fully masked) give zeros, not NaN."""
    xp = xp_of(scores)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
    p = xp.exp(scores - row_max)
    total = p.sum(axis=-1, keepdims=True)
    p /= xp.where(total > 0, total, 1.0)
    return p


def softmax_backward(dp, p):
    return p * (dp - (dp * p).sum(axis=-1, keepdims=True))


def rope_tables(positions, head_dim, theta, dtype):
    """cos/sin of shape [T, head_dim/2] for rotate-half RoPE at the given absolute positions."""
    xp = xp_of(positions)
    inv_freq = 1.0 / (theta ** (xp.arange(0, head_dim, 2, dtype="float64") / head_dim))
    angles = positions.astype("float64")[:, None] * inv_freq[None, :]
    return xp.cos(angles).astype(dtype), xp.sin(angles).astype(dtype)


def rope_apply(x, cos, sin, inverse=False):
    """Rotate pairs (i, i + d/2) of x [..., T, d]; ``inverse`` rotates back (the backward pass)."""
    xp = xp_of(x)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    s = -sin if inverse else sin
    return xp.concatenate([x1 * cos - x2 * s, x2 * cos + x1 * s], axis=-1)
