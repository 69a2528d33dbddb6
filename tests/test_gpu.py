"""The GPU backend against the numpy one: fused kernels, tp equality, training, mixed precision.

The measuring code is hpc_tp.bench.gpu_check's (what ``make gpu-check`` tabulates); these tests
hold it to its bounds. Skipped, with the reason, where cupy or a CUDA device is missing (CI,
laptops). Without a device: every kernel is compiled in every dtype functional sends it wherever
cupy finds NVRTC and the CUDA headers, and the wrappers' dtype handling runs everywhere (numpy
standing in for cupy). The 2-rank test shares one device through MPI (NCCL refuses one device twice).
"""

import functools
import json
import re
import sys

import numpy as np
import pytest
from test_cublas import LAYOUTS, layout

from hpc_tp import backend
from hpc_tp.backend import resolve_dtype
from hpc_tp.bench import gpu_check as G
from hpc_tp.kernels import cuda_kernels as K
from hpc_tp.kernels import flash_attention as FA
from hpc_tp.kernels import functional as F

CUDA = backend.cuda_available()
if CUDA:
    import cupy


def device_test(test):
    """On the device (``on_device``), or skipped with the reason where there is none."""
    return pytest.mark.skipif(not CUDA, reason="no CUDA device (cupy missing or no GPU visible)")(
        pytest.mark.usefixtures("on_device")(test)
    )


@pytest.fixture
def on_device():
    backend.use("cuda")
    yield
    backend.use("cpu")


def _nvrtc(options=(), arch="compute_90"):
    """NVRTC and cupy's compile options (its headers, the CUDA headers it found) for ``options``:
    what a kernel is compiled with on a device, here without one; skipped where either is missing.
    ``arch``: a virtual one gives PTX; a real one (sm_90) runs ptxas too."""
    pytest.importorskip("cupy", reason="cupy is not installed")
    from cupy._core import core
    from cupy_backends.cuda.libs import nvrtc

    try:
        nvrtc.getVersion()
        return nvrtc, [*core.assemble_cupy_compiler_options(tuple(options)), f"-arch={arch}"]
    except Exception as error:  # noqa: BLE001 -- NVRTC and the CUDA headers are separate packages
        pytest.skip(f"NVRTC or the CUDA headers are not found here: {error}")


def _compile(label, source, names=(), options=(), arch="compute_90"):
    """The program log (ptxas's report with ``--ptxas-options=-v`` and a real ``arch``)."""
    nvrtc, options = _nvrtc(options, arch)
    program = nvrtc.createProgram(source, f"{label}.cu", [], [])
    for name in names:
        nvrtc.addNameExpression(program, name)
    try:
        nvrtc.compileProgram(program, options)
    except Exception:  # noqa: BLE001 -- the log says why
        pytest.fail(f"{label} does not compile for sm_90:\n{nvrtc.getProgramLog(program)}")
    assert nvrtc.getPTX(program)
    return nvrtc.getProgramLog(program)


def test_row_kernels_compile_for_sm90():
    """NVRTC alone, no device: every instance the row module holds (float32/float64, the only dtypes
    functional sends it: other dtypes take the composed code)."""
    names = [f"{k}<{t}>" for k in K._ROW_KERNELS for t in K.CTYPES.values()]
    _compile("rows", K.row_source(), names, K.ROW_OPTIONS)


