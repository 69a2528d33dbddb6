"""One layer's prefill attention in bfloat16, on ``kernels.paged_bf16``'s prefill rows (each query a decode
row of its own over the keys up to its position, read in place from a paged pool) against the composed
path it replaces (the rows' slots gathered, then the layer's core: numpy's products through float32, the
softmax in float32), and float32's fused core (``kernels.cpu_attention``) for reference, alternating.

    OMP_NUM_THREADS=1 python benchmarks/prefill_attention.py [--tokens 100,200] [--rows 1] [--threads 1,2]
        [--rounds 5] [--repeats 20]

The shape is SmolLM2-135M's (9 query heads, 3 KV heads of 64): ``--rows`` prompts of ``--tokens`` tokens
each, prefilled from slot 0, their K/V in blocks of 16 slots scattered through one pool. Each round runs
every token count, thread count (``kernels.threads.use``) and path once, ``--repeats`` calls each; a
line gives the time of one layer's call, median [range] over the rounds: at one thread the thread's CPU
time (on a shared machine a descheduled thread is not the kernel's cost), at more the wall time (a second
thread's work is not the caller's CPU time; on a loaded machine it includes the waits for a core). No
time is asserted: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import time

import numpy
from paged_attention import report

from hpc_tp.backend import resolve_dtype
from hpc_tp.comm.mpi import self_comm
from hpc_tp.kernels import cpu_attention, paged_bf16, threads
from hpc_tp.nn.attention import ParallelAttention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def prefill(dtype, rows: int, tokens: int, seed: int = 0):
    """q [rows, hk, g, T, d], K/V pools [hk, slots, d] holding the prompts' K/V, each row's slots [rows, T]."""
    rng = numpy.random.default_rng(seed)
    blocks = -(-tokens // BLOCK)
    order = rng.permutation(rows * blocks).reshape(rows, blocks)  # the pool's blocks, in no order
    slots = (order[:, :, None] * BLOCK + numpy.arange(BLOCK)).reshape(rows, -1)[:, :tokens]
    k, v = (rng.standard_normal((KV_HEADS, rows * blocks * BLOCK, HEAD_DIM)).astype(dtype) for _ in range(2))
    q = (rng.standard_normal((rows, KV_HEADS, HEADS // KV_HEADS, tokens, HEAD_DIM)) / 8).astype(dtype)
    return q, k, v, slots


def composed(layer, q, k, v, slots, out):
    """The layer's path without the prefill rows: the rows' slots gathered, then its core (fused for
    float32, composed for bfloat16)."""
    keys, values = k[:, slots].swapaxes(0, 1), v[:, slots].swapaxes(0, 1)
    fused = cpu_attention.supported(q, keys, values, out)
    layer._core(q, keys, values, out, None, 0, 0, None, fused)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="100,200")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if not paged_bf16.AVAILABLE:
        raise SystemExit("the prefill rows need numba and a CPU with avx512_bf16")
    counts = [int(c) for c in args.threads.split(",")]
    cases = {}  # name: one layer's call
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name in ("bfloat16", "float32"):
            dtype = resolve_dtype(name)
            layer = ParallelAttention(
                HEADS * HEAD_DIM, HEADS, KV_HEADS, self_comm(), bias=False, rope_theta=1e5, dtype=dtype
            )
            q, k, v, slots = prefill(dtype, args.rows, tokens)
            out = numpy.empty_like(q)
            lengths = numpy.full(args.rows, tokens, numpy.int64)
            if name == "bfloat16":
                cases[f"T={tokens} bfloat16 rows"] = lambda a=(q, k, v, slots, 0, lengths, out, 0): paged_bf16.prefill(
                    *a
                )
            label = "composed" if name == "bfloat16" else "fused"
            cases[f"T={tokens} {name} {label}"] = lambda a=(layer, q, k, v, slots, out): composed(*a)
    times = {(name, count): [] for name in cases for count in counts}
    for _ in range(args.rounds + 1):  # the first round compiles and warms up: not counted
        for count in counts:
            threads.use(count)
            for name, call in cases.items():
                clock = time.thread_time if count == 1 else time.perf_counter
                start = clock()
                for _ in range(args.repeats):
                    call()
                times[name, count].append((clock() - start) / args.repeats * 1e3)
    report(times, 28)


if __name__ == "__main__":
    main()
