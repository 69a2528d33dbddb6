"""Peak resident memory per rank while a data-parallel run saves a checkpoint, and while another
resumes from it (ZeRO-1 unless --plain).

    mpiexec -n 2 python benchmarks/zero_checkpoint_memory.py [--dtype bfloat16] [--plain]

The model is hidden 512, 4 layers, 8 heads, FFN 2048 over the byte vocabulary (12.87M parameters),
trained two steps on the demo task (8 x 16 tokens) at dp = world. Each rank prints one JSON line:
its peak after the two steps (construction included), and for the save and the resume the
resident memory before and the peak during (Linux's high-water mark, reset through
/proc/self/clear_refs just before), in MiB, the wall time, and the MiB the dp group's collectives
counted (``Communicator.bytes``: the buffers they filled or sent). The checkpoint goes to a
temporary folder, removed after.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from dataclasses import replace

from hpc_tp.comm.mpi import world
from hpc_tp.train.settings import TrainSettings
from hpc_tp.train.trainer import Trainer

MODEL = {"hidden": 512, "n_layers": 4, "n_heads": 8, "ffn_hidden": 2048, "dropout": 0.0, "attn_dropout": 0.0}


def memory() -> dict[str, float]:
    """VmRSS and VmHWM (the peak since the last reset) in MiB."""
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) / 1024 for line in f if line.startswith(("VmRSS", "VmHWM"))}


def peak_during(work, dp) -> dict[str, float]:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the resident memory now
    before, counted, start = memory()["VmRSS"], dp.bytes, time.perf_counter()
    work()
    return {
        "before": round(before, 1),
        "peak": round(memory()["VmHWM"], 1),
        "seconds": round(time.perf_counter() - start, 3),
        "dp_MiB": round((dp.bytes - counted) / 2**20, 1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--plain", action="store_true", help="plain AdamW (whole states on every rank)")
    args = parser.parse_args()
    comm = world()
    folder = comm.bcast_object(tempfile.mkdtemp(prefix="zero-ckpt-") if comm.rank == 0 else None)
    settings = TrainSettings(
        model="w1",
        model_overrides=MODEL,
        dtype=args.dtype,
        dp=comm.size,
        global_batch=8,
        steps=4,
        warmup=1,
        save=f"{folder}/ckpt",
        distributed_optimizer=not args.plain,
        progress=False,
    )
    try:
        trainer = Trainer(settings, comm)
        for _ in range(2):
            trainer.train_step()
        report = {
            "rank": comm.rank,
            "optimizer": type(trainer.optimizer).__name__,
            "dtype": args.dtype,
            "parameters_M": round(trainer.cfg.parameter_count() / 1e6, 2),
            "steps_peak": round(memory()["VmHWM"], 1),
            "save": peak_during(trainer.save, trainer.grid.dp),
        }
        del trainer
        resumer = Trainer(replace(settings, resume=True), comm)
        report["resume"] = peak_during(resumer.resume, resumer.grid.dp)
        print(json.dumps(report), flush=True)
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
