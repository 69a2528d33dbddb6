"""Elementwise and row-wise kernels with their hand-written backward passes.

Each ``*_forward`` returns the output and what its ``*_backward`` needs. They work on numpy
and cupy arrays alike (``xp_of``) and hold no state.
"""

from __future__ import annotations

import math

import numpy

from ..backend import xp_of
from . import cpu_kernels, cuda_kernels

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _fused(name: str, x, row: bool = False, half: bool = False):
    """The fused kernel ``name`` for ``x``'s device: ``cuda_kernels`` for cupy arrays,
    ``cpu_kernels`` (numba) for numpy ones, their half arrays too where ``half`` says the kernel takes
    them (sums in float32); None where there is none (the composed code runs)."""
    if hasattr(cuda_kernels, name) and cuda_kernels.fused(x, row, half):
        return getattr(cuda_kernels, name)
    if hasattr(cpu_kernels, name) and cpu_kernels.fused(x, row, half):
        return getattr(cpu_kernels, name)
    return None


def _half(x) -> bool:
    """float16/bfloat16: norms compute their statistics in float32 (a float16 sum of squares
    overflows once |x| passes ~256, and the norm would then output its bias, silently)."""
    return x.dtype.itemsize < 4


def _widen(*arrays):
    return tuple(None if a is None else a.astype("float32") for a in arrays)


# Elements from which a half cast or sum pays the fused kernel's call: bfloat16 [1, 576] astype 0.9 us,
# the kernel 4.5; [1, 3072] 7.8 and 6.1; [8, 3072] 42 and 10; the sum of two [1, 576] 1.1 and 2.3 us,
# of [8, 576] 6.7 and 2.9 (one thread, loaded 2-core AMD VM).
FUSED_HALF = 2048


def cast(x, dtype):
    """``x.astype(dtype, copy=False)``; between float32 and a half format through one fused pass on the
    CPU (the same bits) from ``FUSED_HALF`` elements."""
    if x.dtype == dtype:  # a float32 or float64 model's products: nothing to do, at the least cost
        return x
    if x.size >= FUSED_HALF and cpu_kernels.converts(x, dtype):
        return cpu_kernels.converted(x, dtype)
    return x.astype(dtype, copy=False)


def layernorm_forward(x, gain, bias, eps):
    if fast := _fused("layernorm_forward", x, row=True, half=True):
        return fast(x, gain, bias, eps)
    if _half(x):
        y, (xhat, rstd) = layernorm_forward(*_widen(x, gain, bias), eps)
        return y.astype(x.dtype), (xhat.astype(x.dtype), rstd)
    xp = xp_of(x)
    xhat = x - x.mean(axis=-1, keepdims=True)
    # Row sums of squares without a full-size temporary; rstd is per row, so cheap to build.
    var = xp.einsum("...i,...i->...", xhat, xhat)[..., None]
    var *= 1.0 / x.shape[-1]
    var += eps
    rstd = xp.sqrt(var, out=var)
    xp.divide(1.0, rstd, out=rstd)
    xhat *= rstd
    y = xhat * gain
    if bias is not None:
        y += bias
    return y, (xhat, rstd)


def layernorm_backward(dy, gain, saved):
    if fast := _fused("layernorm_backward", dy, row=True, half=True):
        return fast(dy, gain, saved)
    if _half(dy):  # computed in float32; the gain and bias gradients stay float32, as their buffers are
        dx, dgain, dbias = layernorm_backward(*_widen(dy, gain), (*_widen(saved[0]), saved[1]))
        return dx.astype(dy.dtype), dgain, dbias
    xp = xp_of(dy)
    xhat, rstd = saved
    lead = tuple(range(dy.ndim - 1))
    n = dy.shape[-1]
    dgain = xp.einsum("ni,ni->i", dy.reshape(-1, n), xhat.reshape(-1, n))
    dbias = dy.sum(axis=lead)
    g = dy * gain
    # dx = rstd (g - mean(g) - xhat mean(g xhat)), built in g's buffer.
    g_xhat = xp.einsum("...i,...i->...", g, xhat)[..., None]
    g_xhat *= 1.0 / n
    g_mean = g.mean(axis=-1, keepdims=True)
    correction = xhat * g_xhat
    correction += g_mean
    g -= correction
    g *= rstd
    return g, dgain, dbias


def rmsnorm_forward(x, gain, eps):
    if fast := _fused("rmsnorm_forward", x, row=True, half=True):
        return fast(x, gain, eps)
    if _half(x):
        y, (xhat, rrms) = rmsnorm_forward(*_widen(x, gain), eps)
        return y.astype(x.dtype), (xhat.astype(x.dtype), rrms)
    xp = xp_of(x)
    rrms = 1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    xhat = x * rrms
    return xhat * gain, (xhat, rrms)