@pytest.mark.parametrize("dtype", FA.DTYPES)
def test_flash_attention_compiles_for_sm90(dtype):
    """The fused attention's three kernels for every head-size bucket, NVRTC and ptxas for sm_90 alone
    (no device). With float sums (half and float32 inputs) every instance keeps its accumulators in
    registers: ptxas reports no stack frame and no spill (float64, the checking dtype, may spill)."""
    for bucket in FA.HEAD_DIMS:
        log = _compile(
            f"flash {dtype} {bucket}", FA.SOURCE, FA.names(dtype, bucket), (*FA.OPTIONS, "--ptxas-options=-v"), "sm_90"
        )
        frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log)
        assert len(frames) == len(FA.KERNELS), log
        if dtype != "float64":
            assert all(frame == ("0", "0") for frame in frames), f"bucket {bucket}: {log}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_elementwise_kernels_compile_for_sm90(dtype):
    """Each ElementwiseKernel in every dtype functional sends it (any float dtype cupy has), as the
    source cupy generates for a call on 1-d arrays, compiled with NVRTC alone (no device)."""
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    from cupy._core import _carray, _kernel, core
    from cupy._core._scalar import get_typename

    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes").bfloat16
    dtype = np.dtype(dtype)
    try:
        get_typename(dtype)
    except Exception:  # noqa: BLE001 -- cupy < 14 has no bfloat16 arrays, so functional never sends one
        pytest.skip(f"cupy {cupy.__version__} has no C type for {dtype}")
    headers = "".join(f"#include <{h}>\n" for h in core._cupy_header_list)  # what cupy puts first
    for name in K.ELEMENTWISE:
        kernel = K._elementwise(name)
        types = kernel._decide_params_type((dtype,) * kernel.nin, ())[2]
        args = tuple(_kernel._ArgInfo(1, cupy.ndarray, dtype, 1, True, True) for _ in range(kernel.nargs))
        args += (_kernel._ArgInfo(2, _carray.Indexer, None, 1, True, True),)  # kinds: ndarray 1, indexer 2
        source = _kernel._get_elementwise_kernel_code(
            args, types, kernel.params, kernel.operation, kernel.name, kernel.preamble
        )
        _compile(f"{name} {dtype}", headers + source)


@pytest.fixture
def host_kernels(monkeypatch):
    """cuda_kernels' wrappers on the host: numpy stands in for cupy, and each kernel launch checks
    what cupy's would need: one dtype over its arrays (an ElementwiseKernel's ``T``), each row
    kernel's raw pointers in the dtype its source declares (``T``: the input's; ``acc<T>``: the sums'),
    and a row kernel only in a dtype the module has. Returns the launches."""
    launches = []

    def launch(name, *arrays):
        dtypes = {a.dtype for a in arrays}
        assert len(dtypes) == 1, f"{name} launched with {sorted(map(str, dtypes))}"
        launches.append((name, dtypes.pop()))

    def elementwise(name):
        outputs = len(K.ELEMENTWISE[name][1].split(", "))

        def run(*arrays):
            launch(name, *arrays)
            return np.zeros_like(arrays[0]) if outputs == 1 else tuple(np.zeros_like(arrays[0]) for _ in range(outputs))

        return run

    def rows(name, x, *args):
        assert x.dtype.name in K.CTYPES, f"{name} has no {x.dtype} instance"
        pointers = [a.dtype for a in args if isinstance(a, np.ndarray)]
        declared = re.search(rf"\b{name}\((.*?)\)\s*{{", K.row_source(), re.S).group(1).split(",")
        expected = [K._acc(x.dtype) if "acc<T>" in p else x.dtype for p in declared if "*" in p]
        assert pointers == expected, f"{name} launched with {pointers}, declared {expected}"
        launches.append((name, x.dtype))

    monkeypatch.setitem(sys.modules, "cupy", np)
    monkeypatch.setattr(K, "_elementwise", elementwise)
    monkeypatch.setattr(K, "_launch", rows)
    return launches


def test_half_arrays_reach_the_norm_kernels_only():
    """The norms take float16 and bfloat16 (sums in float32, each output rounded once); the softmax
    keeps float32/float64, whose half inputs functional widens."""
    bf16 = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    for half in (np.dtype("float16"), bf16):
        assert K._takes(half, True, True) and not K._takes(half, True, False) and K._acc(half) == np.float32
    assert K._takes(np.dtype("float32"), True, False) and K._acc(np.dtype("float64")) == np.float64


