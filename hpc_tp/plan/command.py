"""``hpc-tp plan``: the layouts a model can train with on a cluster, fastest first, and why the rest cannot.

    hpc-tp plan --model gpt3-175b --gpus 1536 --cluster dgx-a100 --global-batch 1536 --seq-len 2048
    hpc-tp plan --model w1 --gpus 4 --cluster cpu-2core --calibration comm.json --calibration step.json
    mpiexec -n 4 hpc-tp plan --model tiny --set hidden=256 --validate     # predicted vs measured, here

Cluster flags override the preset's numbers. Without ``--validate`` it is arithmetic only: one
process, no MPI.
"""

from __future__ import annotations

import argparse
import json
import math

from ..errors import ConfigError
from ..paths import check_output_file


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--model", default="gpt2", help="preset name or JSON config (default %(default)s)")
    parser.add_argument(
        "--set",
        dest="model_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model config field, e.g. --set n_layers=8 (repeatable; VALUE is JSON)",
    )
    cluster = parser.add_argument_group("cluster (a preset, then any of these numbers)")
    cluster.add_argument("--cluster", default="dgx-a100", help="dgx-a100, dgx-h100 or cpu-2core (default %(default)s)")
    cluster.add_argument("--gpus", type=int, help="devices (ranks) in all (default: one node)")
    cluster.add_argument("--gpus-per-node", type=int, help="devices per node")
    cluster.add_argument("--device-mem", type=float, metavar="GiB", help="memory per device")
    cluster.add_argument("--device-flops", type=float, metavar="TFLOPS", help="peak FLOP/s per device")
    cluster.add_argument("--efficiency", type=float, help="share of the peak that large GEMMs reach")
    cluster.add_argument("--intra-bw", type=float, metavar="GB/s", help="per-device bandwidth inside a node")
    cluster.add_argument("--inter-bw", type=float, metavar="GB/s", help="per-device bandwidth across nodes")
    cluster.add_argument(
        "--placement",
        choices=("block", "cyclic"),
        default="block",
        help="how the launcher puts ranks on nodes: block, node by node (srun's and mpirun's default), or "
        "cyclic, round-robin (srun --distribution=cyclic, mpirun --map-by node) (default %(default)s)",
    )
    cluster.add_argument(
        "--precision",
        choices=("bf16", "float32", "float64"),
        help="bf16 mixed precision or the engine's one dtype (default: the preset's)",
    )
    cluster.add_argument(
        "--calibration",
        action="append",
        default=[],
        metavar="FILE",
        help="JSON of 'hpc-tp bench comm --json' or 'bench step --json' (repeatable)",
    )
    work = parser.add_argument_group("workload")
    work.add_argument("--global-batch", type=int, default=512, help="sequences per step (default %(default)s)")
    work.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's max_seq_len)")
    work.add_argument(
        "--micro-batch",
        type=int,
        action="append",
        metavar="N",
        help="only these micro-batch sizes (repeatable; default: every divisor)",
    )
    work.add_argument(
        "--ep",
        type=int,
        action="append",
        metavar="N",
        help="only these expert-parallel sizes for MoE models (repeatable; default: every divisor of dp)",
    )
    work.add_argument(
        "--sequence-parallel",
        choices=("search", "on", "off"),
        default="search",
        help="sequence parallelism at tp > 1: try both (default), always, never",
    )
    work.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="ZeRO-1 where dp > 1 (hpc-tp train --distributed-optimizer): optimizer states and masters sharded over dp",
    )
    work.add_argument(
        "--virtual-stages",
        metavar="V[,V...]",
        help="model chunks per pipeline rank to try with 1f1b (hpc-tp train --virtual-stages: "
        "interleaved 1F1B), e.g. 1,2; default 1-4 where the engine interleaves, as "
        "--plan auto does; 1: no interleaving",
    )
    work.add_argument(
        "--serve-batch",
        type=int,
        metavar="N",
        help="also show serving memory: weights and KV cache of N sequences of --seq-len, per tp",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=8, help="layouts shown (default %(default)s)")
    out.add_argument("--json", metavar="FILE", help="write the ranked and rejected layouts as JSON")
    out.add_argument(
        "--validate",
        action="store_true",
        help="under mpiexec: calibrate here, train each layout of the world (at each "
        "virtual-stage count V it runs) a few steps, print predicted vs measured step time "
        "and state bytes",
    )
    out.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="--validate: rounds, each calibrating and measuring every layout once (default %(default)s)",
    )
    out.add_argument(
        "--steps",
        type=int,
        default=3,
        help="--validate: timed training steps per layout and round, after an untimed one (default %(default)s)",
    )


