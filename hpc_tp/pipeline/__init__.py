"""Pipeline parallelism: the model cut into contiguous stages over the pp group, micro-batches
streamed through them by a GPipe or 1F1B schedule with non-blocking point-to-point messages.

    model = build_stage(cfg, grid, dtype, seed)                 # this rank's stage
    loss_sum, tokens = pipeline_forward_backward(model, micro_batches, grid, scale, "1f1b")
    sync_tied_embeddings(model, grid)                           # tied embedding copies agree
"""
from .partition import balanced_layers, build_stage, layers_from_counts, parse_pp_layers, stage_costs, stage_layers
from .schedules import SCHEDULES, PipelineStats, pipeline_forward_backward, stage_parameter_groups
from .tied import sync_tied_embeddings, tied_copy_names, tied_names

__all__ = ["SCHEDULES", "PipelineStats", "balanced_layers", "build_stage", "layers_from_counts", "parse_pp_layers",
           "pipeline_forward_backward", "stage_costs", "stage_layers", "stage_parameter_groups",
           "sync_tied_embeddings", "tied_copy_names", "tied_names"]
