"""Fused CUDA kernels (cupy) for the memory-bound pieces of a block; ``functional`` dispatches here
for cupy arrays. Each op is one pass over its data where the composed cupy version makes 4-8
(GELU alone: x*x, *c, +c, *x, tanh, +1, *x, *0.5, each a full read and write); the matrix products
stay with cuBLAS.

- elementwise (ElementwiseKernel, any float dtype cupy has, half types computed in float):
  GELU (tanh) and SiLU forward/backward, SwiGLU forward/backward;
- row-wise (RawModule, one thread block per row, warp-shuffle reductions): softmax with fully
  masked rows giving zeros (and an optional in-kernel causal mask; float32/float64), layernorm and
  rmsnorm forward/backward (also float16/bfloat16: read and written in half, sums, gain, bias and
  1/std in float32, so each output is the widened float32 path's rounded once, in one pass where
  that path makes about six). Their saved tensors are what ``functional``'s backward expects, so a
  forward on one path and a backward on the other agree;
- the KV cache's slot write at a slot held on the device (a captured decode step's).

Each kernel runs in one dtype, that of the array ``functional`` dispatched on (the gradient in a
backward, as in ``cpu_kernels``): the other arrays are cast to it, since cupy refuses an
ElementwiseKernel call whose ``T`` arrays differ and the row kernels read raw pointers.

Importing this module needs no cupy; the kernels compile on first use.
"""

from __future__ import annotations

import functools
import math

import numpy

from .cuda_half import ACC, CTYPES, HALF

ROW_DTYPES = (numpy.dtype("float32"), numpy.dtype("float64"))
_C = math.sqrt(2.0 / math.pi)


def fused(x, row: bool = False, half: bool = False) -> bool:
    """True for a cupy array the kernels take: a floating dtype (row kernels: float32/float64, and
    float16/bfloat16 where ``half``: the norms, which write the half outputs the widened float32 path
    rounds to)."""
    if isinstance(x, numpy.ndarray) or type(x).__module__.split(".")[0] != "cupy":
        return False
    return _takes(x.dtype, row, half)


@functools.cache  # every kernel call asks: ``dtype.name`` alone costs microseconds of Python
def _takes(dtype, row: bool, half: bool) -> bool:
    dtype = numpy.dtype(dtype)
    floating = dtype.kind == "f" or dtype.name == "bfloat16"
    return (dtype in ROW_DTYPES or (half and floating and dtype.itemsize == 2)) if row else floating


def _acc(dtype):
    """The dtype a kernel sums in: float64 for float64, else float32 (``cuda_half``'s ``acc``)."""
    return numpy.dtype("float64") if numpy.dtype(dtype) == numpy.float64 else numpy.dtype("float32")


_G, _K = f"(A){_C!r}", "(A)0.044715"
# name: (inputs, outputs, body); the body computes in A (float, or double for float64).
ELEMENTWISE = {
    "gelu_fwd": (
        "T x",
        "T y, T t",
        f"A v = (A)x; A u = tanh({_G} * v * ((A)1 + {_K} * v * v)); t = (T)u;y = (T)((A)0.5 * v * ((A)1 + u));",
    ),
    "gelu_bwd": (
        "T dy, T x, T t",
        "T dx",
        f"A v = (A)x; A u = (A)t; A inner = (A)0.5 * {_G} * v * ((A)1 + (A)3 * {_K} * v * v);"
        "dx = (T)((A)dy * (inner * ((A)1 - u * u) + (A)0.5 * ((A)1 + u)));",
    ),
    "silu_fwd": ("T x", "T y, T sig", "A v = (A)x; A s = (A)1 / ((A)1 + exp(-v)); sig = (T)s; y = (T)(v * s);"),
    "silu_bwd": (
        "T dy, T x, T sig",
        "T dx",
        "A v = (A)x; A s = (A)sig; dx = (T)((A)dy * s * ((A)1 + v * ((A)1 - s)));",
    ),
    "swiglu_fwd": ("T gate, T up", "T y", "A g = (A)gate; y = (T)(g / ((A)1 + exp(-g)) * (A)up);"),
    "swiglu_bwd": (
        "T dy, T gate, T up",
        "T dgate, T dup",
        "A g = (A)gate; A s = (A)1 / ((A)1 + exp(-g)); A d = (A)dy;"
        "dgate = (T)(d * (A)up * s * ((A)1 + g * ((A)1 - s))); dup = (T)(d * g * s);",
    ),
}


