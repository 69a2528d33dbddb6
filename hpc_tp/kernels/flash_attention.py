"""The attention core on a GPU as fused kernels in the FlashAttention-2 manner (cupy ``RawModule``,
compiled with NVRTC): softmax(Q K^T + masks) V without any [T, keys] scores in device memory.

- forward (``flash_fwd``): a thread block takes ``ROWS * WARPS`` queries of one query head into
  shared memory and walks the keys in tiles of 32 (one key a lane), keeping each query row's running
  maximum ``m``, running sum ``l`` and unnormalized output in registers (the online softmax: each new
  tile rescales them by exp(m_old - m_new)); it writes the output and each row's log-sum-exp
  ``lse = m + log(l)`` (+inf for a row that sees no key), the only statistic backward needs;
- backward: ``delta`` = rowsum(dO * O) first (cupy), then ``flash_dq`` (query tiles again, P made from
  Q K^T and ``lse``, dS = P (dP - delta), dQ += dS K) and ``flash_dkdv`` (a block per tile of 16 keys
  of one KV head, over every query head of its group and every query tile of 32, one query a lane:
  dV += P^T dO, dK += dS^T Q). Each output element is written by one thread: no atomics, the same
  bits every run.

The masks are computed in the loops: causal (query i at absolute position i + ``q_offset`` sees keys up
to it), key padding ([B, keys], 0 for padding) and a sliding ``window`` (a query sees the ``window``
keys ending at its own position; 0 for none); tiles that no query of a block can see are skipped.
Grouped-query attention reads K/V head ``h // group`` for query head h. Inputs are float16, bfloat16,
float32 or float64; sums run in float32 (float64 for float64 inputs). Half types are read and written
as their bits (``widen``/``put``), so the source needs no CUDA header and compiles with NVRTC alone.
Templated on the dtype and the head size's bucket (``HEAD_DIMS``: each lane holds ``bucket / 32``
columns of an output row); head sizes up to ``MAX_HEAD_DIM``.

Tiles are staged in float (double) with rows padded by one element, so the 32 lanes reading 32
different rows at one column hit 32 different banks. ``flash_emulation`` is this file's algorithm in
numpy, tile by tile with the same loops and recurrences, checked against the composed attention on
the CPU.

The products are scalar FMAs on shared-memory tiles, not tensor-core MMA: against cuBLAS's tensor
cores in the composed path they may lose at W1's short sequences while they save the [T, keys] scores'
memory at long ones. So the layer takes them only with ``HPC_TP_FLASH_ATTENTION=1`` until a card's
``make gpu-check`` (which times both, alone and in the W1 step) shows where they win.
"""

from __future__ import annotations

import functools
import math
import os

import numpy

from .. import backend
from .cuda_half import CTYPES, HALF

DTYPES = ("float16", "bfloat16", "float32", "float64")
HEAD_DIMS = (32, 64, 128, 256)  # template buckets: lanes hold bucket / 32 columns each
MAX_HEAD_DIM = HEAD_DIMS[-1]
WARPS, ROWS, LANES = 4, 4, 32  # a block: 4 warps of 4 query rows (or keys) each; key/query tiles of 32
KEY_ROWS = ROWS  # keys per warp in flash_dkdv
OPTIONS = ("-std=c++14",)
KERNELS = ("flash_fwd", "flash_dq", "flash_dkdv")

