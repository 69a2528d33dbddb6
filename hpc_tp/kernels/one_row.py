"""One decode row through a transformer layer whose linear weights are kept quantized and packed
(``int8_dot``'s layout), at tp = 1 and one thread, in three compiled calls where the composed path
makes some twenty Python calls and temporaries (at ~10 us each, 30 layers of SmolLM2-135M spent more
time between the kernels than in its products):

    attention_in   norm1, the row quantized once, the QKV product (+ bias), RoPE and the query scale
    (the cache's attention: the caller's, as the composed path runs it)
    mlp_in         the O product (+ bias), the residual sum and norm2, the gate/up (or fc1) product
                   (+ bias), the activation's first pass
    (numpy's exp or tanh of that pass, as ``cpu_kernels`` calls it between its passes)
    mlp_out        the activation's last pass, the down product (+ bias), the residual sum

Every step is the compiled function the composed path calls (``cpu_kernels``' norm, RoPE, SwiGLU and
GELU passes, ``int8_dot``'s quantization and tiles) on arrays of the same types and shapes, or a
float32 addition numpy makes the same way (a bias, a residual), so a row's numbers are the composed
path's bits (``tests/test_one_row.py``). A weight is a tuple (codes, scales, minimums) of a packed
matrix (``quantized.Packed``) with its bits and columns; an absent bias or norm bias is an empty array.
numba's disk cache keys these functions by this file alone: after an edit to a kernel they call, the
test above sees the stale copy until this file changes too (or its ``__pycache__`` is cleared).
"""

from __future__ import annotations

import os

import numpy

from . import cpu_kernels, int8_dot, paged_attention
from .small_m import FULL

# ``HPC_TP_ONE_ROW=0`` keeps the composed path (an A/B); the rest of what it takes (the integer kernel, one
# thread, the layer's shape) the caller checks (``nn.one_row``)
ENABLED = os.environ.get("HPC_TP_ONE_ROW", "1") != "0"
SWIGLU, GELU_TANH = 0, 1  # the activations whose passes are compiled here (``cpu_kernels``')


if cpu_kernels.ENABLED:
    # No fastmath in the glue: a bias or residual sum is numpy's IEEE addition. The kernels it calls
    # keep the flags they were compiled with.
    _glue = cpu_kernels.numba.njit(cache=True, nogil=True)
else:  # never called: ``ENABLED`` is False without numba
    _glue = cpu_kernels._jit


@_glue
def _times(a, weight, bits, n, bias):
    """a [1, K] @ W (+ bias) as float32 [1, n], as ``int8_dot.matmul`` computes it at one thread."""
    codes, scales, lows = weight
    out = numpy.empty((1, n), numpy.float32)
    acts, a_scales, code_sums, sums = int8_dot._quantized(a)
    int8_dot._product(acts, a_scales, code_sums, sums, codes, scales, lows, bits, out, 0, n)
    for i in range(bias.shape[0]):
        out[0, i] += bias[i]
    return out


@_glue
def _norm(x, residual, gain, bias, eps, center):
    """``cpu_kernels``' norm of the row x (+ residual, summed into x first; no rows: none)."""
    y, xhat = numpy.empty_like(x), numpy.empty_like(x)
    rstd = numpy.empty((1, 1), numpy.float32)
    cpu_kernels._norm_rows(x, residual, gain, bias, eps, center, y, xhat, rstd)
    return y


@_glue
def _heads(qkv, start, heads, d):
    """Heads [start, start + heads) of the QKV row as a contiguous [1, heads, 1, d] copy."""
    return qkv[0, start * d : (start + heads) * d].copy().reshape((1, heads, 1, d))


