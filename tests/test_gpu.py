"""The GPU backend against the numpy one: fused kernels, tp equality, training, mixed precision.

The measuring code is hpc_tp.bench.gpu_check's (what ``make gpu-check`` tabulates); these tests
hold it to its bounds. Skipped, with the reason, where cupy or a CUDA device is missing (CI,
laptops); the kernels' source is compiled wherever NVRTC loads, device or not. The 2-rank test
shares one device through MPI (NCCL refuses one device twice).
"""
import numpy as np
import pytest

from hpc_tp import backend
from hpc_tp.bench import gpu_check as G
from hpc_tp.nn import cuda_kernels as K
from hpc_tp.nn import functional as F

CUDA = backend.cuda_available()
if CUDA:
    import cupy


def device_test(test):
    """On the device (``on_device``), or skipped with the reason where there is none."""
    return pytest.mark.skipif(not CUDA, reason="no CUDA device (cupy missing or no GPU visible)")(
        pytest.mark.usefixtures("on_device")(test))


@pytest.fixture
def on_device():
    backend.use("cuda")
    yield
    backend.use("cpu")


@pytest.mark.parametrize("dtype", ["float", "double"])
def test_kernel_source_compiles_for_sm90(dtype):
    """NVRTC alone, no device: both kernel sets compile for the H100/H200 architecture."""
    pytest.importorskip("cupy", reason="cupy is not installed")
    from cupy_backends.cuda.libs import nvrtc

    try:
        nvrtc.getVersion()
    except Exception as error:  # noqa: BLE001: the library is a separate package (nvidia-cuda-nvrtc)
        pytest.skip(f"NVRTC does not load here: {error}")
    sources = {"rows": (K.row_source(), [f"{k}<{dtype}>" for k in K._ROW_KERNELS])}
    wrapped = [K._ACC]
    for name, (inputs, outputs, body) in K.ELEMENTWISE.items():  # each body in a kernel shaped like cupy's
        names = [p.split()[1] for p in f"{inputs}, {outputs}".split(", ")]
        n_in = len(inputs.split(", "))
        params = ", ".join(("const T* " if i < n_in else "T* ") + f"p_{v}" for i, v in enumerate(names))
        views = " ".join(("const T " if i < n_in else "T& ") + f"{v} = p_{v}[i];" for i, v in enumerate(names))
        wrapped.append(f"template <typename T> __global__ void {name}({params}) {{ int i = threadIdx.x; {views} "
                       f"typedef typename acc<T>::type A; {body} }}")
    sources["elementwise"] = ("\n".join(wrapped), [f"{name}<{dtype}>" for name in K.ELEMENTWISE])
    for label, (source, names) in sources.items():
        program = nvrtc.createProgram(source, f"{label}.cu", [], [])
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, ["-std=c++14", "-arch=compute_90"])
        except Exception:
            pytest.fail(f"{label} kernels do not compile:\n{nvrtc.getProgramLog(program)}")
        assert nvrtc.getPTX(program)


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
def test_training_on_the_device_equals_the_cpu_in_float64():
    cpu, _ = G.train_losses("cpu", "float64")
    gpu, trainer = G.train_losses("cuda", "float64")
    assert all(isinstance(p.data, cupy.ndarray) for p in trainer.params.values())
    assert max(abs(a - b) / b for a, b in zip(gpu, cpu)) <= G.TP_TOL, (gpu, cpu)


@device_test
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mixed_precision_on_the_device_follows_float32(dtype):
    if dtype == "bfloat16" and G._bfloat16_missing():
        pytest.skip(G._bfloat16_missing())
    full, _ = G.train_losses("cuda", "float32", steps=5)
    half, trainer = G.train_losses("cuda", dtype, steps=5, loss_scale=2.0 ** 10)
    assert all(p.data.dtype == np.float32 for p in trainer.precision.master.values())
    assert max(abs(a - b) / b for a, b in zip(half, full)) <= G.MIXED_TOL[dtype] and half[-1] < half[0]


@device_test
@pytest.mark.mpi(min_size=2)
def test_tp2_on_the_device_equals_tp1(comm_world):
    """Two ranks on one GPU (MPI carries the device arrays): tp=2 == tp=1 in float64."""
    error, transport = G.tp_equality(comm_world)
    assert transport != "nccl" or cupy.cuda.runtime.getDeviceCount() > 1
    assert error <= G.TP_TOL
