"""A block's decode step of one row on ``kernels.one_row``'s compiled calls: one process (tp = 1), one
thread, float32 activations, linear weights kept quantized and packed for the integer kernel, a
pre-norm block with SwiGLU or tanh GELU and no query/key norms, post-norms or experts. Everything else
(more rows, tp > 1, other dtypes, a CPU without VNNI, ``HPC_TP_ONE_ROW=0``) takes the composed path,
which the compiled calls reproduce to the bit."""

from __future__ import annotations

import numpy

from ..kernels import cpu_kernels, int8_dot, one_row, threads
from ..kernels import functional as F
from .mlp import ParallelMLP
from .norms import LayerNorm

_ACTIVATIONS = {F.silu_forward: one_row.SWIGLU, F.gelu_tanh_forward: one_row.GELU_TANH}
_SECOND_PASS = {one_row.SWIGLU: numpy.exp, one_row.GELU_TANH: numpy.tanh}  # numpy's, as cpu_kernels' passes


class OneRowStep:
    """The compiled one-row step of ``block`` (a ``TransformerBlock``), where its structure fits."""

    def __init__(self, block):
        self._block = block
        self._arguments = None  # the calls' constant arguments, once every weight is packed

    @staticmethod
    def fits(block, cfg, tp: int, dtype) -> bool:
        """Whether the block's structure is one the compiled calls run (its weights' packing aside)."""
        mlp = block.mlp
        return (
            tp == 1
            and cfg.quantize is not None
            and numpy.dtype(dtype) == numpy.float32
            and block.post_attn_norm is None
            and block.attn.q_norm is None
            and block.attn.causal
            and isinstance(mlp, ParallelMLP)
            and mlp.gated == (mlp.act_forward is F.silu_forward)
            and mlp.act_forward in _ACTIVATIONS
            and mlp.local <= cpu_kernels.CHUNK  # GELU's passes in one chunk, as the composed path makes them
        )

    def takes(self, x) -> bool:
        """Whether this step runs ``x``: one row of one token, float32 on the host, the integer kernel on."""
        return (
            one_row.ENABLED
            and int8_dot.AVAILABLE
            and threads.COUNT == 1
            and isinstance(x, numpy.ndarray)
            and x.shape[:2] == (1, 1)
            and x.dtype == numpy.float32
            and x.flags.c_contiguous
            and not (self._block._drop_attn.active or self._block._drop_mlp.active)
            and self._packed() is not None
        )

    def _packed(self):
        """(norm1, qkv, out, fc1, fc2, norm2, activation) arguments of the compiled calls, built once
        every weight is packed (None until then)."""
        if self._arguments is None:
            block = self._block
            attn, mlp = block.attn, block.mlp
            layers = (attn.qkv, attn.out, mlp.fc1, mlp.fc2)
            weights = [layer.quantized_weight() for layer in layers]
            if all(matrix.pack() for matrix, _ in weights):
                self._arguments = (
                    _norm(block.norm1),
                    *(_weight(matrix, bias) for matrix, bias in weights),
                    _norm(block.norm2),
                    _ACTIVATIONS[mlp.act_forward],
                )
        return self._arguments

    def forward(self, x, key_mask, positions, cache, rope_tables):
        """The block's output [1, 1, H] for ``x`` (``takes``), its keys and values stored in ``cache``."""
        attn, mlp = self._block.attn, self._block.mlp
        norm1, qkv, out, fc1, fc2, norm2, act = self._arguments
        row = x.reshape(1, -1)
        half = attn.head_dim // 2
        if attn.inv_freq is None:
            cos = sin = numpy.empty((0, 1, half), numpy.float32)
        else:
            cos, sin = (t.reshape(-1, 1, half) for t in attn.rope_tables_of(positions, 1, x.dtype, rope_tables))
        heads, kv_heads, d = attn.heads_local, attn.kv_local, attn.head_dim
        attention = (row, *norm1, *qkv, heads, kv_heads, d, cos, sin, numpy.float32(attn.query_scale))
        pools = cache.decode_pools()
        if pools is not None:  # a paged decode step: its attention compiled with the rest
            layer = one_row.paged_layer_in(*attention, *pools, attn.window, *out, *norm2[1:], *fc1, act, mlp.local)
        else:
            q, k, v = one_row.attention_in(*attention)
            merged = attn.attend_cached(q.reshape(1, kv_heads, heads // kv_heads, 1, d), k, v, key_mask, cache)
            layer = one_row.mlp_in(merged.reshape(1, -1), row, *out, *norm2[1:], *fc1, act, mlp.local)
        summed, product, passed = layer
        _SECOND_PASS[act](passed, out=passed)
        return one_row.mlp_out(summed, product, passed, *fc2, act, mlp.local).reshape(x.shape)


def _norm(norm):
    """(an empty residual, gain, bias or an empty one, eps, centred) as ``cpu_kernels``' norm takes them."""
    gain = norm.weight.data
    bias = getattr(norm, "bias", None)
    return (
        numpy.empty((0, gain.shape[0]), gain.dtype),
        gain,
        gain[:0] if bias is None else bias.data,
        float(norm.eps),
        isinstance(norm, LayerNorm),
    )


def _weight(matrix, bias):
    """(codes, scales, minimums), bits, columns and bias (empty: none) of a packed matrix."""
    p = matrix.packed
    return (p.codes, p.scales, p.lows), matrix.bits, p.n, numpy.empty(0, numpy.float32) if bias is None else bias
