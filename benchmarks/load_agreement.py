"""What a load's agreements cost: a checkpoint of many small tensors, loaded at tp = world in one
run, alternating the load as it is (the ranks agree after each tensor whether one failed) with the
same reads unagreed (failures exchanged only at the end, so a rank that failed early left the others
reading the rest).

    mpiexec -n 2 python benchmarks/load_agreement.py [--tensors 400] [--side 64] [--rounds 6]

Every tensor is side x side float64 (64: 32 KiB), split by columns over the ranks. Rank 0 prints
one JSON line a round: each rank's seconds for both loads, and the seconds each rank spent in the
agreed load's all-reduces (the count and one per step) and how many it made. A rank's time in an
all-reduce includes waiting for a slower rank to finish its read (which the unagreed load waits
for at its end instead), so the line also sums, agreement by agreement, the shortest time any
rank spent in it: the last to arrive waits for no one, and its time is the agreement's own
cost. A last line gives the medians over the rounds (a load's seconds: its slowest rank's). The
checkpoint goes to a temporary folder, removed after.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from contextlib import closing

import numpy

from hpc_tp import backend
from hpc_tp.checkpoint import load_checkpoint, read, save_checkpoint
from hpc_tp.checkpoint.collective import run_everywhere
from hpc_tp.comm.mpi import world
from hpc_tp.grid import ProcessGrid
from hpc_tp.module import Parameter, split


def make_tensors(grid, count: int, side: int, fill: bool) -> dict:
    tensors = {}
    part = split((side, side), 1, grid.tp_size, grid.coords.tp)
    for i in range(count):
        tensor = Parameter(numpy.zeros(part.local_shape), part)
        if fill:
            tensor.load_full(numpy.arange(side * side, dtype=numpy.float64).reshape(side, side) + i)
        tensors[f"t{i:04d}"] = tensor
    return tensors


def unagreed_load(path, tensors: dict, comm) -> dict:
    """``load_checkpoint`` without its agreements: the same reads, nothing exchanged between them."""

    def walk():
        with closing(read._reads(path, tensors)) as reads:
            meta = next(reads)
            for _ in reads:
                pass
        return meta

    meta = run_everywhere(comm, walk)
    backend.release_free_memory()
    return meta


def timed_all_reduces(comm) -> list:
    """Each ``comm.all_reduce_scalar`` from now on appends its seconds to the list returned."""
    real, seconds = comm.all_reduce_scalar, []

    def timed(value, op="sum"):
        start = time.perf_counter()
        try:
            return real(value, op)
        finally:
            seconds.append(time.perf_counter() - start)

    comm.all_reduce_scalar = timed
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=400)
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    comm = world()
    grid = ProcessGrid(tp=comm.size, world=comm)
    root = comm.bcast_object(tempfile.mkdtemp(prefix="load-agreement-") if comm.rank == 0 else None)
    try:
        path = save_checkpoint(root, 1, make_tensors(grid, args.tensors, args.side, True), {}, grid)
        agreements = timed_all_reduces(comm)
        loads = {"agreed": lambda t: load_checkpoint(path, t, grid), "unagreed": lambda t: unagreed_load(path, t, comm)}
        medians = {"agreed_s": [], "unagreed_s": [], "agreements_own_cost_s": []}
        for round_ in range(args.rounds):
            row = {}
            for kind in sorted(loads, reverse=bool(round_ % 2)):  # alternate which goes first
                tensors = make_tensors(grid, args.tensors, args.side, False)
                comm.barrier()
                agreements.clear()
                start = time.perf_counter()
                loads[kind](tensors)
                row[f"{kind}_s"] = round(time.perf_counter() - start, 4)
                if kind == "agreed":
                    row["agreements_s"], row["agreements"] = round(sum(agreements), 5), len(agreements)
                    waits = comm.allgather_object(list(agreements))
            rows = comm.allgather_object(row)
            if comm.rank == 0:
                line = {
                    "round": round_,
                    "tensors": args.tensors,
                    "side": args.side,
                    "ranks": rows,
                    "agreements_own_cost_s": round(sum(map(min, zip(*waits))), 5),
                }
                print(json.dumps(line), flush=True)
                for key in ("agreed_s", "unagreed_s"):  # a load lasts as long as its slowest rank
                    medians[key].append(max(r[key] for r in rows))
                medians["agreements_own_cost_s"].append(line["agreements_own_cost_s"])
        if comm.rank == 0:
            print(json.dumps({"median": {key: round(statistics.median(v), 5) for key, v in medians.items()}}))
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