@pytest.mark.parametrize("grad, saved", [("float32", "float16"), ("float16", "float32"), ("float64", "float32")])
def test_kernels_run_in_the_dispatched_dtype(host_kernels, grad, saved):
    """A gradient whose dtype differs from the saved tensors' (mixed precision can give either way
    round): each kernel gets one dtype, the gradient's, which is the one functional checked."""
    rng = np.random.default_rng(0)

    def a(dtype, shape=(3, 8)):
        return rng.standard_normal(shape).astype(dtype)

    results = [
        K.gelu_tanh_backward(a(grad), (a(saved), a(saved))),
        K.silu_backward(a(grad), (a(saved), a(saved))),
        *K.swiglu_backward(a(grad), (a(saved), a(saved))),
        K.swiglu_forward(a(grad), a(saved))[0],
    ]
    if grad in K.CTYPES:  # the row kernels' dtypes
        results += [
            K.softmax_backward(a(grad), a(saved)),
            K.layernorm_backward(a(grad), a(saved, 8), (a(saved), a(saved, (3, 1))))[0],
            K.rmsnorm_backward(a(grad), a(saved, 8), (a(saved), a(saved, (3, 1))))[0],
        ]
    assert {dtype.name for _, dtype in host_kernels} == {grad}
    assert all(r.dtype == grad for r in results)


@device_test
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("n", [7, 300, 1500])  # rows shorter than a warp, a few warps, several passes
def test_fused_kernels_match_numpy(dtype, n):
    errors = G.kernel_errors(dtype, n=n)
    assert set(errors) == {"gelu_tanh", "silu", "swiglu", "softmax", "layernorm", "rmsnorm"}
    assert max(errors.values()) <= G.KERNEL_TOL[dtype], errors


@device_test
def test_softmax_kernel_causal_mask_equals_the_added_bias():
    from hpc_tp.nn.attention import attention_bias

    scores = cupy.asarray(np.random.default_rng(0).standard_normal((2, 4, 6, 9)))
    biased = F.softmax_forward(scores + attention_bias(1, 6, 9, True, None, 3, "float64")[0])
    assert G._rel(K.softmax_forward(scores, causal_offset=3), biased) <= 1e-15


@device_test
def test_float16_elementwise_kernels_compute_in_float32():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    y, _ = F.gelu_tanh_forward(x)
    half, _ = F.gelu_tanh_forward(cupy.asarray(x, dtype=cupy.float16))
    assert half.dtype == cupy.float16 and G._rel(half, y) < 2e-3


@device_test
def test_float32_gradient_with_float16_saved_tensors():
    """The fused backward of a float32 gradient through float16 saved tensors (the kernels cast them)
    equals numpy's on the same float16 values widened."""
    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((4, 300)), dtype=cupy.float16)
    dy = cupy.asarray(rng.standard_normal((4, 300)), dtype=cupy.float32)
    for forward, backward in ((F.gelu_tanh_forward, F.gelu_tanh_backward), (F.silu_forward, F.silu_backward)):
        saved = forward(x)[1]
        expected = backward(dy.get(), tuple(s.get().astype(np.float32) for s in saved))
        dx = backward(dy, saved)
        assert dx.dtype == cupy.float32 and G._rel(dx, expected) < 1e-5
    p = F.softmax_forward(x)  # float16: the composed path
    ds = F.softmax_backward(dy, p)
    assert ds.dtype == cupy.float32 and G._rel(ds, F.softmax_backward(dy.get(), p.get().astype(np.float32))) < 1e-5


@device_test
@pytest.mark.parametrize("name", LAYOUTS)
def test_cublas_gemm_computes_a_at_b_in_every_layout(name):
    """The real cuBLAS call for the layouts test_cublas emulates: float64 to rounding, the half types
    (float32 sums) to their bits, and half inputs summed into a float32 output (a weight gradient)."""
    from hpc_tp.kernels import cublas

    a, b = layout(name, cupy.asarray)
    want = np.matmul(*layout(name))
    assert G._rel(cublas.gemm(a, b, cupy.full(want.shape, cupy.nan)), want) < 1e-13
    halves = [np.dtype("float16")] + ([] if G._bfloat16_missing() else [resolve_dtype("bfloat16")])
    for half in halves:
        low = a.astype(half), b.astype(half)
        exact = np.matmul(*(x.astype(cupy.float64).get() for x in low))  # the rounded inputs' true product
        assert G._rel(cublas.gemm(*low, cupy.empty(want.shape, half)), exact) < 1e-2, half
        total = cupy.ones(want.shape, cupy.float32)
        cublas.gemm(*low, total, accumulate=True)
        assert G._rel(total, exact + 1) < 1e-5, half


