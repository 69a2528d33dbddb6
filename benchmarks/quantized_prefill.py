"""Prefill-shaped products of weights kept quantized, in the packed layout a loaded model keeps
(``QuantizedMatrix.pack``, where the CPU has VNNI), the two paths alternating in one run: blocks of
weight rows dequantized to float32 and multiplied by BLAS (``quantized.dequantized_matmul``, the
many-row path before the integer one took it) against the integer path (``quantized.matmul``:
activations quantized to int8 per row, ``int8_dot``'s wide tiles). For the 135M llama model's linear
weights ([576, 960], [576, 576], [576, 3072], [1536, 576]: one transformer layer's products) in int8
and int4, at each thread count of --threads (``kernels.threads.use``, in this process).

    python benchmarks/quantized_prefill.py [--rows 256] [--rounds 5] [--threads 1,2]

Each line gives, per path, the wall time's range over the rounds and its median, summed over the four
weights, and the ratio of the medians; no time is asserted anywhere. Run it unbound (plain python) for
more than one thread: Open MPI's mpiexec binds a lone rank to one core.
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def main():
    import numpy

    from hpc_tp.kernels import int8_dot, quantized, threads

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="activation rows of a product (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default %(default)s)")
    parser.add_argument("--threads", default="1", help="comma-separated thread counts (default %(default)s)")
    args = parser.parse_args()
    if not int8_dot.AVAILABLE:
        raise SystemExit("the integer path needs numba and a CPU with avx512_vnni")
    counts = [int(count) for count in args.threads.split(",")]
    rng = numpy.random.default_rng(0)
    paths = {
        "dequantize+BLAS": lambda a, w: quantized.dequantized_matmul(a, w, numpy.dtype(numpy.float32)),
        "int8 VNNI": quantized.matmul,
    }
    for bits in (8, 4):
        weights = [quantized.quantize(rng.normal(size=(k, n)), bits) for k, n in SHAPES]
        for w in weights:
            w.pack()
        inputs = {k: rng.normal(size=(args.rows, k)).astype(numpy.float32) for k, _ in SHAPES}
        for count in counts:
            threads.use(count)
            times = {name: [] for name in paths}
            for _ in range(args.rounds + 1):  # the first round compiles: not counted
                for name, product in paths.items():
                    start = time.perf_counter()
                    for w in weights:
                        product(inputs[w.shape[0]], w)
                    times[name].append(time.perf_counter() - start)
            medians = {}
            for name, values in times.items():
                ms = [1e3 * v for v in values[1:]]
                medians[name] = statistics.median(ms)
                print(
                    f"int{bits} {count} thread{'s' * (count > 1)} {name:16s} {min(ms):7.2f}-{max(ms):7.2f} ms, "
                    f"median {medians[name]:7.2f}"
                )
            old, new = medians.values()
            print(f"int{bits} {count} thread{'s' * (count > 1)} dequantize+BLAS / int8 VNNI: {old / new:.2f}x")


if __name__ == "__main__":
    main()
