"""Predicted step time of a (tp, pp, dp, micro-batch, recompute, schedule, sp, ep, V) layout.

Compute. Forward FLOPs per token come from ``pipeline.partition.layer_flops_per_token`` (the
estimate the stage split balances): per block 2 x (QKV, output, MLP weights) + 4 s h for scores
and P V (a sliding-window layer's s its window), plus the embedding on the first stage and the head and loss on the last. Backward costs twice
the forward; full recomputation runs each block's forward once more, selective recomputation
only Q K^T (2 s h per token and layer, the softmax rebuilt from it). A stage's work is split
over its tp ranks, each running at the cluster's (or the calibration's) sustained FLOP/s. An MoE
layer replaces its MLP by the router (2 h E per token) and the experts' rows: the model FLOPs
count top_k experts per token; the busiest rank's time counts the rows its experts receive at
the capacity bound (``memory.Routing``), since the all-to-all waits for it.

Communication, as the engine issues it (``stage_collectives``), each message timed with an
alpha-beta model of the link it crosses (``Link``), plus, in a tp group, the calibration's
``wait``: the time its ranks spend waiting for each other per second of compute (a partner
descheduled, a slower core), which grows with the work between collectives, not their number:

    all-reduce of n bytes over g ranks   2 log2(g) alpha + 2 (g - 1) / g * n / bw
    all-gather, reduce-scatter             log2(g) alpha +   (g - 1) / g * n / bw
    all-to-all (pairwise exchange)          (g - 1) alpha +   (g - 1) / g * n / bw
    point-to-point                                 alpha +                n / bw

The bandwidth terms are the ring's (each rank sends 2 (g - 1) / g of the buffer); the latency
terms are recursive halving/doubling's (Rabenseifner), which MPI and NCCL use for the small
messages where latency matters (a ring's 2 (g - 1) hops would make a 1536-rank scalar
all-reduce cost 60 ms).

tp: per block, the f and g all-reduces of the [b, s, h] activations: 2 forward, 2 backward,
2 more in a recomputed forward; the vocab-parallel embedding, head and loss add 1 + 1 + 2. With
grouped-query attention and tp > kv heads, each replicated K/V weight gradient (and bias) is
summed over its tp / kv replicas every backward: K and V one message each, over that subgroup.
Sequence parallelism (``tensor_parallel/sequence_parallel.py``) turns each block's all-reduces into all-gathers and reduce-scatters of the same [b, s, h]
buffers: forward 2 all-gathers (f) and 2 reduce-scatters (g); backward 2 all-gathers of the
output gradient, 2 all-gathers re-gathering the column-parallel inputs (kept as shards, as
Megatron-LM does) and 2 reduce-scatters of the input gradient; one all-reduce of the norms'
gradients; the embedding adds an all-gather backward, the final norm one forward and its
gradient all-reduce. An MoE layer: the tp all-reduces of each local expert on its rows (the
attention's stay as above; with SP the layer all-gathers its input forward and its output
gradient backward), and over ep an all-gather of the routing counts and the all-to-all
dispatch and combine forward and again backward, each of [ep, M, h] with M the rows one rank
sends another at the capacity bound, spread evenly. pp: one activation (a sequence shard with
SP) forward and one gradient backward per micro-batch and stage boundary. dp: the stage's dense
gradients once per step over dp, the experts' over the expert-dp group (dp / ep), in 25 MiB
buckets. Each step also reduces a few scalars (token count, loss, grad norm, the finite check).
A group whose ranks span nodes (ranks = arange(world).reshape(dp, pp, tp); the dp index is
(outer, e) for ep and expert-dp, ``grid.py``) crosses the inter-node link, the rest stay inside a
node. Which ranks share a node is the layout's ``placement``: ``block`` fills node by node (the
launchers' default: a tp that divides the ranks per node stays inside one), ``cyclic`` deals the
ranks round-robin over the nodes (``srun --distribution=cyclic``, ``mpirun --map-by node``: a tp
group then spans nodes and its pipeline neighbours share one). ``placement.bytes_between_nodes``
counts what a step sends from one node to another, every rank's messages summed.

Pipeline. With per-micro-batch stage times T_s (forward + backward, their tp collectives and
p2p) and m micro-batches, a step takes sum_s T_s + (m - 1) max_s T_s: the slowest stage works
m times, the others add the fill and drain. For equal stages that is (m + p - 1) T, the bubble
(p - 1) / m of the ideal m T. With V virtual stages per rank (interleaved 1F1B) the fill and
drain go through chunks of 1/V of a stage: sum_s T_s / V + (m - 1/V) max_s T_s, for equal stages
(m + (p - 1) / V) T, the bubble (p - 1) / (V m), for V times the p2p messages. Collectives are
counted as not overlapped with compute: on CPU MPI nothing progresses outside an MPI call, and it
keeps the plan on the safe side on GPUs.

Update. AdamW, clipping and zeroing are elementwise: ``UPDATE_PASSES`` reads and writes of the
stage's parameters, gradients and states, at the device's memory bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy

from ..errors import ConfigError
from ..models.config import ModelConfig
from ..module import DEFAULT_BUCKET_BYTES
from ..pipeline.partition import balanced_layers, edge_costs, layer_flops_per_token, rank_layers
from ..recompute import recompute_mode
from .memory import (
    ENGINE,
    ENGINE_ON_GPU,
    Routing,
    expert_params,
    kv_heads_local,
    norm_params,
    sharded_elements,
    stage_memory,
    stage_params,
    vocab_rows,
)

UPDATE_PASSES = 11  # numpy AdamW (about 33 array passes), grad norm, finite check, zeroing: / 4 arrays

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
PLACEMENTS = ("block", "cyclic")  # srun --distribution=block|cyclic: ranks node by node, or round-robin


def hops(op: str, group: int) -> int:
    """Latency steps: recursive halving and doubling, pairwise for all-to-all (module docstring)."""
    if op == "p2p":
        return 1
    if op == "all_to_all":
        return group - 1
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
    bw: float  # bytes/s per rank, one direction

    def time(self, op: str, group: int, nbytes: float) -> float:
        return hops(op, group) * self.alpha + traffic(op, group) * nbytes / self.bw


@dataclass(frozen=True)
class Network:
    """A ``Link`` per operation for each link class: the cluster's one link, or fitted per operation.
    ``wait``: seconds a tp group's collectives take beyond their alpha-beta time per second of
    compute, because its ranks arrive at different moments (measured by a calibration; large when
    ranks share cores)."""

    intra: dict
    inter: dict
    wait: float = 0.0

    @classmethod
    def of_cluster(cls, cluster) -> Network:
        return cls({op: Link(*cluster.link(False)) for op in OPS}, {op: Link(*cluster.link(True)) for op in OPS})

    def time(self, op: str, group: int, nbytes: float, inter: bool) -> float:
        if group <= 1 and op != "p2p":
            return 0.0
        return (self.inter if inter else self.intra)[op].time(op, group, nbytes)


def node_of_rank(world: int, devices_per_node: int, placement: str) -> numpy.ndarray:
    """Each rank's node: ``block`` fills a node before the next, ``cyclic`` deals ranks round-robin."""
    ranks = numpy.arange(world)
    if placement == "cyclic":
        return ranks % -(-world // devices_per_node)
    return ranks // devices_per_node


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    recompute: str = "none"  # a hpc_tp.recompute mode (True/False accepted: full/none)
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    ep: int = 1  # expert parallelism, carved out of dp
    distributed_optimizer: bool = False  # ZeRO-1: optimizer states and masters sharded over dp
    virtual_stages: int = 1  # model chunks per pipeline rank: > 1 is interleaved 1F1B
    placement: str = "block"  # how the launcher deals ranks to nodes: one of PLACEMENTS

    def __post_init__(self):
        object.__setattr__(self, "recompute", recompute_mode(self.recompute))
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement {self.placement!r}: expected one of {', '.join(PLACEMENTS)}")

    @property
    def optimizer_shards(self) -> int:
        return self.dp if self.distributed_optimizer else 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def group_size(self, group: str) -> int:
        sizes = {"world": self.world, "ep": self.ep, "expert_dp": self.dp // self.ep}
        return sizes[group] if group in sizes else getattr(self, group)

    def node_of_rank(self, devices_per_node: int) -> numpy.ndarray:
        return node_of_rank(self.world, devices_per_node, self.placement)

    def spans_nodes(self, group: str, devices_per_node: int) -> bool:
        """Whether some group of this kind has ranks on more than one node (its ring then runs at the
        inter-node speed). Ranks are ``arange(world).reshape(dp, pp, tp)``, placed on nodes by
        ``placement``, and the dp index is ``outer * ep + e`` (``grid.py``)."""
        if self.world <= devices_per_node:
            return False
        if group == "world":
            return True
        nodes = self.node_of_rank(devices_per_node).reshape(self.dp // self.ep, self.ep, self.pp, self.tp)
        if group == "dp":
            nodes = nodes.reshape(1, self.dp, self.pp, self.tp)
        axis = {"dp": 1, "expert_dp": 0, "ep": 1, "pp": 2, "tp": 3}[group]
        return bool((nodes.max(axis=axis) != nodes.min(axis=axis)).any())

    def describe(self, chunks: bool = True) -> str:
        """``tp=1 pp=2 dp=1 micro-batch=2 1f1b V=2``: V with every 1F1B pipeline, so that V=1 says it
        does not interleave; ``chunks`` False leaves V out (a table's own column)."""
        extras = [
            f"ep={self.ep}" if self.ep > 1 else "",
            "sp" if self.sequence_parallel else "",
            {"none": "", "selective": "selective", "full": "recompute"}[self.recompute],
            self.schedule if self.pp > 1 else "",
            f"V={self.virtual_stages}" if chunks and self.pp > 1 and self.schedule == "1f1b" else "",
            "zero1" if self.distributed_optimizer else "",
            "placed cyclic" if self.placement == "cyclic" else "",
        ]
        return " ".join(
            [f"tp={self.tp} pp={self.pp} dp={self.dp} micro-batch={self.micro_batch}", *[e for e in extras if e]]
        )

    @property
    def chunks_shown(self) -> str:
        """V for a table's column: the chunks per rank where there is a pipeline, else '-'."""
        return str(self.virtual_stages) if self.pp > 1 else "-"


@dataclass(frozen=True)
class Collective:
    group: str  # tp, pp, dp or world
    op: str
    nbytes: int  # one message
    count: int  # messages per step on one rank of the stage
    what: str
    per_micro_batch: bool = True  # inside the pipeline (else once per step, after it)
    seconds: float = 0.0  # count x one message's time
    ranks: int = 0  # a subgroup's size (K/V replicas inside tp); 0: the whole group


@dataclass
class Prediction:
    layout: Layout
    step_s: float
    compute_s: float  # the busiest stage's forward and backward FLOPs, m micro-batches
    tp_s: float  # the busiest stage's tp collectives, m micro-batches
    pp_s: float
    dp_s: float  # gradient buckets, and the step's scalar reductions (tokens, loss, norm, finite)
    bubble_s: float  # pipeline fill and drain: the step minus m times the slowest stage
    update_s: float
    tokens_per_s: float
    model_flops_per_device: float  # 3 x forward FLOPs per second per device (recompute not counted)
    memory: dict = field(default_factory=dict)  # stage -> StageMemory, the first stage of each kind
    layers: list = field(default_factory=list)  # layers per stage
    collectives: list = field(default_factory=list)
    ep_s: float = 0.0  # MoE routing counts and all-to-alls over the ep group
    stage_collectives: list = field(default_factory=list)  # every stage's collectives, in stage order

    @property
    def peak_memory(self) -> int:
        return max(m.total for m in self.memory.values())


def forward_flops_per_token(
    cfg: ModelConfig, seq: int, layers: range, first: bool, last: bool, expert_rows_per_token: float | None = None
) -> float:
    """Forward FLOPs per token of a stage's ``layers`` (global indices): the sum of each block's
    ``layer_flops_per_token`` (an MoE layer counting ``expert_rows_per_token`` expert rows, default top_k),
    with the embedding on the first stage and the head on the last."""
    embedding, head = edge_costs(cfg)
    # Layers of one kind (window, MoE or not) cost the same: counted once a kind, as the search asks
    # this for every layout it tries.
    kinds: dict[tuple, list[int]] = {}
    for i in layers:
        kinds.setdefault((cfg.window_of(i), cfg.is_moe_layer(i)), []).append(i)
    blocks = sum(len(ids) * layer_flops_per_token(cfg, ids[0], seq, expert_rows_per_token) for ids in kinds.values())
    return blocks + (embedding if first else 0.0) + (head if last else 0.0)


def router_flops_per_token(cfg: ModelConfig, layers: range) -> float:
    """The MoE routers' forward FLOPs per token in ``layers``: [h] @ [h, E] per MoE layer."""
    return 2 * cfg.hidden * cfg.num_experts * sum(cfg.is_moe_layer(i) for i in layers)


def _tp_collectives(cfg, layout: Layout, seq: int, layers: range, first: bool, last: bool, m: int, elem: int) -> list:
    """The tp group's messages (module docstring): plain, or sequence-parallel, and the experts'."""
    tp, again = layout.tp, 1 if layout.recompute == "full" else 0
    tokens = layout.micro_batch * seq
    activation = tokens * cfg.hidden * elem
    moe = sum(cfg.is_moe_layer(i) for i in layers)
    dense = len(layers) - moe
    out = []
    if layout.sequence_parallel:
        out.append(
            Collective(
                "tp",
                "all_gather",
                activation,
                (2 * (3 + again) * dense + (5 + 2 * again) * moe) * m,
                "SP f: before QKV and fc1 (forward; again backward), output grads; MoE input",
            )
        )
        out.append(
            Collective(
                "tp",
                "reduce_scatter",
                activation,
                (2 * (2 + again) * dense + (2 + again) * moe) * m,
                "SP g: after the output projection and fc2, and the input grads",
            )
        )
        out.append(Collective("tp", "all_reduce", 2 * norm_params(cfg) * elem, len(layers) * m, "SP norm grads"))
        if first:
            out.append(Collective("tp", "all_gather", activation, m, "SP embedding grad"))
        if last:
            out.append(Collective("tp", "all_gather", activation, m, "SP final norm output"))
            out.append(Collective("tp", "all_reduce", norm_params(cfg) * elem, m, "SP final norm grads"))
    else:
        out.append(
            Collective(
                "tp",
                "all_reduce",
                activation,
                ((4 + 2 * again) * dense + (2 + again) * moe) * m,
                "f/g of attention and MLP",
            )
        )
    if moe:
        routing = Routing.bound(cfg, tokens, layout.ep)
        local = cfg.num_experts // layout.ep
        out.append(
            Collective(
                "tp",
                "all_reduce",
                math.ceil(routing.received / local) * cfg.hidden * elem,
                moe * local * (2 + again) * m,
                "f/g of each local expert on its rows",
            )
        )
    if first:
        out.append(Collective("tp", "all_reduce", activation, m, "vocab-parallel embedding"))
    if last:
        out.append(Collective("tp", "all_reduce", activation, m, "LM head input gradient"))
        out.append(Collective("tp", "all_reduce", tokens * elem, m, "loss row max"))
        out.append(Collective("tp", "all_reduce", 2 * tokens * elem, m, "loss sum-exp and target logit"))
    if cfg.n_kv_heads < tp:
        # ColumnParallelLinear._add_param_grads: one all-reduce per K and V segment (and per bias), its replica f.
        columns = cfg.head_dim * kv_heads_local(cfg, tp)
        replicas = tp // cfg.n_kv_heads
        out.append(
            Collective(
                "tp",
                "all_reduce",
                cfg.hidden * columns * elem,
                2 * len(layers) * m,
                "replicated K/V weight grads",
                ranks=replicas,
            )
        )
        if cfg.bias:
            out.append(
                Collective(
                    "tp", "all_reduce", columns * elem, 2 * len(layers) * m, "replicated K/V bias grads", ranks=replicas
                )
            )
    return out


def stage_collectives(
    cfg: ModelConfig,
    layout: Layout,
    seq: int,
    layers: range,
    first: bool,
    last: bool,
    micro_batches: int,
    elem: int,
    grad_bytes: int,
) -> list[Collective]:
    """Every collective one rank of a stage issues in a step, with its size and count."""
    tp, ep, m = layout.tp, layout.ep, micro_batches
    tokens = layout.micro_batch * seq
    activation = tokens * cfg.hidden * elem
    moe = sum(cfg.is_moe_layer(i) for i in layers)
    again = 1 if layout.recompute == "full" else 0
    out = _tp_collectives(cfg, layout, seq, layers, first, last, m, elem) if tp > 1 else []
    if moe and ep > 1:
        routing = Routing.bound(cfg, tokens, ep)
        piece = min(tokens * min(cfg.top_k, cfg.num_experts // ep), math.ceil(routing.received / ep))
        counts_bytes = (cfg.top_k * cfg.num_experts + cfg.num_experts + 1) * 8
        out.append(Collective("ep", "all_gather", counts_bytes * ep, moe * (1 + again) * m, "MoE routing counts"))
        out.append(
            Collective(
                "ep",
                "all_to_all",
                ep * piece * cfg.hidden * elem,
                moe * (4 + 2 * again) * m,
                "MoE dispatch and combine, forward and backward",
            )
        )
    if layout.pp > 1:
        out.append(
            Collective(
                "pp",
                "p2p",
                activation // (tp if layout.sequence_parallel else 1),
                2 * m * layout.virtual_stages,
                "activation forward, gradient backward (per chunk)",
            )
        )
        out.append(Collective("pp", "all_reduce", 16, 2, "loss broadcast, grad norm", False))
        if cfg.tie_embeddings and (first or last):  # pipeline/tied.py: the two copies' gradients summed
            out.append(
                Collective(
                    "pp",
                    "all_reduce",
                    vocab_rows(cfg, tp) * cfg.hidden * grad_bytes,
                    1,
                    "tied embedding grads, first and last stage",
                    False,
                    ranks=2,
                )
            )
    experts = expert_params(cfg, tp, layers, ep) * grad_bytes
    for group, size, grads, what in (
        ("dp", layout.dp, stage_params(cfg, tp, layers, first, last, ep) * grad_bytes - experts, "gradient buckets"),
        ("expert_dp", layout.dp // ep, experts, "expert gradient buckets"),
    ):
        if size > 1 and grads > 0:
            buckets = max(1, math.ceil(grads / DEFAULT_BUCKET_BYTES))
            out.append(Collective(group, "all_reduce", math.ceil(grads / buckets), buckets, what, False))
    if layout.dp > 1:
        out.append(Collective("dp", "all_reduce", 8, 2, "token count, loss", False))
    if tp > 1:
        out.append(Collective("tp", "all_reduce", 16, 1, "grad norm (dense and expert sums)", False))
    if moe and ep > 1:
        out.append(Collective("ep", "all_reduce", 16, 1, "expert grad norm (dense and expert sums)", False))
    out.append(Collective("world", "all_reduce", 8, 1, "gradients finite", False))
    return out


def stage_ranges(counts: list[int]) -> list[range]:
    """Contiguous layer indices from layers per stage (or chunk)."""
    starts = numpy.cumsum([0, *counts])
    return [range(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def predict(
    cfg: ModelConfig, layout: Layout, global_batch: int, seq: int, cluster, calibration=None, layers=None
) -> Prediction:
    """The layout's step time, its parts and memory per stage. ``layers``: blocks per chunk, pp *
    virtual_stages of them (default: the engine's balanced split, ``balanced_layers``). The layout's
    sequence_parallel replaces the config's."""
    cfg = replace(cfg, sequence_parallel=layout.sequence_parallel)
    precision = cluster.precision
    saved = ENGINE if cluster.compute_units is not None else ENGINE_ON_GPU  # CPU nodes name their cores
    per_node = min(layout.world, cluster.devices_per_node)
    network = calibration.network(cluster, layout.tp) if calibration is not None else Network.of_cluster(cluster)
    mem_bw = calibration.mem_bw if calibration is not None and calibration.mem_bw else cluster.rank_mem_bw(per_node)
    m = global_batch // (layout.dp * layout.micro_batch)
    v = layout.virtual_stages
    chunks = stage_ranges(layers or [len(r) for r in balanced_layers(cfg, layout.pp, virtual_stages=v)])
    ranges = [rank_layers(chunks, layout.pp, s) for s in range(layout.pp)]  # each rank's layers

    # Stages with the same layer count, MoE layers and role cost the same: each kind is computed once.
    def kind(s):
        return len(ranges[s]), sum(cfg.is_moe_layer(i) for i in ranges[s]), s == 0, s == layout.pp - 1

    kinds, stage_times = {}, []
    for s, stage_layers in enumerate(ranges):
        if kind(s) not in kinds:
            k = kinds[kind(s)] = _stage(
                cfg, layout, seq, m, stage_layers, s, cluster, calibration, network, mem_bw, per_node
            )
            k["memory"] = stage_memory(
                cfg,
                layout.tp,
                layout.pp,
                s,
                stage_layers,
                layout.micro_batch,
                seq,
                m,
                layout.schedule,
                layout.recompute,
                precision,
                saved,
                layout.ep,
                layout.optimizer_shards,
            )
            k["stage"] = s  # the first of its kind holds the most micro-batches in flight
        stage_times.append(kinds[kind(s)]["micro"])

    slowest = max(range(len(ranges)), key=lambda s: stage_times[s])
    pipeline = sum(stage_times) / v + (m - 1 / v) * stage_times[slowest]
    worst = kinds[kind(slowest)]
    dp_s = max(k["after"] for k in kinds.values())
    update_s = max(k["update"] for k in kinds.values())
    step = pipeline + dp_s + update_s
    model_flops = 3 * forward_flops_per_token(cfg, seq, range(cfg.n_layers), True, True) * global_batch * seq
    memory = {k["stage"]: k["memory"] for k in kinds.values()}
    comm = worst["in_pipeline"]
    return Prediction(
        layout,
        step,
        worst["compute"],
        comm["tp"],
        comm["pp"],
        dp_s,
        pipeline - m * stage_times[slowest],
        update_s,
        global_batch * seq / step,
        model_flops / step / layout.world,
        memory,
        [len(r) for r in ranges],
        worst["comms"],
        comm["ep"],
        [kinds[kind(s)]["comms"] for s in range(layout.pp)],
    )


def _stage(
    cfg, layout: Layout, seq: int, m: int, layers: range, stage: int, cluster, calibration, network, mem_bw, per_node
) -> dict:
    """One stage's compute, collectives and update time; ``micro``: one micro-batch forward + backward."""
    first, last = stage == 0, stage == layout.pp - 1
    precision, tokens = cluster.precision, layout.micro_batch * seq
    rows = Routing.bound(cfg, tokens, layout.ep).received / tokens if cfg.num_experts else None
    router = router_flops_per_token(cfg, layers) * tokens

    def per_rank(flops_per_token):
        # Every tp rank runs the whole router of each MoE layer (it is replicated): not divided by tp.
        return (flops_per_token * tokens - router) / layout.tp + router

    flops = per_rank(forward_flops_per_token(cfg, seq, layers, first, last, rows))
    # A pipeline stage computes m of the m + (pp - 1) / V stage times a step lasts and waits in the
    # rest (MPI yields the core when ranks outnumber cores): on average fewer ranks share the cores.
    busy = per_node * m / (m + (layout.pp - 1) / layout.virtual_stages)
    rate = (
        calibration.rank_flops(cluster, per_node, flops, layout.tp, busy)
        if calibration is not None
        else cluster.rank_flops(busy)
    )
    recomputed = {
        "none": 0.0,
        "full": per_rank(forward_flops_per_token(cfg, seq, layers, False, False, rows)),
        "selective": 2.0 * seq * cfg.hidden * len(layers) * tokens / layout.tp,
    }[layout.recompute]
    compute = (3 * flops + recomputed) / rate
    comms = [
        replace(
            c,
            seconds=c.count
            * network.time(
                c.op,
                c.ranks or layout.group_size(c.group),
                c.nbytes,
                layout.spans_nodes(c.group, cluster.devices_per_node),
            ),
        )
        for c in stage_collectives(
            cfg, layout, seq, layers, first, last, m, precision.activation_bytes, precision.grad_bytes
        )
    ]
    if layout.tp > 1 and network.wait:
        comms.append(
            Collective(
                "tp",
                "wait",
                0,
                m,
                "waiting for tp partners (calibrated, per compute)",
                seconds=network.wait * compute * m,
            )
        )
    in_pipeline = {g: sum(c.seconds for c in comms if c.group == g and c.per_micro_batch) for g in ("tp", "pp", "ep")}
    params = stage_params(cfg, layout.tp, layers, first, last, layout.ep)
    return dict(
        compute=compute * m,
        comms=comms,
        in_pipeline=in_pipeline,
        after=sum(c.seconds for c in comms if not c.per_micro_batch),
        micro=compute + sum(in_pipeline.values()) / m,
        update=UPDATE_PASSES
        * _update_bytes(params, expert_params(cfg, layout.tp, layers, layout.ep), precision, layout)
        / mem_bw,
    )


def _update_bytes(params: int, experts: int, precision, layout: Layout) -> float:
    """Bytes the optimizer step streams: the gradients and states of the elements this rank owns
    (all of them without ZeRO; ``sharded_elements``) and every parameter it writes."""
    owned = sharded_elements(params, experts, layout.optimizer_shards, layout.ep)
    return params * precision.param_bytes + owned * (precision.grad_bytes + precision.optimizer_bytes)
