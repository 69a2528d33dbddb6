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

from . import half_bits
from .half_bits import bits

try:
    import numba
except ImportError:  # optional: the numpy path in ``functional`` does the same work
    numba = None

DTYPES = (numpy.dtype("float32"), numpy.dtype("float64"))
ENABLED = numba is not None and os.environ.get("HPC_TP_CPU_KERNELS", "1") != "0"
CHUNK = (
    1 << 16
)  # elements per GELU chunk: x, t and y of one chunk stay in L2 between the passes (fastest of 2^12..2^18)
PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE: its row sums add blocks up to this long with 8 accumulators
_C = math.sqrt(2.0 / math.pi)
_K = 0.044715


def fused(x, row: bool = False, half: bool = False) -> bool:
    """True for a C-contiguous float32/float64 numpy array when numba is there; with ``half`` (the
    kernel takes them: norms, add_norm, SwiGLU, RoPE) also bfloat16/float16 (``half_bits.VIEWS``)."""
    return (
        ENABLED
        and isinstance(x, numpy.ndarray)
        and (x.dtype in DTYPES or (half and x.dtype in half_bits.VIEWS))
        and x.flags.c_contiguous
    )


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
    """dx of each row, dgain and dbias summed over rows (float64); dy, xhat and dx may be half bits
    (read as float32, dx rounded once)."""
    rows, n = dy.shape
    for r in range(rows):
        g_mean = 0.0
        g_xhat = 0.0
        for i in range(n):
            d, h = half_bits.wide(dy[r, i]), half_bits.wide(xhat[r, i])
            g = d * gain[i]
            g_mean += g
            g_xhat += g * h
            dgain[i] += d * h
            dbias[i] += d
        g_mean = g_mean / n if center else 0.0
        g_xhat /= n
        scale = rstd[r, 0]
        for i in range(n):
            d, h = half_bits.wide(dy[r, i]), half_bits.wide(xhat[r, i])
            dx[r, i] = half_bits.narrow(scale * (d * gain[i] - g_mean - h * g_xhat), dx)


@_jit_exact
def _block_sum(v, start, n):
    """numpy's float32 sum of a block of at most PAIRWISE_BLOCK: 8 accumulators, then the rest in order.
    Indexed from 0 in range loops, which LLVM sees are never negative: the 8 sums become one vector."""
    block = v[start : start + n]
    total = numpy.float32(0)
    if n < 8:
        for i in range(n):
            total += block[i]
        return total
    r0, r1, r2, r3, r4, r5, r6, r7 = block[0], block[1], block[2], block[3], block[4], block[5], block[6], block[7]
    whole = n - n % 8
    for i in range(8, whole, 8):
        r0, r1, r2, r3 = r0 + block[i], r1 + block[i + 1], r2 + block[i + 2], r3 + block[i + 3]
        r4, r5, r6, r7 = r4 + block[i + 4], r5 + block[i + 5], r6 + block[i + 6], r7 + block[i + 7]
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for i in range(whole, n):
        total += block[i]
    return total


def pairwise_stack():
    """The scratch ``pairwise_sum`` walks its tree in: (start, length; -1: join the two sums above),
    2 a level, and the sums waiting for their sibling, 1 a level (lengths below 2^64)."""
    return numpy.empty((128, 2), numpy.int64), numpy.empty(64, numpy.float32)


@_jit_exact
def pairwise_sum(v, start, n, pending, sums):
    """float32 sum of v[start:start + n] in numpy's order (the ``pairwise_sum`` of its add reduction):
    halves split at multiples of 8 down to blocks, each block's sum added to its sibling's. numpy
    recurses; this walks the same tree in ``pairwise_stack``'s scratch (numba's disk cache breaks
    recursive functions)."""
    if n <= PAIRWISE_BLOCK:
        return _block_sum(v, start, n)
    pending[0, 0], pending[0, 1] = start, n
    top, done = 1, 0
    while top:
        top -= 1
        at, length = pending[top, 0], pending[top, 1]
        if length < 0:  # both halves summed: their sums are joined
            done -= 1
            sums[done - 1] = sums[done - 1] + sums[done]
        elif length <= PAIRWISE_BLOCK:
            sums[done] = _block_sum(v, at, length)
            done += 1
        else:
            half = length // 2
            half -= half % 8
            pending[top, 1] = -1
            pending[top + 1, 0], pending[top + 1, 1] = at + half, length - half
            pending[top + 2, 0], pending[top + 2, 1] = at, half  # the left half on top: summed first, as numpy's
            top += 3
    return sums[0]


