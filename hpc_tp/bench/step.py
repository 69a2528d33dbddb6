"""Forward+backward time of a stack of GPT blocks, against the machine's own GEMM peak.

A step is ``blocks_forward`` then ``blocks_backward`` of the loss ``mean(out**2)`` (the PyTorch
peer's loss), timed between barriers, so a step is as slow as the slowest rank; the report is the
median over repeats after warm-up. Embedding and LM head are left out: the block stack is where
tensor parallelism splits the work.

FLOPs count matrix products only (elementwise work is noise next to them), for the whole model,
all tp ranks together. Per layer, with N = batch * seq tokens, H hidden, Q = heads * head_dim,
K = kv_heads * head_dim, F ffn hidden and T the sequence length::

    forward = 2 N (H (Q + 2K) + Q H + m H F) + 4 N T Q      m = 3 for SwiGLU, else 2
    step    = 3 * forward                                  (backward = 2 products per forward one)

The 4 N T Q term is Q K^T and P V over the full T x T square. Causal attention skips the tiles
above the diagonal (``nn/attention.query_blocks``); they are still counted, as the PyTorch peer
computes them, so the FLOPs and MFU of both compare.

The record's ``floor_s`` is the other way round: the fewest FLOPs a step needs (causal attention
over the T (T + 1) / 2 pairs a query may see) at the highest GEMM peak sample, with nothing else:
the time no engine doing this step's products with this GEMM on this machine can beat. A peer's
step over it is the most any engine could be faster than that peer here (``benchmarks/w1_vs_torch.py``
prints it). The highest sample rather than the median, because on a host whose speed moves from
second to second the median can fall below what the step itself sustained (MFU over 100%).

The peak is measured in the same run, with the same GEMM the linear layers use (``kernels.blas``: MKL
where installed, else numpy's OpenBLAS; the record's ``gemm``), dtype and threads per rank: every rank
multiplies a [N, H] by [H, F/tp] matrix (the MLP's first GEMM) at the same time as the others,
since ranks that share cores share them during the step too. It is sampled after every timed
step (seven products each, the slowest rank's median) and the record's peak is the median of the
samples: one measurement after all the steps moved MFU by 2-3 points between rounds as the
machine's speed drifted. MFU = achieved FLOP/s / (tp * peak per rank). Compute and communication
come from the Communicator's ``seconds`` counter: time spent in (or waiting on) collectives is
communication, the rest of the step is compute.

Before the model is built, glibc is told to keep freed memory (``retain_freed_memory``): a step
frees and reallocates the same activations every time, and by default glibc hands the heap top
back to the OS and maps big arrays fresh, so every step page-faults ~100 MB in again (W1 at tp=2:
24k faults and 0.1-0.2 s of system time per step, ~10% of the step). With
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in the environment (the Makefile and jobs/*.sbatch export
it) glibc also asks for transparent huge pages for that heap, and the record says how much of each
rank's memory ended up on them: W1 at tp=2 runs ~2.5% faster so (fewer TLB misses in the GEMMs that
stream activations from memory).
"""

from __future__ import annotations

from statistics import median
from time import perf_counter

import numpy

from .. import backend, cuda_graph
from ..backend import retain_freed_memory  # also what backend.use('cpu') applies for training
from ..comm.mpi import MPICommunicator
from ..grid import node_of_ranks, warn_if_tp_spans_nodes
from ..kernels import blas
from ..models.config import ModelConfig
from ..models.gpt import GPTModel
from ..tensor_parallel.sequence_parallel import scatter_sequence
from ..train.metrics import peak_memory_bytes


def step_flops(cfg: ModelConfig, batch: int, seq: int, needed_only: bool = False) -> int:
    """Matrix-product FLOPs of one forward+backward of the block stack (module docstring); with
    ``needed_only`` causal attention counts only the query-key pairs a query may see."""
    n, h, f = batch * seq, cfg.hidden, cfg.ffn_hidden
    q, k = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    mlp_mats = 3 if cfg.gated_mlp else 2
    pairs = seq * (seq + 1) // 2 if needed_only and cfg.causal else seq * seq
    forward = 2 * n * (h * (q + 2 * k) + q * h + mlp_mats * h * f) + 4 * batch * pairs * q
    return 3 * forward * cfg.n_layers


