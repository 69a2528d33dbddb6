"""Tied input/output embeddings across pipeline stages.

With tied embeddings and pp > 1 the first stage looks tokens up in the embedding matrix and the
last stage multiplies by it in the head, so each holds a copy (same name, same initial value).
The copies stay equal because each step both receive the sum of the two gradients: one
all-reduce in a group of two ranks, the first and last stage of the same tp and dp position.
Only one copy may count in the global gradient norm.
"""

from __future__ import annotations

import weakref

from .. import backend

TIED_NAME = "embed.weight"

_pairs = weakref.WeakKeyDictionary()  # grid -> its first/last stage group (None on middle stages)


def _pair_group(grid):
    """Built once per grid; collective over the whole world the first time."""
    if grid not in _pairs:
        ends = grid.is_first_stage or grid.is_last_stage
        # Ranks outside any pair get a group of their own (a colour nobody shares).
        color = grid.coords.dp * grid.tp_size + grid.coords.tp if ends else grid.world.size + grid.world.rank
        group = grid.world.split(color=color, key=grid.coords.pp)
        if backend.device == "cuda":  # device gradients: a transport that carries them, as the grid's groups get
            from ..comm.nccl import device_communicator

            group = device_communicator(group)
        _pairs[grid] = group if ends else None
    return _pairs[grid]


def sync_tied_embeddings(model, grid):
    """Sum the tied embedding gradient of the first and last stage into both copies. Every rank of
    the world calls it (a no-op where nothing is tied), after the backward of the step."""
    if grid.pp_size == 1 or not model.cfg.tie_embeddings or model.cfg.lora_rank:  # LoRA: frozen, no gradient
        return
    group = _pair_group(grid)
    if group is not None:
        group.all_reduce(dict(model.named_parameters())[TIED_NAME].grad)


def tied_names(model, grid) -> frozenset:
    """Names this rank holds a tied copy of (on the first and last stage of pp > 1): their gradient
    is summed across stages after the dp sync, so the optimizer must see it whole."""
    tied = model.cfg.tie_embeddings and grid.pp_size > 1 and TIED_NAME in model.trainable_state()
    return frozenset([TIED_NAME]) if tied else frozenset()


def tied_copy_names(model, grid) -> frozenset:
    """Names whose gradient this rank must leave out of the global norm: the last stage's copy."""
    tied_copy = model.cfg.tie_embeddings and grid.pp_size > 1 and grid.is_last_stage
    return frozenset([TIED_NAME]) if tied_copy else frozenset()
