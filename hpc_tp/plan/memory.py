"""Memory per device: parameters, gradients, optimizer states, activations, KV cache.

Parameters are counted the way the engine allocates them, tensor by tensor: column-parallel
weights and vocabulary blocks split over tp (the vocabulary padded to ``ceil(V / tp)`` rows),
norm gains and row-parallel biases replicated, K/V heads replicated on ``tp / kv_heads`` ranks
when tp exceeds the KV head count, a tied LM head on a later pipeline stage holding its own copy
of the embedding. Gradients and AdamW's two moments have the parameters' shapes; a data-parallel
group of more than one also holds the flat gradient buckets (one more gradient-sized copy).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4): list every tensor a layer keeps for backward. Per layer and
micro-batch of b sequences of s tokens, hidden h, a heads, tp = t, 16-bit activations, 1-byte
dropout masks and no sequence parallelism, their list sums to

    s b h (10 + 24 / t) + 5 a s^2 b / t  bytes        (34 s b h + 5 a s^2 b at t = 1)

of which 4 s b h elements (the two norm inputs, the QKV and MLP inputs) are replicated over tp.
With full recomputation a layer keeps only its input, s b h elements. ``MEGATRON`` reproduces
the paper's list; ``ENGINE`` is this engine's (tests/test_plan.py checks it byte for byte against
what the pipeline holds): the GeLU/SiLU kernels also keep their tanh/cdf/sigmoid (4 s b h / t
more), dropout keeps no separate output but masks in the activation dtype, norms add their row
statistics, RoPE its tables. Grouped-query attention and SwiGLU change the K/V and MLP terms.

A pipeline stage holds the activations of the micro-batches in flight: all m with GPipe,
``min(pp - stage, m)`` with 1F1B; with recomputation, backward rebuilds one layer's full set.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..models.config import ModelConfig

INDEX_BYTES = 8  # token ids and their per-rank offsets (int64)


@dataclass(frozen=True)
class SavedTensors:
    """Which tensors an implementation keeps for backward, where implementations differ."""

    name: str
    mask_bytes: int | None     # bytes per dropout-mask element; None: the activation dtype's
    keeps_dropout_output: bool # attention keeps dropout(softmax) besides softmax and the mask
    activation_aux: bool       # the activation kernel keeps an extra tensor of its input's size
    row_statistics: bool       # norms keep per-row 1/std; RoPE keeps its cos/sin tables
    always_dropout: bool       # count dropout masks whatever the config (the paper's models use dropout)


MEGATRON = SavedTensors("megatron", 1, True, False, False, True)
ENGINE = SavedTensors("engine", None, False, True, True, False)


def kv_heads_local(cfg: ModelConfig, tp: int) -> int:
    """K/V heads one tp rank holds: its share, or one replicated head when tp > kv heads."""
    return cfg.n_kv_heads // tp if cfg.n_kv_heads >= tp else 1


def vocab_rows(cfg: ModelConfig, tp: int) -> int:
    return -(-cfg.vocab_size // tp)


def norm_params(cfg: ModelConfig) -> int:
    return cfg.hidden * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def block_params(cfg: ModelConfig, tp: int) -> int:
    """Elements of one transformer block on one tp rank."""
    h, d, b = cfg.hidden, cfg.head_dim, 1 if cfg.bias else 0
    qkv = (cfg.n_heads // tp + 2 * kv_heads_local(cfg, tp)) * d
    mats = 2 if cfg.activation == "swiglu" else 1
    f = cfg.ffn_hidden // tp
    attention = h * qkv + b * qkv + (cfg.n_heads // tp) * d * h + b * h
    mlp = h * mats * f + b * mats * f + f * h + b * h
    return 2 * norm_params(cfg) + attention + mlp


def stage_params(cfg: ModelConfig, tp: int, n_layers: int, first: bool, last: bool) -> int:
    """Parameter elements one rank of a stage holds (``GPTModel.local_bytes() / itemsize``)."""
    count = n_layers * block_params(cfg, tp)
    if first or (last and cfg.tie_embeddings):
        count += vocab_rows(cfg, tp) * cfg.hidden
    if first and cfg.position == "learned":
        count += cfg.max_seq_len * cfg.hidden
    if last:
        count += norm_params(cfg) + (0 if cfg.tie_embeddings else vocab_rows(cfg, tp) * cfg.hidden)
    return count


def layer_activation_bytes(cfg: ModelConfig, micro_batch: int, seq: int, tp: int, elem: int,
                           saved: SavedTensors = ENGINE) -> int:
    """Bytes one block keeps for backward for one micro-batch (the list in the module docstring)."""
    sb, h, d = micro_batch * seq, cfg.hidden, cfg.head_dim
    q, kv = cfg.n_heads // tp * d, kv_heads_local(cfg, tp) * d
    f = cfg.ffn_hidden // tp
    mask = elem if saved.mask_bytes is None else saved.mask_bytes
    scores = micro_batch * (cfg.n_heads // tp) * seq * seq
    elements = sb * (2 * h      # the two norms' saved inputs (xhat)
                     + 2 * h    # the QKV and MLP fc1 inputs (norm outputs), replicated over tp
                     + q + 2 * kv + q)  # Q, K, V and the output projection's input
    elements += scores          # softmax
    if cfg.position == "rope":
        elements += sb * (q + kv)  # rotated Q and K are new arrays (V stays a view of QKV)
        if saved.row_statistics:
            elements += seq * d    # cos and sin tables, [s, d/2] each
    if cfg.activation == "swiglu":
        elements += sb * f * (2 + 1 + 1 + (1 if saved.activation_aux else 0))  # gate|up, silu, product, sigmoid
    else:
        elements += sb * f * (1 + 1 + (1 if saved.activation_aux else 0))  # act input, fc2 input, aux
    if saved.row_statistics:
        elements += 2 * sb      # 1/std of each row, both norms
    total = elements * elem
    if cfg.attn_dropout > 0 or saved.always_dropout:
        total += scores * (mask + (elem if saved.keeps_dropout_output else 0))
    if cfg.dropout > 0 or saved.always_dropout:
        total += 2 * sb * h * mask  # after attention and after the MLP
    return total


def embedding_activation_bytes(micro_batch: int, seq: int) -> int:
    """The embedding keeps each token's local id and whether it falls outside this rank's block."""
    return micro_batch * seq * (INDEX_BYTES + 1)


def head_activation_bytes(cfg: ModelConfig, micro_batch: int, seq: int, tp: int, elem: int) -> int:
    """Final norm, head input, the local logits' softmax numerators and the loss's per-token rows."""
    sb = micro_batch * seq
    floats = sb * (2 * cfg.hidden + 1) + sb * vocab_rows(cfg, tp) + 2 * sb
    return floats * elem + sb * (INDEX_BYTES + 2)


def in_flight(schedule: str, pp: int, stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    return micro_batches if schedule == "gpipe" else min(pp - stage, micro_batches)


@dataclass(frozen=True)
class StageMemory:
    params: int            # bytes of parameters
    grads: int             # gradients, plus the dp buckets' copy when dp > 1
    optimizer: int         # AdamW moments (and fp32 master weights in mixed precision)
    activations: int       # held for backward by the micro-batches in flight
    recompute_peak: int    # one layer rebuilt in backward (recomputation only)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.recompute_peak

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer


def stage_memory(cfg: ModelConfig, tp: int, dp: int, pp: int, stage: int, n_layers: int, micro_batch: int,
                 seq: int, micro_batches: int, schedule: str, recompute: bool, precision,
                 saved: SavedTensors = ENGINE) -> StageMemory:
    first, last = stage == 0, stage == pp - 1
    params = stage_params(cfg, tp, n_layers, first, last)
    elem = precision.activation_bytes
    if recompute:
        per_micro = n_layers * micro_batch * seq * cfg.hidden * elem  # each block's input
        rebuilt = layer_activation_bytes(cfg, micro_batch, seq, tp, elem, saved)
    else:
        per_micro = n_layers * layer_activation_bytes(cfg, micro_batch, seq, tp, elem, saved)
        rebuilt = 0
    if first:
        per_micro += embedding_activation_bytes(micro_batch, seq)
    if last:
        per_micro += head_activation_bytes(cfg, micro_batch, seq, tp, elem)
    buckets = params * precision.grad_bytes if dp > 1 else 0
    return StageMemory(params * precision.param_bytes, params * precision.grad_bytes + buckets,
                       params * precision.optimizer_bytes,
                       in_flight(schedule, pp, stage, micro_batches) * per_micro, rebuilt)


def kv_cache_bytes(cfg: ModelConfig, tp: int, n_layers: int, batch: int, max_len: int, elem: int) -> int:
    """K and V of every layer of a stage for ``batch`` sequences up to ``max_len`` tokens, per tp rank
    (``serve.kv_cache.KVCache.nbytes``)."""
    return 2 * n_layers * batch * kv_heads_local(cfg, tp) * max_len * cfg.head_dim * elem
