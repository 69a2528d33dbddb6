"""One layer's decode-step attention over a paged KV cache, the in-place kernel
(``kernels.paged_attention``) against the composed path (every row's slots gathered up to the longest,
then the layer's core: MKL's fused loop for float32, numpy's products for half dtypes), alternating;
for bfloat16 where the CPU has AVX512_BF16 also the kernel that widens K/V to float32 (``widened``, the
path elsewhere) beside ``kernels.paged_bf16``'s.

    OMP_NUM_THREADS=1 python benchmarks/paged_attention.py [--dtypes float32,bfloat16] [--threads 1,2]
        [--rows 8] [--layers 1] [--rounds 5] [--repeats 200] [--no-composed]

The shape is SmolLM2-135M's (9 query heads, 3 KV heads of 64) in workload B of issue 33: ``--rows``
requests of 50-264 tokens (prompts of 50-200 and up to 64 new), their K/V in blocks of 16 slots
scattered through one pool. ``--layers 30`` gives each of 30 layers its own pools, visited in turn as a
decode step does (30 x 1 MiB in bfloat16: out of L2, and much of it out of L3 by the next visit).
Each round runs every dtype, thread count (``kernels.threads.use``) and path once, ``--repeats``
calls of every layer each; a line gives the wall time of one layer's call, median [range] over the
rounds (wall time: a second thread's work is not the caller's CPU time, and on a loaded machine it
includes the waits for a core). No time is asserted: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy

from hpc_tp.backend import resolve_dtype
from hpc_tp.comm.mpi import self_comm
from hpc_tp.kernels import cpu_attention, paged_attention, paged_bf16, threads
from hpc_tp.nn.attention import ParallelAttention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def decode_step(dtype, rows: int, seed: int = 0):
    """q [rows, hk, g, 1, d], K/V pools [hk, slots, d], each row's slots [rows, longest] and lengths."""
    rng = numpy.random.default_rng(seed)
    counts = rng.integers(50, 265, rows)
    blocks = -(-counts // BLOCK)
    order = rng.permutation(int(blocks.sum()))  # the pool's blocks, handed out in no order
    longest = int(counts.max())
    slots, first = numpy.zeros((rows, longest), numpy.int64), 0
    for row, count in enumerate(counts):
        mine = order[first : first + blocks[row]]
        slots[row, :count] = (mine[:, None] * BLOCK + numpy.arange(BLOCK)).reshape(-1)[:count]
        first += blocks[row]
    k, v = (rng.standard_normal((KV_HEADS, len(order) * BLOCK, HEAD_DIM)).astype(dtype) for _ in range(2))
    q = (rng.standard_normal((rows, KV_HEADS, HEADS // KV_HEADS, 1, HEAD_DIM)) / 8).astype(dtype)
    return q, k, v, slots, counts


def composed(layer, q, k, v, slots, counts, out):
    """The layer's path without the kernel: the rows' slots gathered, padding masked, its core."""
    keys, values = k[:, slots].swapaxes(0, 1), v[:, slots].swapaxes(0, 1)
    key_mask = numpy.arange(slots.shape[1]) < counts[:, None]
    fused = cpu_attention.supported(q, keys, values, out)
    layer._core(q, keys, values, out, key_mask, slots.shape[1] - 1, 0, None, fused)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--no-composed", action="store_true", help="time the kernels only")
    args = p.parse_args()
    counts = [int(c) for c in args.threads.split(",")]
    cases = {}  # name: (one call of every layer, whether bfloat16 takes paged_bf16)
    for name in args.dtypes.split(","):
        dtype = resolve_dtype(name)
        layer = ParallelAttention(
            HEADS * HEAD_DIM, HEADS, KV_HEADS, self_comm(), bias=False, rope_theta=1e5, dtype=dtype
        )
        q, k, v, slots, counts_ = decode_step(dtype, args.rows)
        pools = [(k, v)] + [(k.copy(), v.copy()) for _ in range(args.layers - 1)]
        out = numpy.empty_like(q)

        def kernel(q=q, s=slots, c=counts_, o=out, pools=pools):
            for k, v in pools:
                paged_attention.decode(q, k, v, s, c, o)

        def gathered(m=layer, q=q, s=slots, c=counts_, o=out, pools=pools):
            for k, v in pools:
                composed(m, q, k, v, s, c, o)

        cases[f"{name} kernel"] = (kernel, True)
        if name == "bfloat16" and paged_bf16.AVAILABLE:
            cases[f"{name} widened"] = (kernel, False)
        if not args.no_composed:
            cases[f"{name} composed"] = (gathered, True)
    available = paged_bf16.AVAILABLE
    times = {(name, count): [] for name in cases for count in counts}
    for _ in range(args.rounds + 1):  # the first round compiles and warms up: not counted
        for count in counts:
            threads.use(count)
            for name, (call, on_bf16) in cases.items():
                paged_bf16.AVAILABLE = available and on_bf16
                start = time.perf_counter()
                for _ in range(args.repeats):
                    call()
                times[name, count].append((time.perf_counter() - start) / args.repeats / args.layers * 1e3)
    report(times)


def report(times, width: int = 20):
    """A line a (case, thread count) of ``times`` (ms a layer, a round each): median [range] of the
    rounds after the first (it compiles and warms up)."""
    for (name, count), values in times.items():
        values = values[1:]
        print(
            f"{name:{width}s} {count} thread(s): {statistics.median(values):.3f} ms "
            f"[{min(values):.3f}, {max(values):.3f}] a layer"
        )


if __name__ == "__main__":
    main()
