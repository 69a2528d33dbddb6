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
            and mlp.gated == (mlp.act_forward is F.silu_forward)  # SwiGLU or GELU: not GeGLU, not SiLU alone
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
            and not (self._block.attn.rng is not None and self._block.attn.rng.training)  # no dropout to draw
            and (self._arguments is not None or self._packed())
        )

    def _packed(self) -> bool:
        """The compiled calls' constant arguments, once every weight is packed (False until then):
        attention_in's from norm1 to the head sizes, mlp_in's from the O product on, mlp_out's."""
        block = self._block
        attn, mlp = block.attn, block.mlp
        weights = [layer.quantized_weight() for layer in (attn.qkv, attn.out, mlp.fc1, mlp.fc2)]
        if not all(matrix.pack() for matrix, _ in weights):
            return False
        qkv, out, fc1, fc2 = (_weight(matrix, bias) for matrix, bias in weights)
        act = _ACTIVATIONS[mlp.act_forward]
        self._arguments = (
            (*_norm(block.norm1), *qkv, attn.heads_local, attn.kv_local, attn.head_dim),
            numpy.float32(attn.query_scale),
            (*out, *_norm(block.norm2)[1:], *fc1, act, mlp.local),
            (*fc2, act, mlp.local),
            _SECOND_PASS[act],
        )
        return True

    def forward(self, x, key_mask, positions, cache, rope_tables):
        """The block's output [1, 1, H] for ``x`` (``takes``), its keys and values stored in ``cache``."""
        attn = self._block.attn
        attention, scale, mlp_in, mlp_out, second_pass = self._arguments
        row = x.reshape(1, -1)
        half = attn.head_dim // 2
        if attn.inv_freq is None:
            cos = sin = numpy.empty((0, 1, half), numpy.float32)
        else:
            cos, sin = (t.reshape(-1, 1, half) for t in attn.rope_tables_of(positions, 1, x.dtype, rope_tables))
        pools = cache.decode_pools()
        if pools is not None:  # a paged decode step: its attention compiled with the rest
            layer = one_row.paged_layer_in(row, *attention, cos, sin, scale, *pools, attn.window, *mlp_in)
        else:
            q, k, v = one_row.attention_in(row, *attention, cos, sin, scale)
            q = q.reshape(1, attn.kv_local, attn.heads_local // attn.kv_local, 1, attn.head_dim)
            merged = attn.attend_cached(q, k, v, key_mask, cache)
            layer = one_row.mlp_in(merged.reshape(1, -1), row, *mlp_in)
        summed, product, passed = layer
        second_pass(passed, out=passed)
        return one_row.mlp_out(summed, product, passed, *mlp_out).reshape(x.shape)


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