def gemm_peak(comm: MPICommunicator, m: int, k: int, n: int, dtype, repeats: int = 7) -> float:
    """FLOP/s of one rank's ``[m,k] @ [k,n]`` into a reused output, all ranks at once; the median of
    ``repeats`` products, the slowest rank's. The operands live only for the measurement, so they do
    not add to the step's peak memory; their values do not matter to the GEMM's speed."""
    xp = backend.xp  # the device's GEMM where the run is on one (backend.use('cuda'))
    a, b, out = xp.full((m, k), 0.5, dtype), xp.full((k, n), 0.5, dtype), xp.empty((m, n), dtype)
    blas.matmul(a, b, out=out)  # the engine's GEMM: MKL where installed, else numpy's (or the device's)
    backend.synchronize()
    seconds = []
    for _ in range(repeats):
        comm.barrier()
        start = perf_counter()
        blas.matmul(a, b, out=out)
        backend.synchronize()
        seconds.append(perf_counter() - start)
    return 2 * m * k * n / max(comm.allgather_object(median(seconds)))


def build_blocks(cfg: ModelConfig, comm: MPICommunicator, dtype: str, seed: int = 0) -> GPTModel:
    return GPTModel(cfg, comm, dtype=dtype, seed=seed, has_embedding=False, has_head=False)


def step_function(cfg: ModelConfig, comm: MPICommunicator, batch: int, seq: int, dtype: str):
    """One forward + backward of the block stack of ``cfg`` split over ``comm`` on a fixed random input
    [batch, seq, hidden] (this rank's sequence shard with sequence parallelism), the loss mean(out**2):
    what ``benchmark_step`` times and ``device_profile`` breaks down."""
    model = build_blocks(cfg, comm, dtype)
    x = backend.xp.asarray(numpy.random.default_rng(1).standard_normal((batch, seq, cfg.hidden)).astype(dtype))
    scale = backend.xp.asarray(2.0 / x.size, dtype)  # d mean(out**2) / d out, kept in the model's dtype
    if cfg.sequence_parallel and comm.size > 1:
        x = scatter_sequence(x, comm)  # the blocks take and give this rank's sequence shard

    def one_step():  # its activations die with it: one step's alive at a time, as in training
        out, ctxs = model.blocks_forward(x)
        model.blocks_backward(out * scale, ctxs)

    return one_step


