"""Prefill-shaped products of weights kept quantized, the checkpoint's layout against the packed one
(``QuantizedMatrix.pack``: ``int8_dot``'s interleaved layout, the one copy a loaded model keeps where the
CPU has VNNI), alternating in one run: for the 135M llama model's linear weights ([576, 960],
[576, 576], [576, 3072], [1536, 576]) in int8 and int4, blocks of rows dequantized to float32 (the
whole weight) and the product [--rows, K] @ W (blocks dequantized, then BLAS).

    OMP_NUM_THREADS=1 python benchmarks/quantized_prefill.py [--rows 256] [--rounds 5]

Each line gives, per layout, the CPU time's range over the rounds and its median, summed over the four
weights (one transformer layer's products); no time is asserted anywhere.
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def main():
    import numpy

    from hpc_tp.kernels import int8_dot, quantized

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="activation rows of a product (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default %(default)s)")
    args = parser.parse_args()
    if not int8_dot.AVAILABLE:
        raise SystemExit("the packed layout needs numba and a CPU with avx512_vnni")
    rng = numpy.random.default_rng(0)
    for bits in (8, 4):
        weights = {"stored": [], "packed": []}
        for k, n in SHAPES:
            stored = quantized.quantize(rng.normal(size=(k, n)), bits)
            packed = quantized.quantize(rng.normal(size=(k, n)), bits)
            packed.pack()
            weights["stored"].append(stored)
            weights["packed"].append(packed)
        inputs = {k: rng.normal(size=(args.rows, k)).astype(numpy.float32) for k, _ in SHAPES}
        times = {(layout, what): [] for layout in weights for what in ("dequantize", "product")}
        for _ in range(args.rounds + 1):  # the first round compiles: not counted
            for layout, matrices in weights.items():
                start = time.process_time()
                for w in matrices:
                    w.dequantize()
                middle = time.process_time()
                for w in matrices:
                    quantized.matmul(inputs[w.shape[0]], w)
                times[layout, "dequantize"].append(middle - start)
                times[layout, "product"].append(time.process_time() - middle)
        for (layout, what), values in times.items():
            ms = [1e3 * v for v in values[1:]]
            print(
                f"int{bits} {layout:6s} {what:10s} {min(ms):7.2f}-{max(ms):7.2f} ms, median {statistics.median(ms):7.2f}"
            )


if __name__ == "__main__":
    main()
