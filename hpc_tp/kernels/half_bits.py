"""bfloat16 and float16 values inside numba kernels: read as float32, stored rounded to nearest even.

Numba has no 16-bit float type on the CPU, so a half array reaches a kernel as its bits: bfloat16 viewed
as uint16, float16 as int16 (``bits``). The view's type tells the kernel which format it holds, at
compile time: ``wide(v)`` is a float32 of the element ``v`` and ``narrow(value, out)`` the element of
``out``'s format nearest ``value``. For float32/float64 arrays both are plain casts, so one kernel
source serves every dtype.

bfloat16 is the upper half of a float32: widening shifts the bits up; narrowing rounds the lower 16
bits to nearest even in integer arithmetic, inf and overflow as ml_dtypes' ``astype`` gives them, NaN
as its canonical quiet NaN (sign kept). float16 uses LLVM's conversions, the CPU's F16C instructions
(``vcvtph2ps``/``vcvtps2ph``, nearest even), so ``F16`` is True only where the CPU has them.
"""

from __future__ import annotations

import numpy

try:
    import numba
except ImportError:  # optional: without it no kernel takes half arrays
    numba = None


def _bfloat16_dtype():
    try:
        import ml_dtypes
    except ImportError:  # no bfloat16 arrays without it
        return None
    return numpy.dtype(ml_dtypes.bfloat16)


def host_has(feature: str) -> bool:
    """True where LLVM says this host's CPU has ``feature`` (e.g. "f16c") and numba compiles for it:
    NUMBA_CPU_NAME compiles for another CPU (a portable cache), which may lack it."""
    if numba is None or numba.config.CPU_NAME:
        return False
    import llvmlite.binding  # only with numba, which brings it

    try:
        return bool(llvmlite.binding.get_host_cpu_features().get(feature, False))
    except RuntimeError:  # LLVM cannot tell on this host
        return False


F16 = host_has("f16c")
# The dtypes whose arrays the kernels take as bits, and the integer view each is read through.
VIEWS = {}
if numba is not None and (bfloat16 := _bfloat16_dtype()) is not None:
    VIEWS[bfloat16] = numpy.dtype("uint16")
if F16:
    VIEWS[numpy.dtype("float16")] = numpy.dtype("int16")


def bits(x):
    """``x`` as a kernel takes it: a half array viewed as its bits (any strides), others as they are."""
    view = VIEWS.get(x.dtype)
    return x if view is None else x.view(view)


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    _F32, _I16, _I32 = ir.FloatType(), ir.IntType(16), ir.IntType(32)

    @intrinsic
    def wide(typingctx, value):
        """float32 of a bfloat16 (uint16 bits) or float16 (int16 bits) element; a float stays as it is."""
        result = value if isinstance(value, types.Float) else types.float32

        def codegen(context, builder, signature, args):
            (v,) = args
            if isinstance(signature.args[0], types.Float):
                return v
            if signature.args[0] == types.uint16:
                return builder.bitcast(builder.shl(builder.zext(v, _I32), _I32(16)), _F32)
            return builder.fpext(builder.bitcast(v, ir.HalfType()), _F32)

        return result(value), codegen

    @intrinsic
    def narrow(typingctx, value, out):
        """``value`` as an element of the array ``out``: rounded to nearest even for the half formats."""
        result = out.dtype

        def codegen(context, builder, signature, args):
            v, source, target = args[0], signature.args[0], signature.return_type
            if isinstance(target, types.Float):
                return context.cast(builder, v, source, target)
            v = context.cast(builder, v, source, types.float32)
            if target == types.int16:
                return builder.bitcast(builder.fptrunc(v, ir.HalfType()), _I16)
            b = builder.bitcast(v, _I32)
            upper = builder.lshr(b, _I32(16))
            rounded = builder.lshr(builder.add(builder.add(b, _I32(0x7FFF)), builder.and_(upper, _I32(1))), _I32(16))
            nan = builder.or_(builder.and_(upper, _I32(0x8000)), _I32(0x7FC0))
            return builder.trunc(builder.select(builder.fcmp_unordered("uno", v, v), nan, rounded), _I16)

        return result(value, out), codegen
