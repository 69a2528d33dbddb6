"""Memory per device: parameters, gradients, optimizer states, activations, KV cache.

Parameters are counted the way the engine allocates them, tensor by tensor: column-parallel
weights and vocabulary blocks split over tp (the vocabulary padded to ``ceil(V / tp)`` rows),
norm gains and row-parallel biases replicated, K/V heads replicated on ``tp / kv_heads`` ranks
when tp exceeds the KV head count, a tied LM head on a later pipeline stage holding its own copy
of the embedding. Gradients and AdamW's two moments have the parameters' shapes (the
data-parallel buckets are the gradients' own storage, ``module.GradArena``: no copy).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4): list every tensor a layer keeps for backward. Per layer and
micro-batch of b sequences of s tokens, hidden h, a heads, tp = t, 16-bit activations, 1-byte
dropout masks and no sequence parallelism, their list sums to

    s b h (10 + 24 / t) + 5 a s^2 b / t  bytes        (34 s b h + 5 a s^2 b at t = 1)

of which 4 s b h elements (the two norm inputs, the QKV and MLP inputs) are replicated over tp.
With full recomputation a layer keeps only its input, s b h elements; with selective recomputation
everything but the 5 a s^2 b / t of softmax and dropout (``attention_score_bytes``). ``MEGATRON``
reproduces the paper's list; ``ENGINE`` is this engine's on a CPU (tests/test_plan.py checks it
byte for byte against what the pipeline holds), ``ENGINE_ON_GPU`` its GPU path (the causal softmax
kept in larger blocks): the GeLU/SiLU kernels also keep their tanh/cdf/sigmoid (4 s b h / t more),
dropout keeps no separate output but masks in the activation dtype, norms add their row
statistics, RoPE its tables, selective recomputation each query row's log-sum-exp (a b s / t
values, in float32 at least), from which backward makes the softmax again block by block.
Grouped-query attention and SwiGLU change the K/V and MLP terms.

Sequence parallelism (``cfg.sequence_parallel`` at tp > 1) runs the norms, dropout and residuals
on a 1/t slice of the sequence and the column-parallel layers keep only their input's slice, so
the replicated terms above are divided by t: the paper's list becomes s b h (34 / t) + 5 a s^2 b / t,
and the engine's likewise (its final norm too; the LM head keeps the gathered sequence).

Mixture-of-Experts layers (``cfg.is_moe_layer``): the router [h, E] is replicated, each rank of
the ep group holds E / ep experts, each a tensor-parallel MLP. What an MoE layer keeps depends on
the routing, so the planner counts the capacity bound (``Routing``): each expert keeps at most
``capacity = ceil(factor * tokens * top_k / E)`` rows of the ep group's tokens (and at most one per
token). Besides the attention's list it keeps the router probabilities, the top-k order (int64),
the chosen probabilities and gates, the combined expert outputs of this rank's kept assignments,
and each local expert's MLP activations for the rows it received. The layer sees the whole
sequence (with sequence parallelism it gathers its input first and keeps the gathered copy).

A pipeline stage holds the activations of the micro-batches in flight: all m with GPipe,
``min(pp - stage, m)`` with 1F1B; with recomputation, backward rebuilds one layer's full set
(selective: only its attention-dropout masks, redrawn whole; the softmax is never whole again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

from ..models.config import ModelConfig
from ..nn.attention import saved_score_elements
from ..pipeline.partition import chunk_runs
from ..pipeline.schedules import FORWARD, stage_ops
from ..recompute import recompute_mode

INDEX_BYTES = 8  # token ids, their per-rank offsets, the router's top-k order (int64)


@dataclass(frozen=True)
class SavedTensors:
    """Which tensors an implementation keeps for backward, where implementations differ."""

    name: str
    mask_bytes: int | None  # bytes per dropout-mask element; None: the activation dtype's
    keeps_dropout_output: bool  # attention keeps dropout(softmax) besides softmax and the mask
    activation_aux: bool  # the activation kernel keeps an extra tensor of its input's size
    row_statistics: bool  # norms keep per-row 1/std, selective attention its log-sum-exp; RoPE its cos/sin tables
    always_dropout: bool  # count dropout masks whatever the config (the paper's models use dropout)
    causal_blocks: bool  # causal softmax kept only for the query blocks' visible keys (nn.attention)
    on_device: bool = False  # the GPU path: larger query blocks (nn.attention.DEVICE_QUERY_BLOCK)


MEGATRON = SavedTensors("megatron", 1, True, False, False, True, False)
ENGINE = SavedTensors("engine", None, False, True, True, False, True)
ENGINE_ON_GPU = replace(ENGINE, name="engine on a GPU", on_device=True)


def kv_heads_local(cfg: ModelConfig, tp: int) -> int:
    """K/V heads one tp rank holds: its share, or one replicated head when tp > kv heads."""
    return cfg.n_kv_heads // tp if cfg.n_kv_heads >= tp else 1


def vocab_rows(cfg: ModelConfig, tp: int) -> int:
    return -(-cfg.vocab_size // tp)


def norm_params(cfg: ModelConfig) -> int:
    return cfg.hidden * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def mlp_params(cfg: ModelConfig, tp: int, width: int | None = None) -> int:
    """One MLP of ``width`` (default: the dense one; an expert's, the shared expert's) on one tp rank."""
    b, mats = 1 if cfg.bias else 0, 2 if cfg.gated_mlp else 1
    f = (cfg.ffn_hidden if width is None else width) // tp
    return cfg.hidden * mats * f + b * mats * f + f * cfg.hidden + b * cfg.hidden


def shared_expert_params(cfg: ModelConfig, tp: int) -> int:
    """A Qwen2-MoE shared expert on one tp rank and its replicated gate vector (0 without one)."""
    width = cfg.shared_expert_ffn_hidden
    return mlp_params(cfg, tp, width) + cfg.hidden if width else 0


def block_params(cfg: ModelConfig, tp: int, layer: int = 0, ep: int = 1) -> int:
    """Elements of transformer block ``layer`` on one tp rank (of an ep group for MoE layers)."""
    h, d, b = cfg.hidden, cfg.head_dim, 1 if cfg.bias else 0
    qkv = (cfg.n_heads // tp + 2 * kv_heads_local(cfg, tp)) * d
    attention = h * qkv + b * qkv + (cfg.n_heads // tp) * d * h + b * h + (2 * d if cfg.qk_norm else 0)
    if cfg.is_moe_layer(layer):  # router, local experts, shared expert
        experts = cfg.num_experts // ep * mlp_params(cfg, tp, cfg.expert_ffn_hidden)
        mlp = h * cfg.num_experts + experts + shared_expert_params(cfg, tp)
    else:
        mlp = mlp_params(cfg, tp)
    return block_norms(cfg) * norm_params(cfg) + attention + mlp


def block_norms(cfg: ModelConfig) -> int:
    """Norms a block has over the hidden axis: before attention and the MLP, and after each with post_norms."""
    return 4 if cfg.post_norms else 2


def expert_params(cfg: ModelConfig, tp: int, layers: range, ep: int) -> int:
    """The experts' share of ``stage_params``: their gradients go over the expert-dp group."""
    moe_layers = sum(cfg.is_moe_layer(i) for i in layers)
    return moe_layers * (cfg.num_experts // ep) * mlp_params(cfg, tp, cfg.expert_ffn_hidden)


def sharded_elements(params: int, experts: int, shards: int = 1, ep: int = 1) -> float:
    """Of a rank's ``params`` elements (``experts`` of them MoE experts'), those whose optimizer work it
    owns. With the distributed optimizer (``shards`` = dp > 1) each element is owned by one rank of
    the group that shares it: dp for dense parameters, dp / ep for experts (the tied embedding of
    pp > 1, which stays whole, is counted as sharded too); else every element."""
    return (params - experts) / shards + experts / max(1, shards // ep)


def optimizer_bytes_per_rank(params: int, experts: int, precision, shards: int = 1, ep: int = 1) -> int:
    """Optimizer bytes of such a rank: moments, and the masters of mixed precision (at float32/64 the
    parameters are their own masters), for the elements it owns (``sharded_elements``)."""
    return int(sharded_elements(params, experts, shards, ep) * precision.optimizer_bytes)


def stage_params(cfg: ModelConfig, tp: int, layers: range, first: bool, last: bool, ep: int = 1) -> int:
    """Parameter elements one rank of a stage holds (``GPTModel.local_bytes() / itemsize``);
    ``layers``: the stage's global layer indices."""
    count = sum(block_params(cfg, tp, i, ep) for i in layers)
    if first or (last and cfg.tie_embeddings):
        count += vocab_rows(cfg, tp) * cfg.hidden
    if first and cfg.position == "learned":
        count += cfg.max_seq_len * cfg.hidden
    if last:
        count += norm_params(cfg) + (0 if cfg.tie_embeddings else vocab_rows(cfg, tp) * cfg.hidden)
    return count


@dataclass(frozen=True)
class Routing:
    """The capacity bound on one MoE layer's routing for one micro-batch of ``tokens`` per rank."""

    tokens: int  # this rank's tokens (the whole sequence, also with sequence parallelism)
    received: int  # rows this rank's experts receive at most
    sent: int  # this rank's kept assignments at most (top_k per token)

    @classmethod
    def bound(cls, cfg: ModelConfig, tokens: int, ep: int) -> Routing:
        """An expert keeps at most ``capacity`` rows (tensor_parallel/experts.py's rule) and at most
        one per token of the ep group."""
        group, k, experts = ep * tokens, cfg.top_k, cfg.num_experts
        capacity = math.ceil(cfg.capacity_factor * group * k / experts)
        return cls(tokens, min(group * k, experts // ep * min(capacity, group)), tokens * k)


def sequence_sharded(cfg: ModelConfig, tp: int) -> bool:
    return cfg.sequence_parallel and tp > 1


def mlp_saved_per_row(cfg: ModelConfig, tp: int, saved: SavedTensors, width: int | None = None) -> int:
    """Elements an MLP of ``width`` (default the dense one) keeps per token row besides its input:
    activation input(s), fc2 input, aux."""
    f, aux = (cfg.ffn_hidden if width is None else width) // tp, 1 if saved.activation_aux else 0
    return f * ((2 + 1 + 1 + aux) if cfg.gated_mlp else (1 + 1 + aux))  # gate|up, silu, product


def moe_saved_bytes(cfg: ModelConfig, routing: Routing, tp: int, elem: int, saved: SavedTensors) -> int:
    """What an MoE layer's MLP part keeps (its input excepted), at the capacity bound."""
    n, k, experts = routing.tokens, cfg.top_k, cfg.num_experts
    renormalized = cfg.normalize_top_k and k > 1
    floats = n * experts + n * k * (2 if renormalized else 1)  # probabilities, chosen (and renormalised gates)
    floats += routing.sent * cfg.hidden  # combined expert outputs
    expert_rows = cfg.hidden + mlp_saved_per_row(cfg, tp, saved, cfg.expert_ffn_hidden)  # inputs and MLPs
    floats += routing.received * expert_rows
    if cfg.shared_expert_ffn_hidden:  # on the layer's own input: its MLP, its output and its scale
        floats += n * (mlp_saved_per_row(cfg, tp, saved, cfg.shared_expert_ffn_hidden) + cfg.hidden + 1)
    return floats * elem + n * experts * INDEX_BYTES + experts * 8  # top-k order; load shares (float64)


def attention_score_bytes(
    cfg: ModelConfig, micro_batch: int, seq: int, tp: int, elem: int, saved: SavedTensors = ENGINE, layer: int = 0
) -> int:
    """The softmax outputs and attention-dropout tensors of layer ``layer`` and one micro-batch: what
    selective recomputation does not keep (a sliding window keeps only the blocks' tiles it reads)."""
    scores = micro_batch * (cfg.n_heads // tp) * seq * seq
    window = cfg.window_of(layer)
    kept = (
        micro_batch * (cfg.n_heads // tp) * saved_score_elements(seq, seq, cfg.causal, saved.on_device, window)
        if (saved.causal_blocks)
        else scores
    )
    dropout_output = scores * elem if saved.keeps_dropout_output and attention_dropout(cfg, saved) else 0
    return kept * elem + attention_mask_bytes(cfg, micro_batch, seq, tp, elem, saved) + dropout_output


def attention_dropout(cfg: ModelConfig, saved: SavedTensors) -> bool:
    return cfg.attn_dropout > 0 or saved.always_dropout


def attention_mask_bytes(
    cfg: ModelConfig, micro_batch: int, seq: int, tp: int, elem: int, saved: SavedTensors = ENGINE
) -> int:
    """One layer's attention-dropout masks (0 without attention dropout): selective recomputation
    redraws them whole in backward."""
    if not attention_dropout(cfg, saved):
        return 0
    return micro_batch * (cfg.n_heads // tp) * seq * seq * (elem if saved.mask_bytes is None else saved.mask_bytes)


def softmax_statistics_bytes(cfg: ModelConfig, micro_batch: int, seq: int, tp: int, elem: int) -> int:
    """The log-sum-exp of each query row selective recomputation keeps instead of the softmax
    (``nn.attention.statistics_dtype``: float32 at least)."""
    return micro_batch * (cfg.n_heads // tp) * seq * max(elem, 4)


def layer_activation_bytes(
    cfg: ModelConfig,
    micro_batch: int,
    seq: int,
    tp: int,
    elem: int,
    saved: SavedTensors = ENGINE,
    layer: int = 0,
    ep: int = 1,
    selective: bool = False,
) -> int:
    """Bytes block ``layer`` keeps for backward for one micro-batch (the list in the module docstring);
    ``selective``: without ``attention_score_bytes`` (with the rows' log-sum-exp where ``saved``
    counts row statistics)."""
    sb, h, d = micro_batch * seq, cfg.hidden, cfg.head_dim
    shard = sb // tp if sequence_sharded(cfg, tp) else sb  # rows of the norm / dropout / residual tensors
    moe = cfg.is_moe_layer(layer)
    q, kv = cfg.n_heads // tp * d, kv_heads_local(cfg, tp) * d
    mask = elem if saved.mask_bytes is None else saved.mask_bytes
    norms = block_norms(cfg)
    elements = shard * norms * h  # the norms' saved inputs (xhat): two, or four with post_norms
    elements += shard * h  # the QKV input (norm output): replicated over tp without SP
    elements += (sb if moe else shard) * h  # the MLP's input; an MoE layer keeps the whole sequence's
    elements += sb * (q + 2 * kv + q)  # Q, K, V and the output projection's input
    if cfg.qk_norm:  # the normalised heads (xhat), and new Q and K arrays where no rope makes them
        elements += sb * (q + kv) * (1 if cfg.position == "rope" else 2)
        if saved.row_statistics:
            elements += sb * (cfg.n_heads // tp + kv_heads_local(cfg, tp))  # 1/rms of each head's row
    if cfg.position == "rope":
        elements += sb * (q + kv)  # rotated Q and K are new arrays (V stays a view of QKV)
        if saved.row_statistics:
            elements += seq * d  # cos and sin tables, [s, d/2] each
    if not moe:
        elements += sb * mlp_saved_per_row(cfg, tp, saved)
    if saved.row_statistics:
        elements += norms * shard  # 1/std of each row, every norm
    total = elements * elem
    if moe:
        total += moe_saved_bytes(cfg, Routing.bound(cfg, sb, ep), tp, elem, saved)
    if not selective:
        total += attention_score_bytes(cfg, micro_batch, seq, tp, elem, saved, layer)
    elif saved.row_statistics:
        total += softmax_statistics_bytes(cfg, micro_batch, seq, tp, elem)
    if cfg.dropout > 0 or saved.always_dropout:
        total += 2 * shard * h * mask  # after attention and after the MLP
    return total


def embedding_activation_bytes(micro_batch: int, seq: int) -> int:
    """The embedding keeps each token's local id and whether it falls outside this rank's block."""
    return micro_batch * seq * (INDEX_BYTES + 1)


def head_activation_bytes(cfg: ModelConfig, micro_batch: int, seq: int, tp: int, elem: int) -> int:
    """Final norm (on the sequence shard with SP), head input (the whole sequence), the local logits'
    softmax numerators (and their tanh with soft-capping) and the loss's per-token rows."""
    sb = micro_batch * seq
    shard = sb // tp if sequence_sharded(cfg, tp) else sb
    logits = sb * vocab_rows(cfg, tp) * (2 if cfg.logit_softcap else 1)
    floats = shard * (cfg.hidden + 1) + sb * cfg.hidden + logits + 2 * sb
    return floats * elem + sb * (INDEX_BYTES + 2)


@cache
def alive_mixes(schedule: str, pp: int, stage: int, micro_batches: int, chunks: int) -> frozenset:
    """How many passes of each chunk hold activations after each forward of the stage's op list
    (pipeline/schedules.py), the distinct mixes only: the peak is after some forward. One chunk:
    GPipe's m, 1F1B's min(pp - stage, m); interleaved, 2 (pp-1-stage) + (V-1) pp + 1 passes of
    1/V of the stage each, their mix changing as backwards free the last chunks first."""
    alive, mixes = [0] * chunks, set()
    for op, chunk, _ in stage_ops(schedule, micro_batches, pp, stage, chunks):
        alive[chunk] += 1 if op == FORWARD else -1
        if op == FORWARD:
            mixes.add(tuple(alive))
    return frozenset(mixes)


@dataclass(frozen=True)
class StageMemory:
    params: int  # bytes of parameters
    grads: int  # gradients (the dp buckets sum them in place)
    optimizer: int  # AdamW moments (and fp32 master weights in mixed precision)
    activations: int  # held for backward by the micro-batches in flight
    recompute_peak: int  # one layer's set (full recomputation) or dropout masks (selective) rebuilt in backward

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.recompute_peak

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer


def stage_memory(
    cfg: ModelConfig,
    tp: int,
    pp: int,
    stage: int,
    layers: range,
    micro_batch: int,
    seq: int,
    micro_batches: int,
    schedule: str,
    recompute: str | bool,
    precision,
    saved: SavedTensors = ENGINE,
    ep: int = 1,
    optimizer_shards: int = 1,
) -> StageMemory:
    """``layers``: the stage's global layer indices (with virtual stages its chunks', whose runs of
    consecutive indices are the chunks); ``optimizer_shards``: dp with the distributed optimizer
    (``optimizer_bytes_per_rank``), else 1; ``recompute``: a ``hpc_tp.recompute`` mode."""
    first, last = stage == 0, stage == pp - 1
    params = stage_params(cfg, tp, layers, first, last, ep)
    elem = precision.activation_bytes
    layers = list(layers)
    chunks = [[layers[p] for p in run] for run in chunk_runs(layers)]  # V > 1: interleaved, per chunk
    mode = recompute_mode(recompute)
    kept = [
        [layer_activation_bytes(cfg, micro_batch, seq, tp, elem, saved, i, ep, mode == "selective") for i in chunk]
        for chunk in chunks
    ]
    rows = micro_batch * seq // (tp if sequence_sharded(cfg, tp) else 1)
    # A micro-batch's pass through a chunk keeps each block's input (full recomputation) or all it saves.
    per_pass = [len(chunk) * rows * cfg.hidden * elem if mode == "full" else sum(k) for chunk, k in zip(chunks, kept)]
    rebuilt = {
        "none": 0,
        "full": max(max(k) for k in kept),
        "selective": attention_mask_bytes(cfg, micro_batch, seq, tp, elem, saved),
    }[mode]
    if first:
        per_pass[0] += embedding_activation_bytes(micro_batch, seq)
    if last:
        per_pass[-1] += head_activation_bytes(cfg, micro_batch, seq, tp, elem)
    activations = max(
        sum(n * b for n, b in zip(mix, per_pass))
        for mix in alive_mixes(schedule, pp, stage, micro_batches, len(chunks))
    )
    optimizer = optimizer_bytes_per_rank(params, expert_params(cfg, tp, layers, ep), precision, optimizer_shards, ep)
    return StageMemory(params * precision.param_bytes, params * precision.grad_bytes, optimizer, activations, rebuilt)


def kv_cache_bytes(cfg: ModelConfig, tp: int, n_layers: int, batch: int, max_len: int, elem: int) -> int:
    """K and V of every layer of a stage for ``batch`` sequences up to ``max_len`` tokens, per tp rank
    (``serve.kv_cache.KVCache.nbytes``)."""
    return 2 * n_layers * batch * kv_heads_local(cfg, tp) * max_len * cfg.head_dim * elem
