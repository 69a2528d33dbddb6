"""bfloat16 <-> float32 by bits: numpy has no bfloat16, and most released models are stored in it.
A bfloat16 is the upper half of a float32, so widening is exact; narrowing rounds to nearest even."""

from __future__ import annotations

import numpy


def bfloat16_to_float32(raw: numpy.ndarray, shape) -> numpy.ndarray:
    """Little-endian bfloat16 bytes -> float32 array of ``shape``."""
    halves = numpy.frombuffer(raw, dtype="<u2").astype(numpy.uint32)
    return (halves << 16).view(numpy.float32).reshape(shape)


def float32_to_bfloat16_bytes(values: numpy.ndarray) -> bytes:
    values = numpy.ascontiguousarray(values, dtype="<f4")
    bits = values.view(numpy.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    # A NaN's payload can carry the rounding into the exponent (or past 32 bits): keep its upper
    # half, made quiet, so it stays a NaN of its sign.
    rounded = numpy.where(numpy.isnan(values), (bits >> 16) | 0x0040, rounded)
    return rounded.astype("<u2").tobytes()
