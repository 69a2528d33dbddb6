"""Predicted step time of a (tp, pp, dp, micro-batch, recompute, schedule) layout.

Compute. Forward FLOPs per token come from ``pipeline.partition.stage_costs`` (the estimate the
stage split balances): per block 2 x (QKV, output, MLP weights) + 4 s h for scores and P V,
plus the embedding on the first stage and the head and loss on the last. Backward costs twice
the forward; full recomputation runs each block's forward once more. A stage's work is split
over its tp ranks, each running at the cluster's (or the calibration's) sustained FLOP/s.

Communication, as the engine issues it (``stage_collectives``), each message timed with an
alpha-beta model of the link it crosses (``Link``), plus the calibration's ``sync`` per message:

    all-reduce of n bytes over g ranks   2 log2(g) alpha + 2 (g - 1) / g * n / bw
    all-gather, reduce-scatter             log2(g) alpha +   (g - 1) / g * n / bw
    point-to-point                                 alpha +                n / bw

The bandwidth terms are the ring's (each rank sends 2 (g - 1) / g of the buffer); the latency
terms are recursive halving/doubling's (Rabenseifner), which MPI and NCCL use for the small
messages where latency matters (a ring's 2 (g - 1) hops would make a 1536-rank scalar
all-reduce cost 60 ms).

tp: per block, the f and g all-reduces of the [b, s, h] activations: 2 forward, 2 backward,
2 more in a recomputed forward; the vocab-parallel embedding, head and loss add 1 + 1 + 2. With
grouped-query attention and tp > kv heads, replicated K/V weight gradients are summed over
their replicas every backward. pp: one activation forward and one gradient backward per
micro-batch and stage boundary. dp: the stage's gradients once per step, in 25 MiB buckets.
Each step also reduces a few scalars (token count, loss, grad norm, the finite check).
A group whose ranks span nodes (ranks = arange(world).reshape(dp, pp, tp), nodes cut that in
blocks of devices_per_node) crosses the inter-node link, the rest stay inside a node.

Pipeline. With per-micro-batch stage times T_s (forward + backward, their tp collectives and
p2p) and m micro-batches, a step takes sum_s T_s + (m - 1) max_s T_s: the slowest stage works
m times, the others add the fill and drain. For equal stages that is (m + p - 1) T, the bubble
(p - 1) / m of the ideal m T. Collectives are counted as not overlapped with compute: on CPU MPI
nothing progresses outside an MPI call, and it keeps the plan on the safe side on GPUs.

Update. AdamW, clipping and zeroing are elementwise: ``UPDATE_PASSES`` reads and writes of the
stage's parameters, gradients and states, at the device's memory bandwidth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy

from ..models.config import ModelConfig
from ..pipeline.partition import balanced_layers, stage_costs
from ..train.grad_sync import DEFAULT_BUCKET_BYTES
from .memory import ENGINE, kv_heads_local, stage_memory, stage_params

UPDATE_PASSES = 11  # numpy AdamW (about 33 array passes), grad norm, finite check, zeroing: / 4 arrays

OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


def hops(op: str, group: int) -> int:
    """Latency steps: recursive halving and doubling (module docstring)."""
    if op == "p2p":
        return 1
    steps = math.ceil(math.log2(group)) if group > 1 else 0
    return 2 * steps if op == "all_reduce" else steps


def traffic(op: str, group: int) -> float:
    """Bytes each rank sends per byte of the buffer (the bus factor of nccl-tests)."""
    if op == "p2p":
        return 1.0
    return (2 if op == "all_reduce" else 1) * (group - 1) / group


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per hop
    bw: float     # bytes/s per rank, one direction

    def time(self, op: str, group: int, nbytes: float) -> float:
        return hops(op, group) * self.alpha + traffic(op, group) * nbytes / self.bw


@dataclass(frozen=True)
class Network:
    """A ``Link`` per operation for each link class: the cluster's one link, or fitted per operation.
    ``sync``: seconds every message costs inside a step beyond its alpha-beta time, because its
    ranks arrive at different moments (measured by a calibration; large when ranks share cores)."""

    intra: dict
    inter: dict
    sync: float = 0.0

    @classmethod
    def of_cluster(cls, cluster) -> "Network":
        return cls({op: Link(*cluster.link(False)) for op in OPS}, {op: Link(*cluster.link(True)) for op in OPS})

    def time(self, op: str, group: int, nbytes: float, inter: bool) -> float:
        if group <= 1 and op != "p2p":
            return 0.0
        return (self.inter if inter else self.intra)[op].time(op, group, nbytes) + self.sync


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    recompute: bool = False
    schedule: str = "1f1b"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def group_size(self, group: str) -> int:
        return self.world if group == "world" else getattr(self, group)

    def spans_nodes(self, group: str, devices_per_node: int) -> bool:
        """Whether some tp / pp / dp group has ranks on more than one node (its ring then runs at the
        inter-node speed). Ranks are ``arange(world).reshape(dp, pp, tp)``, node = rank // per node."""
        if self.world <= devices_per_node:
            return False
        if group == "world":
            return True
        nodes = numpy.arange(self.world).reshape(self.dp, self.pp, self.tp) // devices_per_node
        axis = {"dp": 0, "pp": 1, "tp": 2}[group]
        return bool((nodes.max(axis=axis) != nodes.min(axis=axis)).any())

    def describe(self) -> str:
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} micro-batch={self.micro_batch} "
                f"{'recompute ' if self.recompute else ''}{self.schedule if self.pp > 1 else ''}").strip()


