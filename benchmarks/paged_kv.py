"""Continuous batching's KV cache and decode step, checkout against checkout: its memory at start-up,
the decode throughput of a full batch and the CPU time of one decode step, in alternating rounds in one run.

    python benchmarks/paged_kv.py --variant main=PATH --variant paged=PATH [--variant small=PATH@GIB]
                                  [--rows 8] [--max-len 2048] [--prompt 256] [--new 256] [--rounds 4]
                                  [--layers 8] [--window 0] [--global-every 0]
                                  [--model CONFIG.json] [--dtype float32]

Each variant is a source tree (``PYTHONPATH``), and optionally ``@GIB`` for ``kv_cache_memory`` (a tree
that has it). A round runs every variant once, in an order that alternates (after an untimed one, in which numba
compiles a fresh tree's kernels into its cache), each in a fresh process at
tp = 1: a llama-shaped random model (``--hidden`` 256, ``--layers`` 8, 8 heads, 2 kv heads, ``--dtype``
float32 or another, the byte vocabulary; with ``--window W`` every layer has a sliding window of W but, with ``--global-every K``,
every K-th, which is global: Gemma 3's pattern at K = 6; or ``--model``, a preset or JSON config such as a
converted checkpoint's, with random weights), a ``ContinuousBatcher`` of ``--rows`` rows and
``--max-len`` positions, then ``--rows`` greedy requests of ``--prompt`` random tokens and ``--new`` new
tokens each, all at once (after an untimed warm-up batch of the same shapes, which compiles the
kernels). Reported per variant and round: the cache's bytes (allocated), the resident memory it added
at start-up and at the end (pages touched: numpy's zeros are mapped lazily), the most KV memory the
requests held at once (the pool's share of blocks referenced after an iteration: deterministic), the
longest request the pool takes (``kv_tokens``), and the completion tokens a second over the whole
batch, of wall time and of the process's CPU time (one process, one thread: the work done, which a
loaded machine's time slicing disturbs less than the wall clock); ``step_cpu_ms``, the CPU time of one
decode step of the full batch: that run's, less a run of other prompts of the same lengths for one
token (the prefill), over the ``--new`` - 1 steps, and ``step_rest_cpu_ms``, the part of it outside the
matrix products' kernels (``kernels.blas.matmul``, LM head included) and the paged attention kernel
(their calls timed in both runs): the step's glue, casts of the products' sums included; then the median and range over rounds. No time is asserted: the
machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(args):
    # the tree under test is on PYTHONPATH: imported only in the worker
    import numpy

    from hpc_tp.comm.mpi import self_comm
    from hpc_tp.kernels import blas, paged_attention
    from hpc_tp.models import GPTModel
    from hpc_tp.models.config import load_config
    from hpc_tp.serve.continuous import ContinuousBatcher
    from hpc_tp.serve.generate import Engine
    from hpc_tp.serve.sampling import SamplingParams
    from hpc_tp.tokenizer import ByteTokenizer

    every = args.global_every
    kinds = ["full_attention" if every and i % every == every - 1 else "sliding_attention" for i in range(args.layers)]
    shape = dict(
        vocab_size=258,
        hidden=args.hidden,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=2,
        ffn_hidden=3 * args.hidden,
        sliding_window=args.window,
        layer_types=kinds if args.window else None,
    )
    cfg = load_config(args.model or "llama-tiny", **({} if args.model else shape), max_seq_len=args.max_len)
    model = GPTModel(cfg, self_comm(), dtype=args.dtype, seed=0)
    engine = Engine(model, ByteTokenizer())
    before = rss_bytes()
    memory = {} if args.kv_gib is None else {"kv_cache_memory": args.kv_gib}
    batcher = ContinuousBatcher(engine, args.rows, args.max_len, **memory)
    at_start = rss_bytes() - before
    blocks, forward, held = batcher.blocks, ContinuousBatcher._forward, [0]

    def counted(self, admitted):  # the blocks referenced once the iteration's tokens are in
        logits = forward(self, admitted)
        held[0] = max(held[0], blocks.usable - blocks.available())
        return logits

    ContinuousBatcher._forward = counted

    timed = [0.0]  # CPU seconds in the products and the attention kernel

    def timed_calls(function):
        def call(*args, **kwargs):
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                timed[0] += time.process_time() - start

        return call

    blas.matmul = timed_calls(blas.matmul)  # looked up at each call by the layers and the LM head
    paged_attention.decode = timed_calls(paged_attention.decode)
    rng = numpy.random.default_rng(0)
    prompts, others, warm = (
        [[int(t) for t in rng.integers(0, 256, args.prompt)] for _ in range(args.rows)] for _ in range(3)
    )
    batcher.generate(warm, [SamplingParams(max_new_tokens=4)] * args.rows)  # compiles kernels
    prefill, timed[0] = time.process_time(), 0.0  # other prompts (no cached prefix), for one token: the prefill
    batcher.generate(others, [SamplingParams(max_new_tokens=1)] * args.rows)
    prefill, prefill_timed = time.process_time() - prefill, timed[0]
    timed[0] = 0.0
    params = [SamplingParams(max_new_tokens=args.new, ignore_eos=True) for _ in prompts]
    start, cpu = time.perf_counter(), time.process_time()
    out = batcher.generate(prompts, params)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(c.ids) for c, _ in out)
    print(
        json.dumps(
            {
                "cache_mib": batcher.cache.nbytes / 2**20,
                "held_mib": held[0] * batcher.cache.nbytes / (blocks.usable + 1) / 2**20,
                "kv_tokens": batcher.kv_tokens,
                "rss_start_mib": at_start / 2**20,
                "rss_end_mib": (rss_bytes() - before) / 2**20,
                "tokens_per_s": tokens / seconds,
                "tokens_per_cpu_s": tokens / cpu,
                "step_cpu_ms": (cpu - prefill) / max(args.new - 1, 1) * 1e3,
                "step_rest_cpu_ms": (cpu - prefill - timed[0] + prefill_timed) / max(args.new - 1, 1) * 1e3,
            }
        )
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", required=False, default=[], metavar="NAME=PATH[@GIB]")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--window", type=int, default=0)
    p.add_argument("--global-every", type=int, default=0)
    p.add_argument("--model", default=None, help="preset or JSON config (default: the llama shape above)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kv-gib", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    variants = []
    for spec in args.variant:
        name, _, tree = spec.partition("=")
        tree, _, gib = tree.partition("@")
        variants.append((name, str(Path(tree).resolve()), gib or None))
    names = ("rows", "max-len", "hidden", "prompt", "new", "layers", "window", "global-every", "dtype")
    shape = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in names]
    shape += (
        [f"--model={Path(args.model).resolve() if Path(args.model).exists() else args.model}"] if args.model else []
    )
    results = {name: [] for name, _, _ in variants}
    for r in range(-1, args.rounds):  # round -1 untimed: numba compiles a fresh tree's kernels into its cache
        for name, tree, gib in variants if r % 2 == 0 else variants[::-1]:
            command = [sys.executable, __file__, "--worker", *shape] + ([f"--kv-gib={gib}"] if gib else [])
            env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
            line = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
            if r >= 0:
                record = json.loads(line)
                results[name].append(record)
                print(json.dumps({"round": r, "variant": name, **record}), flush=True)
    for name, records in results.items():
        summary = {
            key: f"{statistics.median(r[key] for r in records):.1f} "
            f"[{min(r[key] for r in records):.1f}, {max(r[key] for r in records):.1f}]"
            for key in records[0]
        }
        print(json.dumps({"variant": name, "median [range]": summary}), flush=True)


if __name__ == "__main__":
    main()