def _attention_pass(device: str, t: int, padded: bool, window: int = 0) -> list:
    """Output, input gradient and parameter gradients of one causal GQA + RoPE attention layer (with a
    sliding ``window``) on ``device`` (float64, host copies)."""
    from hpc_tp.comm.mpi import self_comm
    from hpc_tp.models.init import initialize
    from hpc_tp.nn.attention import ParallelAttention

    backend.use(device)
    layer = ParallelAttention(32, 4, 2, self_comm(), rope_theta=10000.0, window=window, dtype="float64")
    initialize(layer, std=0.3, n_layers=1, seed=5)
    rng = np.random.default_rng(0)
    x, dy = (backend.xp.asarray(rng.standard_normal((2, t, 32))) for _ in range(2))
    key_mask = np.ones((2, t), "int64")
    key_mask[1, t - 20 :] = 0
    y, ctx = layer.forward(x, key_mask=backend.xp.asarray(key_mask) if padded else None)
    dx = layer.backward(dy, ctx)
    return [backend.to_numpy(a) for a in (y, dx, *(p.grad for _, p in layer.named_parameters()))]


@device_test
@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("padded", [False, True])
def test_attention_in_device_blocks_equals_the_cpu_blocks(padded, window):
    """T = 300: two causal blocks on the device (256 queries, then 44), five on the CPU (64 each);
    with a sliding window each block reads only the keys from its first query's window on."""
    cpu = _attention_pass("cpu", 300, padded, window)
    gpu = _attention_pass("cuda", 300, padded, window)
    assert max(G._rel(g, c) for g, c in zip(gpu, cpu)) <= 1e-12


@device_test
@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("padded", [False, True])
def test_the_fused_attention_layer_equals_the_composed_one(padded, window, monkeypatch):
    """The layer on the device through the fused kernels (``HPC_TP_FLASH_ATTENTION=1``) and through the composed
    path (``HPC_TP_FLASH_ATTENTION=0``), float64: T = 300 crosses query, key and device-block tiles; with a
    sliding window too."""
    monkeypatch.setenv("HPC_TP_FLASH_ATTENTION", "1")
    fused = _attention_pass("cuda", 300, padded, window)
    monkeypatch.setenv("HPC_TP_FLASH_ATTENTION", "0")
    composed = _attention_pass("cuda", 300, padded, window)
    assert max(G._rel(f, c) for f, c in zip(fused, composed)) <= 1e-12


@device_test
def test_the_device_layer_runs_the_fused_kernels_and_keeps_no_scores(monkeypatch):
    from hpc_tp.comm.mpi import self_comm
    from hpc_tp.nn.attention import ParallelAttention

    monkeypatch.setenv("HPC_TP_FLASH_ATTENTION", "1")
    layer = ParallelAttention(32, 4, 2, self_comm(), dtype="float32")
    _, ctx = layer.forward(cupy.ones((2, 40, 32), "float32"))
    assert ctx.flash_out is not None and ctx.probs is None and ctx.lse.shape == (2, 2, 2, 40)


@device_test
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_fused_attention_kernels_match_the_composed_core(dtype):
    """Output, log-sum-exp, dQ, dK, dV of every ``gpu_check.FLASH_CASES`` case (GQA, padding, a cache
    offset, head size 256 with a window, no causal mask) against the composed core in float64."""
    if dtype == "bfloat16" and G._bfloat16_missing():
        pytest.skip(G._bfloat16_missing())
    errors = G.flash_errors(dtype)
    assert max(errors.values()) <= G.FLASH_TOL[dtype], errors


@device_test
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "gemma3"])
def test_decoding_on_the_device_gives_the_cpu_tokens_and_logits(name):
    """Greedy generation with the KV cache (a left-padded prefill, then a token a step) on the device
    picks the CPU's tokens, and the device's logits of the whole sequences equal the CPU's (float64)."""
    from test_generate import PROMPTS, _model

    from hpc_tp.comm.mpi import self_comm
    from hpc_tp.serve.generate import Engine
    from hpc_tp.serve.sampling import SamplingParams
    from hpc_tp.tokenizer import ByteTokenizer

    params = [SamplingParams(max_new_tokens=n) for n in (6, 3, 6, 5)]
    ids, logits = {}, {}
    for device in ("cpu", "cuda"):
        backend.use(device)
        model = _model(name, self_comm())
        out = Engine(model, ByteTokenizer()).generate(PROMPTS, params)
        ids[device] = [c.ids for c in out[0]]
        sequence = backend.xp.asarray([PROMPTS[0] + ids[device][0]])
        logits[device] = backend.to_numpy(model.logits(sequence))
    assert ids["cuda"] == ids["cpu"]
    assert G._rel(logits["cuda"], logits["cpu"]) <= 1e-12


