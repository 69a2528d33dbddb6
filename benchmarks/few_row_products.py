"""Decode-shaped products, BLAS against ``kernels.small_m``, alternating in one run: [M, K] @ W for the
135M llama model's MLP weights and its tied head (a transposed view of the [49152, 576] embedding),
float32 through ``kernels.blas``'s BLAS path, through the few-row kernel and, where the CPU has
AVX-512, through ``kernels.f32_dot``, and bfloat16 weights (with bfloat16 activations, as ``--dtype
bfloat16`` holds them) through the kernel and, where the CPU has avx512_bf16, through
``kernels.bf16_dot`` from the weight as stored and from its panels (``kernels.bf16_panels``, as a
model loaded for inference keeps it). Then prefill-shaped products ([--prefill-rows, K] @ W,
the weight in cache) in GFLOP/s: float32 through MKL, bfloat16 through ``blas.widened_matmul`` and
through ``kernels.bf16_dot`` (stored, and panels).

    OMP_NUM_THREADS=1 python benchmarks/few_row_products.py [--rows 1,8,32] [--rounds 3] [--threads 1,2]
        [--prefill-rows 256] [--step]

Each call takes the next of several copies of the weight (128 MiB in all), so the weight comes from
memory as in a decode step, not from cache. Times are the thread's CPU time per product, the best of
``--repeats`` passes over the copies, and each line gives the range of that best over the rounds
(CPU time rather than wall time: on a shared machine a descheduled thread is not the kernel's cost;
memory traffic of other processes still is). GB/s: the weight's bytes over the best time.

``--threads 1,2`` runs every way at each thread count (``kernels.threads.use``: MKL's and the
kernels'), alternating within each round; the times are then wall times, since a second thread's
work is not the calling thread's CPU time (on a loaded machine they include waits for a core).

``--step`` times instead a whole decode step's products of that model at 8 rows, float32 (30 layers
of QKV [576, 960], output [576, 576], gate and up [576, 3072], down [1536, 576], then the head),
through ``kernels.small_m`` and ``kernels.f32_dot`` in turn: each round, per way and thread count, the
median wall and process CPU time (every thread's) of ``--repeats`` steps.
OpenMP's wait policy is read once a process, so compare it across runs (``OMP_WAIT_POLICY=active``).
"""

from __future__ import annotations

import argparse
import time

import numpy

SHAPES = {
    "mlp in [576, 3072]": (576, 3072, False),
    "mlp out [1536, 576]": (1536, 576, False),
    "head [576, 49152] (E.T)": (576, 49152, True),
}


def best_seconds(product, weights, repeats: int, clock) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        for w in weights:
            product(w)
        best = min(best, (clock() - start) / len(weights))
    return best


STEP_WEIGHTS = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def decode_step_times(counts, rounds: int, repeats: int):
    """{(way, count): ([median wall s], [median CPU s])} over the rounds, for ``--step``: the products
    through ``kernels.small_m`` and, where the CPU has AVX-512, through ``kernels.f32_dot``."""
    from hpc_tp.kernels import f32_dot, small_m, threads

    rng = numpy.random.default_rng(0)
    layers = [[rng.standard_normal(shape).astype(numpy.float32) for shape in STEP_WEIGHTS] for _ in range(30)]
    head = rng.standard_normal((49152, 576)).astype(numpy.float32).T
    hidden, inner = (
        rng.standard_normal((8, 576)).astype(numpy.float32),
        rng.standard_normal((8, 1536)).astype(numpy.float32),
    )
    ways = {"small_m": small_m.matmul}
    if f32_dot.AVAILABLE:
        ways["f32_dot"] = f32_dot.matmul

    def step(matmul):
        for layer in layers:
            for w in layer:
                matmul(inner if w.shape[0] == inner.shape[1] else hidden, w)
        matmul(hidden, head)

    times = {(way, count): ([], []) for way in ways for count in counts}
    for _ in range(rounds):
        for (way, count), (walls, cpus) in times.items():
            threads.use(count)
            step(ways[way])  # the kernels compiled or loaded, the weights touched
            samples = []
            for _ in range(repeats):
                wall, cpu = time.perf_counter(), time.process_time()
                step(ways[way])
                samples.append((time.perf_counter() - wall, time.process_time() - cpu))
            walls.append(numpy.median([wall for wall, _ in samples]))
            cpus.append(numpy.median([cpu for _, cpu in samples]))
    return times