@functools.cache
def _elementwise(name: str):
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    inputs, outputs, body = ELEMENTWISE[name]
    return cupy.ElementwiseKernel(
        inputs, outputs, "typedef typename acc<T>::type A; " + body, f"hpc_tp_{name}", preamble=ACC
    )


_ROWS = (
    HALF
    + r"""
#define NEG_INF (-__int_as_float(0x7f800000))  // NVRTC has no <cmath> INFINITY
struct Sum { template <typename A> __device__ A operator()(A a, A b) const { return a + b; } };
struct Max { template <typename A> __device__ A operator()(A a, A b) const { return a > b ? a : b; } };

// Reduce v over the block (blockDim a multiple of 32, at most 1024); every thread gets the result.
template <typename A, typename Op>
__device__ A block_reduce(A v, A identity, Op op, A* shared) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // the previous call's readers are done with shared
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? shared[threadIdx.x] : identity;
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x == 0) shared[0] = v;
  __syncthreads();
  return shared[0];
}

// Keys j < limit are visible: all of them, or with `causal` those up to the query's own position
// (query q of the row is row % tq, at absolute position q + offset).
template <typename T>
__global__ void softmax_fwd(const T* x, T* y, long long n, long long tq, long long offset, int causal) {
  typedef typename acc<T>::type A;
  __shared__ A shared[32];
  const long long row = blockIdx.x;
  const T* xr = x + row * n;
  T* yr = y + row * n;
  long long limit = causal ? row % tq + offset + 1 : n;
  if (limit > n) limit = n;
  A m = (A)NEG_INF;
  for (long long j = threadIdx.x; j < limit; j += blockDim.x) m = m > widen(xr[j]) ? m : widen(xr[j]);
  m = block_reduce(m, (A)NEG_INF, Max(), shared);
  if (!isfinite(m)) m = 0;  // a fully masked row: every exp is 0, and the row stays 0
  A s = 0;
  for (long long j = threadIdx.x; j < limit; j += blockDim.x) s += exp(widen(xr[j]) - m);
  s = block_reduce(s, (A)0, Sum(), shared);
  const A inv = s > 0 ? (A)1 / s : (A)1;
  for (long long j = threadIdx.x; j < n; j += blockDim.x) put(yr + j, j < limit ? exp(widen(xr[j]) - m) * inv : (A)0);
}

template <typename T>
__global__ void softmax_bwd(const T* dp, const T* p, T* ds, long long n) {
  typedef typename acc<T>::type A;
  __shared__ A shared[32];
  const long long base = blockIdx.x * n;
  A dot = 0;
  for (long long j = threadIdx.x; j < n; j += blockDim.x) dot += widen(dp[base + j]) * widen(p[base + j]);
  dot = block_reduce(dot, (A)0, Sum(), shared);
  for (long long j = threadIdx.x; j < n; j += blockDim.x) put(ds + base + j, (widen(dp[base + j]) - dot) * widen(p[base + j]));
}

// Layernorm (rms = 0) or rmsnorm (rms = 1, no mean, no bias); saves xhat and 1/std per row. The gain,
// bias and 1/std are in the sums' type (float for half inputs).
template <typename T>
__global__ void norm_fwd(const T* x, const typename acc<T>::type* gain, const typename acc<T>::type* bias, T* y,
                         T* xhat, typename acc<T>::type* rstd, long long n, double eps, int rms, int has_bias) {
  typedef typename acc<T>::type A;
  __shared__ A shared[32];
  const long long base = blockIdx.x * n;
  A mean = 0;
  if (!rms) {
    for (long long j = threadIdx.x; j < n; j += blockDim.x) mean += widen(x[base + j]);
    mean = block_reduce(mean, (A)0, Sum(), shared) / (A)n;
  }
  A var = 0;
  for (long long j = threadIdx.x; j < n; j += blockDim.x) { A d = widen(x[base + j]) - mean; var += d * d; }
  var = block_reduce(var, (A)0, Sum(), shared) / (A)n;
  const A r = (A)1 / sqrt(var + (A)eps);
  for (long long j = threadIdx.x; j < n; j += blockDim.x) {
    A h = (widen(x[base + j]) - mean) * r;
    put(xhat + base + j, h);
    put(y + base + j, h * gain[j] + (has_bias ? bias[j] : (A)0));
  }
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy gain; rmsnorm drops the mean(g) term.
template <typename T>
__global__ void norm_bwd(const T* dy, const typename acc<T>::type* gain, const T* xhat,
                         const typename acc<T>::type* rstd, T* dx, long long n, int rms) {
  typedef typename acc<T>::type A;
  __shared__ A shared[32];
  const long long base = blockIdx.x * n;
  A sg = 0, sgx = 0;
  for (long long j = threadIdx.x; j < n; j += blockDim.x) {
    A g = widen(dy[base + j]) * gain[j];
    sg += g;
    sgx += g * widen(xhat[base + j]);
  }
  sgx = block_reduce(sgx, (A)0, Sum(), shared) / (A)n;
  sg = rms ? (A)0 : block_reduce(sg, (A)0, Sum(), shared) / (A)n;
  const A r = rstd[blockIdx.x];
  for (long long j = threadIdx.x; j < n; j += blockDim.x)
    put(dx + base + j, r * (widen(dy[base + j]) * gain[j] - sg - widen(xhat[base + j]) * sgx));
}
"""
)
_ROW_KERNELS = ("softmax_fwd", "softmax_bwd", "norm_fwd", "norm_bwd")
ROW_OPTIONS = ("-std=c++14",)


