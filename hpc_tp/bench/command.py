"""``hpc-tp bench BENCHMARK``: one sub-subcommand per benchmark, each with its own options.

The measuring code of a benchmark lives in its own module (``comm.py``, ``step.py``), imported only when that
benchmark runs, so listing the options stays instant. Options are checked inside ``run`` and raise
ConfigError there, which rank 0 alone reports (an argparse error would print once per rank).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from ..errors import ConfigError
from ..paths import check_output_file, check_output_folder

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def add_arguments(parser):
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    comm = benchmarks.add_parser(
        "comm",
        help="collective and p2p latency/bandwidth: the project's communicator vs raw mpi4py",
        description="Run under mpiexec/srun; times are the slowest rank's, median over iterations.",
    )
    comm.add_argument(
        "--sizes",
        default="8:64M",
        help="message sizes in bytes, MIN[:MAX[:FACTOR]] with K/M/G suffixes (binary); "
        "MIN times powers of FACTOR (default 4), up to and including MAX (default %(default)s)",
    )
    comm.add_argument(
        "--ops",
        default="all_reduce,all_gather,reduce_scatter,p2p",
        help="comma-separated operations (default %(default)s); p2p (rank 0 and the last) needs 2 "
        "ranks; p2p_intra and p2p_inter: rank 0 and a rank on its node / on another node",
    )
    comm.add_argument("--iters", type=int, default=20, help="timed iterations per size (default %(default)s)")
    comm.add_argument("--warmup", type=int, default=5, help="untimed iterations first (default %(default)s)")
    comm.add_argument("--json", metavar="FILE", help="also write the records as a JSON list (rank 0)")
    comm.set_defaults(_benchmark=_run_comm)

    step = benchmarks.add_parser(
        "step",
        help="forward+backward of a GPT block stack: time, FLOP/s, MFU against "
        "the measured GEMM peak, compute/communication split, memory",
        description="tp = the world size (run under mpiexec/srun); the step is the slowest "
        "rank's, median over repeats; FLOPs count matrix products (see "
        "hpc_tp/bench/step.py).",
    )
    step.add_argument("--model", default="w1", help="preset name or JSON config (default %(default)s)")
    step.add_argument("--layers", type=int, help="number of blocks (default: the model's n_layers)")
    step.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default %(default)s)")
    step.add_argument("--micro-batch", type=int, default=4, help="sequences per step (default %(default)s)")
    step.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float64", "float16", "bfloat16"),
        help="default %(default)s (bfloat16 needs ml_dtypes)",
    )
    step.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu (numpy, default) or cuda (cupy, one GPU per node-local rank)",
    )
    step.add_argument(
        "--threads", type=int, help="BLAS threads per rank (default: this rank's cores / ranks on its node, at least 1)"
    )
    step.add_argument("--repeats", type=int, default=5, help="timed steps (default %(default)s)")
    step.add_argument("--warmup", type=int, default=2, help="untimed steps first (default %(default)s)")
    step.add_argument(
        "--cuda-graph",
        action="store_true",
        help="on a GPU (tp=1, or tp over NCCL), replay each step as a CUDA graph captured at the first one",
    )
    step.add_argument("--json", metavar="FILE", help="also write the record as JSON (rank 0)")
    step.set_defaults(_benchmark=_run_step)

    # -- more benchmarks (e.g. `decode`) are added here: a parser with set_defaults(_benchmark=...) --
    for name, help_text in (
        ("decode", "incremental decoding with the KV cache: ms per token, compute/communication"),
        ("checkpoint", "HDF5 checkpoint save/load MB/s against np.save/np.load of the same bytes"),
        ("pipeline", "pipeline bubble: each stage's measured idle against (p-1)/(V*m+p-1)"),
    ):
        module = importlib.import_module(f"hpc_tp.bench.{name}")
        sub = benchmarks.add_parser(name, help=help_text, description=module.__doc__.split("\n\n")[0])
        module.add_arguments(sub)
        sub.set_defaults(_benchmark=module.run)


def run(args) -> int:
    # Paths first: a benchmark that ran for minutes must not end in a traceback about its output.
    if getattr(args, "json", None):
        check_output_file(args.json, "--json")
    if getattr(args, "dir", None):
        check_output_folder(args.dir, "--dir")
    return args._benchmark(args)


def _run_comm(args) -> int:
    # loaded when the command runs, not by hpc-tp --help
    from ..launch import check_launch

    sizes, ops = size_range(args.sizes), args.ops.split(",")
    if args.iters < 1 or args.warmup < 0:
        raise ConfigError(
            f"--iters {args.iters} --warmup {args.warmup}: need at least 1 iteration and no negative warm-up"
        )
    check_launch()
    # loaded when the command runs, not by hpc-tp --help
    from ..comm.mpi import world
    from ..grid import node_of_ranks
    from .comm import OPS, benchmark_comm, format_table, runs_here

    unknown = [name for name in ops if name not in OPS]
    if unknown:
        raise ConfigError(f"--ops: unknown {', '.join(unknown)}; choose from {', '.join(OPS)}")
    comm = world()
    nodes = node_of_ranks(comm)
    records = benchmark_comm(comm, sizes, ops, iters=args.iters, warmup=args.warmup)
    if comm.rank == 0:
        print(
            f"hpc-tp bench comm: {comm.size} ranks on {len(set(nodes))} node(s), float32, median of {args.iters} iterations "
            f"after {args.warmup} warm-up, slowest rank; bandwidths in GB/s as nccl-tests defines them"
        )
        print(format_table(records))
        for name in ops:
            if not runs_here(OPS[name], nodes):
                need = (
                    f"{OPS[name].min_ranks} ranks"
                    if comm.size < OPS[name].min_ranks
                    else "a rank on the link it measures"
                )
                print(f"{name}: skipped, needs {need}")
        _write_json(args.json, records)
    return 0


def _run_step(args) -> int:
    # loaded when the command runs, not by hpc-tp --help
    from ..launch import check_launch

    for name in ("layers", "seq_len", "micro_batch", "threads", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: expected a positive whole number")
    if args.warmup < 0:
        raise ConfigError(f"--warmup {args.warmup}: expected 0 or more")
    check_launch()
    # loaded when the command runs, not by hpc-tp --help
    from threadpoolctl import threadpool_limits

    from ..backend import resolve_dtype
    from ..comm import select_device
    from ..comm.mpi import world
    from ..comm.nccl import device_communicator
    from ..models.config import load_config
    from .step import benchmark_step, format_record

    # The block stack has no position table, so any sequence length fits.
    cfg = load_config(args.model, n_layers=args.layers, max_seq_len=args.seq_len)
    resolve_dtype(args.dtype)  # bfloat16 without ml_dtypes: one line, before anything is built
    select_device(args.device, world())
    comm = device_communicator(world())  # NCCL between GPUs of a node, as training's tp group
    # Set explicitly: ranks that share cores must not each start a thread per core (oversubscription).
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // world().split_node().size)
    with threadpool_limits(limits=threads, user_api="blas"):
        record = benchmark_step(
            comm,
            cfg,
            args.micro_batch,
            args.seq_len,
            args.dtype,
            repeats=args.repeats,
            warmup=args.warmup,
            threads=threads,
            graphs=args.cuda_graph,
        )
    if comm.rank == 0:
        print(format_record(record))
        _write_json(args.json, record)
    return 0


def _write_json(path, records):
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(records, indent=1) + "\n")


def parse_size(text: str) -> int:
    number, unit = (text[:-1], text[-1].upper()) if text[-1:].isalpha() else (text, "")
    if not number.isdigit() or unit not in _UNITS or int(number) == 0:
        raise ConfigError(f"size {text!r}: expected a positive whole number of bytes with an optional K, M or G")
    return int(number) * _UNITS[unit]


def size_range(text: str) -> list[int]:
    """``MIN[:MAX[:FACTOR]]``: MIN, MIN*FACTOR, ... while below MAX, then MAX itself."""
    parts = text.split(":")
    if len(parts) > 3:
        raise ConfigError(f"--sizes {text!r}: expected MIN[:MAX[:FACTOR]], e.g. 8:64M:4")
    low = parse_size(parts[0])
    high = parse_size(parts[1]) if len(parts) > 1 else low
    factor = parts[2] if len(parts) > 2 else "4"
    if not factor.isdigit() or int(factor) < 2 or high < low:
        raise ConfigError(f"--sizes {text!r}: need MIN <= MAX and a whole FACTOR >= 2")
    sizes = [low]
    while sizes[-1] * int(factor) < high:
        sizes.append(sizes[-1] * int(factor))
    return sizes + [high] if high > low else sizes