def main():
    import ml_dtypes

    from hpc_tp.kernels import bf16_dot, bf16_panels, blas, f32_dot, small_m, threads

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32", help="values of M (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="passes per round (default %(default)s)")
    parser.add_argument("--threads", default=None, help="thread counts to compare, e.g. 1,2 (default: the rank's)")
    parser.add_argument("--step", action="store_true", help="time a decode step's products at 8 rows instead")
    parser.add_argument(
        "--prefill-rows", type=int, default=256, help="rows of the prefill products (default %(default)s)"
    )
    args = parser.parse_args()
    counts = [threads.COUNT] if args.threads is None else [int(c) for c in args.threads.split(",")]
    if args.step:
        for (way, count), (walls, cpus) in decode_step_times(counts, args.rounds, args.repeats).items():
            print(
                f"decode step, 8 rows, {way}, {count} thread(s): wall {min(walls) * 1e3:.1f}-{max(walls) * 1e3:.1f} ms, "
                f"CPU {min(cpus) * 1e3:.1f}-{max(cpus) * 1e3:.1f} ms",
                flush=True,
            )
        return
    clock = time.thread_time if counts == [1] else time.perf_counter
    rng = numpy.random.default_rng(0)
    for name, (k, n, transposed) in SHAPES.items():
        copies = max(1, (128 << 20) // (4 * k * n))
        stored = [rng.standard_normal((n, k) if transposed else (k, n)).astype(numpy.float32) for _ in range(copies)]
        full = [w.T if transposed else w for w in stored]
        half = [w.astype(ml_dtypes.bfloat16).T if transposed else w.astype(ml_dtypes.bfloat16) for w in stored]
        panels = None  # packed at the first M, where the kernel is there
        for m in (int(r) for r in args.rows.split(",")):
            a = rng.standard_normal((m, k)).astype(numpy.float32)
            a_half = a.astype(ml_dtypes.bfloat16)
            out = numpy.empty((m, n), numpy.float32)
            # kernels.blas's MKL call as it was before the few-row kernels (numpy where MKL is missing)
            ways = {
                "blas f32": (lambda w: blas._mkl_gemm(a, w, out, 0.0) or numpy.matmul(a, w, out=out), full),
                "small_m f32": (lambda w: small_m.matmul(a, w, out), full),
            }
            if f32_dot.AVAILABLE:
                ways["f32_dot"] = (lambda w: f32_dot.matmul(a, w, out), full)
            ways |= {
                "small_m bf16": (lambda w: small_m.matmul(a_half, w, out), half),
            }
            if bf16_dot.AVAILABLE:
                ways["bf16_dot"] = (lambda w: bf16_dot.matmul(a_half, w, out), half)
                panels = panels or [bf16_panels.PanelMatrix(w) for w in half]
                ways["bf16_dot panels"] = (lambda w: bf16_dot.matmul(a_half, w, out), panels)
            times = {(way, count): [] for way in ways for count in counts}
            for _ in range(args.rounds):
                for way, count in times:
                    threads.use(count)
                    product, weights = ways[way]
                    times[way, count].append(best_seconds(product, weights, args.repeats, clock))
            parts = []
            for (way, count), seconds in times.items():
                gigabytes = (ways[way][1][0].nbytes) / 1e9
                label = way if len(counts) == 1 else f"{way} x{count}"
                parts.append(
                    f"{label} {min(seconds) * 1e3:.3f}-{max(seconds) * 1e3:.3f} ms ({gigabytes / min(seconds):.1f} GB/s)"
                )
            print(f"{name} M={m}: " + ", ".join(parts), flush=True)
        prefill(full[0], half[0], args, rng, clock)


def prefill(full, half, args, rng, clock):
    """[--prefill-rows, K] @ W in GFLOP/s (the weight in cache, as a prefill's rows reuse it)."""
    import ml_dtypes

    from hpc_tp.kernels import bf16_dot, bf16_panels, blas

    (k, n), m = full.shape, args.prefill_rows
    a = rng.standard_normal((m, k)).astype(numpy.float32)
    a_half, out = a.astype(ml_dtypes.bfloat16), numpy.empty((m, n), numpy.float32)
    ways = {
        "mkl f32": (lambda w: blas.matmul(a, w, out), [full]),
        "widened bf16": (lambda w: blas.widened_matmul(a_half, w, out), [half]),
    }
    if bf16_dot.AVAILABLE:
        ways["bf16_dot"] = (lambda w: bf16_dot.matmul(a_half, w, out), [half])
        ways["bf16_dot panels"] = (lambda w: bf16_dot.matmul(a_half, w, out), [bf16_panels.PanelMatrix(half)])
    rates = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way, (product, weights) in ways.items():
            rates[way].append(2 * m * k * n / best_seconds(product, weights, args.repeats, clock) / 1e9)
    parts = [f"{way} {min(r):.0f}-{max(r):.0f} GFLOP/s" for way, r in rates.items()]
    print(f"  prefill M={m}: " + ", ".join(parts), flush=True)


if __name__ == "__main__":
    main()