@functools.cache
def _row_module():
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    names = [f"{k}<{t}>" for k in _ROW_KERNELS for t in CTYPES.values()]
    return cupy.RawModule(code=_ROWS, options=ROW_OPTIONS, name_expressions=names)


def row_source() -> str:
    """The row kernels' CUDA source (for compile checks without a device)."""
    return _ROWS


@functools.cache
def _row_kernel(name: str, dtype):
    return _row_module().get_function(f"{name}<{CTYPES[numpy.dtype(dtype).name]}>")


def _launch(name: str, x, *args):
    """One block per row of ``x``'s last axis: 32-256 threads, enough to cover short rows once."""
    n = x.shape[-1]
    rows = x.size // n if n else 0
    if rows:
        threads = min(256, 32 * -(-n // 32))
        _row_kernel(name, x.dtype)((rows,), (threads,), args)


def _c(x, dtype=None):
    """Contiguous, and in the kernel's dtype: it reads raw pointers, so a float64 gain with float32
    activations would be read as garbage rather than converted."""
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    return cupy.ascontiguousarray(x if dtype is None else x.astype(dtype, copy=False))


def _as(dtype, *arrays):
    """``arrays`` in ``dtype`` (no copy when they are already): an ElementwiseKernel's ``T`` is one
    type, and cupy raises on e.g. a float32 gradient with float16 saved activations."""
    return tuple(a.astype(dtype, copy=False) for a in arrays)


# -- elementwise ----------------------------------------------------------------------------------------
def gelu_tanh_forward(x):
    y, t = _elementwise("gelu_fwd")(x)
    return y, (x, t)


def gelu_tanh_backward(dy, saved):
    x, t = _as(dy.dtype, *saved)
    return _elementwise("gelu_bwd")(dy, x, t)


def silu_forward(x):
    y, sig = _elementwise("silu_fwd")(x)
    return y, (x, sig)


def silu_backward(dy, saved):
    x, sig = _as(dy.dtype, *saved)
    return _elementwise("silu_bwd")(dy, x, sig)


def swiglu_forward(gate, up):
    """silu(gate) * up in one pass; saves the inputs only (the backward recomputes the sigmoid)."""
    return _elementwise("swiglu_fwd")(gate, *_as(gate.dtype, up)), (gate, up)


def swiglu_backward(dy, saved):
    """(d gate, d up)."""
    return _elementwise("swiglu_bwd")(dy, *_as(dy.dtype, *saved))


# -- KV cache -------------------------------------------------------------------------------------------
@functools.cache
def _slot_writer():
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    return cupy.ElementwiseKernel(
        "T token, raw int64 slot, int64 slots, int64 width",
        "raw T cache",
        "cache[(i / width * slots + slot[0]) * width + i % width] = token;",
        "hpc_tp_write_slot",
    )


def write_slot(cache, new, slot):
    """``cache`` [..., slots, d] (C-contiguous) takes ``new`` [..., 1, d] at the slot that the one-element
    device array ``slot`` holds. The slot is read on the device, so a captured CUDA graph writes each
    replay's own slot (``serve.decoding``)."""
    _slot_writer()(new, slot, cache.shape[-2], cache.shape[-1], cache)


# -- row-wise ---------------------------------------------------------------------------------------
def softmax_forward(scores, causal_offset: int | None = None):
    """Softmax over the last axis; ``causal_offset`` masks key j > query + offset in the kernel
    (scores [..., Tq, Tk]) instead of an added -inf bias."""
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    x = _c(scores)
    y = cupy.empty_like(x)
    tq = x.shape[-2] if x.ndim > 1 else 1
    _launch(
        "softmax_fwd",
        x,
        x,
        y,
        numpy.int64(x.shape[-1]),
        numpy.int64(tq),
        numpy.int64(causal_offset or 0),
        numpy.int32(causal_offset is not None),
    )
    return y


def softmax_backward(dp, p):
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    dp = _c(dp)
    p = _c(p, dp.dtype)  # dp's dtype is the one functional checked (float32/float64); p's may be half
    ds = cupy.empty_like(dp)
    _launch("softmax_bwd", dp, dp, p, ds, numpy.int64(dp.shape[-1]))
    return ds


def _norm_forward(x, gain, bias, eps, rms: bool):
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    x = _c(x)
    acc = _acc(x.dtype)
    gain = _c(gain, acc)
    bias = gain if bias is None else _c(bias, acc)
    y, xhat = cupy.empty_like(x), cupy.empty_like(x)
    rstd = cupy.empty(x.shape[:-1] + (1,), dtype=acc)
    _launch(
        "norm_fwd",
        x,
        x,
        gain,
        bias,
        y,
        xhat,
        rstd,
        numpy.int64(x.shape[-1]),
        numpy.float64(eps),
        numpy.int32(rms),
        numpy.int32(bias is not gain),
    )
    return y, (xhat, rstd)


def _norm_backward(dy, gain, saved, rms: bool):
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    xhat, rstd = saved
    dy = _c(dy)
    acc = _acc(dy.dtype)
    xhat, gain, rstd = _c(xhat, dy.dtype), _c(gain, acc), _c(rstd, acc)
    dx = cupy.empty_like(dy)
    _launch("norm_bwd", dy, dy, gain, xhat, rstd, dx, numpy.int64(dy.shape[-1]), numpy.int32(rms))
    n = dy.shape[-1]
    # The gain and bias gradients in the sums' type (float32 for half inputs, as their buffers are): a
    # product and a column sum, two launches where cupy's einsum plans for hundreds of microseconds.
    dy2 = dy.reshape(-1, n).astype(acc, copy=False)
    dgain = (dy2 * xhat.reshape(-1, n).astype(acc, copy=False)).sum(axis=0)
    return dx, dgain, dy2.sum(axis=0)


def layernorm_forward(x, gain, bias, eps):
    return _norm_forward(x, gain, bias, eps, rms=False)


def layernorm_backward(dy, gain, saved):
    return _norm_backward(dy, gain, saved, rms=False)


def rmsnorm_forward(x, gain, eps):
    return _norm_forward(x, gain, None, eps, rms=True)


def rmsnorm_backward(dy, gain, saved):
    dx, dgain, _ = _norm_backward(dy, gain, saved, rms=True)
    return dx, dgain
