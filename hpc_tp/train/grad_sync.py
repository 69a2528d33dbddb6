"""Data-parallel gradient all-reduce in buckets, in place, overlapped with backward.

The model's gradients live in a ``GradArena`` (``hpc_tp.module``): flat chunks of
``module.DEFAULT_BUCKET_BYTES``, filled in the order the layers allocate them. A bucket is a contiguous
run of one chunk, so its all-reduce reads and writes the gradients where they are: no copy into
a flat buffer and back, no second gradient-sized buffer. Buckets go in reverse order of
allocation (about the order backward produces gradients). A fused layer's gradient (QKV,
gate/up) is one piece of storage whose segments are strided views: it always falls in one bucket.

During backward the trainer calls ``mark_ready(*names)`` once gradients are final (after the last
micro-batch); a bucket whose gradients are all final is launched with ``iall_reduce`` while
backward goes on. ``finish()`` launches what is left and waits.

    with GradArena(DEFAULT_BUCKET_BYTES) as arena:
        model = build_stage(...)
    bucketer = GradBucketer(model.state(), grid.dp, arena)
    bucketer.start()
    ... backward, calling bucketer.mark_ready(*names_of_the_layer_just_done) ...
    bucketer.finish()

Non-blocking collectives match by the order they are issued, so buckets are launched strictly
in bucket order: one that completes early waits for those before it. Every dp rank builds the
same model, so the same buckets, and the collectives line up whatever order its gradients come
in. With a dp group of one nothing is sent.
"""

from __future__ import annotations

from ..module import GradArena, Parameter
from ..nn.moe import is_expert_parameter


class _Bucket:
    """The gradients ``names``, which together fill ``flat``: a contiguous slice of an arena chunk.

    Sharded (ZeRO, ``train/distributed_optim.py``): ``flat`` is cut into one piece per rank of the
    group, ``counts`` long (``shard_counts``), and only this rank's piece of the sum is kept: a
    reduce-scatter instead of the all-reduce, half its traffic. It lands in place at the front of
    ``flat`` (MPI's convention), ``shard``, whichever piece it is; ``start`` is where the piece
    belongs."""

    def __init__(self, names: list[str], flat, values=None):
        self.names, self.flat, self.values = names, flat, values  # values: the parameters' run (GradArena params)
        self.pending: set[str] = set()
        self.request = None
        self.counts = self.shard = None

    def make_shard(self, comm):
        self.counts = shard_counts(self.flat.size, comm.size)
        self.start = sum(self.counts[: comm.rank])
        self.shard = self.flat[: self.counts[comm.rank]]

    def launch(self, comm):
        if self.shard is None:
            self.request = comm.iall_reduce(self.flat)
        else:
            self.request = comm.ireduce_scatter_flat(self.flat, self.counts)

    def complete(self, divisor: int | None):
        self.request.wait()
        self.request = None
        if divisor is not None:
            (self.flat if self.shard is None else self.shard)[...] /= divisor


def shard_counts(length: int, ranks: int) -> list[int]:
    """``length`` elements in ``ranks`` consecutive pieces that differ by at most one element (the
    first ``length % ranks`` one longer; empty only when the bucket is shorter than the group):
    rank r's share of a sharded bucket."""
    piece, longer = divmod(length, ranks)
    return [piece + (r < longer) for r in range(ranks)]


def _build_buckets(named: dict[str, Parameter], arena: GradArena) -> list[_Bucket]:
    """Runs of storage in one chunk that the gradients fill without a gap (the strided views of a
    fused gradient overlap one another: one run holds them all), last run first."""
    runs: list[list] = []  # [chunk, start, stop, names]
    for (chunk, start, stop), name in sorted((arena.locate(p.grad), name) for name, p in named.items()):
        if runs and runs[-1][0] == chunk and start <= runs[-1][2]:
            runs[-1][2] = max(runs[-1][2], stop)
            runs[-1][3].append(name)
        else:
            runs.append([chunk, start, stop, [name]])
    return [
        _Bucket(
            names[::-1],
            arena.chunks[chunk][start:stop],
            None if arena.param_chunks[chunk] is None else arena.param_chunks[chunk][start:stop],
        )
        for chunk, start, stop, names in runs[::-1]
    ]


