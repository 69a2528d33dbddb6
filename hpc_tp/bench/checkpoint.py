"""``hpc-tp bench checkpoint``: save and load throughput of the HDF5 checkpoints against a plain
``np.save``/``np.load`` of the very same bytes, side by side in one run.

Every rank holds a model's parameters and AdamW states at tp = world size (float32 by default).
One checkpoint save is timed from the first rank's entry to the last rank's return (it is
collective: plan, shard files, master file of virtual datasets, rename, ``latest``); the load
reads every rank's hyperslab back and checks its checksums. The baseline has each rank
``np.save`` its local arrays into one ``.npz``-like folder of ``.npy`` files and read them back:
no layout independence, no checksums, no atomic publish. Throughput is logical bytes (each
tensor counted once) per second; the ratio says what the checkpoint format costs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy

from ..errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--model", default="gpt2", help="preset name or JSON config (default %(default)s)")
    parser.add_argument("--layers", type=int, help="number of blocks (default: the model's n_layers)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="default %(default)s")
    parser.add_argument(
        "--dir",
        default="io/out/bench-checkpoint",
        help="folder shared by all ranks (default %(default)s); the run writes into a fresh "
        "bench-checkpoint-* folder inside it and removes only that",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed saves and loads (default %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the record as JSON (rank 0)")


def benchmark_checkpoint(grid, model, optimizer, folder, repeats: int = 3) -> dict:
    """Median seconds and MB/s of save_checkpoint / load_checkpoint and of np.save / np.load, in a
    fresh folder inside ``folder`` (whatever else ``folder`` holds is left alone)."""
    # loaded when the command runs, not by hpc-tp --help
    from ..checkpoint import load_checkpoint, save_checkpoint
    from ..checkpoint.collective import run_everywhere

    world = grid.world
    tensors = {**model.state(), **optimizer.state_tensors()}
    logical = sum(int(numpy.prod(t.partition.full_shape)) * t.data.itemsize for t in tensors.values())

    def scratch_folder() -> str:
        Path(folder).mkdir(parents=True, exist_ok=True)
        return tempfile.mkdtemp(prefix="bench-checkpoint-", dir=folder)

    folder = Path(world.bcast_object(run_everywhere(world, lambda: scratch_folder() if world.rank == 0 else None)))

    def timed(action) -> float:
        world.barrier()
        started = time.perf_counter()
        action()
        world.barrier()
        return time.perf_counter() - started

    plain = folder / "plain" / f"rank-{world.rank:05d}"

    def save_plain():
        plain.mkdir(parents=True, exist_ok=True)
        for i, t in enumerate(tensors.values()):
            numpy.save(plain / f"{i}.npy", t.data)

    def load_plain():
        for i, t in enumerate(tensors.values()):
            t.data[...] = numpy.load(plain / f"{i}.npy")

    times = {"save": [], "load": [], "np_save": [], "np_load": []}
    for step in range(repeats):
        times["save"].append(
            timed(lambda: save_checkpoint(folder / "hdf5", step, tensors, {"step": step}, grid, keep=1))
        )
        times["load"].append(timed(lambda: load_checkpoint(folder / "hdf5", tensors, grid)))
        times["np_save"].append(timed(save_plain))
        times["np_load"].append(timed(load_plain))
    median = {k: float(numpy.median(v)) for k, v in times.items()}
    record = {
        "ranks": world.size,
        "tensors": len(tensors),
        "logical_bytes": logical,
        "repeats": repeats,
        **{f"{k}_s": v for k, v in median.items()},
        **{f"{k}_mb_per_s": logical / v / 1e6 for k, v in median.items()},
    }
    record["save_vs_np"] = median["np_save"] / median["save"]
    record["load_vs_np"] = median["np_load"] / median["load"]
    if world.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return record


def format_record(r: dict) -> str:
    return (
        f"{r['tensors']} tensors, {r['logical_bytes'] / 1e6:.1f} MB on {r['ranks']} ranks, median of {r['repeats']}:\n"
        f"  save  {r['save_mb_per_s']:8.1f} MB/s   np.save {r['np_save_mb_per_s']:8.1f} MB/s   "
        f"ratio {r['save_vs_np']:.2f}\n"
        f"  load  {r['load_mb_per_s']:8.1f} MB/s   np.load {r['np_load_mb_per_s']:8.1f} MB/s   "
        f"ratio {r['load_vs_np']:.2f}"
    )


def run(args) -> int:
    # loaded when the command runs, not by hpc-tp --help
    from ..comm.mpi import world
    from ..grid import ProcessGrid
    from ..launch import check_launch
    from ..models import GPTModel, load_config
    from ..train.optim import AdamW

    if args.repeats < 1 or (args.layers is not None and args.layers < 1):
        raise ConfigError(f"--repeats {args.repeats} --layers {args.layers}: expected positive whole numbers")
    check_launch()
    comm = world()
    grid = ProcessGrid(tp=comm.size, world=comm)
    cfg = load_config(args.model, n_layers=args.layers)
    model = GPTModel(cfg, grid.tp, dtype=args.dtype)
    record = benchmark_checkpoint(grid, model, AdamW(model.state(), lr=1e-3), args.dir, args.repeats)
    if grid.world.rank == 0:
        print(format_record(record))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0
