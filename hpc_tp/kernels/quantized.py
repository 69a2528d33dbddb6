"""Linear weights kept quantized for inference: 8-bit or 4-bit codes with a float32 scale (and, for 4
bits, a minimum) per group of 32 weight rows and column.

A weight W [K, N] (``y = x @ W``) is three arrays:

    codes  int8 [K, N], w = code * scale                    (int8)
           uint8 [K/2, N], two codes 0..15 a byte: row 2i   (int4)
           in packed row i's low nibble, row 2i + 1 in its
           high one; w = code * scale + min
    scale  float32 [K/32, N]
    min    float32 [K/32, N], int4 only

Groups run along K, 32 rows each: GGUF's block. GGUF's Q8_0 (a float16 scale and 32 int8 codes a
block), Q4_0 (a float16 scale, codes offset by 8: min = -8 scale, exact) and Q4_1 (float16 scale and
min) are these numbers exactly, transposed, so such files load without a float copy and without a
second rounding. Any other weight is quantized here by those formats' rules: 8 bits symmetric
(scale = max |w| / 127, Q8_0's), 4 bits between the group's minimum and maximum (scale =
(max - min) / 15, Q4_1's). A tp split along K must fall between groups (the layers check it).

Products of float32 (or half) activations, where the CPU has AVX512-VNNI, any number of rows (decode
steps and prefills alike), through ``int8_dot``: the activations quantized to int8 per group and
dotted with the codes in integer arithmetic, from the codes, scales and minimums in the layout
``int8_dot.interleave`` writes (``QuantizedMatrix.pack``: at load for a model that serves,
``tensor_parallel.packing``). A packed matrix keeps that layout only: its stored layout is written
back out only when read (``part``: a checkpoint save), and float64 activations multiply blocks of
rows dequantized from it. Float64 activations, or a CPU without VNNI, through
``small_m.quantized_matmul`` from the stored layout, which widens the codes in registers and reads
every code once for all rows; many rows (prefill) of those, or without numba, or on a GPU: blocks of
weight rows dequantized elementwise (numpy or cupy) and multiplied by BLAS or cuBLAS
(``dequantized_matmul``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy

from ..backend import xp_of
from ..errors import ConfigError
from . import blas, int8_dot, small_m, threads

FORMATS = {"int8": 8, "int4": 4}
GROUP_ROWS = small_m.QUANT_ROWS
PARTS = ("codes", "scale", "min")
_BLOCK_BYTES = 4 << 20  # float rows dequantized at a time on the many-rows path


def bits_of(name, what: str = "--quantize") -> int:
    """8 or 4 for a format name, else one ConfigError line."""
    if name not in FORMATS:
        raise ConfigError(f"{what} {name!r}: expected one of {', '.join(FORMATS)}")
    return FORMATS[name]


def part_rows(part: str, k: int, bits: int) -> int:
    """Rows of ``part`` for a weight of ``k`` rows."""
    if part != "codes":
        return k // GROUP_ROWS
    return k if bits == 8 else k // 2


def check_rows(k: int, parts: int, what: str, bits: int):
    """A weight of ``k`` rows cut into ``parts`` along K keeps whole groups, or one ConfigError line."""
    if k % (GROUP_ROWS * parts):
        cut = f"tensor parallelism {parts} would cut a group" if k % GROUP_ROWS == 0 else "they are not whole groups"
        raise ConfigError(
            f"int{bits} weights of {what} in groups of {GROUP_ROWS} rows along its {k} inputs: {cut} "
            f"(expected inputs a multiple of {GROUP_ROWS} x tp)"
        )


@dataclass(frozen=True)
class Packed:
    """A matrix's arrays in ``int8_dot``'s layout: codes [tiles, groups, bytes], scales and minimums
    [tiles, groups, lanes] (minimums empty for 8 bits; float32, or float16 bits where every value is
    one, ``int8_dot.narrow_columns``), of ``n`` columns."""

    codes: numpy.ndarray
    scales: numpy.ndarray
    lows: numpy.ndarray
    n: int


@dataclass
class QuantizedMatrix:
    """A weight [K, N] as its quantized arrays (numpy or cupy); ``low`` is None for 8 bits. Once
    ``packed`` (``pack``), ``codes``, ``scale`` and ``low`` are None: the packed arrays are the one copy."""

    codes: object
    scale: object
    low: object
    bits: int
    packed: Packed | None = field(default=None, repr=False, compare=False)

    @classmethod
    def zeros(cls, k: int, n: int, bits: int, xp):
        rows = k // GROUP_ROWS
        low = xp.zeros((rows, n), numpy.float32) if bits == 4 else None
        codes = xp.zeros((part_rows("codes", k, bits), n), numpy.int8 if bits == 8 else numpy.uint8)
        return cls(codes, xp.zeros((rows, n), numpy.float32), low, bits)

    @property
    def shape(self) -> tuple:
        if self.packed is not None:
            return self.packed.codes.shape[1] * GROUP_ROWS, self.packed.n
        return self.scale.shape[0] * GROUP_ROWS, self.scale.shape[1]

    def arrays(self) -> list:
        """(part name, array) for each part, in the stored layout (written out of a packed matrix)."""
        return [(part, self.part(part)) for part in PARTS if part != "min" or self.bits == 4]

    def part(self, name: str):
        """The stored layout's ``name`` ("codes", "scale" or "min"): the array, or for a packed matrix a
        new one written from the packed arrays."""
        if self.packed is None:
            return dict(zip(PARTS, (self.codes, self.scale, self.low)))[name]
        p = self.packed
        if name == "codes":
            return int8_dot.deinterleave(p.codes, self.bits, p.n)
        return int8_dot.deinterleave_columns(p.scales if name == "scale" else p.lows, p.n)

    def columns(self, cols: slice) -> QuantizedMatrix:
        """Views of columns ``cols`` (a fused weight's segment), of a matrix not packed."""
        low = None if self.low is None else self.low[:, cols]
        return QuantizedMatrix(self.codes[:, cols], self.scale[:, cols], low, self.bits)

    def pack(self) -> bool:
        """Keep the arrays in ``int8_dot``'s layout only, where few-row products take it (host arrays,
        a CPU with VNNI; elsewhere the stored layout stays the only one). True when packed."""
        if self.packed is None and int8_dot.AVAILABLE and isinstance(self.codes, numpy.ndarray):
            columns = [int8_dot.interleave_columns(values) for values in (self.scale, self.low) if values is not None]
            scales, *lows = int8_dot.narrow_columns(*columns)
            lows = lows[0] if lows else numpy.empty(0, scales.dtype)  # 8 bits
            self.packed = Packed(int8_dot.interleave(self.codes, self.bits), scales, lows, self.shape[1])
            self.codes = self.scale = self.low = None
        return self.packed is not None

    def dequantize(self, start: int = 0, stop: int | None = None, dtype=numpy.float32):
        """Weight rows [start, stop) (whole groups) as ``dtype``."""
        stop = self.shape[0] if stop is None else stop
        if self.packed is not None:
            p, first, last = self.packed, start // GROUP_ROWS, stop // GROUP_ROWS
            if numpy.dtype(dtype) == numpy.float32:
                return int8_dot.dequantize(p.codes, p.scales, p.lows, self.bits, p.n, first, last)
            # other precisions (float64 activations, which packed weights rarely see): the stored layout
            # of these groups written out, then dequantized as it is
            low = None if self.bits == 8 else int8_dot.deinterleave_columns(p.lows[:, first:last], p.n)
            codes = int8_dot.deinterleave(p.codes[:, first:last], self.bits, p.n)
            block = QuantizedMatrix(codes, int8_dot.deinterleave_columns(p.scales[:, first:last], p.n), low, self.bits)
            return block.dequantize(dtype=dtype)
        xp, n = xp_of(self.codes), self.shape[1]
        if self.bits == 8:
            values = self.codes[start:stop].astype(dtype)
        else:
            packed = self.codes[start // 2 : stop // 2]
            values = xp.empty((stop - start, n), dtype)
            values[0::2], values[1::2] = packed & 15, packed >> 4
        groups = values.reshape(-1, GROUP_ROWS, n)
        groups *= self.scale[start // GROUP_ROWS : stop // GROUP_ROWS, None].astype(dtype)
        if self.low is not None:
            groups += self.low[start // GROUP_ROWS : stop // GROUP_ROWS, None].astype(dtype)
        return values


class PackedPart:
    """Part ``name`` of columns ``cols`` of a packed matrix as a Parameter's data: its shape and dtype,
    and its values in the stored layout written out when read (``data[index]``, as a checkpoint save
    reads a Parameter), with no copy held."""

    def __init__(self, matrix: QuantizedMatrix, name: str, cols: slice):
        k, n = matrix.shape
        self.matrix, self.name, self.cols = matrix, name, cols
        self.shape = (part_rows(name, k, matrix.bits), len(range(n)[cols]))
        codes = numpy.int8 if matrix.bits == 8 else numpy.uint8
        self.dtype = numpy.dtype(codes if name == "codes" else numpy.float32)
        self.ndim, self.nbytes = 2, self.shape[0] * self.shape[1] * self.dtype.itemsize

    def __array__(self, dtype=None, copy=None):
        values = self.matrix.part(self.name)[:, self.cols]
        return values if dtype is None else values.astype(dtype)

    def __getitem__(self, index):
        return numpy.asarray(self)[index]


def quantize(w, bits: int) -> QuantizedMatrix:
    """A float weight [K, N] (numpy; K whole groups) quantized by Q8_0's rule (8 bits) or Q4_1's (4).
    A transposed weight (the tied head's E.T) is read as it lies, its groups contiguous: the same
    numbers, without a strided float64 copy of it."""
    k, n = w.shape
    transposed = w.T.flags.c_contiguous and not w.flags.c_contiguous
    if transposed:
        groups, axis = numpy.asarray(w.T, numpy.float64).reshape(n, k // GROUP_ROWS, GROUP_ROWS), 2
    else:
        groups, axis = numpy.asarray(w, numpy.float64).reshape(k // GROUP_ROWS, GROUP_ROWS, n), 1
    if bits == 8:
        scale = (numpy.abs(groups).max(axis=axis) / 127).astype(numpy.float32)
        low, top = None, 127
        shifted = groups
    else:
        low = groups.min(axis=axis).astype(numpy.float32)
        scale = ((groups.max(axis=axis) - low) / 15).astype(numpy.float32)
        top = 15
        shifted = groups - numpy.expand_dims(low, axis)
    # an all-equal group: every code 0 (8 bits) or 0 + min
    safe = numpy.expand_dims(numpy.where(scale == 0, 1, scale), axis)
    codes = numpy.clip(numpy.rint(shifted / safe), -top if bits == 8 else 0, top)
    if transposed:
        return from_codes(codes.reshape(n, k).T, scale.T, None if low is None else low.T, bits)
    return from_codes(codes.reshape(k, n), scale, low, bits)


def from_codes(codes, scale, low, bits: int) -> QuantizedMatrix:
    """The stored arrays from codes as integers [K, N] (-127..127, or 0..15 for 4 bits), scales and
    minimums [K/32, N] (None for 8 bits)."""
    if bits == 8:
        return QuantizedMatrix(codes.astype(numpy.int8, order="C"), scale.astype(numpy.float32, order="C"), None, 8)
    nibbles = codes.astype(numpy.uint8, order="C")
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    return QuantizedMatrix(packed, scale.astype(numpy.float32, order="C"), low.astype(numpy.float32, order="C"), 4)


def warm_up(dtype):
    """Compile (or load from numba's cache) the kernels a decode step and a prefill of ``dtype``
    activations take against 8- and 4-bit weights (``int8_dot``'s where the CPU has VNNI, else
    ``small_m``'s and numpy's), before a server's first request would wait for them."""
    few, many = (numpy.ones((rows, 2 * GROUP_ROWS), dtype) for rows in (small_m.MIN_FULL_ROWS, small_m.MAX_ROWS + 1))
    # weights of 127 have float16 scales and minimums (GGUF's kind), of 0.1 float32 ones
    for bits, value in itertools.product(FORMATS.values(), (127.0, 0.1)):
        # more than one range of columns at 2 threads or more (``threads.shared``): the driver compiled too
        n = threads.split_columns(2 * GROUP_ROWS * bits // 8, small_m.COLUMN_ALIGN)
        w = quantize(numpy.full((2 * GROUP_ROWS, n), value), bits)
        matmul(few, w)  # packs w where the integer kernel takes it, as a served model's weights are
        matmul(many, w)


def matmul(a, w: QuantizedMatrix):
    """``a @ W`` for ``a`` [M, K]: float64 sums for float64 ``a``, else float32 (from int8 activations
    where ``int8_dot.AVAILABLE``)."""
    # the integer path first, with nothing computed before it: a decode step makes four such calls a layer
    if _takes_integer(a) and w.pack():
        # (a matrix that was not packed at load, a model built in process, is packed at its first product)
        p = w.packed
        return int8_dot.matmul(numpy.ascontiguousarray(a, numpy.float32), p.codes, p.scales, p.lows, w.bits, p.n)
    dtype = numpy.dtype(numpy.float64 if a.dtype == numpy.float64 else numpy.float32)
    if small_m.takes_quantized(a) and w.packed is None:
        low = w.scale[:0] if w.low is None else w.low  # 8 bits: no minimums, an empty operand
        return small_m.quantized_matmul(a, w.codes, w.scale.reshape(-1), low.reshape(-1), dtype)
    return dequantized_matmul(a, w, dtype)


def _takes_integer(a) -> bool:
    """True for a numpy 2-D operand of float32 or half activations (any number of rows)."""
    return isinstance(a, numpy.ndarray) and a.ndim == 2 and a.dtype.kind in "fV" and a.dtype != numpy.float64


def dequantized_matmul(a, w: QuantizedMatrix, dtype):
    """``a @ W`` as ``dtype`` sums by blocks of W's rows dequantized to ``dtype`` and multiplied by BLAS
    (cuBLAS for cupy arrays): float64 activations, and many rows where the integer path does not run
    (no VNNI, no numba, or cupy arrays)."""
    (k, n), xp = w.shape, xp_of(a)
    step = max(1, _BLOCK_BYTES // (dtype.itemsize * n * GROUP_ROWS)) * GROUP_ROWS
    out = xp.zeros((a.shape[0], n), dtype)
    return blas.matmul_by_row_blocks(
        a.astype(dtype, copy=False), lambda start, stop: w.dequantize(start, stop, dtype), k, step, out
    )
