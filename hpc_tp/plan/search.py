"""Search every layout of a world, reject the impossible ones with a reason, rank the rest.

A layout is (tp, pp, dp) with tp * pp * dp = world, a micro-batch that divides each dp rank's
share of the global batch, full recomputation on or off, and (for pp > 1) GPipe or 1F1B. The
reasons a layout is rejected are the ones the engine itself would stop with, found before any
rank starts: heads (or KV groups, or the MLP width) that tp does not divide, more stages than
layers, a global batch that dp does not divide, and memory beyond the device's. The feasible
ones are ranked by predicted step time (then by memory); ``choose_layout`` returns the first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from ..grid import factorizations
from ..models.config import ModelConfig
from ..nn.attention import heads_fit
from ..pipeline.partition import balanced_layers
from .cost import Layout, Prediction, predict

GiB = 2**30


@dataclass(frozen=True)
class Rejected:
    layout: dict   # the fields decided when it was rejected (tp, pp, dp, and more for memory)
    reason: str
    kind: str      # heads, layers, batch, memory
    need_bytes: int = 0  # memory: what the busiest device would need


@dataclass
class Plan:
    ranked: list = field(default_factory=list)     # Prediction, fastest first
    rejected: list = field(default_factory=list)   # Rejected
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


def search(cfg: ModelConfig, world: int, global_batch: int, seq: int, cluster, calibration=None,
           micro_batches=None, recompute=(False, True), schedules=("1f1b", "gpipe")) -> Plan:
    """Every layout of ``world`` ranks; ``micro_batches``: the sizes to try (default: every divisor)."""
    if seq > cfg.max_seq_len and cfg.position == "learned":
        raise ConfigError(f"--seq-len {seq} is longer than the model's learned positions (max_seq_len "
                          f"{cfg.max_seq_len})")
    plan, splits = Plan(), {}
    for tp, pp, dp in factorizations(world):
        base = dict(tp=tp, pp=pp, dp=dp)
        why = structural_reason(cfg, tp, pp, dp, global_batch)
        if why is not None:
            plan.rejected.append(Rejected(base, why[1], why[0]))
            continue
        if pp not in splits:
            splits[pp] = [len(r) for r in balanced_layers(cfg, pp)]
        for micro in divisors(global_batch // dp):
            if micro_batches is not None and micro not in micro_batches:
                continue
            for again in recompute:
                for schedule in schedules if pp > 1 else schedules[:1]:
                    layout = Layout(tp, pp, dp, micro, again, schedule)
                    plan.considered += 1
                    p = predict(cfg, layout, global_batch, seq, cluster, calibration, splits[pp])
                    if p.peak_memory > cluster.device_mem:
                        worst = max(p.memory, key=lambda s: p.memory[s].total)
                        plan.rejected.append(Rejected(
                            {**base, "micro_batch": micro, "recompute": again, "schedule": schedule},
                            f"does not fit: stage {worst} needs {p.peak_memory / GiB:.1f} GiB of "
                            f"{cluster.device_mem / GiB:.1f} GiB", "memory", p.peak_memory))
                    else:
                        plan.ranked.append(p)
    plan.ranked.sort(key=lambda p: (p.step_s, p.peak_memory))
    return plan


def explain(best: Prediction, plan: Plan) -> str:
    """One line: why the top plan won."""
    parts = [f"fastest of {len(plan.ranked)} feasible layouts ({len(plan.rejected)} rejected)",
             f"predicted step {best.step_s:.4g} s: compute {best.compute_s:.3g}, tp {best.tp_s:.3g}, "
             f"pp {best.pp_s:.3g}, bubble {best.bubble_s:.3g}, dp {best.dp_s:.3g}, update {best.update_s:.3g}",
             f"{best.peak_memory / GiB:.2f} GiB per device"]
    if len(plan.ranked) > 1:
        runner = plan.ranked[1]
        parts.append(f"next {runner.layout.describe()} at {runner.step_s:.4g} s")
    return "; ".join(parts)


def choose_layout(cfg: ModelConfig, world_size: int, global_batch: int, seq_len: int, cluster="cpu-2core",
                  calibration=None) -> dict:
    """The top plan as the trainer's settings: tp, pp, dp, micro_batch, recompute, schedule, reason.
    ``cluster``: a preset name or a ``Cluster``; ``calibration``: a ``Calibration`` or JSON paths."""
    from .calibration import Calibration, load_calibration
    from .clusters import get_cluster

    cluster = get_cluster(cluster) if isinstance(cluster, str) else cluster
    if calibration is not None and not isinstance(calibration, Calibration):
        calibration = load_calibration([calibration] if isinstance(calibration, str) else calibration)
    plan = search(cfg, world_size, global_batch, seq_len, cluster, calibration)
    if not plan.ranked:
        counts = ", ".join(f"{n} {kind}" for kind, n in plan.reasons().items())
        example = min(plan.rejected, key=lambda r: r.kind != "memory").reason if plan.rejected else "none"
        raise ConfigError(f"no layout of {world_size} ranks can train {cfg.n_layers} layers of hidden {cfg.hidden} "
                          f"with global batch {global_batch}: rejected {counts} (e.g. {example})")
    best = plan.ranked[0]
    lay = best.layout
    return dict(tp=lay.tp, pp=lay.pp, dp=lay.dp, micro_batch=lay.micro_batch, recompute=lay.recompute,
                schedule=lay.schedule, reason=explain(best, plan))