@_jit_exact
def _half_norm_rows(x, residual, gain, bias, eps, center, y, xhat, rstd, w, sq, pending, sums):
    """``functional``'s composed norm of each half row (x, residual, y, xhat: bits; the rest float32),
    its float32 operations in its order: x += residual rounded to x's format, as numpy's half add; the
    row widened into ``w``; mean and mean square as numpy's float32 ``mean`` (``pairwise_sum``, the
    division in float64); y and xhat rounded once from float32. rmsnorm gives the composed bits;
    layernorm sums its variance in another order than the composed ``einsum`` (see ``layernorm_forward``)."""
    rows, n = x.shape
    for r in range(rows):
        row = x[r]
        if residual.shape[0]:
            add = residual[r]
            for i in range(n):
                total = half_bits.narrow(half_bits.wide(row[i]) + half_bits.wide(add[i]), row)
                row[i] = total
                w[i] = half_bits.wide(total)
        else:
            for i in range(n):
                w[i] = half_bits.wide(row[i])
        if center:
            mean = numpy.float32(numpy.float64(pairwise_sum(w, 0, n, pending, sums)) / n)
            for i in range(n):
                w[i] -= mean
        for i in range(n):
            sq[i] = w[i] * w[i]
        if center:  # the composed layernorm: var *= 1 / n
            var = pairwise_sum(sq, 0, n, pending, sums) * numpy.float32(1.0 / n)
        else:  # the composed rmsnorm: (x * x).mean()
            var = numpy.float32(numpy.float64(pairwise_sum(sq, 0, n, pending, sums)) / n)
        scale = numpy.float32(1) / numpy.sqrt(var + eps)
        rstd[r, 0] = scale
        normed, out = xhat[r], y[r]
        for i in range(n):
            h = w[i] * scale
            normed[i] = half_bits.narrow(h, normed)
            sq[i] = h * gain[i]
        if bias.shape[0]:
            for i in range(n):
                sq[i] += bias[i]
        for i in range(n):
            out[i] = half_bits.narrow(sq[i], out)


def _half_norm_forward(x, gain, bias, eps, center: bool, residual):
    """``_norm_forward`` for half x: the composed code's float32 statistics (rstd float32) and half
    y and xhat."""
    rows = _rows(bits(x))
    y, xhat = numpy.empty_like(x), numpy.empty_like(x)
    rstd = numpy.empty(x.shape[:-1] + (1,), numpy.float32)
    gain = _c(gain.astype(numpy.float32))
    bias = gain[:0] if bias is None else _c(bias.astype(numpy.float32))
    residual = rows[:0] if residual is None else _rows(bits(residual))
    scratch = numpy.empty((2, x.shape[-1]), numpy.float32)
    outputs = _rows(bits(y)), _rows(bits(xhat)), _rows(rstd)
    _half_norm_rows(rows, residual, gain, bias, numpy.float32(eps), center, *outputs, *scratch, *pairwise_stack())
    return y, (xhat, rstd)


def _norm_forward(x, gain, bias, eps, center: bool, residual=None):
    """The norm of x, or with ``residual`` of x + residual, summed into x (C-contiguous, the caller's own)."""
    x = _c(x)
    if x.dtype in half_bits.VIEWS:
        return _half_norm_forward(x, gain, bias, eps, center, residual)
    rows = _rows(x)
    y, xhat = numpy.empty_like(x), numpy.empty_like(x)
    rstd = numpy.empty(x.shape[:-1] + (1,), x.dtype)
    gain = _c(gain.astype(x.dtype, copy=False))  # the kernel takes one dtype; x's is the one computed in
    bias = gain[:0] if bias is None else _c(bias.astype(x.dtype, copy=False))
    residual = rows[:0] if residual is None else _rows(_c(residual.astype(x.dtype, copy=False)))
    _norm_rows(rows, residual, gain, bias, eps, center, _rows(y), _rows(xhat), _rows(rstd))
    return y, (xhat, rstd)