@_glue
def attention_in(x, no_rows, gain, norm_bias, eps, center, weight, bits, n, bias, heads, kv_heads, d, cos, sin, scale):
    """norm1 of the row x [1, H], its QKV product and the rotated, scaled queries and keys: (q [1, hq,
    1, d], k [1, hk, 1, d], v [1, hk, 1, d]). ``cos`` and ``sin`` [1, 1, d/2] (no rows: no RoPE, the
    queries multiplied by ``scale`` as numpy's ``*=`` does); ``no_rows``: an empty [0, H] residual."""
    h = _norm(x, no_rows, gain, norm_bias, eps, center)
    qkv = _times(h, weight, bits, n, bias)
    q, k = _heads(qkv, 0, heads, d), _heads(qkv, heads, kv_heads, d)
    v = _heads(qkv, heads + kv_heads, kv_heads, d)
    if cos.shape[0] == 0:
        flat = q.reshape(-1)
        for i in range(flat.size):
            flat[i] *= scale
        return q, k, v
    rotated_q, rotated_k = numpy.empty_like(q), numpy.empty_like(k)
    one = numpy.float32(1)
    cpu_kernels._rotate(q, cos, sin, one, scale, rotated_q)
    cpu_kernels._rotate(k, cos, sin, one, one, rotated_k)
    return rotated_q, rotated_k, v


@_glue
def paged_layer_in(
    x, no_rows, gain, norm_bias, eps, center, weight, bits, n, bias, heads, kv_heads, d, cos, sin, scale,
    k_pool, v_pool, write, read, counts, window,
    out_weight, out_bits, out_n, out_bias, gain2, norm_bias2, eps2, center2, fc1, fc1_bits, fc1_n, fc1_bias, act, local,
):  # fmt: skip
    """``attention_in``, then the keys and values written into the paged pools at ``write`` [1, 1] and
    ``paged_attention``'s attention of the queries over the ``read`` slots [1, W] (the first ``counts[0]``,
    the last ``window`` of them; 0: all), as ``PagedKVCache``'s decode step runs them, then ``mlp_in``."""
    q, k, v = attention_in(
        x, no_rows, gain, norm_bias, eps, center, weight, bits, n, bias, heads, kv_heads, d, cos, sin, scale
    )
    cpu_kernels._write_slots(k_pool, v_pool, write, k, v)
    merged = numpy.empty((1, kv_heads, heads // kv_heads, d), numpy.float32)
    no_bits = numpy.empty((0, 0, 0), numpy.uint16)
    queries = q.reshape((1, kv_heads, heads // kv_heads, d))
    paged_attention._decode(queries, k_pool, v_pool, no_bits, no_bits, FULL, read, counts, merged, window, 0, kv_heads)
    return mlp_in(
        merged.reshape((1, heads * d)), x, out_weight, out_bits, out_n, out_bias, gain2, norm_bias2, eps2, center2,
        fc1, fc1_bits, fc1_n, fc1_bias, act, local,
    )  # fmt: skip


@_glue
def mlp_in(
    merged, x, out_weight, out_bits, out_n, out_bias, gain, norm_bias, eps, center, weight, bits, n, bias, act, local
):
    """The attention's heads ``merged`` [1, hq d] through O (+ bias), plus the residual x [1, H], and
    norm2 of the sum; its fc1 product and the activation's first pass: (the sum, the product, the
    pass's output for numpy's exp (SwiGLU) or tanh (GELU) in place)."""
    summed = _times(merged, out_weight, out_bits, out_n, out_bias)
    h = _norm(summed, x, gain, norm_bias, eps, center)
    fc1 = _times(h, weight, bits, n, bias)
    if act == SWIGLU:
        e = numpy.empty((1, local), numpy.float32)
        cpu_kernels._negate(fc1, local, e)
    else:
        e = numpy.empty_like(fc1)
        cpu_kernels._gelu_inner(fc1[0], e[0])
    return summed, fc1, e


@_glue
def mlp_out(summed, fc1, e, weight, bits, n, bias, act, local):
    """``mlp_in``'s product and pass (after numpy's exp or tanh of ``e``) through the activation's last
    pass and fc2 (+ bias), plus the residual ``summed``: the layer's output [1, H]."""
    if act == SWIGLU:
        sig, inner = numpy.empty_like(e), numpy.empty_like(e)
        cpu_kernels._swiglu(fc1, local, numpy.float32(1), e, sig, numpy.empty_like(e), inner)
    else:
        inner = numpy.empty_like(fc1)
        cpu_kernels._gelu_outer(fc1[0], e[0], inner[0])
    y = _times(inner, weight, bits, n, bias)
    for i in range(y.shape[1]):
        y[0, i] += summed[0, i]
    return y
