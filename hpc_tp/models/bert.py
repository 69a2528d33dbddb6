"""BERT-style encoder built from the same tensor-parallel pieces as the decoder.

    ids -> vocab-parallel word embedding + learned positions + token types -> LayerNorm
        -> post-LN blocks: x = norm1(x + attn(x)); x = norm2(x + mlp(x))
        -> token states [B, T, hidden]

Attention is non-causal (every token sees every real token; padding keys are masked with the
key mask) and split by heads; the MLP (GELU, erf form) is column- then row-parallel. There is no
LM head: the encoder's output is its token states, which ``hpc_tp.serve.embed`` pools into
sentence embeddings.
"""

from __future__ import annotations

from .. import backend
from ..comm.base import Communicator
from ..errors import ConfigError
from ..kernels.functional import scatter_add_rows
from ..module import Module, ModuleList, Parameter, param_buffer, replicated
from ..nn.attention import ParallelAttention
from ..nn.dropout import Dropout
from ..nn.mlp import ParallelMLP
from ..nn.norms import LayerNorm
from ..tensor_parallel.random import DropoutRNG
from ..tensor_parallel.vocab import VocabParallelEmbedding
from .config import ModelConfig
from .init import initialize


class EncoderBlock(Module):
    """Post-LN: the residual sum is normalised (BERT), where the decoder's pre-LN block
    normalises the branch input. Same four collectives per direction."""

    def __init__(self, cfg: ModelConfig, comm: Communicator, layer_id: int, rng: DropoutRNG, dtype="float64"):
        self.attn = ParallelAttention(
            cfg.hidden,
            cfg.n_heads,
            cfg.n_kv_heads,
            comm,
            causal=False,
            bias=cfg.bias,
            dropout=cfg.attn_dropout,
            rng=rng,
            layer_id=layer_id,
            dtype=dtype,
        )
        self.norm1 = LayerNorm(cfg.hidden, comm.size, cfg.norm_eps, cfg.bias, dtype)
        self.mlp = ParallelMLP(cfg.hidden, cfg.ffn_hidden, comm, cfg.activation, cfg.bias, dtype)
        self.norm2 = LayerNorm(cfg.hidden, comm.size, cfg.norm_eps, cfg.bias, dtype)
        self._drop_attn = Dropout(cfg.dropout, rng, ("resid_attn", layer_id))
        self._drop_mlp = Dropout(cfg.dropout, rng, ("resid_mlp", layer_id))

    def forward(self, x, key_mask=None):
        a, attn_ctx = self.attn.forward(x, key_mask)
        a, d1 = self._drop_attn.forward(a)
        x1, n1 = self.norm1.forward(x + a)
        m, mlp_ctx = self.mlp.forward(x1)
        m, d2 = self._drop_mlp.forward(m)
        y, n2 = self.norm2.forward(x1 + m)
        return y, (attn_ctx, d1, n1, mlp_ctx, d2, n2)

    def backward(self, dy, ctx):
        attn_ctx, d1, n1, mlp_ctx, d2, n2 = ctx
        dsum2 = self.norm2.backward(dy, n2)
        dx1 = dsum2 + self.mlp.backward(self._drop_mlp.backward(dsum2, d2), mlp_ctx)
        dsum1 = self.norm1.backward(dx1, n1)
        return dsum1 + self.attn.backward(self._drop_attn.backward(dsum1, d1), attn_ctx)


class BertModel(Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype="float64", seed: int = 0):
        if cfg.family != "bert" or cfg.causal or cfg.position != "learned" or cfg.norm != "layernorm":
            raise ConfigError(
                "a BERT encoder needs family='bert', causal=False, position='learned', "
                f"norm='layernorm'; got family={cfg.family!r}, causal={cfg.causal}, "
                f"position={cfg.position!r}, norm={cfg.norm!r}"
            )
        self.cfg, self.comm, self.dtype = cfg, comm, dtype
        self.rng = DropoutRNG(seed)
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, comm, dtype)
        self.pos = Parameter(
            param_buffer((cfg.max_seq_len, cfg.hidden), dtype), replicated((cfg.max_seq_len, cfg.hidden), comm.size)
        )
        if cfg.type_vocab_size:
            self.type_embed = Parameter(
                param_buffer((cfg.type_vocab_size, cfg.hidden), dtype),
                replicated((cfg.type_vocab_size, cfg.hidden), comm.size),
            )
        self.embed_norm = LayerNorm(cfg.hidden, comm.size, cfg.norm_eps, cfg.bias, dtype)
        self._drop_embed = Dropout(cfg.dropout, self.rng, ("embed",))
        self.layers = ModuleList(EncoderBlock(cfg, comm, i, self.rng, dtype) for i in range(cfg.n_layers))
        initialize(self, cfg.init_std, cfg.n_layers, seed)

    def forward(self, ids, key_mask=None, type_ids=None):
        """Token states [B, T, hidden] (replicated over tp) and the ctx for backward. ``key_mask``
        [B, T] is 1 for real tokens, 0 for padding; ``type_ids`` default to segment 0."""
        t = ids.shape[1]
        if t > self.cfg.max_seq_len:
            raise ConfigError(f"sequence length {t} exceeds the model's max_seq_len {self.cfg.max_seq_len}")
        x, embed_ctx = self.embed.forward(ids)
        x += self.pos.data[:t]
        if self.cfg.type_vocab_size:
            type_ids = backend.xp_of(ids).zeros_like(ids) if type_ids is None else type_ids
            x += self.type_embed.data[type_ids]
        x, norm_ctx = self.embed_norm.forward(x)
        x, drop_ctx = self._drop_embed.forward(x)
        block_ctxs = []
        for block in self.layers:
            x, c = block.forward(x, key_mask)
            block_ctxs.append(c)
        return x, (embed_ctx, type_ids, norm_ctx, drop_ctx, block_ctxs)

    def backward(self, dstates, ctx):
        """Accumulate the parameter gradients of <token states, dstates>."""
        embed_ctx, type_ids, norm_ctx, drop_ctx, block_ctxs = ctx
        dx = dstates
        for block, c in zip(reversed(self.layers.items), reversed(block_ctxs)):
            dx = block.backward(dx, c)
        dx = self.embed_norm.backward(self._drop_embed.backward(dx, drop_ctx), norm_ctx)
        self.pos.grad[: dx.shape[1]] += dx.sum(axis=0, dtype=self.pos.grad.dtype)
        if self.cfg.type_vocab_size:
            scatter_add_rows(self.type_embed.grad, type_ids, dx)
        self.embed.backward(dx, embed_ctx)