@device_test
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "gemma3"])
def test_continuous_batching_on_the_device_gives_the_cpu_tokens(name):
    """The continuous batcher's paged KV cache on the device (``kv_cache.PagedView``'s scatter of new
    K/V to block slots and gather of each row's slots, ``PagedKVCache.copy_block``): the CPU's tokens
    and cached prefixes (float64), some of them cached."""
    from test_generate import CONFIGS, larger_weights

    device, host = (G.continuous_completions(d, CONFIGS[name], larger_weights) for d in ("cuda", "cpu"))
    assert device == host and any(cached for _, cached in host)


@device_test
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "gemma3"])
def test_a_captured_decode_step_replays_the_cpu_steps(name):
    """The fixed-shape decode step, captured as a CUDA graph at its first step: every replay gives the
    CPU's growing steps' logits (float64), at each replay's own slot and positions."""
    from test_generate import CONFIGS, PROMPTS, larger_weights

    error, replayed = G.decode_replay_error(CONFIGS[name], PROMPTS, weights=larger_weights)
    assert replayed and error <= 1e-12


@device_test
@pytest.mark.parametrize("name", ["gpt2", "llama-window", "qwen-moe"])
def test_continuous_steps_replayed_a_graph_a_bucket_give_the_cpu_steps(name):
    """Continuous batching's decode steps at their buckets' fixed shapes, each bucket captured at its first
    step and replayed at the next, rows joining and leaving: the CPU's eager steps' logits (float64)."""
    from test_generate import CONFIGS, larger_weights

    error, replayed = G.continuous_replay_error(CONFIGS[name], weights=larger_weights)
    assert replayed and error <= 1e-12


def test_the_continuous_step_rows_time_both_paths(tmp_path, monkeypatch):
    """gpu-check's continuous decode rows, their own logic on the CPU (the tiny model, one round of one
    step): a row per batch with both paths' times, in the JSON and the table."""
    quick = functools.partial(G.continuous_step_timings, rounds=1, steps=1, preset="tiny")
    monkeypatch.setattr(G, "continuous_step_timings", quick)
    report = G.Report(out=tmp_path)
    G.run_continuous_benchmarks(report, batches=(1, 3))
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["continuous"]
    assert [row["batch"] for row in rows] == [1, 3] and not any(row["graph_used"] for row in rows)
    assert all(row[path]["median"] > 0 for row in rows for path in ("eager_ms", "bucketed_ms"))
    assert "- 3 rows: eager " in (tmp_path / "gpu_check.md").read_text()


@device_test
def test_a_captured_block_stack_step_gives_the_eager_gradients():
    """Forward and backward of the block stack, eager on one model and replayed from a CUDA graph on
    another with the same weights: after three steps each (the graph's first eager, then captured,
    then two replays; each adds into the gradient buffers) every gradient is the same."""
    from hpc_tp.bench.step import build_blocks
    from hpc_tp.comm.mpi import self_comm
    from hpc_tp.cuda_graph import Replayed
    from hpc_tp.models.config import load_config

    cfg = load_config("tiny", max_seq_len=40)
    x = cupy.asarray(np.random.default_rng(0).standard_normal((2, 40, cfg.hidden)))
    grads = []
    for graphed in (False, True):
        model = build_blocks(cfg, self_comm(), "float64")

        def step(model=model):
            out, ctxs = model.blocks_forward(x)
            model.blocks_backward(out * 0.01, ctxs)

        run = Replayed(step, "test step") if graphed else step
        for _ in range(3):
            run()
        assert not graphed or not run.failed
        grads.append([backend.to_numpy(p.grad) for _, p in model.named_parameters()])
    assert max(G._rel(r, e) for r, e in zip(*reversed(grads))) <= 1e-12


