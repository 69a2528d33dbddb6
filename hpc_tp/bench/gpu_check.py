"""``make gpu-check`` (``python3 -m hpc_tp.bench.gpu_check``): the GPU backend checked and measured
on one machine in well under 5 minutes, as a short table.

1. environment: card, driver and runtime, cupy, NCCL, ml_dtypes, MPI (CUDA-aware or not), mpiexec;
2. checks, each a measured number against its bound: the fused kernels against numpy (float64 and
   float32), the norms' float16 and bfloat16 kernels against float32 rounded once (the same bits),
   tp=2 against tp=1 and ZeRO-1 against AdamW at dp=2 on the device in float64 (2 ranks sharing the
   card through MPI, only where ``mpiexec`` works; NCCL where each has a card of its own), tp=2's
   block stack replayed from a CUDA graph against one process (over NCCL only: two cards), training
   steps on the device against the CPU (float64), training steps replayed from a CUDA graph (``train
   --cuda-graph``) against eager ones (float64), decode steps replayed from a captured CUDA graph
   against the CPU's (float64),
   continuous batching's decode steps replayed from a graph a bucket against the CPU's eager ones
   as rows join and leave (float64), and mixed precision (float16, bfloat16 where ml_dtypes is)
   against float32 on the device;
3. the W1 block-stack benchmark (``hpc_tp.bench.step``) on the device in float32 and bfloat16
   (float16 where there is no bfloat16), MFU against the same-shape GEMM and against the card's
   measured large-GEMM peak, and each step again replayed from a CUDA graph (``bench step
   --cuda-graph``); a 1B-class block stack (``gpt-1b``: hidden 2048, 16 layers, seq 2048) in bfloat16;
   W1 trained at tp = 1 eagerly and with ``--cuda-graph``, alternating; then W1 decode steps with and
   without a CUDA graph (``bench decode``), and W1's
   continuous decode step at 1, 8 and 32 rows eager and replayed (``decoding.PagedSteps``), alternating;
4. the fused attention kernels (``flash_attention``) against the composed core: their error (a check
   row, float64, float32 and half) and both paths' forward + backward time on W1's attention and a
   1B-class one, alternating;
5. the PyTorch peer on the same card (``torch_peer``, where torch imports): the W1 step eagerly and
   through ``torch.compile``, alternating with this engine's, and W1 decode eagerly and from a CUDA
   graph, with the ratios; and, right after the W1 rows, where the W1 step's device time goes, this
   engine's and PyTorch's, kernel by kernel (``device_profile``).

The table goes to stdout and, with ``--out DIR`` or ``$OUT``, to DIR/gpu_check.md and .json.
Exit status: 0 when every check passed, and also when there is no CUDA device (the only line
then starts "gpu-check skipped: no CUDA device"); 1 when a check failed or raised.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy

from .. import backend

KERNEL_TOL = {"float64": 1e-12, "float32": 2e-5}
TP_TOL = 1e-9
# Worst per-step loss drift from float32 over 5 demo steps (numpy float16 on the CPU: 5e-4);
# bfloat16 keeps 8 mantissa bits to float16's 11.
MIXED_TOL = {"float16": 1e-2, "bfloat16": 5e-2}
MOE = {"num_experts": 4, "top_k": 2}  # every MLP a Mixture of Experts: routing, dispatch and combine on the device
W1_ROWS = ((4, 256), (32, 256))  # (micro-batch, seq): the CPU benchmark's shape, then one a GPU fills
# (preset, micro-batch, seq, also as a CUDA graph): W1's rows, then a 1B-class model's block stack (hidden
# 2048, 16 layers, seq 2048), whose step is long enough that the host's launches do not count.
BENCH_ROWS = tuple(("w1", batch, seq, True) for batch, seq in W1_ROWS) + (("gpt-1b", 4, 2048, False),)
# Fused attention against the composed core in float64 on the host: sums in float64, float32 or float;
# half inputs differ from it by their output's rounding (2^-8 for bfloat16, 2^-11 for float16) and more.
FLASH_TOL = {"float64": 1e-12, "float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}
# (name, (B, hk, g, T, keys, d), q offset, causal, padded, window): W1's heads, then GQA with padding,
# decoding after a cache, the largest head size with a sliding window, and no causal mask.
FLASH_CASES = (
    ("W1 heads", (2, 12, 1, 256, 256, 64), 0, True, False, 0),
    ("GQA, padding", (2, 2, 4, 100, 100, 128), 0, True, True, 0),
    ("after a cache", (2, 2, 2, 7, 40, 80), 33, True, True, 0),
    ("head 256, window", (1, 1, 2, 70, 70, 256), 0, True, False, 33),
    ("not causal", (2, 3, 1, 50, 50, 32), 0, False, True, 0),
)
# (name, B, heads, T, d): W1's attention at micro-batch 32 and a 1B-class model's (hidden 2048, seq 2048).
FLASH_SHAPES = (("W1 32x256", 32, 12, 256, 64), ("1B 4x2048", 4, 16, 2048, 128))
PEER_ROUNDS = 3
# A training step replayed from a CUDA graph against the same step launched eagerly: the same kernels,
# save the order of cupy's atomic adds (the embedding's gradient); float32 losses drift by their rounding.
CAPTURED_TOL = 1e-12
CAPTURED_TRAIN_TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


# -- checks: each returns numbers; the bounds are applied by the caller (here and tests/test_gpu.py) --
def _rel(a, b) -> float:
    a, b = (numpy.asarray(backend.to_numpy(v), dtype=numpy.float64) for v in (a, b))
    return float(numpy.abs(a - b).max(initial=0.0) / max(numpy.abs(b).max(initial=0.0), 1e-300))


def _worst(device_out, host_out) -> float:
    if isinstance(host_out, tuple):
        return max(_worst(d, h) for d, h in zip(device_out, host_out))
    return _rel(device_out, host_out)


def kernel_errors(dtype: str, rows: int = 37, n: int = 300) -> dict[str, float]:
    """Worst relative error of each fused kernel (``functional`` on cupy) against numpy."""
    import cupy

    from ..kernels import cuda_kernels as K
    from ..kernels import functional as F

    rng = numpy.random.default_rng(0)
    x, dy, gain, bias = (rng.standard_normal(s).astype(dtype) for s in ((rows, n), (rows, n), (n,), (n,)))
    scores = x.copy()
    scores[0] = -numpy.inf  # a fully masked row
    scores[1, n // 3 :] = -numpy.inf
    d = {
        name: cupy.asarray(v) for name, v in (("x", x), ("dy", dy), ("gain", gain), ("bias", bias), ("scores", scores))
    }
    errors = {}
    for name, fwd, bwd in (
        ("gelu_tanh", F.gelu_tanh_forward, F.gelu_tanh_backward),
        ("silu", F.silu_forward, F.silu_backward),
    ):
        (y, saved), (dev_y, dev_saved) = fwd(x), fwd(d["x"])
        errors[name] = max(_worst(dev_y, y), _worst(bwd(d["dy"], dev_saved), bwd(dy, saved)))
    act, act_saved = F.silu_forward(x)
    dev_y, dev_saved = K.swiglu_forward(d["x"], d["dy"])
    errors["swiglu"] = max(
        _worst(dev_y, act * dy),
        _worst(
            K.swiglu_backward(d["gain"][None] * d["dy"], dev_saved),
            (F.silu_backward(gain * dy * dy, act_saved), gain * dy * act),
        ),
    )
    p, dev_p = F.softmax_forward(scores), F.softmax_forward(d["scores"])
    errors["softmax"] = max(_worst(dev_p, p), _worst(F.softmax_backward(d["dy"], dev_p), F.softmax_backward(dy, p)))
    (y, saved), (dev_y, dev_saved) = (
        F.layernorm_forward(x, gain, bias, 1e-5),
        F.layernorm_forward(d["x"], d["gain"], d["bias"], 1e-5),
    )
    errors["layernorm"] = max(
        _worst((dev_y, dev_saved), (y, saved)),
        _worst(F.layernorm_backward(d["dy"], d["gain"], dev_saved), F.layernorm_backward(dy, gain, saved)),
    )
    (y, saved), (dev_y, dev_saved) = F.rmsnorm_forward(x, gain, 1e-6), F.rmsnorm_forward(d["x"], d["gain"], 1e-6)
    errors["rmsnorm"] = max(
        _worst((dev_y, dev_saved), (y, saved)),
        _worst(F.rmsnorm_backward(d["dy"], d["gain"], dev_saved), F.rmsnorm_backward(dy, gain, saved)),
    )
    return errors


def half_norm_mismatches(dtype: str, rows: int = 37, n: int = 300) -> dict[str, int]:
    """Elements where the norm kernels' half instances (``dtype`` in and out, sums in float32) differ
    from the float32 kernels on the widened inputs, each output rounded once to ``dtype`` (the path a
    half norm took before): y and xhat forward, dx, the gain's and the bias's float32 gradients
    backward, for layernorm and rmsnorm. 0 everywhere: the same bits."""
    from ..kernels import cuda_kernels as K

    xp = backend.xp
    rng = numpy.random.default_rng(0)
    x, dy = (xp.asarray(rng.standard_normal((rows, n)) * 3).astype(dtype) for _ in range(2))
    gain, bias = (xp.asarray(rng.standard_normal(n), dtype="float32") for _ in range(2))
    wide_x, wide_dy = x.astype("float32"), dy.astype("float32")

    def differ(a, b):  # b rounded once to a's dtype where a is half
        return int((a.astype("float32") != b.astype(a.dtype).astype("float32")).sum())

    mismatches = {}
    for norm, extra in (("layernorm", (bias,)), ("rmsnorm", ())):
        forward, backward = getattr(K, f"{norm}_forward"), getattr(K, f"{norm}_backward")
        y, saved = forward(x, gain, *extra, 1e-5)
        wide_y, (wide_xhat, wide_rstd) = forward(wide_x, gain, *extra, 1e-5)
        grads = backward(dy, gain, saved)
        wide_grads = backward(wide_dy, gain, (wide_xhat.astype(dtype).astype("float32"), wide_rstd))
        mismatches[norm] = differ(y, wide_y) + differ(saved[0], wide_xhat)
        mismatches[norm] += sum(differ(g, w) for g, w in zip(grads, wide_grads))
    return mismatches


def composed_attention(q, k, v, dout, q_offset, causal, key_mask=None, window=0):
    """(output, log-sum-exp, dQ, dK, dV) of the composed attention core (``attention._composed_forward``
    and ``_composed_backward``) on host arrays: Q [B, hk, g, T, d] (scaled), K, V [B, hk, keys, d]; the
    padding and the sliding window as an additive bias, the causal mask in the softmax."""
    from ..nn import attention  # the engine loads when a check runs: gpu-check first probes for a device

    b, hk, g, t, d = q.shape
    keys = k.shape[2]
    allowed = numpy.ones((b, t, keys), dtype=bool)
    if key_mask is not None:
        allowed &= key_mask.astype(bool)[:, None, :]
    if window:
        allowed &= (numpy.arange(t)[:, None] + q_offset - numpy.arange(keys)[None]) < window
    masks = (numpy.where(allowed, 0.0, -numpy.inf)[:, None, None], q_offset if causal else None, 0)
    blocks = [(slice(0, t), slice(0, keys))]
    out = numpy.empty(q.shape)
    probs = attention._composed_forward(q, k, v, out, blocks, masks, None)
    lse = attention._composed_forward(q, k, v, numpy.empty(q.shape), blocks, masks, None, statistics=True)
    dq, dk, dv = numpy.empty(q.shape), numpy.zeros(k.shape), numpy.zeros(v.shape)
    attention._composed_backward(dout, q, k, v, probs, blocks, None, dq, dk, dv)
    return out, lse, dq, dk, dv


def attention_case(shape, padded: bool, seed: int = 0):
    """Q (scaled), K, V, dO in float64 and a key mask (left padding of unequal lengths, so that the first
    queries of a sequence see no key at all; None without ``padded``) for ``shape`` (B, hk, g, T, keys, d)."""
    batch, hk, g, t, keys, d = shape
    rng = numpy.random.default_rng(seed)
    q = rng.standard_normal((batch, hk, g, t, d)) / numpy.sqrt(d)
    k, v = rng.standard_normal((2, batch, hk, keys, d))
    key_mask = None
    if padded:
        key_mask = numpy.ones((batch, keys), dtype=bool)
        for b in range(batch):
            key_mask[b, : (2 * b + 3) % keys] = False
    return q, k, v, rng.standard_normal(q.shape), key_mask


def flash_errors(dtype: str) -> dict[str, float]:
    """Worst relative error of the fused kernels' output, log-sum-exp, dQ, dK and dV in ``dtype``, per
    case of ``FLASH_CASES``, against the composed core in float64 on the same (rounded) inputs."""
    import cupy  # optional (hpc_tp[gpu]): only a machine with a device gets here

    from ..kernels import flash_attention  # loaded when the check runs, as the engine's other modules

    errors = {}
    for name, shape, q_offset, causal, padded, window in FLASH_CASES:
        arrays = attention_case(shape, padded)
        rounded = [a.astype(backend.resolve_dtype(dtype)) for a in arrays[:4]]
        q, k, v, dout = (cupy.asarray(a) for a in rounded)
        mask = None if arrays[4] is None else cupy.asarray(arrays[4])
        out = cupy.empty_like(q)
        lse = flash_attention.forward(q, k, v, out, q_offset, causal, mask, window)
        dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
        flash_attention.backward(dout, q, k, v, out, lse, q_offset, causal, mask, dq, dk, dv, window)
        wide = [a.astype(numpy.float64) for a in rounded]
        ref = composed_attention(*wide, q_offset, causal, arrays[4], window)
        seen = numpy.isfinite(ref[1])
        lse_host = backend.to_numpy(lse)
        lse_error = _rel(lse_host[seen], ref[1][seen]) if numpy.array_equal(numpy.isfinite(lse_host), seen) else 1.0
        errors[name] = max(lse_error, *(_rel(x, r) for x, r in zip((out, dq, dk, dv), (ref[0], *ref[2:]))))
    return errors


def flash_timings(dtype: str, batch: int, heads: int, seq: int, d: int, rounds: int = 5) -> dict:
    """Forward + backward of one causal attention core [batch, heads, seq, d] on the device, the fused
    kernels and the composed path (query blocks of ``DEVICE_QUERY_BLOCK``) alternating: each round's
    time (CUDA events), median and range in ms."""
    import cupy  # optional (hpc_tp[gpu]): only a machine with a device gets here

    from ..kernels import flash_attention  # loaded when the row runs, as the engine's other modules
    from ..nn import attention

    rng = numpy.random.default_rng(0)
    q, k, v, dout = (
        cupy.asarray((rng.standard_normal(s) / scale).astype(backend.resolve_dtype(dtype)))
        for s, scale in (
            ((batch, heads, 1, seq, d), numpy.sqrt(d)),
            ((batch, heads, seq, d), 1),
            ((batch, heads, seq, d), 1),
            ((batch, heads, 1, seq, d), 1),
        )
    )
    out, dq, dk, dv = cupy.empty_like(q), cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
    blocks = attention.query_blocks(seq, seq, 0, True, on_device=True)

    def fused():
        lse = flash_attention.forward(q, k, v, out, 0, True)
        flash_attention.backward(dout, q, k, v, out, lse, 0, True, None, dq, dk, dv)

    def composed():
        probs = attention._composed_forward(q, k, v, out, blocks, (None, 0, 0), None)
        dk[...], dv[...] = 0, 0
        attention._composed_backward(dout, q, k, v, probs, blocks, None, dq, dk, dv)

    times = {"fused": [], "composed": []}
    for run in (fused, composed):  # compiles and warms both
        run()
    for _ in range(rounds):
        for name, run in (("fused", fused), ("composed", composed)):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            run()
            stop.record()
            stop.synchronize()
            times[name].append(cupy.cuda.get_elapsed_time(start, stop))
    return {f"{name}_ms": _spread(t) for name, t in times.items()}


def flash_step_timings(dtype: str, batch: int, seq: int, rounds: int = 3) -> dict:
    """The W1 step (``bench step``) with the layer's attention through the fused kernels
    (``HPC_TP_FLASH_ATTENTION=1``) and through the composed path, alternating: ms per round."""
    times = {"fused": [], "composed": []}
    before = os.environ.get("HPC_TP_FLASH_ATTENTION")
    try:
        for _ in range(rounds):
            for name, flag in (("fused", "1"), ("composed", "0")):
                os.environ["HPC_TP_FLASH_ATTENTION"] = flag
                times[name].append(benchmark(dtype, batch, seq)["step_s"] * 1e3)
    finally:
        if before is None:
            os.environ.pop("HPC_TP_FLASH_ATTENTION")
        else:
            os.environ["HPC_TP_FLASH_ATTENTION"] = before
    return {f"{name}_ms": _spread(t) for name, t in times.items()}


def _spread(values) -> dict:
    """Median and range of one path's rounds."""
    values = sorted(values)
    return {"median": float(numpy.median(values)), "min": values[0], "max": values[-1]}