SOURCE = (
    r"""
#define NEG_INF (-__int_as_float(0x7f800000))  // NVRTC has no <cmath> INFINITY
#define POS_INF (__int_as_float(0x7f800000))
#define WARPS 4
#define ROWS 4
#define LANES 32
#define FULL 0xffffffffu

"""
    + HALF
    + r"""
template <typename A> __device__ __forceinline__ A warp_max(A v) {
  for (int o = 16; o > 0; o >>= 1) { A w = __shfl_xor_sync(FULL, v, o); v = v > w ? v : w; }
  return v;
}
template <typename A> __device__ __forceinline__ A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
  return v;
}

// Whether query i (absolute position i + q_offset) of sequence b sees key j.
__device__ __forceinline__ bool visible(long long i, long long j, long long b, long long n_q, long long n_keys,
                                        long long q_offset, int causal, long long window,
                                        const unsigned char* key_mask, int has_mask) {
  const long long pos = i + q_offset;
  if (i >= n_q || j >= n_keys) return false;
  if (causal && j > pos) return false;
  if (window > 0 && pos - j >= window) return false;
  return !has_mask || key_mask[b * n_keys + j];
}

// The key tiles a block of queries [q0, q_end) can see: [first, end), first a multiple of LANES.
__device__ __forceinline__ void key_range(long long q0, long long q_end, long long n_keys, long long q_offset,
                                          int causal, long long window, long long* first, long long* end) {
  long long last = q_end - 1 + q_offset;
  *end = causal && last + 1 < n_keys ? last + 1 : n_keys;
  long long start = window > 0 ? q0 + q_offset - window + 1 : 0;
  start = start > 0 ? start : 0;
  *first = start / LANES * LANES;
}

// The query tiles that can see keys [k0, k_end): [first, end), first a multiple of LANES.
__device__ __forceinline__ void query_range(long long k0, long long k_end, long long n_q, long long q_offset,
                                            int causal, long long window, long long* first, long long* end) {
  long long start = causal ? k0 - q_offset : 0;
  start = start > 0 ? start : 0;
  *first = start / LANES * LANES;
  long long stop = window > 0 ? k_end - 1 + window - q_offset : n_q;
  *end = stop < n_q ? stop : n_q;
}

// A query-tile block's place: sequence b, query head h, queries [q0, q_end), and the K and V rows of
// the KV head that h reads.
template <typename T> struct QueryBlock {
  long long b, q0, q_end;
  int h;
  const T* k;
  const T* v;
};
template <typename T>
__device__ __forceinline__ QueryBlock<T> query_block(const T* k, long long kb, long long kh, const T* v, long long vb,
                                                     long long vh, int heads, int group, long long n_q) {
  QueryBlock<T> t;
  t.b = blockIdx.x / heads;
  t.h = blockIdx.x % heads;
  t.q0 = (long long)blockIdx.y * WARPS * ROWS;
  t.q_end = t.q0 + WARPS * ROWS < n_q ? t.q0 + WARPS * ROWS : n_q;
  t.k = k + t.b * kb + t.h / group * kh;
  t.v = v + t.b * vb + t.h / group * vh;
  return t;
}

// rows [row0, row0 + count) of x (row stride xt) into s (row stride ld), zeros past n_rows.
template <typename T, typename A>
__device__ __forceinline__ void stage(A* s, const T* x, long long xt, long long row0, int count, long long n_rows,
                                      int d, int ld) {
  for (int e = threadIdx.x; e < count * d; e += blockDim.x) {
    const int r = e / d, c = e % d;
    s[r * ld + c] = row0 + r < n_rows ? (A)widen(x[(row0 + r) * xt + c]) : (A)0;
  }
}

// The next tile of two matrices (K and V, or Q and dO), once every warp is done with the last one.
template <typename T, typename A>
__device__ __forceinline__ void next_tiles(A* xs, const T* x, long long xt, A* ys, const T* y, long long yt,
                                           long long row0, long long n_rows, int d, int ld) {
  __syncthreads();
  stage(xs, x, xt, row0, LANES, n_rows, d, ld);
  stage(ys, y, yt, row0, LANES, n_rows, d, ld);
}

template <typename A> __device__ __forceinline__ A dot(const A* x, const A* y, int d) {
  A s = 0;
  for (int c = 0; c < d; ++c) s += x[c] * y[c];
  return s;
}

// Output rows: acc[t] += sum over the warp's 32 lanes j of w_j * s[j * ld + lane + 32 t].
template <typename A, int NT>
__device__ __forceinline__ void accumulate(A (&out)[NT], A w, const A* s, int ld, int d, int lane) {
#pragma unroll 4
  for (int j = 0; j < LANES; ++j) {
    const A wj = __shfl_sync(FULL, w, j);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int c = lane + LANES * t;
      if (c < d) out[t] += wj * s[j * ld + c];
    }
  }
}

// Grid (batch * heads, query tiles of WARPS*ROWS): x has room for any batch of heads; block WARPS*32 threads; shared (BQ + 2*32) * (d+1) A.
template <typename T, int NT>
__global__ void __launch_bounds__(WARPS * 32)
flash_fwd(const T* q, const T* k, const T* v, T* o, typename acc<T>::type* lse, const unsigned char* key_mask,
          long long qb, long long qh, long long qt, long long kb, long long kh, long long kt, long long vb,
          long long vh, long long vt, long long ob, long long oh, long long ot, int heads, int group, long long n_q,
          long long n_keys, int d, long long q_offset, int causal, long long window, int has_mask) {
  typedef typename acc<T>::type A;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const int BQ = WARPS * ROWS, ld = d + 1;
  A* Qs = (A*)shared_bytes;
  A* Ks = Qs + BQ * ld;
  A* Vs = Ks + LANES * ld;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const QueryBlock<T> blk = query_block(k, kb, kh, v, vb, vh, heads, group, n_q);
  const long long b = blk.b, q0 = blk.q0;
  const int h = blk.h;
  stage(Qs, q + b * qb + h * qh, qt, q0, BQ, n_q, d, ld);
  A m[ROWS], l[ROWS], out[ROWS][NT];
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    m[r] = NEG_INF;
    l[r] = 0;
    #pragma unroll
    for (int t = 0; t < NT; ++t) out[r][t] = 0;
  }
  long long first, end;
  key_range(q0, blk.q_end, n_keys, q_offset, causal, window, &first, &end);
  for (long long k0 = first; k0 < end; k0 += LANES) {
    next_tiles(Ks, blk.k, kt, Vs, blk.v, vt, k0, n_keys, d, ld);
    __syncthreads();
    const long long j = k0 + lane;
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int row = warp * ROWS + r;
      const bool seen = visible(q0 + row, j, b, n_q, n_keys, q_offset, causal, window, key_mask, has_mask);
      const A s = seen ? dot(Qs + row * ld, Ks + lane * ld, d) : (A)NEG_INF;
      const A m_new = fmax(m[r], warp_max(s));
      const A shift = m_new == (A)NEG_INF ? (A)0 : m_new;  // nothing seen yet: every p and the rescale are 0
      const A p = exp(s - shift), rescale = exp(m[r] - shift);
      l[r] = l[r] * rescale + warp_sum(p);
      #pragma unroll
      for (int t = 0; t < NT; ++t) out[r][t] *= rescale;
      accumulate(out[r], p, Vs, ld, d, lane);
      m[r] = m_new;
    }
  }
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long i = q0 + warp * ROWS + r;
    if (i >= n_q) continue;
    const A inv = l[r] > 0 ? (A)1 / l[r] : (A)0;
    T* orow = o + b * ob + h * oh + i * ot;
    #pragma unroll
    for (int t = 0; t < NT; ++t)
      if (lane + LANES * t < d) put(orow + lane + LANES * t, out[r][t] * inv);
    if (lane == 0) lse[(b * heads + h) * n_q + i] = l[r] > 0 ? m[r] + log(l[r]) : (A)POS_INF;
  }
}

// dQ = scale * sum_j dS_ij K_j, dS = P (dP - delta), P = exp(Q K^T - lse): the forward's tiles again.
// Shared (2 BQ + 2*32) * (d+1) A.
template <typename T, int NT>
__global__ void __launch_bounds__(WARPS * 32)
flash_dq(const T* q, const T* k, const T* v, const T* dout, const typename acc<T>::type* lse,
         const typename acc<T>::type* delta, T* dq, const unsigned char* key_mask, long long qb, long long qh,
         long long qt, long long kb, long long kh, long long kt, long long vb, long long vh, long long vt,
         long long gb, long long gh, long long gt, long long dqb, long long dqh, long long dqt, int heads,
         int group, long long n_q, long long n_keys, int d, long long q_offset, int causal, long long window,
         int has_mask, double scale) {
  typedef typename acc<T>::type A;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const int BQ = WARPS * ROWS, ld = d + 1;
  A* Qs = (A*)shared_bytes;
  A* Gs = Qs + BQ * ld;  // dO
  A* Ks = Gs + BQ * ld;
  A* Vs = Ks + LANES * ld;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const QueryBlock<T> blk = query_block(k, kb, kh, v, vb, vh, heads, group, n_q);
  const long long b = blk.b, q0 = blk.q0;
  const int h = blk.h;
  stage(Qs, q + b * qb + h * qh, qt, q0, BQ, n_q, d, ld);
  stage(Gs, dout + b * gb + h * gh, gt, q0, BQ, n_q, d, ld);
  A row_lse[ROWS], row_delta[ROWS], grad[ROWS][NT];
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long i = q0 + warp * ROWS + r;
    row_lse[r] = i < n_q ? lse[(b * heads + h) * n_q + i] : (A)POS_INF;
    row_delta[r] = i < n_q ? delta[(b * heads + h) * n_q + i] : (A)0;
    #pragma unroll
    for (int t = 0; t < NT; ++t) grad[r][t] = 0;
  }
  long long first, end;
  key_range(q0, blk.q_end, n_keys, q_offset, causal, window, &first, &end);
  for (long long k0 = first; k0 < end; k0 += LANES) {
    next_tiles(Ks, blk.k, kt, Vs, blk.v, vt, k0, n_keys, d, ld);
    __syncthreads();
    const long long j = k0 + lane;
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int row = warp * ROWS + r;
      A ds = 0;
      if (visible(q0 + row, j, b, n_q, n_keys, q_offset, causal, window, key_mask, has_mask)) {
        const A p = exp(dot(Qs + row * ld, Ks + lane * ld, d) - row_lse[r]);
        ds = p * (dot(Gs + row * ld, Vs + lane * ld, d) - row_delta[r]);
      }
      accumulate(grad[r], ds, Ks, ld, d, lane);
    }
  }
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long i = q0 + warp * ROWS + r;
    if (i >= n_q) continue;
    T* row = dq + b * dqb + h * dqh + i * dqt;
    #pragma unroll
    for (int t = 0; t < NT; ++t)
      if (lane + LANES * t < d) put(row + lane + LANES * t, grad[r][t] * (A)scale);
  }
}

// dK_j = sum_i dS_ij Q_i, dV_j = sum_i P_ij dO_i over every query head of KV head kvh's group.
// Grid (batch * kv heads, key tiles of WARPS*ROWS); shared (2 BK + 2*32) * (d+1) + 2*32 A.
template <typename T, int NT>
__global__ void __launch_bounds__(WARPS * 32)
flash_dkdv(const T* q, const T* k, const T* v, const T* dout, const typename acc<T>::type* lse,
           const typename acc<T>::type* delta, T* dk, T* dv, const unsigned char* key_mask, long long qb,
           long long qh, long long qt, long long kb, long long kh, long long kt, long long vb, long long vh,
           long long vt, long long gb, long long gh, long long gt, long long dkb, long long dkh, long long dkt,
           long long dvb, long long dvh, long long dvt, int heads, int group, long long n_q, long long n_keys, int d,
           long long q_offset, int causal, long long window, int has_mask) {
  typedef typename acc<T>::type A;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const int BK = WARPS * ROWS, ld = d + 1;
  A* Ks = (A*)shared_bytes;
  A* Vs = Ks + BK * ld;
  A* Qs = Vs + BK * ld;
  A* Gs = Qs + LANES * ld;  // dO
  A* lse_s = Gs + LANES * ld;
  A* delta_s = lse_s + LANES;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kv_heads = heads / group;
  const long long b = blockIdx.x / kv_heads, k0 = (long long)blockIdx.y * BK;
  const int kvh = blockIdx.x % kv_heads;
  const long long k_end = k0 + BK < n_keys ? k0 + BK : n_keys;
  stage(Ks, k + b * kb + kvh * kh, kt, k0, BK, n_keys, d, ld);
  stage(Vs, v + b * vb + kvh * vh, vt, k0, BK, n_keys, d, ld);
  A gk[ROWS][NT], gv[ROWS][NT];
  #pragma unroll
  for (int r = 0; r < ROWS; ++r)
    #pragma unroll
    for (int t = 0; t < NT; ++t) gk[r][t] = gv[r][t] = 0;
  long long first, end;
  query_range(k0, k_end, n_q, q_offset, causal, window, &first, &end);
  for (int g = 0; g < group; ++g) {
    const int h = kvh * group + g;
    const long long stats = (b * heads + h) * n_q;
    for (long long q0 = first; q0 < end; q0 += LANES) {
      next_tiles(Qs, q + b * qb + h * qh, qt, Gs, dout + b * gb + h * gh, gt, q0, n_q, d, ld);
      if (threadIdx.x < LANES) {
        const long long i = q0 + threadIdx.x;
        lse_s[threadIdx.x] = i < n_q ? lse[stats + i] : (A)POS_INF;
        delta_s[threadIdx.x] = i < n_q ? delta[stats + i] : (A)0;
      }
      __syncthreads();
      const long long i = q0 + lane;
      #pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int key = warp * ROWS + r;
        A p = 0, ds = 0;
        if (visible(i, k0 + key, b, n_q, n_keys, q_offset, causal, window, key_mask, has_mask)) {
          p = exp(dot(Qs + lane * ld, Ks + key * ld, d) - lse_s[lane]);
          ds = p * (dot(Gs + lane * ld, Vs + key * ld, d) - delta_s[lane]);
        }
        accumulate(gv[r], p, Gs, ld, d, lane);
        accumulate(gk[r], ds, Qs, ld, d, lane);
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long j = k0 + warp * ROWS + r;
    if (j >= n_keys) continue;
    T* krow = dk + b * dkb + kvh * dkh + j * dkt;
    T* vrow = dv + b * dvb + kvh * dvh + j * dvt;
    #pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int c = lane + LANES * t;
      if (c < d) {
        put(krow + c, gk[r][t]);
        put(vrow + c, gv[r][t]);
      }
    }
  }
}
"""
)