def rmsnorm_backward(dy, gain, saved):
    if fast := _fused("rmsnorm_backward", dy, row=True, half=True):
        return fast(dy, gain, saved)
    if _half(dy):  # as layernorm_backward: the gain gradient stays float32
        dx, dgain = rmsnorm_backward(*_widen(dy, gain), (*_widen(saved[0]), saved[1]))
        return dx.astype(dy.dtype), dgain
    xhat, rrms = saved
    dgain = (dy * xhat).sum(axis=tuple(range(dy.ndim - 1)))
    g = dy * gain
    dx = rrms * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, dgain


def add_norm_forward(x, residual, gain, bias, eps, center: bool):
    """``x += residual`` (x: the caller's own array), then its layernorm (``center``) or rmsnorm
    (``bias`` None): (x, y, saved), a pre-LN block's residual sum and the norm after it."""
    if cpu_kernels.fused_rows(x, residual):
        return cpu_kernels.add_norm_forward(x, residual, gain, bias, eps, center)
    x += residual
    return (x, *(layernorm_forward(x, gain, bias, eps) if center else rmsnorm_forward(x, gain, eps)))


def add_into(x, residual):
    """``x += residual`` (x: the caller's own array), half x through one fused pass on the CPU from
    ``FUSED_HALF`` elements."""
    if x.size >= FUSED_HALF and x.dtype not in cpu_kernels.DTYPES and cpu_kernels.fused_rows(x, residual):
        return cpu_kernels.add_into(x, residual)
    x += residual
    return x


def gated_forward(h, local: int, act_forward):
    """act(gate) * up for h = [gate | up] [..., 2 local], a gated MLP's activation (``act_forward``:
    e.g. ``silu_forward``): (the product, (act's saved values, act, up)) for the MLP's backward."""
    if act_forward is silu_forward and cpu_kernels.fused(h, half=True):
        return cpu_kernels.swiglu_forward(h, local)
    gate, up = h[..., :local], h[..., local:]
    act, act_ctx = act_forward(gate)
    return act * up, (act_ctx, act, up)


def gelu_tanh_forward(x):
    """0.5 x (1 + tanh(c (x + 0.044715 x^3))), with the inner term as x (c + 0.044715 c x^2) and
    every step in place: no float power (x**3 costs more than the GEMM before it) and one output."""
    if fast := _fused("gelu_tanh_forward", x):
        return fast(x)
    xp = xp_of(x)
    t = x * x
    t *= _SQRT_2_OVER_PI * 0.044715
    t += _SQRT_2_OVER_PI
    t *= x
    xp.tanh(t, out=t)
    y = t + 1.0
    y *= x
    y *= 0.5
    return y, (x, t)


def gelu_tanh_backward(dy, saved):
    """dy (0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 0.044715 x^2)), in place in one buffer."""
    if fast := _fused("gelu_tanh_backward", dy):
        return fast(dy, saved)
    xp = xp_of(dy)
    x, t = saved
    g = x * x
    g *= 0.5 * _SQRT_2_OVER_PI * 3 * 0.044715
    g += 0.5 * _SQRT_2_OVER_PI
    g *= x
    scratch = t * t
    xp.subtract(1.0, scratch, out=scratch)
    g *= scratch
    half_1_plus_t = xp.multiply(t, 0.5, out=scratch)
    half_1_plus_t += 0.5
    g += half_1_plus_t
    g *= dy
    return g


def _erf(x):
    xp = xp_of(x)
    if xp.__name__ == "numpy":
        from scipy.special import erf  # scipy is slow to load, and only the exact GELU needs it
    else:
        from cupyx.scipy.special import erf  # optional (hpc_tp[gpu]): device arrays only
    return erf(x)


def gelu_erf_forward(x):
    cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))
    return x * cdf, (x, cdf)


def gelu_erf_backward(dy, saved):
    x, cdf = saved
    pdf = xp_of(x).exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return dy * (cdf + x * pdf)


def silu_forward(x):
    if fast := _fused("silu_forward", x):
        return fast(x)
    sig = 1.0 / (1.0 + xp_of(x).exp(-x))
    return x * sig, (x, sig)


def silu_backward(dy, saved):
    if fast := _fused("silu_backward", dy):
        return fast(dy, saved)
    x, sig = saved
    return dy * sig * (1.0 + x * (1.0 - sig))


