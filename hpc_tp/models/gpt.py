"""Decoder language model (GPT-2; Llama family through the config: RoPE, RMSNorm, SwiGLU, GQA;
Gemma 3: embeddings scaled by sqrt(hidden), post-norms, GeGLU, local and global layers, soft-capped logits).

    ids -> vocab-parallel embedding (x sqrt(hidden)) (+ learned positions) -> blocks -> final norm
        -> vocab-parallel LM head (-> cap * tanh(logits / cap)) -> vocab-parallel cross entropy

The pieces are exposed separately (embed, blocks, head) so a pipeline stage can run only its part.

With ``cfg.sequence_parallel`` the blocks pass sequence shards [B, T/tp, H]: the embedding's
output is cut into shards, and the final norm runs on a shard before the sequence is gathered
for the vocab-parallel head. With ``cfg.num_experts`` some MLPs are Mixture-of-Experts layers
whose experts are spread over ``ep_comm``; ``set_loss_scale`` tells them the scale of the loss
their load-balancing term joins (``backward`` sets it, and so does the pipeline schedule).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager

from .. import backend
from ..comm.base import Communicator
from ..errors import ConfigError
from ..module import Module, ModuleList, Parameter, frozen, param_buffer, replicated, split
from ..nn.block import TransformerBlock
from ..nn.moe import MoEMLP
from ..nn.norms import make_norm
from ..tensor_parallel.mappings import SEQUENCE_AXIS, GatherFromTensorParallel, ScatterToTensorParallel
from ..tensor_parallel.random import DropoutRNG
from ..tensor_parallel.sequence_parallel import check_sequence_divisible, sum_grads_over
from ..tensor_parallel.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding, VocabParallelLMHead
from .config import ModelConfig
from .init import initialize


class GPTModel(Module):
    def __init__(
        self,
        cfg: ModelConfig,
        comm: Communicator,
        dtype="float64",
        seed: int = 0,
        layers: Sequence[int] | None = None,
        has_embedding: bool = True,
        has_head: bool = True,
        ep_comm: Communicator | None = None,
    ):
        with frozen(cfg.lora_rank > 0):  # LoRA: only the adapters (built unfrozen) get gradients
            self._build(cfg, comm, dtype, seed, layers, has_embedding, has_head, ep_comm)
        initialize(self, cfg.init_std, cfg.n_layers, seed)

    def _build(self, cfg, comm, dtype, seed, layers, has_embedding, has_head, ep_comm):
        self.cfg, self.comm, self.dtype = cfg, comm, dtype
        self.rng = DropoutRNG(seed)
        self.layer_ids = range(cfg.n_layers) if layers is None else layers
        self.has_embedding, self.has_head = has_embedding, has_head
        # A tied head on a pipeline stage without the embedding keeps its own copy of the matrix under the
        # embedding's name: it starts identical, checkpoints store it once, and the pipeline all-reduces
        # the two copies' gradients.
        if has_embedding or (has_head and cfg.tie_embeddings):
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, comm, dtype)
        if has_embedding and cfg.position == "learned":
            self.pos = Parameter(
                param_buffer((cfg.max_seq_len, cfg.hidden), dtype), replicated((cfg.max_seq_len, cfg.hidden), comm.size)
            )
        self.layers = ModuleList(TransformerBlock(cfg, comm, i, self.rng, dtype, ep_comm) for i in self.layer_ids)
        self._sequence_comm = comm if cfg.sequence_parallel and comm.size > 1 else None
        # Sequence parallelism: the embedding's output is cut into the blocks' sequence shards, and
        # the final norm's shards are gathered for the head (each region's backward the other way).
        self._to_shards = ScatterToTensorParallel(comm, SEQUENCE_AXIS)
        self._from_shards = GatherFromTensorParallel(comm, SEQUENCE_AXIS)
        self._vocab_gather = GatherFromTensorParallel(comm)  # whole logits, for evaluation and sampling
        if has_head:
            self.final_norm = make_norm(cfg.norm, cfg.hidden, comm.size, cfg.norm_eps, cfg.bias, dtype)
            if cfg.tie_embeddings:
                self.head = VocabParallelLMHead(self.embed.weight, comm, owns_weight=False, quantize=cfg.quantize)
            else:
                weight = Parameter(
                    param_buffer((-(-cfg.vocab_size // comm.size), cfg.hidden), dtype),
                    split((cfg.vocab_size, cfg.hidden), 0, comm.size, comm.rank),
                )
                self.head = VocabParallelLMHead(weight, comm, owns_weight=True, quantize=cfg.quantize)
            self._loss = VocabParallelCrossEntropy(cfg.vocab_size, comm)

    def named_parameters(self, prefix: str = ""):
        # Global layer indices in names, so every pipeline stage names its layers as the full model does.
        for name, p in super().named_parameters(prefix):
            if name.startswith(prefix + "layers."):
                rest = name[len(prefix + "layers.") :]
                local, tail = rest.split(".", 1)
                name = f"{prefix}layers.{self.layer_ids[int(local)]}.{tail}"
            yield name, p

    def hidden_shape(self, batch: int, seq: int) -> tuple[int, int, int]:
        """The hidden states between blocks (what a pipeline stage sends): [B, T, H], or this rank's
        sequence shard [B, T/tp, H] with sequence parallelism."""
        if self._sequence_comm is None:
            return batch, seq, self.cfg.hidden
        check_sequence_divisible(seq, self._sequence_comm.size)
        return batch, seq // self._sequence_comm.size, self.cfg.hidden

    # -- pieces ---------------------------------------------------------------------------------------
    def embed_forward(self, ids, positions=None):
        x, ctx = self.embed.forward(ids)
        if self.cfg.scale_embeddings:
            x *= math.sqrt(self.cfg.hidden)
        if self.cfg.position == "learned":
            t = ids.shape[1]
            if positions is None and t > self.cfg.max_seq_len:  # given positions are each checked by indexing
                raise ConfigError(f"sequence length {t} exceeds the model's max_seq_len {self.cfg.max_seq_len}")
            x += self.pos.data[:t] if positions is None else self.pos.data[positions]
        if self._sequence_comm is not None:
            check_sequence_divisible(x.shape[SEQUENCE_AXIS], self._sequence_comm.size)
            x = self._to_shards.forward(x)
        return x, ctx

    def embed_backward(self, dx, ctx):
        if self._sequence_comm is not None:
            dx = self._to_shards.backward(dx)
        if self.cfg.position == "learned" and self.pos.trainable:
            self.pos.grad[: dx.shape[1]] += dx.sum(axis=0, dtype=self.pos.grad.dtype)
        if self.cfg.scale_embeddings:
            dx = dx * math.sqrt(self.cfg.hidden)
        self.embed.backward(dx, ctx)

    def blocks_forward(self, x, key_mask=None, positions=None):
        ctxs = []
        for block in self.layers:
            x, c = block.forward(x, key_mask, positions)
            ctxs.append(c)
        return x, ctxs

    def blocks_backward(self, dx, ctxs):
        for block, c in zip(reversed(self.layers.items), reversed(ctxs)):
            dx = block.backward(dx, c)
        return dx

    def logits_forward(self, x):
        h, norm_ctx = self.final_norm.forward(x)
        if self._sequence_comm is not None:
            h = self._from_shards.forward(h)
        logits, head_ctx = self.head.forward(h)
        capped = None
        if self.cfg.logit_softcap:  # elementwise, so on each rank's vocabulary shard
            cap = self.cfg.logit_softcap
            capped = backend.xp_of(logits).tanh(logits / cap)
            logits = capped * cap
        return logits, (norm_ctx, head_ctx, capped)

    def logits_backward(self, dlogits, ctx):
        norm_ctx, head_ctx, capped = ctx
        if capped is not None:
            dlogits = dlogits * (1.0 - capped * capped)
        dh = self.head.backward(dlogits, head_ctx)
        if self._sequence_comm is None:
            return self.final_norm.backward(dh, norm_ctx)
        # The head's f already summed dh over tp: every rank cuts its own shard.
        with sum_grads_over(self._sequence_comm, self.final_norm.parameters()):
            return self.final_norm.backward(self._from_shards.backward(dh), norm_ctx)

    def head_forward(self, x, targets, on_device: bool = False):
        """(loss sum, target tokens, ctx); ``on_device``: the two as 0-d device arrays, not host numbers."""
        logits, lctx = self.logits_forward(x)
        loss_sum, count, loss_ctx = self._loss.forward(
            logits, targets, overwrite=True, on_device=on_device
        )  # logits: the head's own product
        return loss_sum, count, (lctx, loss_ctx)

    def head_backward(self, ctx, scale: float):
        lctx, loss_ctx = ctx
        return self.logits_backward(self._loss.backward(loss_ctx, scale), lctx)

    # -- whole model (one pipeline stage) ----------------------------------------------------------------
    def forward(self, ids, targets, key_mask=None):
        """Returns (sum of token losses, number of target tokens, ctx)."""
        x, ectx = self.embed_forward(ids)
        x, bctx = self.blocks_forward(x, key_mask)
        loss_sum, count, hctx = self.head_forward(x, targets)
        return loss_sum, count, (ectx, bctx, hctx)

    def backward(self, ctx, scale: float):
        """Accumulate gradients of ``scale * loss_sum`` (scale = 1 / global token count)."""
        ectx, bctx, hctx = ctx
        self.set_loss_scale(scale)
        self.embed_backward(self.blocks_backward(self.head_backward(hctx, scale), bctx), ectx)

    def moe_layers(self) -> list[MoEMLP]:
        return [block.mlp for block in self.layers if isinstance(block.mlp, MoEMLP)]

    @contextmanager
    def uncounted(self):
        """Forwards the MoE layers leave out of their routing counts: recomputation (counted once
        already), evaluation (not training)."""
        layers = self.moe_layers()
        for moe in layers:
            moe.count_stats = False
        try:
            yield
        finally:
            for moe in layers:
                moe.count_stats = True

    def set_loss_scale(self, scale: float):
        """The factor backward applies to ``loss_sum`` (1 / global token count): the MoE layers'
        load-balancing terms are scaled alike, so micro-batching and dp do not change them."""
        for moe in self.moe_layers():
            moe.loss_scale = scale

    def set_selective_recompute(self, on: bool):
        """Whether attention recomputes its softmax and dropout masks in backward instead of keeping
        them (``hpc_tp.recompute``): set by the pipeline for each step's mode."""
        for block in self.layers:
            block.attn.recompute_scores = on

    def logits(self, ids, key_mask=None):
        """Full-vocabulary logits [B, T, V] (gathered over tp): for evaluation and sampling."""
        x, _ = self.embed_forward(ids)
        x, _ = self.blocks_forward(x, key_mask)
        return self._full_logits(x)

    def _full_logits(self, x):
        local, _ = self.logits_forward(x)
        full = self._vocab_gather.forward(local)
        return full[..., : self.cfg.vocab_size]

    @contextmanager
    def inference(self):
        """Forward passes that drop nothing, as inference and evaluation want: dropout off, and MoE layers
        keeping every token's choices (no capacity), whatever the model was trained with."""
        training, self.rng.training = self.rng.training, False
        experts = self.moe_layers()
        for moe in experts:
            moe.dropless = True
        try:
            yield
        finally:
            self.rng.training = training
            for moe in experts:
                moe.dropless = False

    # -- inference with a KV cache (hpc_tp.serve) ------------------------------------------------------
    def infer(self, ids, positions, key_mask, cache, all_positions: bool = False, last=None):
        """Run new tokens ``ids`` [B, T] at ``positions`` [B, T] (or [T], the same for every row)
        through the model, appending their K/V to ``cache`` (a ``serve.kv_cache.KVCache``, or a view
        with its ``layer`` and ``advance``). ``key_mask`` [B, cache.length + T] marks the real tokens
        among the filled slots and the new ones. Prefill is one call with the (padded) prompts, each
        decode step one call with T = 1. Returns full-vocabulary logits (gathered over tp) of the last
        position [B, V], of every position [B, T, V] with ``all_positions``, or with ``last`` (ints
        [B], on the device) of position ``last[b]`` in row b [B, V]: right-padded prompts' last real
        tokens, picked before the final norm so that only B positions reach the head.
        Decoding never drops: dropout is off for the call, whatever the model was trained with, and
        MoE layers keep every token's choices (no capacity), so a request's tokens do not depend on
        the other requests or the padding in its batch, as in vLLM's and Megatron's inference."""
        self._check_inference()  # before the embedding, which would cut the sequence into shards
        x, _ = self.embed_forward(ids, positions)
        x = self.infer_blocks(x, positions, key_mask, cache)
        cache.advance(ids.shape[1])
        return self.infer_logits(x, all_positions, last)

    def infer_blocks(self, x, positions, key_mask, cache):
        """``infer``'s blocks alone over hidden states ``x`` [B, T, H] (this model's blocks: a pipeline
        stage's own, ``serve.stages``), each writing its K/V into ``cache.layer(i)``; the caller
        advances the cache."""
        self._check_inference()
        rope_tables = {}  # the positions' rotary tables, made once for every layer of a rope
        with self.inference():
            for i, block in enumerate(self.layers):
                x, _ = block.forward(x, key_mask, positions, cache.layer(i), rope_tables)
        return x

    def _check_inference(self):
        if self._sequence_comm is not None:
            raise ConfigError("sequence_parallel is for training: serve the checkpoint with sequence_parallel false")

    def infer_logits(self, x, all_positions: bool = False, last=None):
        """``infer``'s full-vocabulary logits from the last block's hidden states ``x`` [B, T, H]."""
        if not all_positions:
            x = x[:, -1] if last is None else x[backend.xp_of(x).arange(x.shape[0]), last]
        return self._full_logits(x)
