"""``hpc-tp convert --quantize``: an imported model with its linear layers' weights quantized
(``kernels.quantized``), still one tensor at a time: each weight becomes its parts (``.codes``,
``.scale``, ``.min``), made when the writer reads the first and dropped after the last. A source that
stores a weight in that very format (GGUF's Q8_0 for int8, Q4_0 and Q4_1 for int4) hands over its own
numbers; any other weight (a float one, or GGUF's K-quants) is read as floats and quantized."""

from __future__ import annotations

import dataclasses

import numpy

from ...kernels.quantized import bits_of, check_rows, part_rows, quantize
from . import Imported, SourceTensor


def quantize_imported(imported: Imported, name: str, axes) -> Imported:
    """``imported`` with ``quantize=name``; ``axes(cfg)`` names the tensors of a model of ``cfg``."""
    bits = bits_of(name)
    cfg = dataclasses.replace(imported.config, quantize=name)  # validates: dense decoders only
    ours = axes(cfg)
    tensors = {}
    for key, tensor in imported.tensors.items():
        if key in ours:
            tensors[key] = tensor
            continue
        check_rows(tensor.shape[0], 1, key, bits)
        weight = _QuantizedWeight(tensor, bits)
        for part in weight.parts:
            tensors[f"{key}.{part}"] = weight.tensor(part)
    source = {**imported.source, "quantize": name}
    return dataclasses.replace(imported, config=cfg, tensors=tensors, source=source)


class _QuantizedWeight:
    """One weight's parts as source tensors, quantized once for all of them."""

    def __init__(self, tensor: SourceTensor, bits: int):
        self.source, self.bits, self._matrix = tensor, bits, None
        self.parts = ("codes", "scale", "min") if bits == 4 else ("codes", "scale")

    def tensor(self, part: str) -> SourceTensor:
        k, n = self.source.shape
        dtype = numpy.float32 if part != "codes" else numpy.int8 if self.bits == 8 else numpy.uint8
        return SourceTensor((part_rows(part, k, self.bits), n), dtype, lambda: self._read(part))

    def _read(self, part: str):
        if self._matrix is None:
            self._matrix = self.source.quantized(self.bits) or quantize(self.source[...], self.bits)
        values = dict(self._matrix.arrays())[part]
        if part == self.parts[-1]:  # the writer reads the parts in order: the last one frees the weight
            self._matrix = None
        return values
