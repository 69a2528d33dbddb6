"""Step time and peak memory of one training step with --recompute none, selective and full.

    mpiexec -n 1 python benchmarks/recompute_memory.py [--hidden 256 --seq-len 256 --layers 4 --attn-dropout 0 ...]

The whole model (embedding, blocks, head and loss; tp = world size, dropout 0.1 everywhere unless
``--attn-dropout`` says otherwise for attention's) runs
one micro-batch forward and backward through the pipeline engine. The three modes alternate step
by step, so a slow spell of a shared machine falls on all of them. Peak memory is the most array
bytes alive during a separate step traced by ``tracemalloc`` (numpy reports its buffers to it),
above what was alive before the step: the activations, the recomputed ones and backward's
temporaries, not the parameters and gradients. Printed next to it: the planner's prediction of
what the step holds (``stage_memory``: activations plus the recomputed layer). Rank 0 prints one
JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from statistics import median

import numpy

from hpc_tp.comm.mpi import world
from hpc_tp.grid import ProcessGrid
from hpc_tp.models import ModelConfig
from hpc_tp.pipeline import build_stage, pipeline_forward_backward
from hpc_tp.plan.clusters import engine_precision
from hpc_tp.plan.memory import stage_memory
from hpc_tp.recompute import MODES


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attn-dropout", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    comm = world()
    cfg = ModelConfig(
        vocab_size=258,
        hidden=args.hidden,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq_len,
        dropout=0.1,
        attn_dropout=args.attn_dropout,
    )
    grid = ProcessGrid(comm.size, 1, 1, comm)
    model = build_stage(cfg, grid, args.dtype)
    rng = numpy.random.default_rng(0)
    batch = [(rng.integers(0, 258, (args.micro_batch, args.seq_len)),) * 2]
    scale = 1.0 / (args.micro_batch * args.seq_len)

    def step(mode, i):
        pipeline_forward_backward(model, batch, grid, scale, "1f1b", mode, step=i)
        model.zero_grad()

    times = {mode: [] for mode in MODES}
    for i in range(args.repeats + 1):  # the first round warms up (numba, allocator)
        for mode in MODES:
            grid.world.barrier()
            t0 = time.perf_counter()
            step(mode, i)
            if i:
                times[mode].append(time.perf_counter() - t0)
    for mode in MODES:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        step(mode, 0)
        peak = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
        predicted = stage_memory(
            cfg,
            grid.tp_size,
            1,
            0,
            range(cfg.n_layers),
            args.micro_batch,
            args.seq_len,
            1,
            "1f1b",
            mode,
            engine_precision(args.dtype),
        )
        slowest = max(grid.world.allgather_object(median(times[mode])))
        if comm.rank == 0:
            print(
                json.dumps(
                    dict(
                        mode=mode,
                        tp=grid.tp_size,
                        hidden=args.hidden,
                        heads=args.heads,
                        layers=args.layers,
                        seq_len=args.seq_len,
                        micro_batch=args.micro_batch,
                        dtype=args.dtype,
                        attn_dropout=args.attn_dropout,
                        step_ms=round(slowest * 1e3, 1),
                        peak_step_mib=round(peak / 2**20, 2),
                        predicted_mib=round((predicted.activations + predicted.recompute_peak) / 2**20, 2),
                    )
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