def enabled() -> bool:
    """Whether the attention layer sends device arrays here (read at every call: an A/B can switch it)."""
    return os.environ.get("HPC_TP_FLASH_ATTENTION", "0") == "1"


def bucket(head_dim: int) -> int:
    """The template's head size: the smallest of ``HEAD_DIMS`` that holds ``head_dim``."""
    return next(b for b in HEAD_DIMS if b >= head_dim)


def names(dtype: str, head_dim_bucket: int) -> list[str]:
    """The kernel instances one module holds: the three kernels for one dtype and head-size bucket."""
    return [f"{k}<{CTYPES[dtype]}, {head_dim_bucket // LANES}>" for k in KERNELS]


def shared_bytes(kernel: str, head_dim: int, dtype) -> int:
    """Dynamic shared memory of one block of ``kernel``: its staged tiles, rows padded by one."""
    rows = {"flash_fwd": WARPS * ROWS + 2 * LANES, "flash_dq": 2 * WARPS * ROWS + 2 * LANES}
    tiles = rows.get(kernel, 2 * WARPS * KEY_ROWS + 2 * LANES) * (head_dim + 1)
    statistics = 2 * LANES if kernel == "flash_dkdv" else 0
    return (tiles + statistics) * (8 if numpy.dtype(dtype) == numpy.float64 else 4)


