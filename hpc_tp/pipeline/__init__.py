"""Pipeline parallelism: the model cut into contiguous chunks over the pp group (one per rank, or
V per rank with ``virtual_stages``), micro-batches streamed through them by a GPipe, 1F1B or
interleaved 1F1B schedule with non-blocking point-to-point messages.

    model = build_stage(cfg, grid, dtype, seed, virtual_stages=V)  # this rank's chunks
    loss_sum, tokens = pipeline_forward_backward(model, micro_batches, grid, scale, "1f1b")
    sync_tied_embeddings(model, grid)                              # tied embedding copies agree
"""

from .partition import (
    balanced_layers,
    build_stage,
    layers_from_counts,
    model_chunks,
    parse_pp_layers,
    stage_costs,
    stage_layers,
)
from .schedules import SCHEDULES, PipelineStats, pipeline_forward_backward, stage_ops, stage_parameter_groups
from .tied import sync_tied_embeddings, tied_copy_names, tied_names

__all__ = [
    "SCHEDULES",
    "PipelineStats",
    "balanced_layers",
    "build_stage",
    "layers_from_counts",
    "model_chunks",
    "parse_pp_layers",
    "pipeline_forward_backward",
    "stage_costs",
    "stage_layers",
    "stage_ops",
    "stage_parameter_groups",
    "sync_tied_embeddings",
    "tied_copy_names",
    "tied_names",
]
