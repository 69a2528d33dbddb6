"""The trainer's side of Mixture-of-Experts: which ``--ep`` a model allows, and the step's MoE counts.

Routing groups: an MoE layer routes, caps and balances the tokens of one micro-batch of its
whole ep group (``tensor_parallel/experts.py``). So ``--ep N`` with micro-batch m per rank
computes what ``--ep 1`` computes with micro-batches of N * m sequences over dp / N ranks,
whenever those hold the same rows (one micro-batch per rank, the default at pp = 1).
"""

from __future__ import annotations

import numpy

from ..errors import ConfigError


def check_expert_parallel(ep: int, cfg):
    """One-line errors for an ``--ep`` the model cannot take (``ProcessGrid`` checks that ep divides dp)."""
    if ep == 1:
        return
    if not cfg.num_experts:
        raise ConfigError(
            f"--ep {ep} needs a Mixture-of-Experts model (num_experts > 0, e.g. --set num_experts=4); "
            "this model has none"
        )
    if cfg.num_experts % ep:
        raise ConfigError(
            f"--ep {ep} does not divide num_experts={cfg.num_experts}: every ep rank holds the same number of experts"
        )


def moe_metrics(model, grid) -> dict:
    """The step's MoE counts over the whole global batch, every layer and stage, the same on every
    rank (one small all-reduce over the world); resets the layers' counts. {} for a dense model.

    ``moe_aux``: the mean load-balancing loss per routed micro-batch and layer (1 when the experts
    are evenly used, up to num_experts when one takes everything); ``moe_dropped``: assignments
    over capacity, ``moe_dropped_frac`` their share; ``moe_load``: each expert's share of the
    assignments (before dropping)."""
    experts = model.cfg.num_experts
    if not experts:
        return {}
    totals = numpy.zeros(4 + experts)
    # The ranks of a tp group and of an ep group count the same routing: one of each reports it.
    if grid.coords.tp == 0 and grid.coords.ep == 0:
        for moe in model.moe_layers():
            s = moe.stats
            if s.forwards:
                totals += numpy.concatenate([[s.forwards, s.assignments, s.dropped, s.aux], s.load])
    for moe in model.moe_layers():
        moe.stats = type(moe.stats)()
    totals = grid.world.all_reduce(totals)
    forwards, assignments, dropped, aux = totals[:4]
    return dict(
        moe_aux=float(aux / max(forwards, 1)),
        moe_dropped=int(round(dropped)),
        moe_dropped_frac=float(dropped / max(assignments, 1)),
        moe_load=[float(x) for x in totals[4:] / max(assignments, 1)],
    )


def moe_summary(record: dict) -> str:
    """The last step's MoE counts as one line of the run's report."""
    load = " ".join(f"{share:.2f}" for share in record["moe_load"])
    return (
        f"MoE last step: load-balancing loss {record['moe_aux']:.3f} (1 = even), {record['moe_dropped']} "
        f"assignments over capacity ({100 * record['moe_dropped_frac']:.1f}%), expert load {load}"
    )
