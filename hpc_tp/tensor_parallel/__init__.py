"""Tensor parallelism: the f/g communication regions, column/row-parallel linears, vocab-parallel
embedding, LM head and cross entropy, and layout-independent dropout randomness."""

from .layers import ColumnParallelLinear, RowParallelLinear, Segment
from .mappings import (
    CopyToTensorParallel,
    GatherFromSequenceParallel,
    GatherFromTensorParallel,
    ReduceFromTensorParallel,
    ReduceScatterToSequenceParallel,
    ScatterToTensorParallel,
)
from .vocab import IGNORE_INDEX, VocabParallelCrossEntropy, VocabParallelEmbedding, VocabParallelLMHead

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "Segment",
    "CopyToTensorParallel",
    "ReduceFromTensorParallel",
    "ScatterToTensorParallel",
    "GatherFromTensorParallel",
    "ReduceScatterToSequenceParallel",
    "GatherFromSequenceParallel",
    "IGNORE_INDEX",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
]
