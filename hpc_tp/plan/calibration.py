"""Measured speeds in place of datasheet numbers: ``hpc-tp bench comm --json`` and ``bench step --json``.

Communication: for each operation, the records of one rank count r >= 2 are fitted (least squares
on relative error, so 8-byte and 64-MiB messages count alike) to the ring model of ``cost.py``,

    time(n) = hops(op, r) * alpha + traffic(op, r) * n / bw,

which gives the operation its own (alpha, bw) for the link class the benchmark ran on: the one
each record names (``link``: "intra" or "inter" node; ``p2p_intra`` and ``p2p_inter`` are the
ping-pongs of each), else inside a node when its ranks fit on one. An operation not measured on a
class whose ping-pong was is priced with that ping-pong's alpha and bandwidth: the same wire, in the
same alpha-beta model. Compute: a step record gives the sustained FLOP/s of one rank
on the block stack, elementwise work included: ``flops / tp / compute_s``. A layout uses the
record of its tp, else the one whose per-rank work per micro-batch is closest to its own (GEMM
efficiency falls as matrices shrink); on CPU nodes (``compute_units``) the rate is rescaled when the plan puts more
or fewer ranks on a node than the benchmark did, since ranks share the cores.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy

from ..errors import ConfigError
from .cost import OPS, Link, Network, hops, traffic


@dataclass(frozen=True)
class StepRate:
    ranks: int  # ranks that ran at once on the node while this was measured
    forward_flops: float  # one rank's forward FLOPs per micro-batch
    rate: float  # sustained FLOP/s of one rank
    tp: int = 1
    messages: int = 0  # tp all-reduces in the measured step: 4 per block
    message_bytes: int = 0
    comm_s: float = 0.0  # the step's time in them, waiting for the other ranks included
    inter: bool = False  # its tp group spanned nodes: its messages crossed the inter-node link

    def wait(self, link: Link) -> float | None:
        """Seconds the messages took beyond ``link``'s alpha-beta time, per second of the step's
        compute; None without messages."""
        if self.messages == 0:
            return None
        excess = self.comm_s - self.messages * link.time("all_reduce", self.tp, self.message_bytes)
        return max(0.0, excess) / (3 * self.forward_flops / self.rate)


@dataclass
class Calibration:
    links: dict = field(default_factory=dict)  # op -> Link, from records that do not name their link
    link_ranks: int = 0  # ranks of the communication benchmark
    steps: list = field(default_factory=list)  # StepRate
    mem_bw: float | None = None  # bytes/s of the update per rank (as cost.py counts them), if measured
    sources: list = field(default_factory=list)
    node_links: dict = field(default_factory=dict)  # "intra" / "inter" -> {op: Link}, records that name it

    def network(self, cluster, tp: int | None = None) -> Network:
        """The measured links over the cluster's, per link class; ``wait`` from the step records at ``tp``
        (ranks wait longer for their partners in larger groups), else the largest of any record, each
        against the link class its messages crossed."""
        base = Network.of_cluster(cluster)
        unnamed = "inter" if self.link_ranks > cluster.devices_per_node else "intra"
        classes = {}
        for name, preset in (("intra", base.intra), ("inter", base.inter)):
            measured = {**(self.links if name == unnamed else {}), **self.node_links.get(name, {})}
            wire = {op: measured["p2p"] for op in OPS} if "p2p" in measured else {}
            classes[name] = {**preset, **wire, **measured}
        records = [s for s in self.steps if s.tp == tp] or self.steps
        waits = [s.wait(classes["inter" if s.inter else "intra"]["all_reduce"]) for s in records]
        return replace(base, **classes, wait=max((w for w in waits if w is not None), default=0.0))

    def rank_flops(
        self, cluster, ranks_per_node: int, forward_flops: float, tp: int, busy_ranks: float | None = None
    ) -> float:
        """FLOP/s of one rank doing ``forward_flops`` per micro-batch at ``tp``: the record measured
        with as many ranks on the node, at the same tp, of the nearest work, in that order;
        ``busy_ranks``: how many of them compute at once on average (``Cluster.rank_flops``); of equally
        near records, the slowest."""
        busy = ranks_per_node if busy_ranks is None else busy_ranks
        if not self.steps:
            return cluster.rank_flops(busy)

        def distance(s):
            return (
                s.ranks != ranks_per_node,
                s.tp != tp,
                abs(math.log(max(s.forward_flops, 1.0) / max(forward_flops, 1.0))),
            )

        best = min(self.steps, key=distance)
        # Records as near (groups measured at once, one per node): the slowest, as a pipeline waits for it.
        rate = min(s.rate for s in self.steps if distance(s) == distance(best))
        if cluster.compute_units is not None:

            def share(ranks):
                return min(1.0, cluster.compute_units / ranks)

            rate *= share(busy) / share(best.ranks)
        return rate

    def merge(self, other: Calibration) -> Calibration:
        return Calibration(
            {**self.links, **other.links},
            other.link_ranks or self.link_ranks,
            self.steps + other.steps,
            other.mem_bw or self.mem_bw,
            self.sources + other.sources,
            {
                c: {**self.node_links.get(c, {}), **other.node_links.get(c, {})}
                for c in {*self.node_links, *other.node_links}
            },
        )

    def describe(self) -> str:
        named = [(f"{op} {c}", link) for c, links in self.node_links.items() for op, link in links.items()]
        parts = [
            f"{op} alpha {link.alpha * 1e6:.1f} us, {link.bw / 1e9:.3g} GB/s"
            for op, link in [*self.links.items(), *named]
        ]
        parts += [
            f"compute {s.rate / 1e9:.1f} GFLOP/s per rank ({s.ranks} ranks, tp={s.tp}, "
            f"{s.forward_flops / 1e9:.2f} GFLOP forward per micro-batch)"
            for s in self.steps
        ]
        if self.mem_bw:
            parts.append(f"update {self.mem_bw / 1e9:.1f} GB/s per rank")
        return "; ".join(parts)


def fit_link(op: str, ranks: int, sizes, seconds) -> Link:
    """alpha and bw of ``op`` from (bytes, seconds) pairs measured at ``ranks`` ranks."""
    sizes, seconds = numpy.asarray(sizes, float), numpy.asarray(seconds, float)
    a = numpy.stack([numpy.full_like(sizes, hops(op, ranks)), traffic(op, ranks) * sizes], axis=1) / seconds[:, None]
    (alpha, inverse_bw), *_ = numpy.linalg.lstsq(a, numpy.ones_like(seconds), rcond=None)
    if alpha <= 0 or inverse_bw <= 0:  # noise on a flat curve: latency from the smallest, bandwidth the largest
        small, large = numpy.argmin(sizes), numpy.argmax(sizes)
        alpha = seconds[small] / hops(op, ranks)
        inverse_bw = max(seconds[large] - alpha * hops(op, ranks), 1e-12) / (traffic(op, ranks) * sizes[large])
    return Link(float(alpha), float(1.0 / inverse_bw))


# bench comm's ping-pongs between rank 0 and a rank on its own node or on another: p2p on that class.
PING_PONGS = {"p2p_intra": "intra", "p2p_inter": "inter"}


def from_comm_records(records: list[dict], source: str = "bench comm") -> Calibration:
    """Fit every operation measured at two ranks or more (the largest rank count of each), per link
    class where the records name it."""
    groups = {}
    for r in records:
        op, link = ("p2p", PING_PONGS[r.get("op")]) if r.get("op") in PING_PONGS else (r.get("op"), r.get("link"))
        if op in OPS and r.get("ranks", 0) >= 2:
            groups.setdefault((link, op), []).append(r)
    links, node_links, unnamed_ranks = {}, {}, 0
    for (link, op), mine in groups.items():
        ranks = max(r["ranks"] for r in mine)
        mine = [r for r in mine if r["ranks"] == ranks]
        fitted = fit_link(op, ranks, [r["bytes"] for r in mine], [r["project_time_s"] for r in mine])
        if link is None:
            links[op], unnamed_ranks = fitted, max(unnamed_ranks, ranks)
        else:
            node_links.setdefault(link, {})[op] = fitted
    return Calibration(links=links, link_ranks=unnamed_ranks, sources=[source], node_links=node_links)


def step_rate(record: dict, ranks: int | None = None) -> StepRate:
    """A ``bench step`` record as a rate; ``ranks``: how many ran on the node (default: the record's
    ``ranks_per_node``, else its tp)."""
    tp = record["tp"]
    itemsize = numpy.dtype(record["dtype"]).itemsize
    messages = 4 * record["layers"] if tp > 1 else 0
    return StepRate(
        ranks or record.get("ranks_per_node", tp),
        record["flops"] / 3 / tp,
        record["flops"] / tp / record["compute_s"],
        tp,
        messages,
        record["micro_batch"] * record["seq_len"] * record["hidden"] * itemsize,
        record["comm_s"],
        record.get("nodes", 1) > 1,
    )


def from_step_records(records: list[dict], source: str = "bench step") -> Calibration:
    return Calibration(steps=[step_rate(r) for r in records], sources=[source])


def load_calibration(paths) -> Calibration:
    """Read one or more JSON files written by ``bench comm --json`` or ``bench step --json``."""
    total = Calibration()
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"--calibration {path}: no such file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"--calibration {path}: not JSON ({e.msg} at line {e.lineno})") from None
        records = data if isinstance(data, list) else [data]
        if records and all(isinstance(r, dict) and "op" in r and "project_time_s" in r for r in records):
            total = total.merge(from_comm_records(records, str(path)))
        elif records and all(isinstance(r, dict) and r.get("benchmark") == "step" for r in records):
            total = total.merge(from_step_records(records, str(path)))
        else:
            raise ConfigError(
                f"--calibration {path}: expected the JSON of 'hpc-tp bench comm --json' or 'hpc-tp bench step --json'"
            )
    return total
