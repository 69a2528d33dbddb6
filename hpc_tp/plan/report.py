"""A plan as text for people and as JSON for scripts."""

from __future__ import annotations

from dataclasses import asdict

from .memory import kv_cache_bytes, stage_params
from .search import GiB, Plan, divisors

KIND_WORDS = {
    "memory": "do not fit in memory",
    "heads": "heads or MLP width not divisible by tp",
    "layers": "more stages than layers",
    "batch": "global batch not divisible by dp",
    "sequence": "sequence not divisible by tp (sequence parallelism)",
    "experts": "experts not divisible by ep",
    "nodes": "tp across nodes while tp inside one fits",
}


def _count(x: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


def describe_cluster(cluster, gpus: int) -> str:
    p = cluster.precision
    return (
        f"{gpus} devices of {cluster.name}: {cluster.devices_per_node} per node, "
        f"{cluster.device_mem / GiB:.1f} GiB, "
        f"{cluster.device_flops / 1e12:.4g} TFLOP/s peak x {cluster.gemm_efficiency:.2f} GEMM efficiency, "
        f"{cluster.intra_bw / 1e9:.4g} GB/s inside a node, {cluster.inter_bw / 1e9:.4g} GB/s per device across "
        f"nodes; {p.name}: {p.training_bytes_per_param} bytes per parameter, {p.activation_bytes} per activation"
    )


def format_plan(
    plan: Plan,
    cfg,
    model: str,
    cluster,
    gpus: int,
    global_batch: int,
    seq: int,
    calibration=None,
    top: int = 8,
    serve_batch: int | None = None,
    placed: list | None = None,
) -> str:
    """``placed``: the top layout under each placement (``placement.compare_placements``), fastest first."""
    lines = [
        f"hpc-tp plan: {model} ({_count(cfg.parameter_count())} parameters, {cfg.n_layers} layers, hidden "
        f"{cfg.hidden}, {cfg.n_heads} heads) on {describe_cluster(cluster, gpus)}",
        f"  global batch {global_batch} x {seq} tokens; "
        + (f"calibrated: {calibration.describe()}" if calibration is not None else "datasheet numbers, no calibration"),
    ]
    if plan.ranked:
        shown = plan.ranked[:top]
        width = max(40, *(len(p.layout.describe(chunks=False)) for p in shown))
        lines.append(
            f"  {'#':>3}  {'layout':<{width}} {'V':>2} {'step s':>9} {'tokens/s':>9} {'TFLOP/s/dev':>11} "
            f"{'GiB/dev (states + act)':>24} {'bubble':>7}"
        )
        for i, p in enumerate(shown, 1):
            stage = max(p.memory, key=lambda s: p.memory[s].total)
            m = p.memory[stage]
            memory = f"{m.total / GiB:.1f} ({m.model_states / GiB:.1f} + {(m.total - m.model_states) / GiB:.1f})"
            lines.append(
                f"  {i:>3}  {p.layout.describe(chunks=False):<{width}} {p.layout.chunks_shown:>2} "
                f"{p.step_s:>9.4g} {_count(p.tokens_per_s):>9} {p.model_flops_per_device / 1e12:>11.4g} "
                f"{memory:>24} {p.bubble_s / p.step_s * 100:>6.1f}%"
            )
        best = plan.ranked[0]
        ep = f"ep {best.ep_s:.4g} s, " if best.ep_s else ""
        lines.append(
            f"  top plan, busiest stage, per step: compute {best.compute_s:.4g} s, tp {best.tp_s:.4g} s, "
            f"pp {best.pp_s:.4g} s, {ep}bubble {best.bubble_s:.4g} s, dp and step reductions {best.dp_s:.4g} s, "
            f"update {best.update_s:.4g} s; layers per stage {best.layers}"
            + (f" in {best.layout.virtual_stages} chunks each" if best.layout.virtual_stages > 1 else "")
        )
        for c in best.collectives:
            lines.append(
                f"    {c.group:<5} {c.op:<10} {c.nbytes / 2**20:>10.3f} MiB x {c.count:<6} {c.seconds:>9.4g} s"
                f"  {c.what}"
            )
        if placed:
            lines.append(f"  the top layout on nodes of {cluster.devices_per_node}, by placement (fastest first):")
            lines += [f"    {p.describe()}" for p in placed]
    else:
        lines.append("  no feasible layout")
    if plan.rejected:
        counts = ", ".join(f"{n} {KIND_WORDS[k]}" for k, n in plan.reasons().items())
        lines.append(f"  rejected {len(plan.rejected)} of {plan.considered + _structural(plan)}: {counts}")
        for kind in plan.reasons():
            mine = sorted((r for r in plan.rejected if r.kind == kind), key=lambda r: r.need_bytes)
            for r in mine[:2]:  # for memory, the nearest misses
                shown = " ".join(f"{k}={v}" for k, v in r.layout.items())
                lines.append(f"    {shown}: {r.reason}")
    if serve_batch:
        lines.append(f"  serving {serve_batch} sequences of {seq} tokens (weights + KV cache per device, pp=1):")
        for tp in divisors(min(gpus, cluster.devices_per_node)):
            if cfg.n_heads % tp or cfg.ffn_hidden % tp:
                continue
            weights = stage_params(cfg, tp, range(cfg.n_layers), True, True) * cluster.precision.param_bytes
            kv = kv_cache_bytes(cfg, tp, cfg.n_layers, serve_batch, seq, cluster.precision.activation_bytes)
            fits = "fits" if weights + kv <= cluster.device_mem else "does not fit"
            lines.append(f"    tp={tp:<4} {weights / GiB:8.2f} + {kv / GiB:8.2f} GiB  {fits}")
    return "\n".join(lines)


def _structural(plan: Plan) -> int:
    return sum(1 for r in plan.rejected if r.kind not in ("memory", "nodes"))  # those two were considered


def plan_json(
    plan: Plan, cfg, model: str, cluster, gpus: int, global_batch: int, seq: int, placed: list | None = None
) -> dict:
    def prediction(p):
        return {
            **asdict(p.layout),
            "step_s": p.step_s,
            "compute_s": p.compute_s,
            "tp_s": p.tp_s,
            "pp_s": p.pp_s,
            "ep_s": p.ep_s,
            "dp_s": p.dp_s,
            "bubble_s": p.bubble_s,
            "update_s": p.update_s,
            "tokens_per_s": p.tokens_per_s,
            "model_flops_per_device": p.model_flops_per_device,
            "peak_memory_bytes": p.peak_memory,
            "layers_per_stage": p.layers,
            "memory": {str(s): asdict(m) for s, m in p.memory.items()},
            "collectives": [asdict(c) for c in p.collectives],
        }

    return {
        "model": model,
        "config": cfg.to_dict(),
        "gpus": gpus,
        "global_batch": global_batch,
        "seq_len": seq,
        "cluster": asdict(cluster),
        "ranked": [prediction(p) for p in plan.ranked],
        "rejected": [{**r.layout, "reason": r.reason, "kind": r.kind} for r in plan.rejected],
        "placements": [
            {
                "placement": p.prediction.layout.placement,
                "step_s": p.prediction.step_s,
                "bytes_between_nodes": p.bytes_between_nodes,
                "tp_spans_nodes": p.tp_spans_nodes,
            }
            for p in placed or []
        ],
    }
