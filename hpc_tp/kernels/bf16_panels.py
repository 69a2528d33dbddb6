"""bfloat16 weights in the layout ``vdpbf16ps`` reads (``kernels.bf16_dot``): made once as a model is
loaded for inference, so a product's loads are the instruction's operands as they lie.

The instruction sums the products of neighbouring bfloat16 pairs into float32 lanes, so lane j wants
``W[k, j]`` and ``W[k + 1, j]`` side by side. A weight W [K, N] is cut into panels of ``PANEL`` columns
and each panel stored as its pairs of rows, one after the other:

    panels[q, p, 2c + t] = W[2p + t, PANEL q + c]     (zeros past K and past N)

A pair row of a panel (``PAIR_ROW`` elements, 128 bytes: two cache lines) is two vectors of 16 lanes'
pairs, and a panel is one run of memory from its first pair to its last, so a tile that sums all of
K over a panel streams it in the order it is stored. Panels start on a cache line.

Only the packed copy is kept (``PanelMatrix``); the plain values are written out when read
(``values``: a checkpoint save reads a Parameter), and ``rows_of_transpose`` looks up rows of W.T (a
tied embedding's rows, when W is the LM head's E.T) from the panels directly.
"""

from __future__ import annotations

import numpy

PANEL = 32  # columns of a panel: a pair row is two vectors of 16 float32 lanes
PAIR_ROW = 2 * PANEL
_LINE = 64  # bytes
_BLOCK_PANELS = 64  # panels packed at a time: a [K, 2048] slice's temporaries, not the whole weight's


def _aligned_zeros(shape):
    """uint16 zeros of ``shape`` starting on a cache line."""
    size = int(numpy.prod(shape))
    raw = numpy.zeros(size + _LINE // 2, numpy.uint16)
    skip = (-raw.ctypes.data % _LINE) // 2
    return raw[skip : skip + size].reshape(shape)


def pack(w):
    """The panels [ceil(N / PANEL), ceil(K / 2), PAIR_ROW] (uint16 bits) of a bfloat16 W [K, N], row-major
    or the transposed view of a row-major array (the tied head's E.T: read as it lies)."""
    k, n = w.shape
    pairs, count = -(-k // 2), -(-n // PANEL)
    panels = _aligned_zeros((count, pairs, PAIR_ROW))
    bits = w.view(numpy.uint16)
    for first in range(0, count, _BLOCK_PANELS):
        last = min(count, first + _BLOCK_PANELS)
        block = numpy.zeros((2 * pairs, (last - first) * PANEL), numpy.uint16)
        piece = bits[:, first * PANEL : last * PANEL]
        block[:k, : piece.shape[1]] = piece
        # [2p + t, PANEL q + c] -> [q, p, c, t]
        panels[first:last] = (
            block.reshape(pairs, 2, last - first, PANEL).transpose(2, 0, 3, 1).reshape(-1, pairs, PAIR_ROW)
        )
    return panels


class PanelMatrix:
    """A bfloat16 weight [K, N] kept as its panels only (``pack``)."""

    def __init__(self, w):
        self.panels = pack(w)
        self.shape = tuple(w.shape)
        self.dtype = w.dtype

    @property
    def nbytes(self) -> int:
        """The panels' bytes (W's, and the zeros that pad its last panel and an odd K)."""
        return self.panels.nbytes

    def _grid(self):
        """The panels as [panel, pair, column, row of the pair]."""
        count, pairs = self.panels.shape[:2]
        return self.panels.reshape(count, pairs, PANEL, 2)

    def values(self, transposed: bool = False):
        """W (or W.T) written out of the panels: a new C-contiguous array."""
        k, n = self.shape
        grid = self._grid()
        if transposed:  # [q, c, p, t] -> [PANEL q + c, 2p + t]
            plain = grid.transpose(0, 2, 1, 3).reshape(grid.shape[0] * PANEL, -1)[:n, :k]
        else:  # [p, t, q, c] -> [2p + t, PANEL q + c]
            plain = grid.transpose(1, 3, 0, 2).reshape(-1, grid.shape[0] * PANEL)[:k, :n]
        return numpy.ascontiguousarray(plain).view(self.dtype)

    def rows_of_transpose(self, ids):
        """W.T[ids] ([*ids.shape, K]) for integer ``ids``: W's columns, each gathered from its panel
        (an embedding's lookup, where W is the tied head's E.T), without writing out the rest."""
        # a pair's two elements as one 32-bit word: [panel, column, pair] (gathered 1.5x as fast as pairs)
        words = self.panels.view(numpy.uint32).transpose(0, 2, 1)
        return words[ids // PANEL, ids % PANEL].view(self.dtype)[..., : self.shape[0]]


class PanelValues:
    """Columns ``cols`` of a ``PanelMatrix`` (its transpose with ``transposed``) as a Parameter's data:
    its shape and dtype, and its values written out when read (``data[index]``, as a checkpoint save
    or an embedding's lookup reads a Parameter), with no copy held."""

    def __init__(self, matrix: PanelMatrix, cols=slice(None), transposed: bool = False):
        self.matrix, self.cols, self.transposed = matrix, cols, transposed
        k, n = matrix.shape
        self.shape = (n, k) if transposed else (k, len(range(n)[cols]))
        self.dtype, self.ndim = matrix.dtype, 2
        self.nbytes = self.shape[0] * self.shape[1] * self.dtype.itemsize

    def __array__(self, dtype=None, copy=None):
        values = self.matrix.values(self.transposed)
        values = values if self.transposed else values[:, self.cols]
        return values if dtype is None else values.astype(dtype)

    def __getitem__(self, index):
        if self.transposed and isinstance(index, numpy.ndarray) and index.dtype.kind in "iu":
            return self.matrix.rows_of_transpose(index)
        return numpy.asarray(self)[index]