def train_losses(
    device: str, dtype: str, steps: int = 3, loss_scale: float | None = None, **model
) -> tuple[list, object]:
    """Losses of ``steps`` demo training steps on ``device`` (one process), and the trainer.
    ``loss_scale``: float16's starting scale (default 2^16), low enough that no step overflows
    when a run is compared step by step with float32 (a skipped step would shift it by one).
    ``model``: overrides of the demo model's config (``MOE``: Mixture-of-Experts MLPs)."""
    from ..comm.mpi import self_comm
    from ..train.mixed_precision import LossScaler
    from ..train.settings import TrainSettings
    from ..train.trainer import Trainer

    settings = TrainSettings(
        device=device, dtype=dtype, steps=10, global_batch=8, progress=False, samples=0, model_overrides=model
    )
    trainer = Trainer(settings, world=self_comm())
    if loss_scale is not None and trainer.precision.scaler is not None:
        trainer.precision.scaler = LossScaler(scale=loss_scale)
    with numpy.errstate(over="ignore", invalid="ignore"):  # fp16 overflow is a skipped step, on purpose
        return [trainer.train_step()["loss"] for _ in range(steps)], trainer


def captured_train_steps(
    dtype: str, preset: str = "demo", batch: int = 8, seq: int | None = None, rounds: int = 1, steps: int = 4
) -> dict:
    """``preset`` trained on the device eagerly and with ``--cuda-graph`` (two trainers of one run, one
    process), ``rounds`` alternating rounds of ``steps`` steps each after one warm-up step each (the
    captured run's first step is eager and captures): ms a step (median and range of the rounds'
    medians), the worst relative difference of the steps' losses, and whether the steps replayed."""
    from ..comm.mpi import self_comm
    from ..train.settings import TrainSettings
    from ..train.trainer import Trainer

    runs = {}
    for graph in (False, True):
        settings = TrainSettings(
            model=preset, device="cuda", dtype=dtype, global_batch=batch, seq_len=seq, steps=1 + rounds * steps,
            progress=False, samples=0, cuda_graph=graph,
        )  # fmt: skip
        runs["graph" if graph else "eager"] = (Trainer(settings, world=self_comm()), [], [])
    with numpy.errstate(over="ignore", invalid="ignore"):  # fp16 overflow is a skipped step, on purpose
        for round in range(1 + rounds):
            for trainer, losses, times in runs.values():
                records = [trainer.train_step() for _ in range(1 if round == 0 else steps)]  # each reads back
                losses += [r["loss"] for r in records]
                if round:
                    times.append(1e3 * float(numpy.median([r["step_s"] for r in records])))
    (_, eager, eager_ms), (captured, graph, graph_ms) = runs["eager"], runs["graph"]
    return {
        "eager_ms": _spread(eager_ms),
        "graph_ms": _spread(graph_ms),
        "loss_error": max(abs(a - b) / abs(b) for a, b in zip(graph, eager)),
        "graph_used": captured.captured.replayed,
    }


