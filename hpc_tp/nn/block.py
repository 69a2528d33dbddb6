"""Pre-LN transformer block: x + drop(attn(norm1(x))), then + drop(mlp(norm2(.))); with
``cfg.post_norms`` (Gemma) each branch's output is normed too before its residual:
x + drop(post_attn_norm(attn(norm1(x)))), then + drop(post_mlp_norm(mlp(norm2(.)))).

Four collectives per block and direction: the f and g of attention and of the MLP. With
``cfg.sequence_parallel`` the block's input and output are sequence shards [B, T/tp, H]: f is an
all-gather, g a reduce-scatter, and the norms' gradients are summed over tp after backward.
The MLP is a Mixture-of-Experts layer where ``cfg.is_moe_layer(layer_id)`` (``ep_comm``: its
expert-parallel group).
"""

from __future__ import annotations

from ..comm.base import Communicator
from ..kernels import functional as F
from ..module import Module
from ..tensor_parallel.random import DropoutRNG
from ..tensor_parallel.sequence_parallel import sum_grads_over
from .attention import ParallelAttention
from .dropout import Dropout
from .moe import feed_forward
from .norms import make_norm
from .one_row import OneRowStep
from .sequence_parallel import SequenceShardDropout


class TransformerBlock(Module):
    def __init__(
        self,
        cfg,
        comm: Communicator,
        layer_id: int,
        rng: DropoutRNG | None = None,
        dtype="float64",
        ep_comm: Communicator | None = None,
    ):
        self.norm1 = make_norm(cfg.norm, cfg.hidden, comm.size, cfg.norm_eps, cfg.bias, dtype)
        rope_theta, rope_scaling = cfg.rope_of(layer_id)
        self.attn = ParallelAttention(
            cfg.hidden,
            cfg.n_heads,
            cfg.n_kv_heads,
            comm,
            causal=cfg.causal,
            bias=cfg.bias,
            rope_theta=rope_theta if cfg.position == "rope" else None,
            rope_scaling=rope_scaling,
            window=cfg.window_of(layer_id),
            dropout=cfg.attn_dropout,
            rng=rng,
            layer_id=layer_id,
            sequence_parallel=cfg.sequence_parallel,
            head_dim=cfg.head_dim,
            qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None,
            query_scale=None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5,
            dtype=dtype,
            quantize=cfg.quantize,
            lora=cfg.lora(),
        )
        self.norm2 = make_norm(cfg.norm, cfg.hidden, comm.size, cfg.norm_eps, cfg.bias, dtype)
        self.post_attn_norm = self.post_mlp_norm = None
        if cfg.post_norms:
            self.post_attn_norm = make_norm(cfg.norm, cfg.hidden, comm.size, cfg.norm_eps, cfg.bias, dtype)
            self.post_mlp_norm = make_norm(cfg.norm, cfg.hidden, comm.size, cfg.norm_eps, cfg.bias, dtype)
        self.mlp = feed_forward(cfg, comm, layer_id, ep_comm, dtype)
        self._sequence_comm = comm if cfg.sequence_parallel else None
        drop = (
            (lambda site: SequenceShardDropout(cfg.dropout, rng, site, comm))
            if cfg.sequence_parallel
            else (lambda site: Dropout(cfg.dropout, rng, site))
        )
        self._drop_attn = drop(("resid_attn", layer_id))
        self._drop_mlp = drop(("resid_mlp", layer_id))
        # a decode step's one row through compiled calls where the structure allows (``nn.one_row``)
        self._one_row = OneRowStep(self) if OneRowStep.fits(self, cfg, comm.size, dtype) else None

    def forward(self, x, key_mask=None, positions=None, cache=None, rope_tables=None):
        """``rope_tables``: the dict of rotary tables the blocks of one pass share (``ParallelAttention``)."""
        if cache is not None and self._one_row is not None and self._one_row.takes(x):
            return self._one_row.forward(x, key_mask, positions, cache, rope_tables), None
        h, n1 = self.norm1.forward(x)
        a, attn_ctx = self.attn.forward(h, key_mask, positions, cache, rope_tables)
        a, p1 = _maybe_norm(self.post_attn_norm, a)
        a, d1 = self._drop_attn.forward(a)
        # Residual sums in place: a branch's output is a fresh array nothing else holds. The sum and
        # the norm after it are one pass over each row.
        x1, h, n2 = self.norm2.add_forward(a, x)
        m, mlp_ctx = self.mlp.forward(h)
        m, p2 = _maybe_norm(self.post_mlp_norm, m)
        m, d2 = self._drop_mlp.forward(m)
        m = F.add_into(m, x1)
        return m, (n1, attn_ctx, p1, d1, n2, mlp_ctx, p2, d2)

    def backward(self, dy, ctx):
        if self._sequence_comm is None:
            return self._backward(dy, ctx)
        norms = [self.norm1, self.norm2, self.post_attn_norm, self.post_mlp_norm]
        with sum_grads_over(self._sequence_comm, [p for n in norms if n is not None for p in n.parameters()]):
            return self._backward(dy, ctx)

    def _backward(self, dy, ctx):
        n1, attn_ctx, p1, d1, n2, mlp_ctx, p2, d2 = ctx
        dm = _maybe_norm_backward(self.post_mlp_norm, self._drop_mlp.backward(dy, d2), p2)
        dm = self.mlp.backward(dm, mlp_ctx)
        dx1 = self.norm2.backward(dm, n2)
        dx1 += dy
        da = _maybe_norm_backward(self.post_attn_norm, self._drop_attn.backward(dx1, d1), p1)
        da = self.attn.backward(da, attn_ctx)
        dx = self.norm1.backward(da, n1)
        dx += dx1
        return dx


def _maybe_norm(norm, x):
    """``norm(x)`` and its context, or x itself where the block has no such norm."""
    return (x, None) if norm is None else norm.forward(x)


def _maybe_norm_backward(norm, dy, saved):
    return dy if norm is None else norm.backward(dy, saved)