def softmax_forward(scores, causal_offset: int | None = None, window: int = 0):
    """Softmax over the last axis; rows that are entirely -inf (fully masked) give zeros, not NaN.
    One full-size array is written (the result); the row statistics are small. ``causal_offset``:
    scores [..., Tq, Tk] where query i sees only keys j <= i + offset, masked as an added -inf
    bias would (the device kernel skips them in place; elsewhere they are set to -inf first);
    ``window`` > 0 hides the keys j <= i + offset - window too (sliding-window attention)."""
    if causal_offset is not None and not window and cuda_kernels.fused(scores, row=True):
        return cuda_kernels.softmax_forward(scores, causal_offset)
    if _half(scores):  # as the norms: float32 row sums (and the device's float32 row kernel)
        return softmax_forward(scores.astype("float32"), causal_offset, window).astype(scores.dtype)
    xp = xp_of(scores)
    if causal_offset is not None:
        scores = causal_masked(scores, causal_offset, window)
    if fast := _fused("softmax_forward", scores, row=True):
        return fast(scores)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max[~xp.isfinite(row_max)] = 0.0
    p = scores - row_max
    xp.exp(p, out=p)
    total = p.sum(axis=-1, keepdims=True)
    total[total == 0] = 1.0
    p *= xp.divide(1.0, total, out=total)
    return p


def causal_hidden(q_len: int, k_len: int, offset: int, xp, window: int = 0):
    """[Tq, Tk]: True where key j comes after query i's position i + ``offset`` (the causal mask)
    or, with a ``window`` > 0, lies ``window`` or more positions before it (sliding-window attention:
    a query sees itself and the window - 1 keys before it)."""
    keys, queries = xp.arange(k_len)[None, :], xp.arange(offset, offset + q_len)[:, None]
    hidden = keys > queries
    if window:
        hidden |= keys <= queries - window
    return hidden


def causal_masked(scores, offset: int, window: int = 0):
    """``scores`` [..., Tq, Tk] with -inf where ``causal_hidden`` hides the key."""
    xp = xp_of(scores)
    hidden = causal_hidden(*scores.shape[-2:], offset, xp, window)
    return xp.where(hidden, -xp.inf, scores).astype(scores.dtype, copy=False)


def softmax_backward(dp, p):
    if fast := _fused("softmax_backward", dp, row=True):
        return fast(dp, p)
    if _half(dp):
        return softmax_backward(*_widen(dp, p)).astype(dp.dtype)
    xp = xp_of(dp)
    row_dot = xp.einsum("...i,...i->...", dp, p)[..., None]
    ds = dp - row_dot
    ds *= p
    return ds


def scatter_add_rows(target, rows, values):
    """``target[rows[t]] += values[t]`` for every t, repeated rows summed in order: the gradient of a
    row lookup (embeddings) and the sum of routed rows (MoE). ``target`` [N, H], ``rows`` integer
    indices of any shape S (in [0, N): the fused loop refuses a negative one, which add.at would
    wrap), ``values`` [*S, H], cast to ``target``'s dtype. Other shapes take add.at's broadcasting."""
    if (
        cpu_kernels.fused(target)
        and isinstance(values, numpy.ndarray)
        and isinstance(rows, numpy.ndarray)
        and rows.dtype.kind in "iu"
        and target.ndim == 2
        and values.shape == rows.shape + target.shape[1:]
    ):
        return cpu_kernels.scatter_add_rows(target, rows, values)
    xp = xp_of(target)
    if xp is not numpy and target.dtype.name == "bfloat16":  # cupy's add.at has no bfloat16: sum in float32
        wide = target.astype(numpy.float32)
        xp.add.at(wide, rows, values.astype(numpy.float32, copy=False))
        target[...] = wide
    else:
        xp.add.at(target, rows, values.astype(target.dtype, copy=False))


def rope_tables(positions, inv_freq, dtype):
    """cos/sin of shape [..., T, head_dim/2] for rotate-half RoPE at absolute ``positions`` [..., T].
    In training each layer makes its own (the planner's memory model counts them a layer,
    tests/test_plan.py); an inference pass makes them once for the layers that share a rope."""
    xp = xp_of(positions)
    angles = positions.astype("float64")[..., None] * inv_freq
    return xp.cos(angles).astype(dtype), xp.sin(angles).astype(dtype)


def rope_apply(x, cos, sin, inverse=False, scale=1.0):
    """Rotate pairs (i, i + d/2) of x [..., T, d]; ``inverse`` rotates back (the backward pass);
    ``scale``: the rotated values then multiplied by it (attention's query scale), in one pass on the CPU."""
    if cpu_kernels.fused(cos, half=True) and isinstance(x, numpy.ndarray) and x.dtype == cos.dtype == sin.dtype:
        return cpu_kernels.rope_apply(x, cos, sin, inverse, scale)
    xp = xp_of(x)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    s = -sin if inverse else sin
    out = xp.concatenate([x1 * cos - x2 * s, x2 * cos + x1 * s], axis=-1)
    if scale != 1:
        out *= scale
    return out