def build_cluster(args):
    # loaded when the command runs, not by hpc-tp --help
    from .clusters import GB, MIXED_BF16, TFLOPS, GiB, engine_precision, get_cluster

    for flag in ("gpus", "gpus_per_node", "device_mem", "device_flops", "efficiency", "intra_bw", "inter_bw"):
        value = getattr(args, flag)
        if value is not None and not 0 < value < math.inf:
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: expected a finite number > 0")
    if args.efficiency is not None and args.efficiency > 1:  # a share: above 1 would beat the peak
        raise ConfigError(f"--efficiency {args.efficiency}: expected a share of the peak FLOP/s in (0, 1]")
    scale = lambda value, unit: None if value is None else value * unit  # noqa: E731
    precision = (
        None
        if args.precision is None
        else (MIXED_BF16 if args.precision == "bf16" else engine_precision(args.precision))
    )
    return get_cluster(args.cluster).with_overrides(
        devices_per_node=args.gpus_per_node,
        device_mem=scale(args.device_mem, GiB),
        device_flops=scale(args.device_flops, TFLOPS),
        gemm_efficiency=args.efficiency,
        intra_bw=scale(args.intra_bw, GB),
        inter_bw=scale(args.inter_bw, GB),
        precision=precision,
    )


def run(args) -> int:
    # loaded when the command runs, not by hpc-tp --help
    from ..models.config import load_config, parse_overrides
    from ..pipeline.partition import parse_virtual_stages
    from .search import AUTO_VIRTUAL_STAGES

    overrides = parse_overrides(args.model_overrides)
    for flag, value in (
        ("global-batch", args.global_batch),
        ("seq-len", args.seq_len),
        ("top", args.top),
        ("serve-batch", args.serve_batch),
        *(("micro-batch", m) for m in args.micro_batch or []),
        *(("ep", e) for e in args.ep or []),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"--{flag} {value}: expected a positive whole number")
    # The same V as --plan auto unless the flag limits them: plain, --json and --validate alike.
    virtual_stages = AUTO_VIRTUAL_STAGES if args.virtual_stages is None else parse_virtual_stages(args.virtual_stages)
    if args.validate:
        return _validate(args, overrides, virtual_stages)
    if args.json:
        check_output_file(args.json, "--json")
    # loaded when the command runs, not by hpc-tp --help
    from .calibration import load_calibration
    from .placement import compare_placements
    from .report import format_plan, plan_json
    from .search import search

    cluster = build_cluster(args)
    cfg = load_config(args.model, **overrides)
    seq = args.seq_len or cfg.max_seq_len
    gpus = args.gpus or cluster.devices_per_node
    if args.ep and not cfg.num_experts and max(args.ep) > 1:
        raise ConfigError(f"--ep {max(args.ep)}: model {args.model} has no experts (num_experts=0)")
    calibration = load_calibration(args.calibration) if args.calibration else None
    sp = {"search": (False, True), "on": (True,), "off": (False,)}[args.sequence_parallel]
    plan = search(
        cfg,
        gpus,
        args.global_batch,
        seq,
        cluster,
        calibration,
        micro_batches=args.micro_batch,
        sequence_parallel=sp,
        eps=args.ep,
        distributed_optimizer=args.distributed_optimizer,
        virtual_stages=virtual_stages,
        placement=args.placement,
    )
    placed = (
        compare_placements(cfg, plan.ranked[0].layout, args.global_batch, seq, cluster, calibration)
        if plan.ranked and gpus > cluster.devices_per_node
        else []
    )
    print(
        format_plan(
            plan,
            cfg,
            args.model,
            cluster,
            gpus,
            args.global_batch,
            seq,
            calibration,
            args.top,
            args.serve_batch,
            placed,
        )
    )
    if args.json:
        from pathlib import Path

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(plan_json(plan, cfg, args.model, cluster, gpus, args.global_batch, seq, placed), indent=1) + "\n"
        )
    return 0 if plan.ranked else 1


def _validate(args, overrides, virtual_stages) -> int:
    # loaded when the command runs, not by hpc-tp --help
    from ..comm.mpi import world
    from ..launch import check_launch
    from .validate import format_rows, validate

    check_launch()
    comm = world()
    micro = (args.micro_batch or [2])[0]
    rows, calibration = validate(
        comm,
        args.model,
        overrides,
        args.global_batch,
        args.seq_len or 64,
        micro,
        cluster=args.cluster,
        steps=args.steps,
        repeats=args.rounds,
        distributed_optimizer=args.distributed_optimizer,
        virtual_stages=virtual_stages,
    )
    if comm.rank == 0:
        print(f"hpc-tp plan --validate: {comm.size} ranks, calibrated here: {calibration.describe()}")
        print(format_rows(rows))
    return 0
