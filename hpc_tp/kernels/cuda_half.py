"""CUDA source that the device kernels share: the type their sums run in (``acc``: float, double for
double) and the half types read and written as their bits (``widen`` to float, ``put`` rounding to
nearest even), so a kernel's source needs no CUDA header and compiles with NVRTC alone, and a half
kernel rounds each output once, as ``astype`` of its float32 value would.

``CTYPES`` names each dtype's C type for a kernel's template instances."""

ACC = """
template <typename T> struct acc { typedef float type; };
template <> struct acc<double> { typedef double type; };
"""

HALF = (
    ACC
    + r"""
struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }
__device__ __forceinline__ float widen(bf16 x) { return __uint_as_float(((unsigned int)x.bits) << 16); }
__device__ __forceinline__ float widen(f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ void put(float* p, float a) { *p = a; }
__device__ __forceinline__ void put(double* p, double a) { *p = a; }
__device__ __forceinline__ void put(bf16* p, float a) {  // round to nearest even; a NaN stays a NaN
  unsigned int u = __float_as_uint(a);
  p->bits = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((u >> 16) | 0x40u)
                                            : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ void put(f16* p, float a) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(a));
  p->bits = h;
}
"""
)

CTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "float", "float64": "double"}