def _first_pair(world, transport: str | None = None):
    """The group of ``world``'s first two ranks (the others make a group of their own) with the device
    transport it takes (``transport`` forces one), and that transport's name. Collective over ``world``."""
    from ..comm.nccl import device_communicator, group_transport

    pair = world.split(color=int(world.rank < 2), key=world.rank)
    transport = transport or group_transport(pair)
    return device_communicator(pair, transport=transport), transport


def tp_equality(world, transport: str | None = None) -> tuple[float, str]:
    """Worst relative error (loss and every gradient) of the tiny model at tp = 2 (the first two
    ranks of ``world``, sharing devices as they are) against tp = 1, float64; and the transport."""
    from ..comm.mpi import self_comm
    from ..models import GPTModel, load_config
    from ..verify import gradient_errors

    tp, transport = _first_pair(world, transport)
    if world.rank >= 2:
        return 0.0, transport
    xp = backend.xp
    cfg = load_config("tiny", vocab_size=64)
    rng = numpy.random.default_rng(0)
    ids, targets = (xp.asarray(rng.integers(0, 64, (2, 9))) for _ in range(2))
    results = []
    for comm in (tp, self_comm()):
        model = GPTModel(cfg, comm, dtype="float64", seed=0)
        loss, count, ctx = model.forward(ids, targets)
        model.backward(ctx, 1.0 / count)
        results.append((model, float(loss)))
    (par, loss_par), (one, loss_one) = results
    errors = gradient_errors(par, one, tp)
    errors["loss"] = abs(loss_par - loss_one) / abs(loss_one)
    return max(errors.values()), transport


def tp_replay_error(world) -> tuple[float | None, bool, str]:
    """Worst relative error (block outputs, input gradient, every weight gradient) of a two-layer
    block stack's forward + backward at tp = 2 (the first two ranks of ``world``) replayed from a
    CUDA graph on a second input, copied into the captured step's, against one process's eager step
    on that input, float64; whether it replayed; the transport. The error is None where the pair's
    transport cannot be captured: two ranks sharing a card go over MPI (NCCL needs a card a rank)."""
    from .. import cuda_graph
    from ..comm.mpi import self_comm
    from ..models import load_config
    from ..verify import gradient_errors
    from .step import build_blocks

    tp, transport = _first_pair(world)
    if world.rank >= 2 or not cuda_graph.capturable(tp):
        return None, False, transport
    cfg = load_config("tiny", n_layers=2)
    first, second = (
        backend.xp.asarray(numpy.random.default_rng(s).standard_normal((2, 9, cfg.hidden))) for s in (0, 1)
    )
    par, one = build_blocks(cfg, tp, "float64"), build_blocks(cfg, self_comm(), "float64")

    def step(model, x):
        model.zero_grad()  # in place: the captured step's gradients are the buffers it zeroes
        out, ctxs = model.blocks_forward(x)
        return out, model.blocks_backward(out * 0.01, ctxs)

    x = first.copy()
    replayed = cuda_graph.Replayed(lambda: step(par, x), "the tp=2 block stack")
    replayed()  # eager on the first input, then captured
    x[...] = second
    out, dx = replayed()
    expected_out, expected_dx = step(one, second)
    errors = gradient_errors(par, one, tp) | {"out": _rel(out, expected_out), "dx": _rel(dx, expected_dx)}
    return max(errors.values()), not replayed.failed, transport


# A Llama-style decoder (GQA, RoPE, SwiGLU, RMSNorm) and left-padded prompts of unequal lengths.
DECODE_MODEL = dict(
    vocab_size=258,
    hidden=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden=48,
    max_seq_len=32,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
    tie_embeddings=False,
)
DECODE_PROMPTS = ([5, 17, 99, 3, 250], [42, 7], [1, 2, 3, 4, 5, 6, 7], [200])


def decode_replay_error(
    config: dict = DECODE_MODEL, prompts=DECODE_PROMPTS, steps: int = 6, weights=None
) -> tuple[float, bool]:
    """Decode steps after a left-padded prefill, float64, one process: the device's fixed-shape step
    captured as a CUDA graph at its first step and replayed for the rest (``serve.decoding``), against
    the CPU's growing steps on the same ids. (worst relative logit error, whether the graph replayed).
    ``weights(model)``: sets the model's weights (default: its own seeded initialization)."""
    from ..comm.mpi import self_comm
    from ..models import GPTModel, ModelConfig
    from ..serve.decoding import FixedStep, GrowingStep
    from ..serve.generate import left_pad
    from ..serve.kv_cache import KVCache

    follow = numpy.random.default_rng(2).integers(0, config["vocab_size"], (len(prompts), steps))
    lens = numpy.array([len(p) for p in prompts])
    logits, replayed = {}, False
    for device in ("cpu", "cuda"):
        backend.use(device)
        xp, model = backend.xp, GPTModel(ModelConfig(**config), self_comm(), dtype="float64", seed=3)
        if weights is not None:
            weights(model)
        tokens, key_mask, positions = left_pad([list(p) for p in prompts], steps, pad_id=0)
        cache = KVCache.for_model(model, len(prompts), tokens.shape[1] + steps)
        model.infer(xp.asarray(tokens), xp.asarray(positions), xp.asarray(key_mask[:, : tokens.shape[1]]), cache)
        stepper = (
            FixedStep(model, cache, key_mask, lens, capture=True)
            if device == "cuda"
            else GrowingStep(model, cache, key_mask, lens)
        )
        logits[device] = [backend.to_numpy(stepper.step(follow[:, s])) for s in range(steps)]  # a replay overwrites
        replayed = replayed or stepper.uses_graph
        stepper.close()
    return max(_rel(g, c) for g, c in zip(logits["cuda"], logits["cpu"])), replayed


def continuous_completions(device: str, config: dict = DECODE_MODEL, weights=None) -> list[tuple[list[int], int]]:
    """(token ids, cached prompt tokens) of each request through ``ContinuousBatcher.generate`` on
    ``device``, float64, one process: two rows, prefill chunks of 4 tokens, prompts sharing prefixes,
    so that a batched prefill scatters into rows, a prefix is found in place and copied from a busy
    row, chunks start from a held slot, and each decode step writes every row at its own slot.
    ``weights(model)``: sets the model's weights (default: its own seeded initialization)."""
    from ..comm.mpi import self_comm
    from ..models import GPTModel, ModelConfig
    from ..serve.continuous import ContinuousBatcher
    from ..serve.generate import Engine
    from ..serve.sampling import SamplingParams
    from ..tokenizer import ByteTokenizer

    backend.use(device)
    model = GPTModel(ModelConfig(**config), self_comm(), dtype="float64", seed=3)
    if weights is not None:
        weights(model)
    first, second = list(DECODE_PROMPTS[2]), list(DECODE_PROMPTS[0])
    prompts = [first, second, first[:5] + [250, 251], second + [9] * 9, first + [1, 2]]
    params = [SamplingParams(max_new_tokens=n) for n in (9, 2, 3, 4, 2)]
    out = ContinuousBatcher(Engine(model, ByteTokenizer()), 2, chunk_tokens=4).generate(prompts, params)
    return [(completion.ids, completion.cached_tokens) for completion, _ in out]