def _dtype_name(dtype) -> str:
    return numpy.dtype(dtype).name


def supported(*arrays) -> bool:
    """True for cupy Q, K, V and output views the kernels take: one dtype of ``DTYPES``, head size up
    to ``MAX_HEAD_DIM`` with unit column stride, and tiles that fit the device's shared memory."""
    if not enabled():
        return False
    first = arrays[0]
    if type(first).__module__.split(".")[0] != "cupy":
        return False
    if _dtype_name(first.dtype) not in DTYPES or first.shape[-1] > MAX_HEAD_DIM:
        return False
    if any(a.dtype != first.dtype or a.strides[-1] != a.itemsize for a in arrays):
        return False
    return max(shared_bytes(k, first.shape[-1], first.dtype) for k in KERNELS) <= _shared_limit()


@functools.cache
def _shared_limit() -> int:
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    optin = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin
    return cupy.cuda.runtime.deviceGetAttribute(optin, cupy.cuda.Device().id)


@functools.cache
def _module(dtype: str, head_dim_bucket: int):
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    return cupy.RawModule(code=SOURCE, options=OPTIONS, name_expressions=names(dtype, head_dim_bucket))


@functools.cache
def _kernel(kernel: str, dtype: str, head_dim_bucket: int):
    module = _module(dtype, head_dim_bucket)
    return module.get_function(names(dtype, head_dim_bucket)[KERNELS.index(kernel)])


