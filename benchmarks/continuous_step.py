"""Continuous batching's decode step alone, eager (``decoding.step_view``: as many rows as the batch,
slots up to the longest row's) against the same step at its bucket's fixed shapes
(``decoding.PagedSteps``: rows padded up to a power of two, slots up to a power of two of blocks; what a
GPU at tp = 1 replays from a CUDA graph), alternating in one run, one process.

    python benchmarks/continuous_step.py [--model w1] [--rows 1,3,5,8] [--rounds 5] [--steps 5]

Per batch size, rows of a quarter to half the context (W1: 64 to 127 tokens, blocks of 16) feed one
token each; each round times ``--steps`` steps of each path (the same step again) and keeps their
median. Printed: ms a step, the median and range of the rounds, and bucketed / eager. On the CPU this
says whether the padding costs: the paged attention kernel reads each row's own slots, but every
product takes the padded rows.
"""

from __future__ import annotations

import argparse
import json

from hpc_tp.bench.gpu_check import continuous_step_timings


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="w1", help="preset (default %(default)s)")
    parser.add_argument("--dtype", default="float32", help="(default %(default)s)")
    parser.add_argument("--rows", default="1,3,5,8", help="batch sizes, comma-separated (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="steps of each path a round (default %(default)s)")
    args = parser.parse_args()
    for rows in (int(r) for r in args.rows.split(",")):
        r = continuous_step_timings(rows, args.rounds, args.steps, args.model, args.dtype)
        eager, bucketed = r["eager_ms"], r["bucketed_ms"]
        record = {"rows": rows, "eager_ms": eager, "bucketed_ms": bucketed}
        record["bucketed / eager"] = round(bucketed["median"] / eager["median"], 3)
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