# Continuous batching's rows over ``continuous_step_logits``' decode steps: at each, the rows (of 6) that
# leave, then those that join (row: prompt tokens, prefilled first); every row in the batch feeds a token.
# Batches of 1 to 6 rows (buckets of 1, 2, 4 and 6, the batch's cap) and 1 to 17 slots (buckets of 8, 16
# and 32 with blocks of 4), a bucket met again after others.
CONTINUOUS_STEPS = (
    ((), {0: 5}),
    ((), {1: 2, 2: 9}),
    ((), {}),
    ((), {3: 1, 4: 13, 5: 3}),
    ((), {}),
    ((1, 4), {}),
    ((), {1: 7}),
    ((0, 2, 3, 5), {}),
    ((), {}),
    ((), {0: 11, 2: 2}),
    ((), {}),
    ((2,), {}),
    ((), {}),
    ((), {}),
    ((), {}),
)


def continuous_step_logits(
    device: str, fixed: bool, config: dict = DECODE_MODEL, weights=None, comm=None, block_size: int = 4
) -> tuple[list, bool]:
    """The logits (host) of each of ``CONTINUOUS_STEPS``' decode steps over a paged cache on ``device``,
    float64, at tp = ``comm``'s size (default one process): with ``fixed``, through ``PagedSteps``
    (each bucket captured as a CUDA graph at its first step where ``cuda_graph.capturable``), else
    ``step_view``'s eager steps; and whether a graph replayed. ``weights(model)``: as in
    ``decode_replay_error``."""
    from .. import cuda_graph
    from ..comm.mpi import self_comm
    from ..models import GPTModel, ModelConfig
    from ..serve.blocks import Sequence
    from ..serve.decoding import PagedSteps, decode_slots, step_arguments
    from ..serve.kv_cache import PagedView

    backend.use(device)
    comm = comm or self_comm()
    xp, model = backend.xp, GPTModel(ModelConfig(**config), comm, dtype="float64", seed=3)
    if weights is not None:
        weights(model)
    rows, vocab = 6, config["vocab_size"]
    layout, cache, blocks = _paged_cache(model, rows, block_size)
    steps = PagedSteps(model, cache, rows, model.cfg.max_seq_len, cuda_graph.capturable(comm)) if fixed else None
    rng, seqs, logits = numpy.random.default_rng(7), {}, []
    for leaving, joining in CONTINUOUS_STEPS:
        for row in leaving:
            blocks.release(seqs.pop(row))
        for row, length in joining.items():
            seqs[row] = seq = Sequence(len(layout.windows))
            prompt = rng.integers(0, vocab, length)
            blocks.reserve(seq, length)
            view = PagedView(cache, xp.asarray(blocks.slots(seq, length)[:, None]))
            model.infer(xp.asarray(prompt[None]), xp.arange(length), xp.ones((1, length), dtype=bool), view)
            blocks.written(seq, prompt.tolist())
        batch = [seqs[row] for row in sorted(seqs)]
        for seq in batch:
            blocks.reserve(seq, seq.length + 1)
        ids = rng.integers(0, vocab, len(batch))
        lens, slots = decode_slots(blocks, batch)
        out = steps.step(ids, lens, slots) if fixed else model.infer(*step_arguments(model, cache, ids, lens, slots))
        logits.append(backend.to_numpy(out))  # before the next replay overwrites it
        for seq, token in zip(batch, ids.tolist()):
            blocks.written(seq, [token])
    replayed = fixed and steps.uses_graph
    if fixed:
        steps.close()
    return logits, replayed


def _paged_cache(model, rows: int, block_size: int):
    """(layout, paged KV cache, block manager without prefix caching) with room for ``rows`` requests
    of ``model``'s whole context, and the scratch block."""
    from ..serve.blocks import BlockManager, PagedLayout
    from ..serve.kv_cache import PagedKVCache

    layout = PagedLayout.of(model.cfg, block_size)
    units = rows * layout.units_for(model.cfg.max_seq_len) + 1
    return layout, PagedKVCache.for_model(model, units, layout), BlockManager(units, layout, prefix_caching=False)


def continuous_replay_error(config: dict = DECODE_MODEL, weights=None) -> tuple[float, bool]:
    """The device's continuous decode steps through ``PagedSteps`` (each bucket captured at its first
    step, replayed at the next ones) against the CPU's eager ``step_view`` steps, float64, one process:
    (worst relative logit error, whether a graph replayed)."""
    device, replayed = continuous_step_logits("cuda", True, config, weights)
    host, _ = continuous_step_logits("cpu", False, config, weights)
    return max(_rel(d, h) for d, h in zip(device, host)), replayed


def continuous_step_timings(
    rows: int, rounds: int = 3, steps: int = 5, preset: str = "w1", dtype: str = "float32"
) -> dict:
    """The continuous decode step of model ``preset`` (one process) over a paged cache of blocks of
    16, ``rows`` requests of a quarter to half its context (W1: 64 to 127 tokens): eager
    (``step_view``) and through ``PagedSteps`` (its bucket's fixed shapes; replayed from a CUDA graph
    where ``cuda_graph.capturable``) in alternating rounds, each round the median of ``steps`` steps
    (the same step again: the same bucket). ms a step, median and range of the rounds; whether the
    graph replayed."""
    from .. import cuda_graph
    from ..comm.mpi import self_comm
    from ..models import GPTModel, load_config
    from ..serve.blocks import Sequence
    from ..serve.decoding import PagedSteps, decode_slots, step_arguments

    comm = self_comm()
    model = GPTModel(load_config(preset), comm, dtype=backend.resolve_dtype(dtype), seed=0)
    layout, cache, blocks = _paged_cache(model, rows, 16)
    batch = [Sequence(len(layout.windows)) for _ in range(rows)]
    quarter = model.cfg.max_seq_len // 4
    for i, seq in enumerate(batch):
        length = quarter + 37 * i % quarter
        blocks.reserve(seq, length + 1)
        blocks.written(seq, [0] * length)  # the timing does not read what the slots hold
    ids, (lens, slots) = numpy.zeros(rows, dtype=numpy.int64), decode_slots(blocks, batch)
    fixed = PagedSteps(model, cache, rows, model.cfg.max_seq_len, cuda_graph.capturable(comm))
    paths = {
        "eager": lambda: model.infer(*step_arguments(model, cache, ids, lens, slots)),
        "bucketed": lambda: fixed.step(ids, lens, slots),
    }

    def timed(run) -> float:
        start = time.perf_counter()
        run()
        backend.synchronize()
        return time.perf_counter() - start

    for run in paths.values():  # the kernels compiled, the bucket's graph captured
        timed(run)
        timed(run)
    times = {name: [] for name in paths}
    for _ in range(rounds):
        for name, run in paths.items():
            times[name].append(1e3 * float(numpy.median([timed(run) for _ in range(steps)])))
    replayed = fixed.uses_graph
    fixed.close()
    return {f"{name}_ms": _spread(t) for name, t in times.items()} | {"graph_used": replayed}


def decode_timings(batch: int, graphs: bool) -> dict:
    """``bench decode``'s record for W1, prompt 64, 32 timed tokens, float32, one process."""
    from ..comm.mpi import self_comm
    from ..models.config import load_config
    from .decode import benchmark_decode

    return benchmark_decode(self_comm(), load_config("w1"), batch, 64, 32, "float32", warmup=3, graphs=graphs)