def _launch(kernel: str, grid, x, args):
    d = x.shape[-1]
    function = _kernel(kernel, _dtype_name(x.dtype), bucket(d))
    size = shared_bytes(kernel, d, x.dtype)
    if function.max_dynamic_shared_size_bytes < size:  # above 48 KiB a kernel must opt in
        function.max_dynamic_shared_size_bytes = size
    function(grid, (WARPS * LANES,), args, shared_mem=size)


def _heads(x):
    """``x`` [B, hk, g, T, d] or [B, hk, T, d] as (array, batch stride, head stride, row stride) in
    elements with heads numbered h = kv head * g + group member; a copy where the two head axes
    cannot be walked with one stride."""
    if x.ndim == 5 and x.shape[2] > 1 and x.shape[1] > 1 and x.strides[1] != x.shape[2] * x.strides[2]:
        x = backend.xp_of(x).ascontiguousarray(x)
    item = x.itemsize
    head = x.strides[2] if x.ndim == 5 and x.shape[2] > 1 else x.strides[1]
    return (x, numpy.int64(x.strides[0] // item), numpy.int64(head // item), numpy.int64(x.strides[-2] // item))


def _key_mask(key_mask, batch: int, keys: int):
    """The padding mask as the kernels read it: [B, keys] uint8 (1: a real key), and whether there is one."""
    if key_mask is None:
        return backend.xp.ones(1, dtype=numpy.uint8), numpy.int32(0)
    xp = backend.xp_of(key_mask)
    mask = xp.broadcast_to(key_mask.astype(bool, copy=False), (batch, keys))
    return xp.ascontiguousarray(mask).view(numpy.uint8), numpy.int32(1)


def _shape_args(q, k, q_offset, causal, window):
    b, hk, g, t, d = q.shape
    return (
        numpy.int32(hk * g),
        numpy.int32(g),
        numpy.int64(t),
        numpy.int64(k.shape[2]),
        numpy.int32(d),
        numpy.int64(q_offset),
        numpy.int32(bool(causal)),
        numpy.int64(window or 0),
    )


def statistics_dtype(dtype):
    return numpy.float64 if numpy.dtype(dtype) == numpy.float64 else numpy.float32


def forward(q, k, v, out, q_offset: int, causal: bool, key_mask=None, window: int = 0):
    """softmax(Q K^T + masks) V into ``out``; Q [B, hk, g, T, d] (already scaled), K and V [B, hk,
    keys, d], ``out`` like Q (a view is written in place). Returns each row's log-sum-exp [B, hk, g, T]
    (float32; float64 for float64 inputs), +inf for a row that sees no key."""
    xp = backend.xp_of(q)
    b, hk, g, t, d = q.shape
    lse = xp.empty((b, hk, g, t), dtype=statistics_dtype(q.dtype))
    if t == 0:
        return lse
    target = out if out.strides[-1] == out.itemsize else xp.empty_like(out)
    qs, ks, vs, os_ = _heads(q), _heads(k), _heads(v), _heads(target)
    mask, has_mask = _key_mask(key_mask, b, k.shape[2])
    args = (qs[0], ks[0], vs[0], os_[0], lse, mask, *qs[1:], *ks[1:], *vs[1:], *os_[1:])
    shape = _shape_args(q, k, q_offset, causal, window)
    _launch("flash_fwd", (b * hk * g, -(-t // (WARPS * ROWS))), q, args + shape + (has_mask,))
    if os_[0] is not out:
        out[...] = os_[0]
    return lse


def backward(dout, q, k, v, out, lse, q_offset: int, causal: bool, key_mask, dq, dk, dv, window: int = 0):
    """dQ (times 1/sqrt(d): Q was scaled in forward), dK and dV written into their views (dq like Q,
    dk and dv like K), from forward's output ``out`` and log-sum-exp ``lse``."""
    xp = backend.xp_of(q)
    b, hk, g, t, d = q.shape
    keys = k.shape[2]
    if t == 0 or keys == 0:
        dq[...], dk[...], dv[...] = 0, 0, 0
        return
    wide = lse.dtype
    delta = xp.ascontiguousarray((dout.astype(wide) * out.astype(wide)).sum(axis=-1))
    targets = [x if x.strides[-1] == x.itemsize else xp.empty_like(x) for x in (dq, dk, dv)]
    qs, ks, vs, gs = _heads(q), _heads(k), _heads(v), _heads(dout.astype(q.dtype, copy=False))
    dqs, dks, dvs = (_heads(x) for x in targets)
    mask, has_mask = _key_mask(key_mask, b, keys)
    lse = xp.ascontiguousarray(lse)
    shape = _shape_args(q, k, q_offset, causal, window)
    strides = (*qs[1:], *ks[1:], *vs[1:], *gs[1:])
    _launch(
        "flash_dq",
        (b * hk * g, -(-t // (WARPS * ROWS))),
        q,
        (qs[0], ks[0], vs[0], gs[0], lse, delta, dqs[0], mask, *strides, *dqs[1:])
        + shape
        + (has_mask, numpy.float64(1.0 / math.sqrt(d))),
    )
    _launch(
        "flash_dkdv",
        (b * hk, -(-keys // (WARPS * KEY_ROWS))),
        q,
        (qs[0], ks[0], vs[0], gs[0], lse, delta, dks[0], dvs[0], mask, *strides, *dks[1:], *dvs[1:])
        + shape
        + (has_mask,),
    )
    for x, written in zip((dq, dk, dv), (dqs[0], dks[0], dvs[0])):
        if written is not x:
            x[...] = written
