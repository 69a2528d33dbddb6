"""``hpc-tp bench BENCHMARK``: one sub-subcommand per benchmark, each with its own options.

The measuring code of a benchmark lives in its own module (``comm.py``), imported only when that
benchmark runs, so listing the options stays instant. Options are checked inside ``run`` and raise
ConfigError there, which rank 0 alone reports (an argparse error would print once per rank).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def add_arguments(parser):
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    comm = benchmarks.add_parser("comm", help="collective and p2p latency/bandwidth: the project's communicator vs raw mpi4py",
                                 description="Run under mpiexec/srun; times are the slowest rank's, median over iterations.")
    comm.add_argument("--sizes", default="8:64M",
                      help="message sizes in bytes, MIN[:MAX[:FACTOR]] with K/M/G suffixes (binary); "
                           "MIN times powers of FACTOR (default 4), up to and including MAX (default %(default)s)")
    comm.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,p2p",
                      help="comma-separated operations (default %(default)s); p2p needs 2 ranks")
    comm.add_argument("--iters", type=int, default=20, help="timed iterations per size (default %(default)s)")
    comm.add_argument("--warmup", type=int, default=5, help="untimed iterations first (default %(default)s)")
    comm.add_argument("--json", metavar="FILE", help="also write the records as a JSON list (rank 0)")
    comm.set_defaults(_benchmark=_run_comm)


def run(args) -> int:
    return args._benchmark(args)


def _run_comm(args) -> int:
    from ..launch import check_launch

    sizes, ops = size_range(args.sizes), args.ops.split(",")
    if args.iters < 1 or args.warmup < 0:
        raise ConfigError(f"--iters {args.iters} --warmup {args.warmup}: need at least 1 iteration and no negative warm-up")
    check_launch()
    from ..comm.mpi import world
    from .comm import OPS, benchmark_comm, format_table

    unknown = [name for name in ops if name not in OPS]
    if unknown:
        raise ConfigError(f"--ops: unknown {', '.join(unknown)}; choose from {', '.join(OPS)}")
    comm = world()
    records = benchmark_comm(comm, sizes, ops, iters=args.iters, warmup=args.warmup)
    if comm.rank == 0:
        print(f"hpc-tp bench comm: {comm.size} ranks, float32, median of {args.iters} iterations "
              f"after {args.warmup} warm-up, slowest rank; bandwidths in GB/s as nccl-tests defines them")
        print(format_table(records))
        for name in ops:
            if comm.size < OPS[name].min_ranks:
                print(f"{name}: skipped, needs {OPS[name].min_ranks} ranks")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    return 0


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