@device_test
def test_training_steps_replayed_from_a_cuda_graph_equal_the_eager_steps():
    """``hpc-tp train --cuda-graph`` on the card (the demo model, float64): the first step eager and
    captured, the next four replayed, each loss within 1e-12 of the eager run's."""
    row = G.captured_train_steps("float64")
    assert row["graph_used"] and row["loss_error"] <= G.CAPTURED_TOL, row


def test_the_captured_training_rows_put_both_paths_side_by_side(tmp_path, monkeypatch):
    """gpu-check's W1 training rows, eager against --cuda-graph: their cells and JSON from a stand-in
    measurement (the measurement itself needs a card)."""
    spread = {"median": 8.0, "min": 7.5, "max": 9.0}
    measured = {"eager_ms": spread, "graph_ms": {"median": 2.0, "min": 1.9, "max": 2.2}, "graph_used": True}
    monkeypatch.setattr(G, "captured_train_steps", lambda dtype, *a: {**measured, "loss_error": 3e-6})
    monkeypatch.setattr(G, "_bf16_or_fp16", lambda: "bfloat16")
    report = G.Report(out=tmp_path)
    G.run_captured_train_benchmarks(report)
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["train_graph"]
    assert [(r["dtype"], r["shape"]) for r in rows] == [("float32", "4x256"), ("bfloat16", "4x256")]
    text = (tmp_path / "gpu_check.md").read_text()
    assert (
        "- W1 train float32 4x256: eager 8.00 ms (7.50-9.00), replayed 2.00 ms (1.90-2.20), 4.00x; "
        "losses within 3.0e-06 of eager (ok, bound 1e-04)"
    ) in text


@device_test
@pytest.mark.parametrize("model", [{}, G.MOE], ids=["dense", "moe"])
def test_training_on_the_device_equals_the_cpu_in_float64(model):
    cpu, _ = G.train_losses("cpu", "float64", **model)
    gpu, trainer = G.train_losses("cuda", "float64", **model)
    assert all(isinstance(p.data, cupy.ndarray) for p in trainer.params.values())
    assert max(abs(a - b) / b for a, b in zip(gpu, cpu)) <= G.TP_TOL, (gpu, cpu)


@device_test
@pytest.mark.parametrize(
    "dtype, model",
    [("float16", {}), ("bfloat16", {}), ("bfloat16", G.MOE)],
    ids=["float16", "bfloat16", "bfloat16-moe"],
)
def test_mixed_precision_on_the_device_follows_float32(dtype, model):
    if dtype == "bfloat16" and G._bfloat16_missing():
        pytest.skip(G._bfloat16_missing())
    full, _ = G.train_losses("cuda", "float32", steps=5, **model)
    half, trainer = G.train_losses("cuda", dtype, steps=5, loss_scale=2.0**10, **model)
    assert all(p.data.dtype == np.float32 for p in trainer.precision.master.values())
    assert max(abs(a - b) / b for a, b in zip(half, full)) <= G.MIXED_TOL[dtype] and half[-1] < half[0]


@device_test
@pytest.mark.mpi(min_size=2)
def test_tp2_on_the_device_equals_tp1(comm_world):
    """Two ranks on one GPU (MPI carries the device arrays): tp=2 == tp=1 in float64."""
    error, transport = G.tp_equality(comm_world)
    assert transport != "nccl" or cupy.cuda.runtime.getDeviceCount() > 1
    assert error <= G.TP_TOL