@dataclass(frozen=True)
class Collective:
    group: str     # tp, pp, dp or world
    op: str
    nbytes: int    # one message
    count: int     # messages per step on one rank of the stage
    what: str
    per_micro_batch: bool = True  # inside the pipeline (else once per step, after it)
    seconds: float = 0.0          # count x one message's time


@dataclass
class Prediction:
    layout: Layout
    step_s: float
    compute_s: float       # the busiest stage's forward and backward FLOPs, m micro-batches
    tp_s: float
    pp_s: float
    dp_s: float            # gradient buckets, and the step's scalar reductions (tokens, loss, norm, finite)
    bubble_s: float        # pipeline fill and drain: the step minus m times the slowest stage
    update_s: float
    tokens_per_s: float
    model_flops_per_device: float  # 3 x forward FLOPs per second per device (recompute not counted)
    memory: dict = field(default_factory=dict)      # stage -> StageMemory, the first stage of each kind
    layers: list = field(default_factory=list)      # layers per stage
    collectives: list = field(default_factory=list)

    @property
    def peak_memory(self) -> int:
        return max(m.total for m in self.memory.values())


def forward_flops_per_token(cfg: ModelConfig, seq: int, n_layers: int, first: bool, last: bool) -> float:
    embedding, block, head = stage_costs(cfg, seq)
    return n_layers * block + (embedding if first else 0.0) + (head if last else 0.0)


def stage_collectives(cfg: ModelConfig, layout: Layout, seq: int, n_layers: int, first: bool, last: bool,
                      micro_batches: int, elem: int, grad_bytes: int) -> list[Collective]:
    """Every collective one rank of a stage issues in a step, with its size and count."""
    tp, m = layout.tp, micro_batches
    activation = layout.micro_batch * seq * cfg.hidden * elem
    tokens = layout.micro_batch * seq
    out = []
    if tp > 1:
        per_block = 4 + (2 if layout.recompute else 0)
        out.append(Collective("tp", "all_reduce", activation, per_block * n_layers * m, "f/g of attention and MLP"))
        if first:
            out.append(Collective("tp", "all_reduce", activation, m, "vocab-parallel embedding"))
        if last:
            out.append(Collective("tp", "all_reduce", activation, m, "LM head input gradient"))
            out.append(Collective("tp", "all_reduce", tokens * elem, m, "loss row max"))
            out.append(Collective("tp", "all_reduce", 2 * tokens * elem, m, "loss sum-exp and target logit"))
        if cfg.n_kv_heads < tp:
            replicas_bytes = cfg.hidden * 2 * cfg.head_dim * elem * kv_heads_local(cfg, tp)
            out.append(Collective("tp", "all_reduce", replicas_bytes, n_layers * m, "replicated K/V grads"))
    if layout.pp > 1:
        out.append(Collective("pp", "p2p", activation, 2 * m, "activation forward, gradient backward"))
        out.append(Collective("pp", "all_reduce", 16, 2, "loss broadcast, grad norm", False))
    if layout.dp > 1:
        grads = stage_params(cfg, tp, n_layers, first, last) * grad_bytes
        buckets = max(1, math.ceil(grads / DEFAULT_BUCKET_BYTES))
        out.append(Collective("dp", "all_reduce", math.ceil(grads / buckets), buckets, "gradient buckets", False))
        out.append(Collective("dp", "all_reduce", 8, 2, "token count, loss", False))
    if tp > 1:
        out.append(Collective("tp", "all_reduce", 8, 1, "grad norm", False))
    out.append(Collective("world", "all_reduce", 8, 1, "gradients finite", False))
    return out