def card_peak(dtype: str, size: int = 8192, repeats: int = 5) -> float:
    """FLOP/s of a large square GEMM in ``dtype``: what the card's cuBLAS reaches (median)."""
    import cupy

    a = cupy.asarray(numpy.random.default_rng(0).standard_normal((size, size)).astype(dtype))
    out = cupy.empty_like(a)
    cupy.matmul(a, a, out=out)
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        cupy.matmul(a, a, out=out)
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return 2 * size**3 / sorted(times)[len(times) // 2]


def benchmark(dtype: str, batch: int, seq: int, graphs: bool = False, model: str = "w1") -> dict:
    from ..comm.mpi import self_comm
    from ..models.config import load_config
    from .step import benchmark_step

    cfg = load_config(model, max_seq_len=seq)
    return benchmark_step(self_comm(), cfg, batch, seq, dtype, repeats=5, warmup=2, graphs=graphs)


def step_profiles(dtype: str, batch: int, seq: int) -> dict:
    """Where the W1 step's device time goes (``device_profile``): this engine's eager step, as ``bench
    step`` runs it, and PyTorch's eager one, profiled alike."""
    from ..comm.mpi import self_comm
    from ..models.config import load_config
    from . import device_profile, torch_peer
    from .step import step_function

    steps = {
        "engine": step_function(load_config("w1", max_seq_len=seq), self_comm(), batch, seq, dtype),
        "torch eager": torch_peer.w1_step_function(dtype, batch, compiled=False),
    }
    return {name: device_profile.summary(device_profile.kernel_times(step)) for name, step in steps.items()}


def decode_profiles(batch: int = 1, prompt: int = 64) -> dict:
    """Where a W1 decode token's device time goes (``device_profile``), float32 after a ``prompt``-token
    prefill, each from a captured CUDA graph: this engine's step (``serve.decoding``) and PyTorch's."""
    from ..comm.mpi import self_comm
    from ..models import GPTModel, load_config
    from ..serve.decoding import decode_stepper
    from ..serve.kv_cache import KVCache
    from . import device_profile, torch_peer

    xp, steps = backend.xp, 8  # the untimed and the profiled steps, with room to spare
    model = GPTModel(load_config("w1"), self_comm(), dtype="float32", seed=0)
    cache = KVCache.for_model(model, batch, prompt + steps)
    key_mask = numpy.zeros((batch, prompt + steps), dtype=bool)
    key_mask[:, :prompt] = True
    ids = xp.asarray(numpy.random.default_rng(0).integers(0, model.cfg.vocab_size, (batch, prompt)))
    model.infer(ids, xp.broadcast_to(xp.arange(prompt), ids.shape), xp.asarray(key_mask[:, :prompt]), cache)
    stepper = decode_stepper(model, cache, key_mask, numpy.full(batch, prompt), graphs=True)
    token = numpy.zeros(batch, dtype=numpy.int64)
    runs = {"engine": lambda: stepper.step(token), "torch": torch_peer.decode_step_function(batch, graphs=True)[0]}
    profiles = {name: device_profile.summary(device_profile.kernel_times(run)) for name, run in runs.items()}
    profiles["engine"]["graph"] = stepper.uses_graph
    stepper.close()
    return profiles


# -- the report -------------------------------------------------------------------------------------
def environment() -> list[tuple[str, str]]:
    import cupy

    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    rows = [
        (
            "card",
            f"{name}, {props['totalGlobalMem'] / 2**30:.0f} GiB, sm_{props['major']}{props['minor']}, "
            f"{props['multiProcessorCount']} SMs, {rt.getDeviceCount()} visible",
        ),
        ("driver / runtime", f"CUDA {_cuda_version(rt.driverGetVersion())} / {_cuda_version(rt.runtimeGetVersion())}"),
        ("python / numpy / cupy", f"{sys.version.split()[0]} / {numpy.__version__} / {cupy.__version__}"),
    ]
    from ..comm.nccl import nccl_available

    if nccl_available():
        from cupy.cuda import nccl

        rows.append(("nccl", f"available, version {nccl.get_version()}"))
    else:
        rows.append(("nccl", "not available (cupy finds no libnccl): groups use MPI"))
    try:
        import ml_dtypes

        rows.append(("ml_dtypes (bfloat16)", ml_dtypes.__version__))
    except ImportError:
        rows.append(("ml_dtypes (bfloat16)", "missing: bfloat16 rows are skipped, float16 measured instead"))
    rows.append(("mpiexec", _mpiexec() or "not found: the 2-rank check is skipped"))
    return rows


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _mpiexec() -> str | None:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def _mpi_env() -> dict:
    """This environment for a child ``mpiexec``, without the launch variables of any parent MPI job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMIX_", "OMPI_COMM_WORLD", "PMI_"))}
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")])
        ),
    )
    return env


def _mpiexec_2(*command: str, timeout: float) -> subprocess.CompletedProcess:
    """``mpiexec -n 2`` in a process group of its own: on a timeout the whole group is killed, so no rank is
    left holding the card while the next checks are timed."""
    with subprocess.Popen(
        [_mpiexec(), "-n", "2", sys.executable, *command],
        env=_mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def zero_equality(world, steps: int = 3, device: str = "cuda") -> float:
    """Worst relative loss difference of ``steps`` demo steps at dp = 2 (``world``: two ranks) with
    the distributed optimizer against plain AdamW, float64 on ``device`` (on the GPU its
    reduce-scatter and all-gather go through the device transport)."""
    from ..train.settings import TrainSettings
    from ..train.trainer import Trainer

    losses = []
    for zero in (False, True):
        settings = TrainSettings(
            device=device,
            dtype="float64",
            dp=2,
            steps=10,
            global_batch=8,
            progress=False,
            samples=0,
            distributed_optimizer=zero,
        )
        trainer = Trainer(settings, world=world)
        losses.append([trainer.train_step()["loss"] for _ in range(steps)])
    return max(abs(a - b) / abs(b) for a, b in zip(*losses))


def _last_line(done: subprocess.CompletedProcess) -> str:
    """The line that says what went wrong: the last error line, else the last line with words."""
    lines = [line.strip() for line in (done.stdout + "\n" + done.stderr).splitlines() if any(c.isalpha() for c in line)]
    errors = [line for line in lines if "Error" in line]
    return ((errors or lines or ["no output"])[-1])[:160]


PAIR_ROWS = ("tp", "zero", "tp graph")


def _run_pair_worker(timeout: float = 150) -> dict[str, tuple[str, str, str]]:
    """The two-rank checks under ``mpiexec -n 2`` (this module, --pair-worker), a row for each of
    ``PAIR_ROWS``: skipped where mpiexec cannot start two ranks of this Python (probed first), FAIL
    where it can and a check does not pass."""

    def both(*row):
        return dict.fromkeys(PAIR_ROWS, row)

    if _mpiexec() is None:
        return both("skipped", "", "no mpiexec")
    try:
        probe = _mpiexec_2("-c", "from mpi4py import MPI; assert MPI.COMM_WORLD.Get_size() == 2", timeout=20)
    except subprocess.TimeoutExpired:
        return both("skipped", "", "mpiexec -n 2 hangs here (20 s probe)")
    if probe.returncode:
        return both("skipped", "", f"mpiexec -n 2 does not run here: {_last_line(probe)}")
    try:
        done = _mpiexec_2("-m", "hpc_tp.bench.gpu_check", "--pair-worker", timeout=timeout)
    except subprocess.TimeoutExpired:
        return both("FAIL", "", f"mpiexec -n 2 did not finish in {timeout:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return both("FAIL", "", f"exit {done.returncode}: {_last_line(done)}")
    report = json.loads(lines[-1])
    replay = report["tp_replay"]
    if replay["error"] is None:
        graph = (
            "skipped",
            "",
            f"2 ranks via {replay['transport']}: a graph holds NCCL's collectives only (a card a rank)",
        )
    else:
        graph = _replay_check(replay["error"], replay["replayed"], f"tp=2 over {replay['transport']}, a second input")
    return {
        "tp": _bounded(report["tp_error"], TP_TOL, f"2 ranks via {report['transport']}"),
        "zero": _bounded(report["zero_error"], TP_TOL, "dp=2, 3 demo steps"),
        "tp graph": graph,
    }


def _pair_worker() -> int:
    from ..comm.mpi import world

    comm = world()
    backend.use("cuda", comm.split_node().rank)
    tp_error, transport = tp_equality(comm)
    zero_error = zero_equality(comm)
    replay = dict(zip(("error", "replayed", "transport"), tp_replay_error(comm)))
    if comm.rank == 0:
        report = {"tp_error": tp_error, "transport": transport, "zero_error": zero_error, "tp_replay": replay}
        print(json.dumps(report), flush=True)
    return 0


def _bfloat16_missing() -> str | None:
    """Why bfloat16 arrays cannot be made on the device here (None: they can). cupy knows the type
    only through ml_dtypes, and only from cupy 14."""
    try:
        import ml_dtypes
    except ImportError:
        return "ml_dtypes missing (make gpu-deps)"
    try:
        backend.xp.zeros(1, dtype=ml_dtypes.bfloat16)
    except Exception as error:  # noqa: BLE001 -- cupy 13 raises TypeError, others may differ
        return f"cupy {backend.xp.__version__} has no bfloat16 arrays ({type(error).__name__})"
    return None


def _bf16_or_fp16() -> str:
    return "float16" if _bfloat16_missing() else "bfloat16"


class Report:
    """The checks and W1 rows so far; with ``out`` they are written after every row, so a run cut
    off by its time limit still leaves what it measured."""

    def __init__(self, env=(), out: Path | None = None):
        self.env, self.out = list(env), out
        self.checks: list[dict] = []
        self.bench: list[dict] = []
        self.decode: list[dict] = []
        self.rows: dict[str, list[dict]] = {section: [] for section in ROW_SECTIONS}
        self.started = time.perf_counter()

    def save(self):
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.md").write_text(self.text())
        (self.out / "gpu_check.json").write_text(
            json.dumps(
                {
                    "environment": dict(self.env),
                    "checks": self.checks,
                    "w1": self.bench,
                    "w1_decode": self.decode,
                    **self.rows,
                },
                indent=1,
            )
            + "\n"
        )

    def text(self) -> str:
        return markdown(self.env, self) + f"\ntotal {time.perf_counter() - self.started:.0f} s\n"

    def add_bench(self, row: dict):
        self.bench.append(row)
        self.save()

    def add_decode(self, row: dict):
        self.decode.append(row)
        self.save()

    def add_row(self, section: str, row: dict):
        self.rows[section].append(row)
        self.save()

    def check(self, name: str, bound: str, run):
        """``run()`` -> (result, measured, detail); an exception is a FAIL with its message."""
        started = time.perf_counter()
        try:
            result, measured, detail = run()
        except ModuleNotFoundError as error:  # a package this machine lacks: not a failure of the backend
            result, measured, detail = "skipped", "", f"needs {error.name} (make gpu-deps, see README)"
        except Exception as error:  # noqa: BLE001 -- the table says what broke, the next check still runs
            first_line = (str(error).splitlines() or [""])[0]  # an exception may carry no message at all
            result, measured, detail = "FAIL", "", f"{type(error).__name__}: {first_line[:160]}"
        row = dict(
            check=name,
            result=result,
            measured=measured,
            bound=bound,
            detail=detail,
            seconds=round(time.perf_counter() - started, 1),
        )
        self.checks.append(row)
        self.save()
        print(f"  {result:7s} {name:34s} {measured:>9s}  (bound {bound}) {detail}", flush=True)

    @property
    def failed(self) -> bool:
        return any(row["result"] == "FAIL" for row in self.checks)


def _bounded(value: float, bound: float, detail: str = ""):
    return ("ok" if value <= bound else "FAIL"), f"{value:.1e}", detail


def _replay_check(error: float, replayed: bool, detail: str, bound: float = TP_TOL):
    """A check row of steps replayed from CUDA graphs against the CPU's: FAIL where none replayed."""
    result, measured, _ = _bounded(error, bound)
    return (result if replayed else "FAIL"), measured, (detail if replayed else "the capture failed: steps ran eagerly")


def _worst_of(errors: dict[str, float], bound: float, what: str = ""):
    """A check row from named errors: the worst against ``bound``, every one in the detail."""
    worst = max(errors, key=errors.get)
    return _bounded(
        errors[worst], bound, f"{what}worst: {worst}; " + ", ".join(f"{k} {v:.0e}" for k, v in errors.items())
    )


def run_checks(report: Report):
    # First, while this process has not started MPI: a singleton MPI parent can confuse a child mpiexec.
    pair = {}

    def pair_row(key):
        if not pair:  # one mpiexec for every pair row; if it raises, the next rows do not start it again
            pair.update(dict.fromkeys(PAIR_ROWS, ("FAIL", "", "the two-rank worker raised")))
            pair.update(_run_pair_worker())
        return pair[key]

    report.check("tp=2 vs tp=1 on the device, float64", f"{TP_TOL:.0e}", lambda: pair_row("tp"))
    report.check("ZeRO-1 vs AdamW, dp=2, float64", f"{TP_TOL:.0e}", lambda: pair_row("zero"))
    report.check("tp=2 step as a CUDA graph vs one process, float64", f"{TP_TOL:.0e}", lambda: pair_row("tp graph"))
    for dtype in ("float64", "float32"):

        def kernels(dtype=dtype):
            return _worst_of(kernel_errors(dtype), KERNEL_TOL[dtype])

        report.check(f"fused kernels vs numpy, {dtype}", f"{KERNEL_TOL[dtype]:.0e}", kernels)

    for dtype in ("float16", "bfloat16"):

        def half_norms(dtype=dtype):
            if dtype == "bfloat16" and _bfloat16_missing():
                return "skipped", "", _bfloat16_missing()
            mismatches = half_norm_mismatches(dtype)
            worst = max(mismatches.values())
            detail = "elements differing: " + ", ".join(f"{k} {v}" for k, v in mismatches.items())
            return ("ok" if worst == 0 else "FAIL"), str(worst), detail

        report.check(f"{dtype} norm kernels vs float32 rounded once", "0", half_norms)

    for label, model in (("", {}), ("MoE ", MOE)):

        def training(model=model):
            cpu, _ = train_losses("cpu", "float64", **model)
            gpu, trainer = train_losses("cuda", "float64", **model)
            on_device = all(not isinstance(p.data, numpy.ndarray) for p in trainer.params.values())
            error = max(abs(a - b) / abs(b) for a, b in zip(gpu, cpu))
            result, measured, _ = _bounded(error, TP_TOL)
            return (
                (result if on_device else "FAIL"),
                measured,
                (f"3 demo steps, losses {', '.join(f'{v:.4f}' for v in gpu)}; groups: {trainer.transports}"),
            )

        report.check(f"{label}training on the device vs CPU, float64", f"{TP_TOL:.0e}", training)

    def captured_training():
        row = captured_train_steps("float64")
        detail = "5 demo steps with --cuda-graph vs eager, one process"
        return _replay_check(row["loss_error"], row["graph_used"], detail, CAPTURED_TOL)

    report.check("training steps as a CUDA graph vs eager, float64", f"{CAPTURED_TOL:.0e}", captured_training)
    report.check(
        "decode steps as a CUDA graph vs CPU, float64",
        f"{TP_TOL:.0e}",
        lambda: _replay_check(*decode_replay_error(), "6 steps replayed from one captured CUDA graph"),
    )

    def continuous():
        device, host = continuous_completions("cuda"), continuous_completions("cpu")
        same, cached = device == host, [c for _, c in host]
        return (
            ("ok" if same and any(cached) else "FAIL"),
            "same" if same else "differ",
            (f"5 requests in 2 rows, prefill chunks of 4, cached prompt tokens {cached}"),
        )

    report.check("continuous batching vs CPU (rows, prefixes, chunks), float64", "same tokens", continuous)

    report.check(
        "continuous decode steps as CUDA graphs vs CPU, float64",
        f"{TP_TOL:.0e}",
        lambda: _replay_check(
            *continuous_replay_error(), f"{len(CONTINUOUS_STEPS)} steps of 1-6 rows, a graph a bucket"
        ),
    )
    for dtype, model in (("float16", {}), ("bfloat16", {}), ("bfloat16", MOE)):

        def mixed(dtype=dtype, model=model):
            if dtype == "bfloat16" and _bfloat16_missing():
                return "skipped", "", _bfloat16_missing()
            full, _ = train_losses("cuda", "float32", steps=5, **model)
            half, trainer = train_losses("cuda", dtype, steps=5, loss_scale=2.0**10, **model)
            fp32_masters = all(p.data.dtype == numpy.float32 for p in trainer.precision.master.values())
            drift = max(abs(a - b) / b for a, b in zip(half, full))
            ok = fp32_masters and half[-1] < half[0] and drift <= MIXED_TOL[dtype]
            return (
                ("ok" if ok else "FAIL"),
                f"{drift:.1e}",
                (
                    f"5 steps, loss {half[0]:.3f} -> {half[-1]:.3f} (fp32 {full[0]:.3f} -> {full[-1]:.3f}), "
                    f"loss scale {trainer.precision.loss_scale:g}, fp32 masters: {fp32_masters}"
                ),
            )

        report.check(f"{'MoE ' if model else ''}mixed precision {dtype} vs float32", f"{MIXED_TOL[dtype]:.0e}", mixed)
    for dtype in ("float64", "float32", _bf16_or_fp16()):

        def flash(dtype=dtype):
            return _worst_of(flash_errors(dtype), FLASH_TOL[dtype], "out, lse, dQ, dK, dV; ")

        report.check(f"fused attention vs composed, {dtype}", f"{FLASH_TOL[dtype]:.0e}", flash)


def run_benchmarks(report: Report):
    for dtype in ("float32", _bf16_or_fp16()):
        try:
            peak = card_peak(dtype)
        except Exception as error:  # noqa: BLE001
            report.add_bench({"dtype": dtype, "error": f"{type(error).__name__}: {error}"[:200]})
            print(f"  {dtype}: GEMM peak failed: {report.bench[-1]['error']}", flush=True)
            continue
        for model, batch, seq, graphs in BENCH_ROWS:
            if model != "w1" and dtype == "float32":  # the 1B-class target is bfloat16's
                continue
            head = {"model": model, "dtype": dtype, "micro_batch": batch, "seq_len": seq}
            try:
                r = benchmark(dtype, batch, seq, model=model)
                replayed = benchmark(dtype, batch, seq, graphs=True, model=model) if graphs else None
            except Exception as error:  # noqa: BLE001
                report.add_bench(head | {"error": f"{type(error).__name__}: {error}"[:200]})
                print(f"  {model} {dtype} {batch}x{seq}: failed: {report.bench[-1]['error']}", flush=True)
                continue
            row = head | {
                "step_ms": r["step_s"] * 1e3,
                "tokens_per_s": r["tokens_per_s"],
                "achieved_tflops": r["achieved_flops"] / 1e12,
                "same_shape_gemm_tflops": r["gemm_peak_flops_per_rank"] / 1e12,
                "mfu_same_shape": r["mfu"],
                "card_gemm_tflops": peak / 1e12,
                "mfu_card": r["achieved_flops"] / peak,
            }
            if replayed is not None:
                row["graph_step_ms"] = replayed["step_s"] * 1e3 if replayed["cuda_graph"] else None
            report.add_bench(row)
            print(
                f"  {model} {dtype:8s} {batch:3d}x{seq}: {row['step_ms']:8.2f} ms ({_graph_cell(row)} as a CUDA graph)  "
                f"{row['tokens_per_s']:10.0f} tok/s  "
                f"{row['achieved_tflops']:7.2f} TFLOP/s  MFU {100 * row['mfu_same_shape']:5.1f}% of the same-shape "
                f"GEMM ({row['same_shape_gemm_tflops']:.1f}), {100 * row['mfu_card']:5.1f}% of the card's "
                f"{row['card_gemm_tflops']:.1f} TFLOP/s",
                flush=True,
            )


def run_flash_benchmarks(report: Report):
    """The fused attention's forward + backward against the composed path's, alternating, per shape;
    then the W1 step with each."""
    for dtype in ("float32", _bf16_or_fp16()):
        for name, batch, heads, seq, d in FLASH_SHAPES:
            measure = functools.partial(flash_timings, dtype, batch, heads, seq, d)
            _measured_row(report, "flash", {"dtype": dtype, "shape": name}, measure, _flash_cells)
        batch, seq = W1_ROWS[-1]
        measure = functools.partial(flash_step_timings, dtype, batch, seq)
        _measured_row(report, "flash", {"dtype": dtype, "shape": f"W1 step {batch}x{seq}"}, measure, _flash_cells)


def run_captured_train_benchmarks(report: Report, batch: int = 4, seq: int = 256, rounds: int = 3):
    """W1 trained eagerly and with ``--cuda-graph`` at tp = 1, alternating rounds of 5 steps: ms a step
    and the captured run's losses against the eager run's (the W1 shape, the byte tokenizer's
    vocabulary, the demo task's rows)."""
    for dtype in ("float32", _bf16_or_fp16()):
        measure = functools.partial(captured_train_steps, dtype, "w1", batch, seq, rounds, 5)
        _measured_row(report, "train_graph", {"dtype": dtype, "shape": f"{batch}x{seq}"}, measure, _train_graph_cells)


def _train_graph_cells(row: dict) -> str:
    if (text := _not_measured(row, f"W1 train {row.get('dtype')} {row.get('shape')}")) is not None:
        return text
    eager, graph, bound = row["eager_ms"], row["graph_ms"], CAPTURED_TRAIN_TOL[row["dtype"]]
    how = "replayed" if row["graph_used"] else "no graph (the capture failed)"
    return (
        f"W1 train {row['dtype']} {row['shape']}: eager {eager['median']:.2f} ms ({eager['min']:.2f}-{eager['max']:.2f}), "
        f"{how} {graph['median']:.2f} ms ({graph['min']:.2f}-{graph['max']:.2f}), "
        f"{eager['median'] / graph['median']:.2f}x; losses within {row['loss_error']:.1e} of eager "
        f"({'ok' if row['loss_error'] <= bound else 'FAIL'}, bound {bound:.0e})"
    )


def _measured_row(report: Report, section: str, row: dict, measure, cells):
    """``row`` with what ``measure()`` returns, or the error it raised (one failed row must not end the
    table); saved, and printed as ``cells`` writes it."""
    try:
        row.update(measure())
    except Exception as error:  # noqa: BLE001
        row["error"] = f"{type(error).__name__}: {error}"[:200]
    report.add_row(section, row)
    print("  " + cells(row), flush=True)


def _flash_cells(row: dict) -> str:
    if "error" in row:
        return f"{row['dtype']} {row['shape']}: failed: {row['error']}"
    fused, composed = row["fused_ms"], row["composed_ms"]
    return (
        f"{row['dtype']} {row['shape']}: fused {fused['median']:.3f} ms ({fused['min']:.3f}-{fused['max']:.3f}), "
        f"composed {composed['median']:.3f} ms ({composed['min']:.3f}-{composed['max']:.3f}), "
        f"composed/fused {composed['median'] / fused['median']:.2f}x"
    )


def run_peer_benchmarks(report: Report):
    """W1 steps of this engine and of PyTorch (eager, torch.compile) alternating, then W1 decode of both
    (eager, CUDA graphs); one row each with the medians, ranges and ratios (> 1: this engine is faster)."""
    from . import torch_peer  # loaded when the rows run, as the engine's other modules

    if _without_torch(report, "peer"):
        return
    for dtype in ("float32", _bf16_or_fp16()):
        for batch, seq in W1_ROWS:
            _peer_row(
                report,
                {"kind": "W1 step", "dtype": dtype, "batch": batch},
                lambda dtype=dtype, batch=batch, seq=seq: benchmark(dtype, batch, seq)["step_s"],
                {
                    "torch eager": lambda dtype=dtype, batch=batch: torch_peer.w1_step(dtype, batch, compiled=False),
                    "torch.compile": lambda dtype=dtype, batch=batch: torch_peer.w1_step(dtype, batch, compiled=True),
                },
            )
    for batch in (1, 32):
        _peer_row(
            report,
            {"kind": "W1 decode", "dtype": "float32", "batch": batch},
            lambda batch=batch: decode_timings(batch, graphs=True)["token_s"],
            {
                "torch eager": lambda batch=batch: torch_peer.decode_step(batch, graphs=False),
                "torch CUDA graph": lambda batch=batch: torch_peer.decode_step(batch, graphs=True),
            },
        )


def _peer_row(report: Report, row: dict, engine, peers: dict):
    """``PEER_ROUNDS`` rounds of: this engine's time (``engine()``), then each peer's (``peers[name]()``
    builds a timer once; each round times 5 steps); the medians and ranges in ms, and peer/engine."""

    def measure():
        timers = {name: make() for name, make in peers.items()}
        rounds = {name: [] for name in ("engine", *timers)}
        for _ in range(PEER_ROUNDS):
            rounds["engine"].append(engine())
            for name, timer in timers.items():
                rounds[name].append(timer(5))
        spread = {name: _spread([1e3 * s for s in seconds]) for name, seconds in rounds.items()}
        ratios = {f"{name} / engine": spread[name]["median"] / spread["engine"]["median"] for name in timers}
        return spread | ratios

    _measured_row(report, "peer", row, measure, _peer_cells)


def _without_torch(report: Report, section: str) -> bool:
    """Where torch cannot run here: one row of ``section`` saying why, and True."""
    from . import torch_peer  # loaded when the rows run, as the engine's other modules

    missing = torch_peer.torch_missing()
    if missing:
        report.add_row(section, {"skipped": missing})
        print(f"  skipped: {missing}", flush=True)
    return missing is not None


def _not_measured(row: dict, head: str) -> str | None:
    """A row's cells where it has no measurement: skipped, or failed with its error."""
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    return f"{head}: failed: {row['error']}" if "error" in row else None


def _peer_cells(row: dict) -> str:
    head = f"{row.get('kind')} {row.get('dtype')} batch {row.get('batch')}"
    if (text := _not_measured(row, head)) is not None:
        return text
    cells = [
        f"{name} {v['median']:.3f} ms ({v['min']:.3f}-{v['max']:.3f})" for name, v in row.items() if isinstance(v, dict)
    ]
    ratios = [f"{name} {v:.2f}x" for name, v in row.items() if name.endswith("/ engine")]
    return f"{head}: " + ", ".join(cells) + "; " + ", ".join(ratios)


def run_profiles(report: Report):
    """The W1 step's kernels by category, this engine's and PyTorch's, at micro-batch 32 (where the
    card, not the host, sets the pace) in float32 and bfloat16; then a decode token's at batch 1, each
    replayed from a CUDA graph (where the kernels' count sets the pace)."""
    if _without_torch(report, "profile"):
        return
    batch, seq = W1_ROWS[-1]
    for dtype in ("float32", _bf16_or_fp16()):
        measure = functools.partial(step_profiles, dtype, batch, seq)
        row = {"kind": "W1 step", "dtype": dtype, "shape": f"{batch}x{seq}"}
        _measured_row(report, "profile", row, measure, _profile_cells)
    row = {"kind": "W1 decode token, CUDA graphs", "dtype": "float32", "shape": "batch 1"}
    _measured_row(report, "profile", row, decode_profiles, _profile_cells)


def _profile_cells(row: dict) -> str:
    head = f"{row.get('kind')} {row.get('dtype')} {row.get('shape')}"
    if (text := _not_measured(row, head)) is not None:
        return text
    parts = []
    for name in [k for k in row if isinstance(row[k], dict)]:
        p = row[name]
        categories = ", ".join(f"{k} {v['ms']:.2f} ({v['calls']:.0f})" for k, v in p["categories"].items())
        parts.append(
            f"{name}: wall {p['wall_ms']:.2f} ms, device busy {p['busy_ms']:.2f} ms in {p['launches']:.0f} launches; "
            f"{categories}"
        )
    top = "; ".join(f"{k['kernel']} {k['ms']:.2f} ms ({k['calls']:.0f})" for k in row["engine"]["top"])
    return f"{head}: " + " | ".join(parts) + f" | engine's largest: {top}"


def run_decode_benchmarks(report: Report, batches=(1, 8, 64)):
    """W1 decode steps without and with a CUDA graph, alternating in this one process."""
    for batch in batches:
        row = {"batch": batch}
        try:
            for graphs in (False, True):
                r = decode_timings(batch, graphs)
                row["graph_ms" if graphs else "eager_ms"] = r["token_s"] * 1e3
                row["graph_first_ms" if graphs else "eager_first_ms"] = r["first_step_s"] * 1e3
                row["graph_used" if graphs else "eager_used_graph"] = r["cuda_graph"]
        except Exception as error:  # noqa: BLE001
            row["error"] = f"{type(error).__name__}: {error}"[:200]
        report.add_decode(row)
        print("  " + _decode_cells(row), flush=True)


def run_continuous_benchmarks(report: Report, batches=(1, 8, 32)):
    """W1's continuous decode step eager and replayed per bucket, alternating, at each batch."""
    for batch in batches:
        measure = functools.partial(continuous_step_timings, batch)
        _measured_row(report, "continuous", {"batch": batch}, measure, _continuous_cells)


def _continuous_cells(row: dict) -> str:
    if (text := _not_measured(row, f"{row.get('batch')} rows")) is not None:
        return text
    eager, bucketed = row["eager_ms"], row["bucketed_ms"]
    how = "replayed" if row["graph_used"] else "bucketed, no graph (the capture failed)"
    return (
        f"{row['batch']} rows: eager {eager['median']:.3f} ms ({eager['min']:.3f}-{eager['max']:.3f}), "
        f"{how} {bucketed['median']:.3f} ms ({bucketed['min']:.3f}-{bucketed['max']:.3f}), "
        f"{eager['median'] / bucketed['median']:.2f}x"
    )


def _graph_cell(row: dict) -> str:
    if "graph_step_ms" not in row:
        return "not captured"
    return "capture failed" if row["graph_step_ms"] is None else f"{row['graph_step_ms']:.2f}"


def _decode_cells(d: dict) -> str:
    if "error" in d:
        return f"batch {d['batch']}: failed: {d['error']}"
    graph = f"{d['graph_ms']:.3f}" + ("" if d["graph_used"] else " (no graph: the capture failed)")
    return (
        f"batch {d['batch']}: {d['eager_ms']:.3f} ms a token without a graph, {graph} with one, "
        f"{d['eager_ms'] / d['graph_ms']:.2f}x; first decode step {d['eager_first_ms']:.1f} / "
        f"{d['graph_first_ms']:.1f} ms (with the graph: an eager step and the capture)"
    )


def markdown(env, report: Report) -> str:
    lines = [f"gpu-check {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    lines += [f"- {k}: {v}" for k, v in env]
    lines += ["", "| check | result | measured | bound | detail |", "| --- | --- | --- | --- | --- |"]
    lines += [
        f"| {c['check']} | {c['result']} | {c['measured']} | {c['bound']} | {c['detail']} |" for c in report.checks
    ]
    lines += [
        "",
        "| model | dtype | micro-batch x seq | step ms | step ms, CUDA graph | tokens/s | TFLOP/s "
        "| MFU (same-shape GEMM) | MFU (card GEMM peak) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in report.bench:
        if "error" in b:
            lines.append(
                f"| {b.get('model', '')} | {b['dtype']} | {b.get('micro_batch', '')}x{b.get('seq_len', '')} "
                f"| failed: {b['error']} | | | | | |"
            )
        else:
            lines.append(
                f"| {b['model']} | {b['dtype']} | {b['micro_batch']}x{b['seq_len']} | {b['step_ms']:.2f} | {_graph_cell(b)} | "
                f"{b['tokens_per_s']:.0f} | {b['achieved_tflops']:.2f} | {100 * b['mfu_same_shape']:.1f}% "
                f"of {b['same_shape_gemm_tflops']:.1f} | {100 * b['mfu_card']:.1f}% of "
                f"{b['card_gemm_tflops']:.1f} |"
            )
    if report.decode:
        lines += ["", "W1 decode, float32, prompt 64, 32 timed tokens (median ms a token):", ""]
        lines += [f"- {_decode_cells(d)}" for d in report.decode]
    for section, (title, cells) in ROW_SECTIONS.items():
        if report.rows[section]:
            lines += ["", title, "", *(f"- {cells(r)}" for r in report.rows[section])]
    return "\n".join(lines) + "\n"


# The row sections after the W1 table and its decode lines, in the table's order: (title, the row's cells).
ROW_SECTIONS = {
    "continuous": (
        "W1 continuous decode step, float32, rows of 64-127 tokens, 3 alternating rounds (ms a step):",
        _continuous_cells,
    ),
    "train_graph": (
        "W1 training steps at tp = 1, eager vs --cuda-graph, 3 alternating rounds of 5 (ms a step):",
        _train_graph_cells,
    ),
    "flash": ("Fused attention vs composed, causal, forward + backward, alternating (median and range):", _flash_cells),
    "profile": (
        "Device time of a W1 step by kernel category, ms a step (launches), CUPTI via torch.profiler:",
        _profile_cells,
    ),
    "peer": (
        f"PyTorch on the same card, {PEER_ROUNDS} alternating rounds (peer / engine > 1: engine faster):",
        _peer_cells,
    ),
}


# The table's sections in the order they run: the checks, the training step's rows and its peer, then the
# decode timings (a run cut off by its time limit keeps the rows before it): (title, rows). The profile and
# peer sections need torch.
SECTIONS = {
    "checks": ("checks:", run_checks),
    "bench": ("block stacks (W1: 4 layers, hidden 768; gpt-1b: 16 layers, hidden 2048), one process:", run_benchmarks),
    "train": ("W1 training steps, eager vs --cuda-graph, tp = 1:", run_captured_train_benchmarks),
    "profile": ("W1 step's device time by kernel, this engine and PyTorch:", run_profiles),
    "flash": ("fused attention vs composed, forward + backward:", run_flash_benchmarks),
    "peer": ("PyTorch on the same card:", run_peer_benchmarks),
    "decode": ("W1 decode, float32, prompt 64, 32 timed tokens:", run_decode_benchmarks),
    "continuous": ("W1 continuous decode step, float32, eager vs replayed per bucket:", run_continuous_benchmarks),
}


def run_section(report: Report, name: str):
    """``SECTIONS[name]``'s rows, then a check row with the section's time (what a device loan's minutes
    go to); one that raises past its rows' own guards is a failed row, and the next section runs."""
    title, rows = SECTIONS[name]
    print(title, flush=True)

    def timed():
        started = time.perf_counter()
        rows(report)
        return "ok", f"{time.perf_counter() - started:.0f} s", ""

    report.check(f"section {name}", "runs to its end", timed)
    backend.use("cuda", 0)  # a section may have switched to the CPU for its reference


def chosen_sections(only: str | None, no_bench: bool, no_peer: bool) -> list[str]:
    """The sections to run, in ``SECTIONS``' order: ``only`` (comma-separated names) or all, less the
    benchmarks (``no_bench``: the checks alone) and the PyTorch rows (``no_peer``)."""
    names = list(SECTIONS) if only is None else [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise ValueError(f"--only {only!r}: expected some of {', '.join(SECTIONS)}, comma-separated")
    return [
        n
        for n in SECTIONS
        if n in names and not (no_bench and n != "checks") and not (no_peer and n in ("profile", "peer"))
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.md/.json (default $OUT)")
    parser.add_argument("--no-bench", action="store_true", help="checks only")
    parser.add_argument("--no-peer", action="store_true", help="without the PyTorch rows")
    parser.add_argument(
        "--only", metavar="SECTIONS", help=f"some of {','.join(SECTIONS)} (comma-separated), e.g. to split a run in two"
    )
    parser.add_argument("--pair-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pair_worker:
        return _pair_worker()
    try:
        sections = chosen_sections(args.only, args.no_bench, args.no_peer)
    except ValueError as error:
        parser.error(str(error))
    from ..errors import ConfigError

    try:
        backend.import_cupy()
    except ConfigError as error:
        print(f"gpu-check skipped: no CUDA device ({str(error).removeprefix('--device cuda: ')})")
        return 0
    backend.use("cuda", 0)
    env = environment()
    print("gpu-check environment:\n" + "\n".join(f"  {k}: {v}" for k, v in env), flush=True)
    report = Report(env, Path(args.out) if args.out else None)
    for name in sections:
        run_section(report, name)
    report.save()
    print("\n" + report.text(), flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
