"""Which ranks share a node, and what it costs: the bytes a step sends between nodes, and a layout's
step time under each placement side by side.

A launcher deals ranks to nodes block-wise (node by node: ``srun --distribution=block``, ``mpirun``'s
default) or cyclic (round-robin: ``--distribution=cyclic``, ``mpirun --map-by node``). With ranks =
``arange(world).reshape(dp, pp, tp)``, block keeps a tp group that fits a node on one node and sends
the pipeline across; cyclic puts a tp group across the nodes and pipeline neighbours on one.
``predict`` prices each group's messages on the link they cross; ``bytes_between_nodes`` counts what
crosses, the way a network counter at the nodes does (each byte from one node to another once):

- a collective over a group, in rank order, as a ring: each rank sends ``traffic(op, g) x n`` bytes to
  the next (all-reduce 2 (g - 1) / g n), so every ring edge between two nodes carries that across;
  small messages go by recursive doubling instead, whose bytes are as few and do not matter;
- an all-to-all: each rank sends n / g to every other, the pairs on different nodes cross;
- the pipeline: each boundary between consecutive model chunks (pp x V - 1 of them, chunk c on stage
  c mod pp) carries 2m messages (m activations forward, m gradients back) between the ranks of the
  same dp and tp position on its two stages.

Collectives over a pipeline group (the loss broadcast, the tied embedding's pair) and the world are
issued by every stage together and counted once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy

from .cost import PLACEMENTS, Layout, Prediction, node_of_rank, predict, traffic


def _node_grid(layout: Layout, devices_per_node: int) -> numpy.ndarray:
    """Each rank's node at its (dp outer, ep, pp, tp) position (``grid.py``)."""
    return layout.node_of_rank(devices_per_node).reshape(layout.dp // layout.ep, layout.ep, layout.pp, layout.tp)


def _groups(layout: Layout, nodes: numpy.ndarray, kind: str, stage: int, ranks: int) -> numpy.ndarray:
    """The nodes of each group of ``kind`` that ranks of ``stage`` belong to: one row per group;
    ``ranks``: a subgroup's size (the K/V replicas, consecutive tp ranks; the tied pair, the end stages)."""
    here = nodes[:, :, stage, :]  # (dp outer, ep, tp)
    if kind == "tp":
        return here.reshape(-1, ranks or layout.tp)
    if kind == "dp":
        return here.reshape(layout.dp, layout.tp).T
    if kind == "expert_dp":
        return here.transpose(1, 2, 0).reshape(-1, layout.dp // layout.ep)
    if kind == "ep":
        return here.transpose(0, 2, 1).reshape(-1, layout.ep)
    if kind == "pp":
        pipelines = nodes.transpose(0, 1, 3, 2).reshape(-1, layout.pp)
        return pipelines[:, [0, -1]] if ranks == 2 else pipelines
    return nodes.reshape(1, -1)  # world


def _crossing_bytes(op: str, members: numpy.ndarray, nbytes: float) -> float:
    """Bytes one collective of ``nbytes`` over a group (the node of each member) sends between nodes."""
    g = len(members)
    if g < 2:
        return 0.0
    if op == "all_to_all":
        return float((members[:, None] != members[None, :]).sum()) * nbytes / g
    edges = members != numpy.roll(members, -1)
    return float(edges.sum()) * traffic(op, g) * nbytes


def bytes_between_nodes(prediction: Prediction, devices_per_node: int) -> float:
    """Bytes one step sends from one node to another, every rank's messages summed (module docstring)."""
    layout = prediction.layout
    nodes = _node_grid(layout, devices_per_node)
    total = 0.0
    for stage, collectives in enumerate(prediction.stage_collectives):
        for c in collectives:
            if c.group in ("pp", "world") and (stage > 0 or c.op == "p2p"):
                continue  # issued by all stages together (counted at stage 0); p2p: by boundary below
            groups = _groups(layout, nodes, c.group, stage, c.ranks)
            total += c.count * sum(_crossing_bytes(c.op, members, c.nbytes) for members in groups)
    p2p = next((c for c in prediction.stage_collectives[0] if c.group == "pp" and c.op == "p2p"), None)
    if p2p is not None:
        m = p2p.count // (2 * layout.virtual_stages)
        for chunk in range(layout.pp * layout.virtual_stages - 1):
            a, b = chunk % layout.pp, (chunk + 1) % layout.pp
            total += float((nodes[:, :, a, :] != nodes[:, :, b, :]).sum()) * 2 * m * p2p.nbytes
    return total


@dataclass(frozen=True)
class Placed:
    prediction: Prediction
    bytes_between_nodes: float
    tp_spans_nodes: bool

    def describe(self) -> str:
        where = "tp across nodes" if self.tp_spans_nodes else "tp inside a node"
        return (
            f"{self.prediction.layout.placement} ({where}) {self.prediction.step_s:.4g} s, "
            f"{self.bytes_between_nodes / 2**20:.1f} MiB between nodes a step"
        )


def compare_placements(cfg, layout: Layout, global_batch: int, seq: int, cluster, calibration=None) -> list[Placed]:
    """``layout`` under every placement, fastest first: its step time and traffic between nodes."""
    placed = []
    for placement in PLACEMENTS:
        p = predict(cfg, replace(layout, placement=placement), global_batch, seq, cluster, calibration)
        per_node = cluster.devices_per_node
        placed.append(Placed(p, bytes_between_nodes(p, per_node), p.layout.spans_nodes("tp", per_node)))
    return sorted(placed, key=lambda x: x.prediction.step_s)


def launch_placement(nodes: list) -> tuple[int, str] | None:
    """(ranks per node, placement) of a launch from each rank's node (``grid.node_of_ranks``); None
    when its ranks follow neither placement (nodes of different sizes, a hand-made rank file)."""
    names = list(dict.fromkeys(nodes))  # in the order of the lowest rank on each
    index = [names.index(n) for n in nodes]
    per_node = -(-len(index) // len(names))
    for placement in PLACEMENTS:
        if node_of_rank(len(index), per_node, placement).tolist() == index:
            return per_node, placement
    return None


def launch_cluster(cluster, nodes: list) -> tuple:
    """The planner's (cluster, placement) for a launch, from each rank's node: on more than one node,
    the launch's ranks per node and placement; on one node (or a placement of neither kind: block,
    the launchers' default) the cluster as it is."""
    found = launch_placement(nodes)
    if len(set(nodes)) < 2 or found is None:
        return cluster, "block"
    per_node, placement = found
    return cluster.with_overrides(devices_per_node=per_node), placement