def _norm_backward(dy, gain, saved, center: bool):
    """dx in dy's dtype; for half dy, computed in float32 with float32 gain and bias gradients, as the
    composed half code returns them (its sums run in float32, these in float64: dx within a half step
    of its, tests/test_half_kernels.py)."""
    xhat, rstd = saved
    dy = _c(dy)
    dx = numpy.empty_like(dy)
    compute = dy.dtype if dy.dtype in DTYPES else numpy.dtype(numpy.float32)
    dgain, dbias = numpy.zeros(dy.shape[-1]), numpy.zeros(dy.shape[-1])  # float64 sums over every row
    _norm_rows_backward(
        _rows(bits(dy)),
        _c(gain.astype(compute, copy=False)),
        _rows(bits(_c(xhat.astype(dy.dtype, copy=False)))),
        _rows(_c(rstd.astype(compute, copy=False))),
        center,
        _rows(bits(dx)),
        dgain,
        dbias,
    )
    return dx, dgain.astype(compute), dbias.astype(compute)


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
    residual of its shape (and of its dtype where x is half: C-contiguous, read as bits)."""
    return (
        fused(x, half=True)
        and x.flags.writeable
        and isinstance(residual, numpy.ndarray)
        and residual.shape == x.shape
        and (x.dtype in DTYPES or (residual.dtype == x.dtype and residual.flags.c_contiguous))
    )


@_jit_exact
def _add_into(x, residual):
    for i in range(x.size):
        x[i] = half_bits.narrow(half_bits.wide(x[i]) + half_bits.wide(residual[i]), x)


def add_into(x, residual):
    """``x += residual`` for half x (as ``fused_rows`` says): each sum in float32, rounded, numpy's
    bits in one pass, where ml_dtypes' ufunc costs 13 us for a decode step's 8 x 576."""
    _add_into(bits(x).reshape(-1), bits(residual).reshape(-1))
    return x


# -- SwiGLU's gate and up --------------------------------------------------------------------------


@_jit_exact
def _negate(h, local, out):
    for r in range(h.shape[0]):
        gate, o = h[r, :local], out[r]
        for i in range(local):
            o[i] = -half_bits.wide(gate[i])


@_jit_exact
def _swiglu(h, local, one, e, sig, act, inner):
    """From e = exp(-gate) (numpy's exp): sig = 1 / (1 + e), act = gate sig and inner = act up, the
    operations of ``functional.silu_forward`` and the product after it, in ``one``'s precision; each
    stored in its array's format."""
    for r in range(h.shape[0]):
        gate, up, ex, s, a, y = h[r, :local], h[r, local:], e[r], sig[r], act[r], inner[r]
        for i in range(local):
            v = one / (one + ex[i])
            s[i] = half_bits.narrow(v, s)
            w = half_bits.wide(gate[i]) * v
            a[i] = half_bits.narrow(w, a)
            y[i] = half_bits.narrow(w * half_bits.wide(up[i]), y)


def swiglu_forward(h, local: int):
    """silu(gate) * up for h = [gate | up] [..., 2 local]: the product, and what ``silu_backward``
    and the MLP's backward keep, (gate, sig), act, up; three passes (numpy's vectorized exp between two
    fused ones) where the composed code makes seven, each with its own temporary.

    Half h is computed in float32 (exp(-gate) in a float32 scratch) and each result rounded once: the
    composed code's float32 numbers on the widened h, rounded. The composed half code rounds each of
    its five steps to the half format instead, so it differs by a few half steps
    (tests/test_cpu_kernels.py bounds it)."""
    h = _c(h)
    rows = _rows(bits(h))
    shape = h.shape[:-1] + (local,)
    sig, act, inner = numpy.empty(shape, h.dtype), numpy.empty(shape, h.dtype), numpy.empty(shape, h.dtype)
    # exp's own scratch even for float32: with e the same array as sig the loop's stores may alias its
    # loads, and LLVM's overlap check sends it to the scalar loop (1.6x the time at 8 rows)
    e = numpy.empty(shape, h.dtype if h.dtype in DTYPES else numpy.float32)
    _negate(rows, local, _rows(e))
    numpy.exp(e, out=e)
    _swiglu(rows, local, e.dtype.type(1), _rows(e), *(_rows(bits(a)) for a in (sig, act, inner)))
    gate, up = h[..., :local], h[..., local:]
    return inner, ((gate, sig), act, up)


# -- rotary position embedding ---------------------------------------------------------------------


@_jit_exact
def _rotate(x, cos, sin, sign, scale, out):
    """out = x with pairs (i, i + d/2) of each [B, H, T, d] row rotated by the tables [1|B, T, d/2]
    (``sign`` -1: rotated back), as ``functional.rope_apply`` computes it, then times ``scale`` (1:
    none), rounded in between as a multiplication after it rounds. out may be x."""
    rows, heads, steps, d = x.shape
    half = d // 2
    for b in range(rows):
        tb = 0 if cos.shape[0] == 1 else b
        for h in range(heads):
            for t in range(steps):
                c, s, src, dst = cos[tb, t], sin[tb, t], x[b, h, t], out[b, h, t]
                for i in range(half):
                    x1, x2, ci = half_bits.wide(src[i]), half_bits.wide(src[i + half]), half_bits.wide(c[i])
                    si = sign * half_bits.wide(s[i])
                    first, second = x1 * ci - x2 * si, x2 * ci + x1 * si
                    if scale != 1:
                        first = half_bits.wide(half_bits.narrow(first, dst)) * scale
                        second = half_bits.wide(half_bits.narrow(second, dst)) * scale
                    dst[i] = half_bits.narrow(first, dst)
                    dst[i + half] = half_bits.narrow(second, dst)


def rope_apply(x, cos, sin, inverse: bool = False, scale: float = 1.0):
    """``functional.rope_apply`` for x [..., T, d] (any strides) and tables of x's dtype, [T, d/2]
    or [B, 1.., T, d/2] for x [B, ..., T, d]: one pass into a new C-contiguous array. Half x is
    rotated in float32 and rounded once (the composed half code rounds both products and their sum);
    ``scale`` multiplies the rounded rotation as numpy's ``*=`` would: by ``scale`` in x's dtype."""
    t, d = x.shape[-2:]
    heads = (x.shape[0] if x.ndim > 2 else 1, -1, t, d)
    out = numpy.empty(x.shape, x.dtype)
    half = (-1, t, d // 2)
    wide = x.dtype.type if x.dtype in DTYPES else numpy.float32
    sign, scale = wide(-1 if inverse else 1), wide(x.dtype.type(scale))
    _rotate(
        *(bits(a) for a in (x.reshape(heads), cos.reshape(half), sin.reshape(half))),
        sign,
        scale,
        bits(out.reshape(heads)),
    )
    return out


# -- float32 to and from a half format ------------------------------------------------------------


@_jit_exact
def _convert(x, out):
    for i in range(x.size):
        out[i] = half_bits.narrow(half_bits.wide(x[i]), out)


def converts(x, dtype) -> bool:
    """True where ``converted`` takes ``x`` to ``dtype``: a C-contiguous numpy array from float32 to a
    half format the kernels hold as bits, or back."""
    dtype, f32 = numpy.dtype(dtype), DTYPES[0]
    return (
        ENABLED
        and isinstance(x, numpy.ndarray)
        and x.flags.c_contiguous
        and ((x.dtype == f32 and dtype in half_bits.VIEWS) or (x.dtype in half_bits.VIEWS and dtype == f32))
    )


def converted(x, dtype):
    """``x.astype(dtype)``, the same bits, in one pass: ml_dtypes' bfloat16 casts cost 0.68 ms for the
    8 x 49152 float32 logits of a decode step and ~70 us a layer for its products' float32 sums."""
    out = numpy.empty(x.shape, dtype)
    _convert(bits(x).reshape(-1), bits(out).reshape(-1))
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
