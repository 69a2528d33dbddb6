"""Weights kept quantized made ready as a model is loaded for inference: each linear layer's in the
layout its products read, kept once (``kernels.quantized.QuantizedMatrix.pack``), and the LM head's
int8 copy, so a server's first request builds nothing that later ones do not."""

from __future__ import annotations

from .. import backend
from .layers import ColumnParallelLinear, RowParallelLinear
from .vocab import VocabParallelLMHead

_QUANTIZED = (ColumnParallelLinear, RowParallelLinear, VocabParallelLMHead)


def pack_quantized(model):
    """Pack ``model``'s quantized weights (a model of float64 activations keeps its stored layout: its
    products never take the integer kernel). Call once its weights are loaded: a Parameter of a packed
    weight can be read (a checkpoint save), no longer loaded into."""
    if str(model.dtype) == "float64":
        return
    for module in model.modules():
        if isinstance(module, _QUANTIZED):
            module.pack_quantized()
    backend.release_free_memory()  # the stored arrays dropped, and the packing's temporaries