def predict(cfg: ModelConfig, layout: Layout, global_batch: int, seq: int, cluster, calibration=None,
            layers=None) -> Prediction:
    """The layout's step time, its parts and memory per stage. ``layers``: blocks per stage (default:
    the engine's balanced split, ``balanced_layers``)."""
    precision = cluster.precision
    per_node = min(layout.world, cluster.devices_per_node)
    network = calibration.network(cluster) if calibration is not None else Network.of_cluster(cluster)
    mem_bw = calibration.mem_bw if calibration is not None and calibration.mem_bw else cluster.rank_mem_bw(per_node)
    m = global_batch // (layout.dp * layout.micro_batch)
    counts = layers or [len(r) for r in balanced_layers(cfg, layout.pp)]

    # Stages with the same layer count and role cost the same: each kind is computed once.
    kinds, stage_times = {}, []
    for s, n_layers in enumerate(counts):
        key = (n_layers, s == 0, s == layout.pp - 1)
        if key not in kinds:
            kinds[key] = _stage(cfg, layout, seq, m, key, cluster, calibration, network, mem_bw, per_node)
            kinds[key]["memory"] = stage_memory(cfg, layout.tp, layout.dp, layout.pp, s, n_layers, layout.micro_batch,
                                                seq, m, layout.schedule, layout.recompute, precision, ENGINE)
            kinds[key]["stage"] = s  # the first of its kind holds the most micro-batches in flight
        stage_times.append(kinds[key]["micro"])

    slowest = max(range(len(counts)), key=lambda s: stage_times[s])
    pipeline = sum(stage_times) + (m - 1) * stage_times[slowest]
    worst = kinds[(counts[slowest], slowest == 0, slowest == layout.pp - 1)]
    dp_s = max(k["after"] for k in kinds.values())
    update_s = max(k["update"] for k in kinds.values())
    step = pipeline + dp_s + update_s
    model_flops = 3 * forward_flops_per_token(cfg, seq, cfg.n_layers, True, True) * global_batch * seq
    memory = {k["stage"]: k["memory"] for k in kinds.values()}
    return Prediction(layout, step, worst["compute"], worst["in_pipeline"]["tp"], worst["in_pipeline"]["pp"], dp_s,
                      pipeline - m * stage_times[slowest], update_s, global_batch * seq / step,
                      model_flops / step / layout.world, memory, list(counts), worst["comms"])


def _stage(cfg, layout: Layout, seq: int, m: int, key, cluster, calibration, network, mem_bw, per_node) -> dict:
    """One stage's compute, collectives and update time; ``micro``: one micro-batch forward + backward."""
    n_layers, first, last = key
    precision, tokens = cluster.precision, layout.micro_batch * seq
    flops = forward_flops_per_token(cfg, seq, n_layers, first, last) * tokens / layout.tp
    rate = (calibration.rank_flops(cluster, per_node, flops, layout.tp) if calibration is not None
            else cluster.rank_flops(per_node))
    recomputed = forward_flops_per_token(cfg, seq, n_layers, False, False) * tokens / layout.tp
    compute = (3 * flops + (recomputed if layout.recompute else 0.0)) / rate
    comms = [replace(c, seconds=c.count * network.time(c.op, layout.group_size(c.group), c.nbytes,
                                                       layout.spans_nodes(c.group, cluster.devices_per_node)))
             for c in stage_collectives(cfg, layout, seq, n_layers, first, last, m, precision.activation_bytes,
                                        precision.grad_bytes)]
    in_pipeline = {g: sum(c.seconds for c in comms if c.group == g and c.per_micro_batch) for g in ("tp", "pp")}
    params = stage_params(cfg, layout.tp, n_layers, first, last)
    return dict(compute=compute * m, comms=comms, in_pipeline=in_pipeline,
                after=sum(c.seconds for c in comms if not c.per_micro_batch),
                micro=compute + (in_pipeline["tp"] + in_pipeline["pp"]) / m,
                update=UPDATE_PASSES * params * precision.training_bytes_per_param / mem_bw)
