"""Pipeline bubble: the measured idle fraction of every stage against the textbook formula.

With p equal stages and m micro-batches, GPipe (and 1F1B, which only reorders the work) keeps
each stage idle for p - 1 of the m + p - 1 slots a step lasts: an idle fraction of
(p-1)/(m+p-1), i.e. a bubble of (p-1)/m of the useful time. With V virtual stages per rank
(interleaved 1F1B) a slot is a pass through one chunk, 1/V of a stage, and the step lasts
V m + p - 1 of them: idle (p-1)/(V m+p-1), a bubble of (p-1)/(V m). A step is timed between two
world barriers; a stage's busy time is its forward and backward compute (its tp collectives
included), the rest of the step it waits on its neighbours or on the step's end. The chunk split
is the balanced default, so the head's cost on the last chunk is spread as well as whole layers
allow; what remains unequal shows up as extra idle time on the cheaper stages.

Several V are measured in one run, their steps alternating, so a slow spell of a noisy machine
falls on all of them alike.
"""

from __future__ import annotations

import argparse
from statistics import median
from time import perf_counter

import numpy

from ..errors import ConfigError


def bubble_formula(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a stage with equal chunk costs: (p-1)/(V m+p-1)."""
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


def measure_bubble(
    cfg,
    grid,
    micro_batches: int,
    micro_batch: int,
    seq_len: int,
    schedule: str = "gpipe",
    repeats: int = 3,
    warmup: int = 1,
    dtype: str = "float32",
    seed: int = 0,
    virtual_stages=(1,),
) -> list[dict]:
    """One record per stage and V in ``virtual_stages`` (the same list on every rank): measured idle
    fraction (median over repeats), the formula's, and the stage's busy and step seconds."""
    # loaded when the command runs, not by hpc-tp --help
    from ..pipeline import PipelineStats, build_stage, pipeline_forward_backward

    models = {v: build_stage(cfg, grid, dtype, seed, virtual_stages=v) for v in virtual_stages}
    rng = numpy.random.default_rng(seed)
    batches = [
        (
            rng.integers(0, cfg.vocab_size, (micro_batch, seq_len)),
            rng.integers(0, cfg.vocab_size, (micro_batch, seq_len)),
        )
        for _ in range(micro_batches)
    ]
    scale = 1.0 / (micro_batches * micro_batch * seq_len)
    samples = {v: ([], [], []) for v in models}  # idle, busy, step
    for repeat in range(warmup + repeats):
        for v, model in models.items():
            stats = PipelineStats()
            grid.world.barrier()
            t0 = perf_counter()
            pipeline_forward_backward(model, batches, grid, scale, schedule, step=repeat, stats=stats)
            grid.world.barrier()
            seconds = perf_counter() - t0
            model.zero_grad()
            if repeat >= warmup:
                for kept, value in zip(samples[v], (1.0 - stats.busy_seconds / seconds, stats.busy_seconds, seconds)):
                    kept.append(value)
    mine = [
        dict(
            virtual_stages=v,
            stage=grid.coords.pp,
            layers=len(model.layer_ids),
            idle=median(samples[v][0]),
            formula=bubble_formula(grid.pp_size, micro_batches, v),
            busy_s=median(samples[v][1]),
            step_s=median(samples[v][2]),
        )
        for v, model in models.items()
    ]
    records = [r for stage in grid.pp.allgather_object(mine) for r in stage]
    return sorted(records, key=lambda r: (r["virtual_stages"], r["stage"]))


def report_lines(records: list[dict], pp: int, micro_batches: int, schedule: str) -> list[str]:
    lines = []
    for r in records:
        v = r["virtual_stages"]
        if r["stage"] == 0:
            lines.append(
                f"{schedule}, pp={pp}, V={v}, m={micro_batches}: formula idle (p-1)/(V*m+p-1) = "
                f"{r['formula']:.3f}, bubble (p-1)/(V*m) = {(pp - 1) / (v * micro_batches):.3f}"
            )
        lines.append(
            f"  stage {r['stage']} ({r['layers']} layers): idle {r['idle']:.3f} measured, "
            f"busy {r['busy_s'] * 1e3:.1f} ms of a {r['step_s'] * 1e3:.1f} ms step"
        )
    return lines


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--model", default="demo", help="preset name or JSON config (default %(default)s)")
    parser.add_argument("--pp", type=int, help="pipeline stages (default: the world size; tp = world / pp)")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step (default %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch (default %(default)s)")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default %(default)s)")
    parser.add_argument(
        "--schedule",
        default="gpipe",
        choices=("gpipe", "1f1b"),
        help="default %(default)s; 1f1b with a virtual-stage count > 1 is interleaved 1F1B",
    )
    parser.add_argument(
        "--virtual-stages",
        default="1",
        metavar="V[,V...]",
        help="chunks per rank, e.g. 1,2 to measure both in one run, steps alternating (default %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (default %(default)s)")


def run(args) -> int:
    # loaded when the command runs, not by hpc-tp --help
    from ..comm.mpi import world
    from ..grid import ProcessGrid
    from ..launch import check_launch
    from ..models import load_config
    from ..pipeline.partition import parse_virtual_stages

    for flag in ("micro_batches", "micro_batch", "seq_len", "repeats"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected a positive whole number")
    virtual_stages = parse_virtual_stages(args.virtual_stages)
    check_launch()
    comm = world()
    pp = args.pp or comm.size
    if pp < 1 or comm.size % pp:
        raise ConfigError(f"--pp {pp}: expected a divisor of the world size {comm.size}")
    grid = ProcessGrid(tp=comm.size // pp, pp=pp, dp=1, world=comm)
    cfg = load_config(args.model, vocab_size=258)
    records = measure_bubble(
        cfg,
        grid,
        args.micro_batches,
        args.micro_batch,
        args.seq_len,
        args.schedule,
        repeats=args.repeats,
        virtual_stages=virtual_stages,
    )
    if comm.rank == 0:
        print("\n".join(report_lines(records, pp, args.micro_batches, args.schedule)))
    return 0
