"""ProcessGrid: COMM_WORLD reshaped into (dp, pp, tp) and cut into groups.

    ranks = arange(world).reshape(dp, pp, tp)

tp is the fastest-varying axis, so a tp group is made of neighbouring ranks, which launchers
place on the same node (fast links for the two all-reduces per layer); pp crosses nodes with
point-to-point sends; dp is outermost and all-reduces gradients once per step.

Expert parallelism (``ep``, Mixture-of-Experts) is carved out of dp: the dp index splits into
(outer, e) = divmod(dp_index, ep). The ``ep`` group (same outer index, pp and tp) holds different
experts and exchanges tokens with all-to-all; each of its ranks reads its own data like any dp
rank. Non-expert gradients are still summed over the whole ``dp`` group; an expert's gradient
over ``expert_dp`` (same e, pp and tp: the dp/ep ranks that hold that same expert). Experts are
tensor-parallel inside over the tp group, so ep never crosses tp.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy

from .comm.base import Communicator
from .errors import ConfigError


def factorizations(world: int) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) with tp*pp*dp == world."""
    return [
        (t, p, world // (t * p))
        for t in range(1, world + 1)
        if world % t == 0
        for p in range(1, world // t + 1)
        if (world // t) % p == 0
    ]


def _layouts_that_fit(world: int) -> str:
    return f"layouts that fit: {', '.join(f'{t}x{p}x{d}' for t, p, d in factorizations(world))}"


def node_of_ranks(comm: Communicator) -> list[int]:
    """The node of each rank of ``comm``, named by the lowest rank on it. Collective over ``comm``."""
    return comm.allgather_object(comm.split_node().allgather_object(comm.rank)[0])


def nodes_spanned(comm: Communicator) -> int:
    """How many nodes the ranks of ``comm`` sit on. Collective over ``comm``."""
    return len(set(node_of_ranks(comm)))


def tp_across_nodes_warning(tp: int, nodes: int) -> str:
    return (
        f"a tensor-parallel group of {tp} ranks spans {nodes} nodes: its all-reduces will cross the slow "
        "network; use tp <= ranks per node"
    )


def warn_if_tp_spans_nodes(tp_group: Communicator) -> bool:
    """For commands that use one communicator as their tp group (``bench step``, ``bench decode``):
    warn, on its rank 0, when it spans nodes. Collective over ``tp_group``."""
    nodes = nodes_spanned(tp_group)
    if nodes > 1 and tp_group.rank == 0:
        warnings.warn(tp_across_nodes_warning(tp_group.size, nodes), stacklevel=2)
    return nodes > 1


@dataclass
class Coordinates:
    dp: int
    pp: int
    tp: int
    ep: int = 0


class ProcessGrid:
    def __init__(self, tp: int = 1, pp: int = 1, dp: int | None = None, world: Communicator | None = None, ep: int = 1):
        if world is None:
            from .comm.mpi import world as mpi_world  # starts MPI: the planner builds grids without it

            world = mpi_world()
        for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"--{name} {value!r} must be a positive integer")
        if dp is None:
            if world.size % (tp * pp):
                raise ConfigError(
                    f"world size {world.size} is not divisible by tp*pp = {tp}*{pp}; {_layouts_that_fit(world.size)}"
                )
            dp = world.size // (tp * pp)
        if tp * pp * dp != world.size:
            raise ConfigError(
                f"world size {world.size} != tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp}; "
                f"{_layouts_that_fit(world.size)}"
            )
        self.world, self.tp_size, self.pp_size, self.dp_size = world, tp, pp, dp
        self.ranks = numpy.arange(world.size).reshape(dp, pp, tp)
        d, p, t = (int(i[0]) for i in numpy.nonzero(self.ranks == world.rank))
        self.coords = Coordinates(dp=d, pp=p, tp=t)
        # One split per axis: ranks that agree on the other two coordinates share a group.
        self.tp = world.split(color=d * pp + p, key=t)
        self.pp = world.split(color=d * tp + t, key=p)
        self.dp = world.split(color=p * tp + t, key=d)
        if dp % ep:
            raise ConfigError(
                f"--ep {ep} must divide the data-parallel size {dp} (expert parallelism is carved out of dp)"
            )
        self.ep_size = ep
        outer, self.coords.ep = divmod(d, ep)
        self.ep = world.split(color=(outer * pp + p) * tp + t, key=self.coords.ep)
        self.expert_dp = world.split(color=(self.coords.ep * pp + p) * tp + t, key=outer)
        self.node = world.split_node()
        self._check_tp_node_local()

    def _check_tp_node_local(self):
        widest = max(self.world.allgather_object(nodes_spanned(self.tp)))  # every tp group, not only rank 0's
        self.tp_spans_nodes = widest > 1
        if self.tp_spans_nodes and self.world.rank == 0:
            warnings.warn(tp_across_nodes_warning(self.tp_size, widest), stacklevel=2)

    @property
    def local_rank(self) -> int:
        return self.node.rank

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.pp_size - 1

    def __repr__(self):
        return (
            f"ProcessGrid(tp={self.tp_size}, pp={self.pp_size}, dp={self.dp_size}, ep={self.ep_size}, "
            f"rank={self.world.rank}, coords={self.coords})"
        )
