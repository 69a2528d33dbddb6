"""Prefill's threaded work at several thread counts, alternating in one run, float32: the fused CPU
attention core (``kernels.cpu_attention``) of a prefill pass of the 135M llama model (9 query heads
over 3 KV heads, head size 64, two right-padded prompts, causal) and of a training step (12 heads, 4
sequences of 256 tokens, forward and backward), and with ``--products`` that model's prefill products
([--rows, K] @ W through ``kernels.blas``, each call the next of 30 copies of W, as 30 layers are).

    OMP_NUM_THREADS=1 python benchmarks/prefill_threads.py [--threads 1,2] [--rounds 5] [--repeats 20]
        [--products] [--rows 93]

Each round runs every case at every count (``kernels.threads.use``: MKL's count and the kernels'),
``--repeats`` calls each, and keeps the median wall time of a call and the median process CPU time
(every thread's); a line gives the median and the range of those over the rounds. Run it with
another checkout first on ``PYTHONPATH`` for an A/B.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy

from hpc_tp.kernels import blas, cpu_attention, threads
from hpc_tp.nn.attention import query_blocks


def _case(batch, kv_heads, group, tokens, head_dim, padded, rng):
    """Q (scaled), K, V, the output view, dO and the key padding bias of one attention call."""
    shape = (batch, kv_heads, group, tokens, head_dim)
    q, dout = (rng.standard_normal(shape).astype(numpy.float32) / 8 for _ in range(2))
    k, v = (rng.standard_normal((batch, kv_heads, tokens, head_dim)).astype(numpy.float32) for _ in range(2))
    bias = numpy.zeros((batch, tokens), numpy.float32)
    for row, length in enumerate(padded):
        bias[row, length:] = -numpy.inf
    return q, k, v, numpy.empty_like(q), dout, bias


def _prefill(q, k, v, out, dout, bias):
    cpu_attention.forward(q, k, v, out, query_blocks(q.shape[3], k.shape[2], 0, True), 0, True, bias)


def _training(q, k, v, out, dout, bias):
    blocks = query_blocks(q.shape[3], k.shape[2], 0, True)
    probs = cpu_attention.forward(q, k, v, out, blocks, 0, True)
    dq, dk, dv = numpy.empty_like(q), numpy.zeros_like(k), numpy.zeros_like(v)
    cpu_attention.backward(dout, q, k, v, probs, blocks, dq, dk, dv)


def _products(rows, rng):
    """{name: (call, arrays)} for the model's four prefill products at ``rows`` rows."""
    cases = {}
    for k, n in ((576, 3072), (1536, 576), (576, 960), (576, 576)):
        weights = [rng.standard_normal((k, n)).astype(numpy.float32) for _ in range(30)]
        a, out = rng.standard_normal((rows, k)).astype(numpy.float32), numpy.empty((rows, n), numpy.float32)
        cases[f"[{rows}, {k}] @ [{k}, {n}], 30 weights"] = (_each_weight, (a, weights, out))
    return cases


def _each_weight(a, weights, out):
    for w in weights:
        blas.matmul(a, w, out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--products", action="store_true", help="time the prefill products instead")
    parser.add_argument("--rows", type=int, default=93, help="rows of the products (default %(default)s)")
    args = parser.parse_args(argv)
    rng = numpy.random.default_rng(0)
    shapes = (
        _products(args.rows, rng)
        if args.products
        else {
            "prefill [2, 3x3, 200, 64] forward": (_prefill, _case(2, 3, 3, 200, 64, (200, 90), rng)),
            "training [4, 12, 256, 64] forward+backward": (_training, _case(4, 12, 1, 256, 64, (), rng)),
        }
    )
    counts = [int(c) for c in args.threads.split(",")]
    times = {(name, count): ([], []) for name in shapes for count in counts}
    for _ in range(args.rounds):
        for name, (call, arrays) in shapes.items():
            for count in counts:
                threads.use(count)
                call(*arrays)  # compiled and warm before it is timed
                walls, cpus = [], []
                for _ in range(args.repeats):
                    wall, cpu = time.perf_counter(), time.process_time()
                    call(*arrays)
                    walls.append(time.perf_counter() - wall)
                    cpus.append(time.process_time() - cpu)
                times[name, count][0].append(statistics.median(walls))
                times[name, count][1].append(statistics.median(cpus))
    for (name, count), (walls, cpus) in times.items():
        print(f"{name:45s} threads={count}: wall {_ms(walls)}, CPU {_ms(cpus)}")


def _ms(seconds):
    ms = [1000 * t for t in seconds]
    return f"{statistics.median(ms):7.3f} ms ({min(ms):.3f}-{max(ms):.3f})"


if __name__ == "__main__":
    main()
