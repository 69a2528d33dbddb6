"""Peak resident memory of a few training steps: every weight trained against LoRA (--set lora_rank=R).

    python benchmarks/lora_memory.py [--model gpt2 --layers 4 --rank 8 --steps 3 --rounds 3]

Each run is its own ``hpc-tp train`` process (one rank, float32, the demo task, dropout 0), so its
peak resident memory (``peak_mem_bytes`` of its metrics log, Linux's ru_maxrss) is its own: the
model, its gradients, masters and AdamW moments, and the steps' activations. The full fine-tune and
LoRA alternate round by round, so a busy spell of a shared machine falls on both. Prints one JSON
line per run (mode, peak MiB, trained and total parameter counts, seconds) and a summary line with
each mode's range.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpc_tp.models import load_config
from hpc_tp.train.metrics import read_metrics

BIN = Path(sys.executable).parent


def run(args, rank: int, log: Path) -> dict:
    overrides = [f"n_layers={args.layers}", "dropout=0", "attn_dropout=0", f"lora_rank={rank}"]
    command = [str(BIN / "hpc-tp"), "train", "--model", args.model, "--steps", str(args.steps)]
    command += ["--global-batch", "8", "--dtype", "float32", "--samples", "0"]
    command += ["--no-progress", "--log", str(log)] + [flag for o in overrides for flag in ("--set", o)]
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True)
    records = read_metrics(log)
    cfg = load_config(args.model, n_layers=args.layers, lora_rank=rank, vocab_size=258)
    peak = max(max(r["peak_mem_bytes"]) for r in records if "peak_mem_bytes" in r)
    return {
        "mode": f"lora r={rank}" if rank else "full",
        "peak_mib": round(peak / 2**20, 1),
        "trained_parameters": cfg.lora_parameters() if rank else cfg.parameter_count(),
        "parameters": cfg.parameter_count(),
        "seconds": round(time.perf_counter() - started, 1),
        "loss": [r["loss"] for r in records if "loss" in r][-1],
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    peaks: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            for rank in (0, args.rank):
                result = run(args, rank, Path(folder) / f"{round_}-{rank}.jsonl")
                peaks.setdefault(result["mode"], []).append(result["peak_mib"])
                print(json.dumps(result), flush=True)
    print(json.dumps({mode: [min(p), max(p)] for mode, p in peaks.items()} | {"unit": "peak MiB, min and max"}))


if __name__ == "__main__":
    main()
