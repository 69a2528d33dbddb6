"""Search every layout of a world, reject the impossible ones with a reason, rank the rest.

A layout is (tp, pp, dp) with tp * pp * dp = world, a micro-batch that divides each dp rank's
share of the global batch, full recomputation on or off, (for pp > 1) GPipe or 1F1B, sequence
parallelism on or off (for tp > 1), and for MoE models an expert-parallel size ep that divides
dp (``grid.py`` carves ep out of dp). The reasons a layout is rejected are the ones the engine
itself would stop with, found before any rank starts: heads (or KV groups, or the MLP width)
that tp does not divide, more stages than layers, a global batch that dp does not divide, a
sequence that tp does not divide under sequence parallelism, experts that ep does not divide,
and memory beyond the device's; a tp group spanning nodes is rejected too while a layout with tp inside a
node fits. The feasible ones are ranked by predicted step time (then by
memory); ``choose_layout`` returns the first of those the trainer can run from its settings,
interleaved 1F1B (V > 1 chunks per rank) included where the engine runs it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import ConfigError
from ..grid import factorizations
from ..models.config import ModelConfig
from ..nn.attention import heads_fit
from ..pipeline.partition import balanced_layers
from .calibration import Calibration, load_calibration
from .clusters import get_cluster
from .cost import Layout, Prediction, predict

GiB = 2**30
# The chunk counts per rank ``choose_layout`` tries by default. Each step up shrinks the bubble by
# less ((p-1)/(V m)) while the p2p messages grow V-fold, so past 4 the search grows for little.
AUTO_VIRTUAL_STAGES = (1, 2, 3, 4)


@dataclass(frozen=True)
class Rejected:
    layout: dict  # the fields decided when it was rejected (tp, pp, dp, and more for memory)
    reason: str
    kind: str  # heads, layers, batch, sequence, experts, memory, nodes
    need_bytes: int = 0  # memory: what the busiest device would need


@dataclass
class Plan:
    ranked: list = field(default_factory=list)  # Prediction, fastest first
    rejected: list = field(default_factory=list)  # Rejected
    considered: int = 0

    def reasons(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.rejected:
            counts[r.kind] = counts.get(r.kind, 0) + 1
        return counts


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def structural_reason(cfg: ModelConfig, tp: int, pp: int, dp: int, global_batch: int) -> tuple[str, str] | None:
    """Why the engine cannot run this (tp, pp, dp) at all, or None."""
    if not heads_fit(cfg.n_heads, cfg.n_kv_heads, tp):
        return "heads", (f"{cfg.n_heads} heads ({cfg.n_kv_heads} kv heads) are not divisible by tp={tp}")
    if cfg.ffn_hidden % tp:
        return "heads", f"MLP width {cfg.ffn_hidden} is not divisible by tp={tp}"
    if pp > cfg.n_layers:
        return "layers", f"pp={pp} is more stages than the model's {cfg.n_layers} layers"
    if global_batch % dp:
        return "batch", f"global batch {global_batch} is not divisible by dp={dp}"
    return None


def variant_reason(
    cfg: ModelConfig, tp: int, dp: int, seq: int, sequence_parallel: bool, ep: int
) -> tuple[str, str] | None:
    """Why the engine cannot run sequence parallelism or this ep on a (tp, pp, dp) it can run, or None."""
    if sequence_parallel and seq % tp:
        return "sequence", f"sequence length {seq} is not divisible by tp={tp} with sequence parallelism"
    if ep > 1 and dp % ep:
        return "experts", f"ep={ep} does not divide dp={dp} (expert parallelism is carved out of dp)"
    if ep > 1 and cfg.num_experts % ep:
        return "experts", f"num_experts={cfg.num_experts} is not divisible by ep={ep}"
    return None


def variants(cfg: ModelConfig, tp: int, dp: int, sequence_parallel, eps):
    """(sp, ep) pairs worth trying: at tp = 1 sequence parallelism is off whatever was asked (the
    engine runs such a model as plain tp=1, so asking for it must not drop the layout); ep > 1 only
    for MoE models; ``eps`` None: every divisor of dp."""
    for sp in dict.fromkeys(asked and tp > 1 for asked in sequence_parallel):
        for ep in (divisors(dp) if eps is None else eps) if cfg.num_experts else (1,):
            yield sp, ep


def search(
    cfg: ModelConfig,
    world: int,
    global_batch: int,
    seq: int,
    cluster,
    calibration=None,
    micro_batches=None,
    recompute=("none", "selective", "full"),
    schedules=("1f1b", "gpipe"),
    sequence_parallel=(False, True),
    eps=None,
    distributed_optimizer: bool = False,
    virtual_stages=(1,),
    placement: str = "block",
) -> Plan:
    """Every layout of ``world`` ranks; ``micro_batches``: the sizes to try (default: every divisor);
    ``sequence_parallel``: the settings to try; ``eps``: the expert-parallel sizes (default: every
    divisor of dp, for MoE models); ``distributed_optimizer``: ZeRO-1 wherever dp > 1;
    ``virtual_stages``: the chunk counts per rank to try with 1F1B, where the engine runs them
    (pp > 1, pp * V <= layers, micro-batches a multiple of pp); ``placement``: how the launcher
    deals ranks to nodes (``cost.PLACEMENTS``)."""
    if seq > cfg.max_seq_len and cfg.position == "learned":
        raise ConfigError(
            f"--seq-len {seq} is longer than the model's learned positions (max_seq_len {cfg.max_seq_len})"
        )
    plan, splits = Plan(), {}
    for tp, pp, dp in factorizations(world):
        base = dict(tp=tp, pp=pp, dp=dp)
        why = structural_reason(cfg, tp, pp, dp, global_batch)
        if why is not None:
            plan.rejected.append(Rejected(base, why[1], why[0]))
            continue
        for sp, ep in variants(cfg, tp, dp, sequence_parallel, eps):
            variant = {**base, "sequence_parallel": sp, "ep": ep}
            why = variant_reason(cfg, tp, dp, seq, sp, ep)
            if why is not None:
                plan.rejected.append(Rejected(variant, why[1], why[0]))
                continue
            for micro in divisors(global_batch // dp):
                if micro_batches is not None and micro not in micro_batches:
                    continue
                for again in recompute:
                    for schedule in schedules if pp > 1 else schedules[:1]:
                        for v in chunk_counts(cfg, pp, global_batch // (dp * micro), schedule, virtual_stages):
                            if (pp, v) not in splits:
                                splits[pp, v] = [len(r) for r in balanced_layers(cfg, pp, virtual_stages=v)]
                            layout = Layout(
                                tp,
                                pp,
                                dp,
                                micro,
                                again,
                                schedule,
                                sp,
                                ep,
                                distributed_optimizer and dp > 1,
                                v,
                                placement,
                            )
                            _consider(plan, cfg, layout, global_batch, seq, cluster, calibration, splits[pp, v])
    _keep_tp_inside_nodes(plan, cluster.devices_per_node)
    plan.ranked.sort(key=lambda p: (p.step_s, p.peak_memory))
    return plan


def _keep_tp_inside_nodes(plan: Plan, devices_per_node: int):
    """A tp group across nodes all-reduces over the network twice per layer, forward and backward: such
    a layout is never proposed while one with tp inside a node fits, whatever the cost model (with an
    optimistic inter-node bandwidth, or a calibration from one node) predicts for it."""
    spanning = [p for p in plan.ranked if p.layout.spans_nodes("tp", devices_per_node)]
    if not spanning or len(spanning) == len(plan.ranked):
        return
    plan.ranked = [p for p in plan.ranked if not p.layout.spans_nodes("tp", devices_per_node)]
    plan.rejected += [
        Rejected(
            asdict(p.layout),
            f"tp={p.layout.tp} spans nodes of {devices_per_node} devices, and a layout with tp inside a node fits "
            f"(predicted {p.step_s:.4g} s)",
            "nodes",
        )
        for p in spanning
    ]


def chunk_counts(cfg, pp: int, micro_batches: int, schedule: str, virtual_stages) -> list[int]:
    """The V of ``virtual_stages`` the engine can run for this layout (V = 1 always)."""
    interleaves = pp > 1 and schedule == "1f1b" and micro_batches % pp == 0
    return [v for v in virtual_stages if v == 1 or (interleaves and pp * v <= cfg.n_layers)]


def _consider(plan: Plan, cfg, layout: Layout, global_batch: int, seq: int, cluster, calibration, split):
    plan.considered += 1
    p = predict(cfg, layout, global_batch, seq, cluster, calibration, split)
    if p.peak_memory <= cluster.device_mem:
        plan.ranked.append(p)
        return
    worst = max(p.memory, key=lambda s: p.memory[s].total)
    plan.rejected.append(
        Rejected(
            asdict(layout),
            f"does not fit: stage {worst} needs {p.peak_memory / GiB:.1f} GiB of {cluster.device_mem / GiB:.1f} GiB",
            "memory",
            p.peak_memory,
        )
    )


def explain(best: Prediction, plan: Plan) -> str:
    """One line: why the top plan won."""
    parts = [
        f"fastest of {len(plan.ranked)} feasible layouts ({len(plan.rejected)} rejected)",
        f"predicted step {best.step_s:.4g} s: compute {best.compute_s:.3g}, tp {best.tp_s:.3g}, "
        f"pp {best.pp_s:.3g}, bubble {best.bubble_s:.3g}, dp {best.dp_s:.3g}, update {best.update_s:.3g}",
        f"{best.peak_memory / GiB:.2f} GiB per device",
    ]
    if len(plan.ranked) > 1:
        runner = plan.ranked[1]
        parts.append(f"next {runner.layout.describe()} at {runner.step_s:.4g} s")
    return "; ".join(parts)


def choose_layout(
    cfg: ModelConfig,
    world_size: int,
    global_batch: int,
    seq_len: int,
    cluster="cpu-2core",
    calibration=None,
    ep: int = 1,
    distributed_optimizer: bool = False,
    virtual_stages: int | None = None,
    placement: str = "block",
) -> dict:
    """The top plan as the trainer's settings: tp, pp, dp, micro_batch, recompute, schedule,
    virtual_stages, reason. ``cluster``: a preset name or a ``Cluster``; ``calibration``: a
    ``Calibration`` or JSON paths; ``ep``: the expert-parallel size the run asked for (only layouts
    whose dp it divides); ``distributed_optimizer``: whether the run shards its optimizer (its memory
    and update time); ``virtual_stages``: None tries ``AUTO_VIRTUAL_STAGES`` where the engine runs
    them, a number keeps only the layouts that run that V (so 1: no interleaving); ``placement``: how the
    launch put ranks on nodes (``cluster.devices_per_node`` of them a node)."""
    if virtual_stages is not None and (not isinstance(virtual_stages, int) or virtual_stages < 1):
        raise ConfigError(f"--virtual-stages {virtual_stages!r}: expected a positive integer")
    cluster = get_cluster(cluster) if isinstance(cluster, str) else cluster
    if calibration is not None and not isinstance(calibration, Calibration):
        calibration = load_calibration([calibration] if isinstance(calibration, str) else calibration)
    # The trainer takes sequence parallelism from the model config and ep from its own settings.
    plan = search(
        cfg,
        world_size,
        global_batch,
        seq_len,
        cluster,
        calibration,
        sequence_parallel=(cfg.sequence_parallel,),
        eps=(ep,),
        distributed_optimizer=distributed_optimizer,
        virtual_stages=AUTO_VIRTUAL_STAGES if virtual_stages is None else (virtual_stages,),
        placement=placement,
    )
    if not plan.ranked:
        counts = ", ".join(f"{n} {kind}" for kind, n in plan.reasons().items())
        rejected = (
            ""
            if not plan.rejected
            else f": rejected {counts} (e.g. {min(plan.rejected, key=lambda r: r.kind != 'memory').reason})"
        )
        # Layouts that cannot interleave are skipped, not rejected: name the rule they break.
        asked = (
            ""
            if virtual_stages in (None, 1)
            else (
                f" at --virtual-stages {virtual_stages}, which needs pp > 1 with pp x {virtual_stages} <= "
                f"{cfg.n_layers} layers and the micro-batches per step a multiple of pp"
            )
        )
        raise ConfigError(
            f"no layout of {world_size} ranks can train {cfg.n_layers} layers of hidden {cfg.hidden} "
            f"with global batch {global_batch}{asked}{rejected}"
        )
    best = plan.ranked[0]
    lay = best.layout
    return dict(
        tp=lay.tp,
        pp=lay.pp,
        dp=lay.dp,
        micro_batch=lay.micro_batch,
        recompute=lay.recompute,
        schedule=lay.schedule,
        virtual_stages=lay.virtual_stages,
        reason=explain(best, plan),
    )