def benchmark_step(
    comm: MPICommunicator,
    cfg: ModelConfig,
    batch: int,
    seq: int,
    dtype: str = "float32",
    repeats: int = 5,
    warmup: int = 2,
    threads: int | None = None,
    graphs: bool = False,
) -> dict:
    """One record (the same on every rank) for the block stack of ``cfg`` split over ``comm``; ``graphs``:
    on a GPU, where ``comm`` is one rank or NCCL's (``cuda_graph.capturable``), the first step is
    captured as a CUDA graph, tp all-reduces included, and every later one replays it (the first step
    is then a warm-up one)."""
    retained = retain_freed_memory()
    warn_if_tp_spans_nodes(comm)
    nodes = node_of_ranks(comm)
    one_step = step_function(cfg, comm, batch, seq, dtype)
    shape = (batch * seq, cfg.hidden, max(1, cfg.ffn_hidden // comm.size))
    replayed = cuda_graph.Replayed(one_step, "the benchmark step") if graphs and cuda_graph.capturable(comm) else None
    steps, comms, peaks = [], [], []
    for i in range(warmup + repeats):
        comm.barrier()
        start, comm_start = perf_counter(), comm.seconds
        (one_step if replayed is None else replayed)()
        backend.synchronize()
        comm_s = comm.seconds - comm_start
        comm.barrier()
        if i >= warmup:
            steps.append(perf_counter() - start)
            comms.append(comm_s)
            peaks.append(gemm_peak(comm, *shape, dtype))  # between the steps: the machine as fast as during them
    per_rank = comm.allgather_object((median(steps), median(comms), peak_memory_bytes(), backend.huge_page_bytes()))
    step_s = max(s for s, _, _, _ in per_rank)
    comm_s = max(c for _, c, _, _ in per_rank)
    peak_flops = median(peaks)
    flops = step_flops(cfg, batch, seq)
    achieved = flops / step_s
    return {
        "benchmark": "step",
        "tp": comm.size,
        "nodes": len(set(nodes)),  # the planner's calibration: which link the tp all-reduces crossed,
        "ranks_per_node": max(nodes.count(n) for n in nodes),  # and how many ranks shared a node's cores
        "dtype": numpy.dtype(dtype).name,
        "threads_per_rank": threads,
        "gemm": blas.backend_for(dtype) if backend.device == "cpu" else backend.device,
        "malloc_retained": retained,
        "huge_pages_requested": backend.heap_huge_pages_requested(),
        "cuda_graph": replayed is not None and not replayed.failed,
        "huge_page_bytes": [h for _, _, _, h in per_rank],
        "layers": cfg.n_layers,
        "hidden": cfg.hidden,
        "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads,
        "ffn_hidden": cfg.ffn_hidden,
        "activation": cfg.activation,
        "causal": cfg.causal,
        "seq_len": seq,
        "micro_batch": batch,
        "repeats": repeats,
        "warmup": warmup,
        "step_s": step_s,
        "step_s_all": [float(s) for s in steps],
        "tokens_per_s": batch * seq / step_s,
        "comm_s": comm_s,
        "compute_s": step_s - comm_s,
        "flops": flops,
        "achieved_flops": achieved,
        "gemm_peak_flops_per_rank": peak_flops,
        "gemm_peak_samples": [float(p) for p in peaks],
        "mfu": achieved / (peak_flops * comm.size),
        "floor_s": step_flops(cfg, batch, seq, needed_only=True) / (max(peaks) * comm.size),
        "peak_mem_bytes": [m for _, _, m, _ in per_rank],
    }


def format_record(r: dict) -> str:
    mib = ", ".join(f"{m / 2**20:.0f}" for m in r["peak_mem_bytes"])
    return "\n".join(
        [
            f"hpc-tp bench step: {r['layers']} layers, hidden {r['hidden']}, {r['heads']} heads, ffn {r['ffn_hidden']}, "
            f"seq {r['seq_len']}, micro-batch {r['micro_batch']}, {r['dtype']}, tp={r['tp']}, "
            f"{r['threads_per_rank']} BLAS thread(s)/rank, GEMM: {r['gemm']}",
            f"  step      {r['step_s'] * 1e3:9.1f} ms  (median of {r['repeats']} after {r['warmup']} warm-up, slowest rank)"
            f"  {r['tokens_per_s']:.0f} tokens/s" + ("  (each a CUDA graph replay)" if r.get("cuda_graph") else ""),
            f"  compute   {r['compute_s'] * 1e3:9.1f} ms   communication {r['comm_s'] * 1e3:.1f} ms",
            f"  FLOPs     {r['flops'] / 1e9:9.1f} G    achieved {r['achieved_flops'] / 1e9:.1f} GFLOP/s",
            f"  GEMM peak {r['gemm_peak_flops_per_rank'] / 1e9:9.1f} GFLOP/s per rank (median of {len(r['gemm_peak_samples'])} between the steps)  "
            f"MFU {r['mfu'] * 100:.1f}%",
            f"  floor     {r['floor_s'] * 1e3:9.1f} ms  (the needed products at the highest peak sample, nothing else; step / floor "
            f"{r['step_s'] / r['floor_s']:.2f})",
            f"  peak memory per rank: {mib} MiB",
            _huge_pages_line(r),
        ]
    )


def _huge_pages_line(r: dict) -> str:
    shares = [f"{h / 2**20:.0f} of {rss / 2**20:.0f}" for h, rss in filter(None, r["huge_page_bytes"])]
    measured = f"{', '.join(shares)} MiB resident per rank" if shares else "not reported by this kernel"
    if r["huge_pages_requested"]:
        return f"  huge pages: {measured}"
    return f"  huge pages: {measured}; heap not on them (export GLIBC_TUNABLES={backend.HUGE_PAGE_TUNABLE}: faster)"