@device_test
@pytest.mark.mpi(min_size=2)
def test_zero_on_the_device_trains_like_adamw(comm_world):
    pair = comm_world.split(color=comm_world.rank // 2, key=comm_world.rank)
    if pair.size == 2:
        assert G.zero_equality(pair) <= G.TP_TOL


@pytest.mark.mpi(min_size=2)
def test_the_zero_row_measures_a_difference_on_the_cpu(comm_world):
    """The gpu-check row's own logic, on the CPU: two ranks, ZeRO-1 against AdamW."""
    pair = comm_world.split(color=comm_world.rank // 2, key=comm_world.rank)
    if pair.size == 2:
        assert 0 <= G.zero_equality(pair, device="cpu") <= G.TP_TOL


@pytest.mark.mpi(min_size=2)
def test_the_tp_graph_row_measures_a_replay_on_a_second_input_on_the_cpu(comm_world, monkeypatch):
    """The gpu-check row's own logic, on the CPU, where no group can be captured (None), and with a
    stand-in whose every call runs the step: the tp = 2 step on the second input against one process."""
    from hpc_tp import cuda_graph

    assert G.tp_replay_error(comm_world) == (None, False, "mpi")

    class Rerun:
        def __init__(self, work, what):
            self.work, self.failed = work, False

        def __call__(self):
            return self.work()

    monkeypatch.setattr(cuda_graph, "capturable", lambda *groups: True)
    monkeypatch.setattr(cuda_graph, "Replayed", Rerun)
    error, replayed, transport = G.tp_replay_error(comm_world)
    if comm_world.rank < 2:  # the pair; the other ranks only split
        assert replayed and transport == "mpi" and 0 <= error <= G.TP_TOL


def test_sections_run_in_their_order_and_the_flags_drop_theirs():
    assert G.chosen_sections(None, False, False) == list(G.SECTIONS)
    assert G.chosen_sections("peer, checks", False, False) == ["checks", "peer"]
    assert G.chosen_sections(None, True, False) == ["checks"]
    assert "profile" not in G.chosen_sections(None, False, True) and "peer" not in G.chosen_sections(None, False, True)
    with pytest.raises(ValueError, match=r"--only 'bench,gpu': expected some of checks, bench, "):
        G.chosen_sections("bench,gpu", False, False)


def test_a_section_that_raises_is_a_failed_row_and_a_finished_one_gives_its_time(tmp_path, monkeypatch):
    def broken(report):
        raise KeyError("dtype")

    monkeypatch.setitem(G.SECTIONS, "decode", ("decode:", broken))
    monkeypatch.setitem(G.SECTIONS, "flash", ("flash:", lambda report: None))
    monkeypatch.setattr(G.backend, "use", lambda *device: None)  # no card here to go back to
    report = G.Report(out=tmp_path)
    G.run_section(report, "decode")
    G.run_section(report, "flash")
    assert [(c["check"], c["result"], c["detail"]) for c in report.checks] == [
        ("section decode", "FAIL", "KeyError: 'dtype'"),
        ("section flash", "ok", ""),
    ]
    assert report.checks[1]["measured"] == "0 s"


def test_a_check_that_fails_without_a_message_is_a_row_not_a_crash(tmp_path):
    """gpu-check runs on a lent machine in a few minutes: one bad check must not end the table."""
    report = G.Report(out=tmp_path)
    report.check("silent", "1e-9", lambda: (_ for _ in ()).throw(AssertionError()))
    report.check("next", "1e-9", lambda: G._bounded(0.0, 1e-9))
    assert [(row["check"], row["result"], row["detail"]) for row in report.checks] == [
        ("silent", "FAIL", "AssertionError: "),
        ("next", "ok", ""),
    ]


def test_peer_rows_alternate_and_put_the_peer_over_the_engine(tmp_path):
    """A peer row from stand-in timers: every round times the engine and then each peer, the medians and
    ranges land in ms, peer / engine > 1 where the engine is faster, and the table and JSON carry it."""
    report, calls = G.Report(out=tmp_path), []
    engine_s = iter([0.004, 0.002, 0.003])

    def engine():
        calls.append("engine")
        return next(engine_s)

    def peer(repeats):
        calls.append(f"peer x{repeats}")
        return 0.0045

    G._peer_row(report, {"kind": "W1 step", "dtype": "float32", "batch": 4}, engine, {"torch eager": lambda: peer})
    row = json.loads((tmp_path / "gpu_check.json").read_text())["peer"][0]
    assert calls == ["engine", "peer x5"] * G.PEER_ROUNDS
    assert row["engine"] == {"median": 3.0, "min": 2.0, "max": 4.0} and row["torch eager / engine"] == 1.5
    assert "W1 step float32 batch 4: engine 3.000 ms (2.000-4.000)" in (tmp_path / "gpu_check.md").read_text()
    assert "torch eager / engine 1.50x" in (tmp_path / "gpu_check.md").read_text()


def test_without_torch_on_a_device_the_peer_section_is_one_row_saying_why(tmp_path, monkeypatch):
    from hpc_tp.bench import torch_peer

    monkeypatch.setattr(torch_peer, "torch_missing", lambda: "torch is not importable here (stand-in)")
    report = G.Report(out=tmp_path)
    G.run_peer_benchmarks(report)
    G.run_profiles(report)
    assert report.rows["peer"] == report.rows["profile"] == [{"skipped": "torch is not importable here (stand-in)"}]
    assert (tmp_path / "gpu_check.md").read_text().count("- skipped: torch is not importable here (stand-in)") == 2


def test_a_profile_row_names_each_step_s_categories_and_the_engine_s_largest_kernels(tmp_path, monkeypatch):
    """The row from stand-in profiles: wall and busy ms, each category's ms and launches, for the engine
    and PyTorch, then the engine's largest kernels; the JSON keeps the whole summary."""
    from hpc_tp.bench import device_profile

    def profile(kernels):
        return device_profile.summary({"wall_ms": 20.0, "kernels": kernels}, top=1)

    engine = profile({"sm90_xmma_gemm_bf16": {"ms": 8.0, "calls": 48}, "cupy_add": {"ms": 6.0, "calls": 300}})
    torch = profile({"sm90_xmma_gemm_bf16": {"ms": 7.5, "calls": 48}, "pytorch_flash::fwd": {"ms": 1.0, "calls": 4}})
    monkeypatch.setattr(G, "step_profiles", lambda dtype, batch, seq: {"engine": engine, "torch eager": torch})
    monkeypatch.setattr(G, "decode_profiles", lambda: {"engine": engine | {"graph": True}, "torch": torch})
    monkeypatch.setattr("hpc_tp.bench.torch_peer.torch_missing", lambda: None)
    report = G.Report(out=tmp_path)
    G.run_profiles(report)
    text = (tmp_path / "gpu_check.md").read_text()
    assert [r["kind"] for r in report.rows["profile"]] == ["W1 step"] * 2 + ["W1 decode token, CUDA graphs"]
    assert "W1 decode token, CUDA graphs float32 batch 1: engine: wall 20.00 ms" in text
    assert "| torch: wall 20.00 ms, device busy 8.50 ms in 52 launches" in text
    assert (
        "W1 step float32 32x256: engine: wall 20.00 ms, device busy 14.00 ms in 348 launches; products 8.00 (48), "
        in text
    )
    assert (
        "torch eager: wall 20.00 ms, device busy 8.50 ms in 52 launches; products 7.50 (48), attention kernels" in text
    )
    assert "engine's largest: sm90_xmma_gemm_bf16 8.00 ms (48)" in text
    assert json.loads((tmp_path / "gpu_check.json").read_text())["profile"][0]["engine"]["categories"][
        "other elementwise"
    ] == {
        "ms": 6.0,
        "calls": 300,
    }


def test_the_profiled_steps_run_on_the_cpu_through_stand_ins(monkeypatch):
    """``step_profiles`` and ``decode_profiles`` build and step the engine's own W1 (here on the CPU,
    4 calls each as ``kernel_times`` makes them) beside a stand-in PyTorch, and summarize both."""
    from hpc_tp.bench import device_profile, torch_peer

    calls = []

    def kernel_times(step, steps=3):
        for _ in range(steps + 1):
            step()
        calls.append(steps + 1)
        return {"wall_ms": 1.0, "kernels": {"cupy_add": {"ms": 0.5, "calls": 2}}}

    monkeypatch.setattr(device_profile, "kernel_times", kernel_times)
    monkeypatch.setattr(torch_peer, "w1_step_function", lambda dtype, batch, compiled: lambda: None)
    monkeypatch.setattr(torch_peer, "decode_step_function", lambda batch, graphs: (lambda: None, None))
    step = G.step_profiles("float32", 1, 8)
    decode = G.decode_profiles(batch=1, prompt=4)
    assert calls == [4] * 4 and set(step) == {"engine", "torch eager"} and set(decode) == {"engine", "torch"}
    assert decode["engine"]["graph"] is False and step["engine"]["categories"] == {
        device_profile.OTHER: {"ms": 0.5, "calls": 2}
    }