class GradBucketer:
    """``average=True`` divides the sums by the dp size (the mean gradient, for a loss averaged
    per rank); ``average=False`` keeps the sums (for a loss already scaled by the global count)."""

    def __init__(
        self,
        named_params: dict[str, Parameter],
        dp_comm,
        arena: GradArena,
        average: bool = True,
        shard: bool = False,
        posted: list | None = None,
    ):
        self.comm, self.average = dp_comm, average
        # Buckets launched and not yet waited, in posting order; bucketers that post on one
        # communicator share it (``ExpertAwareBucketer``), so waits follow posts across them too.
        self.posted = [] if posted is None else posted
        self.buckets = _build_buckets(named_params, arena)
        if shard:
            for bucket in self.buckets:
                bucket.make_shard(dp_comm)
        self._bucket_of = {name: bucket for bucket in self.buckets for name in bucket.names}
        self._next = None  # index of the next bucket to launch; None outside start() .. finish()

    def start(self):
        """Begin a step: every gradient is pending again."""
        if self._next is not None:
            raise RuntimeError("GradBucketer.start() called twice without finish()")
        for bucket in self.buckets:
            bucket.pending = set(bucket.names)
        self._next = 0

    def mark_ready(self, *names: str):
        """These gradients are final for this step; launches every bucket that can go now."""
        if self._next is None:
            raise RuntimeError("GradBucketer.mark_ready() called before start()")
        for name in names:
            bucket = self._bucket_of.get(name)
            if bucket is None:
                raise KeyError(f"{name!r} is not a parameter of this gradient bucketer")
            if name not in bucket.pending:
                raise RuntimeError(f"gradient {name!r} marked ready twice in one step")
            bucket.pending.remove(name)
        self._launch(stop_at_pending=True)

    def finish(self):
        """Launch what is left (gradients never marked go as they are) and wait for every bucket."""
        self.launch_rest()
        wait_posted(self.posted)

    def launch_rest(self):
        """End the step's launches: what is left goes now (to be waited with ``wait_posted``)."""
        if self._next is None:
            raise RuntimeError("GradBucketer.finish() called before start()")
        self._launch(stop_at_pending=False)
        self._next = None

    def all_reduce(self):
        """The whole step's all-reduce at once, without overlap."""
        self.start()
        self.finish()

    def _launch(self, stop_at_pending: bool):
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if stop_at_pending and bucket.pending:
                return
            if self.comm.size > 1:
                bucket.launch(self.comm)
                self.posted.append((bucket, self.comm.size if self.average else None))
            self._next += 1


def wait_posted(posted: list):
    """Wait for the launched buckets in the order they were posted (the Communicator's rule)."""
    for bucket, divisor in posted:
        bucket.complete(divisor)
    posted.clear()


class ExpertAwareBucketer:
    """The trainer's gradient sync under expert parallelism: dense gradients summed over the dp
    group, each expert's over ``grid.expert_dp`` (the ranks that hold that same expert; every other
    dp rank holds other experts). Same interface as ``GradBucketer``, sums (``average=False``).

    ``shard=True`` (ZeRO-1): the buckets are reduce-scattered, save those of ``whole``, which are
    all-reduced as before (the tied embedding of pp > 1, summed across stages after this sync)."""

    def __init__(
        self, named_params: dict[str, Parameter], grid, arena: GradArena, shard: bool = False, whole=frozenset()
    ):
        self.posted: list = []

        def part(names, comm, sharded):
            return GradBucketer(
                {n: named_params[n] for n in names}, comm, arena, average=False, shard=sharded, posted=self.posted
            )

        experts = [n for n in named_params if is_expert_parameter(n)]
        dense = [n for n in named_params if n not in experts and not (shard and n in whole)]
        self.parts = [part(dense, grid.dp, shard), part(experts, grid.expert_dp, shard)]
        if shard and whole:
            self.parts.append(part([n for n in named_params if n in whole], grid.dp, False))
        self._part_of = {name: part for part in self.parts for name in part._bucket_of}
        # The names whose buckets are reduce-scattered: the ones the distributed optimizer holds in pieces.
        self.sharded_names = frozenset(
            name for part in self.parts for bucket in part.buckets if bucket.shard is not None for name in bucket.names
        )

    def start(self):
        for part in self.parts:
            part.start()

    def mark_ready(self, *names: str):
        for name in names:
            if name not in self._part_of:
                raise KeyError(f"{name!r} is not a parameter of this gradient bucketer")
        for part in self.parts:
            mine = [n for n in names if self._part_of[n] is part]
            if mine:
                part.mark_ready(*mine)

    def finish(self):
        for part in self.parts:
            part.launch_rest()
        wait_posted(self.posted)


def all_reduce_grads(named_params: dict[str, Parameter], dp_comm, arena: GradArena, average: bool = True):
    """Plain path (no overlap): the same buckets and collectives as the overlapped one, so the
    numbers are bit-identical."""
    GradBucketer(named_params, dp_comm, arena, average).all_reduce()
