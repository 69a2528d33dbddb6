"""Weights made ready as a model is loaded for inference, each kept once in the layout its products
read: quantized linear weights interleaved (``kernels.quantized.QuantizedMatrix.pack``) and the LM
head's int8 copy, bfloat16 ones in panels (``kernels.bf16_panels``), so a server's first request
builds nothing that later ones do not. Training keeps the stored layout (a packed Parameter can be
read, as a checkpoint save reads it, no longer loaded into or trained)."""

from __future__ import annotations

from .. import backend
from .layers import ColumnParallelLinear, RowParallelLinear
from .vocab import VocabParallelLMHead

_PACKED = (ColumnParallelLinear, RowParallelLinear, VocabParallelLMHead)


def fold_adapters(model):
    """Every LoRA adapter folded into its weight (W += s A B) and dropped: the adapted model's numbers
    from the plain products, which the packing and the decode kernels then read. Call once the
    weights are loaded, before ``pack_for_inference``."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.fold_adapter()


def pack_for_inference(model):
    """Pack ``model``'s weights (a model of float64 activations keeps its stored layout: its products
    never take the integer kernel). Call once its weights are loaded."""
    if str(model.dtype) == "float64":
        return
    for module in model.modules():
        if isinstance(module, _PACKED):
            module.pack_for_inference()
    backend.release_free_memory()  # the stored arrays dropped, and the packing's temporaries
