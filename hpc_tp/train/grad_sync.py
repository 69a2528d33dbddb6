"""Data-parallel gradient all-reduce in flat buckets, overlapped with backward.

Parameters are grouped, in reverse order of registration (about the order backward produces
their gradients), into contiguous buckets of at most ``bucket_bytes`` (a larger parameter gets
a bucket of its own). During backward the trainer calls ``mark_ready(*names)`` once gradients
are final (after the last micro-batch); a bucket whose gradients are all final is packed and
launched with ``iall_reduce`` while backward goes on. ``finish()`` launches what is left, waits
and writes the results back into ``p.grad`` (views into fused buffers included).

    bucketer = GradBucketer(model.state(), grid.dp)
    bucketer.start()
    ... backward, calling bucketer.mark_ready(*names_of_the_layer_just_done) ...
    bucketer.finish()

Non-blocking collectives match by the order they are issued, so buckets are launched strictly
in bucket order: one that completes early waits for those before it. Every dp rank builds the
same buckets from the same names, so the collectives line up whatever order its gradients come
in. With a dp group of one nothing is packed or sent.
"""
from __future__ import annotations

from .. import backend
from ..errors import ConfigError
from ..module import Parameter

DEFAULT_BUCKET_BYTES = 25 * 2**20


class _Bucket:
    def __init__(self, named: list[tuple[str, Parameter]]):
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.numel = sum(p.grad.size for p in self.params)
        self.flat = None  # allocated at the first launch, so a dp group of one never holds a copy
        self.pending: set[str] = set()
        self.request = None

    def _views(self):
        offset = 0
        for p in self.params:
            yield p.grad, self.flat[offset:offset + p.grad.size].reshape(p.grad.shape)
            offset += p.grad.size

    def launch(self, comm):
        if self.flat is None:
            grad = self.params[0].grad
            self.flat = backend.xp_of(grad).empty(self.numel, dtype=grad.dtype)
        for grad, packed in self._views():
            packed[...] = grad
        self.request = comm.iall_reduce(self.flat)

    def complete(self, divisor: int | None):
        self.request.wait()
        self.request = None
        if divisor is not None:
            self.flat /= divisor
        for grad, packed in self._views():
            grad[...] = packed


def _build_buckets(named: list[tuple[str, Parameter]], bucket_bytes: int) -> list[_Bucket]:
    buckets, current, nbytes = [], [], 0
    for name, p in named:
        # One dtype per bucket: the flat buffer is a single array.
        if current and (nbytes + p.grad.nbytes > bucket_bytes or p.grad.dtype != current[0][1].grad.dtype):
            buckets.append(_Bucket(current))
            current, nbytes = [], 0
        current.append((name, p))
        nbytes += p.grad.nbytes
    if current:
        buckets.append(_Bucket(current))
    return buckets


class GradBucketer:
    """``average=True`` divides the sums by the dp size (the mean gradient, for a loss averaged
    per rank); ``average=False`` keeps the sums (for a loss already scaled by the global count)."""

    def __init__(self, named_params: dict[str, Parameter], dp_comm, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 average: bool = True):
        if not bucket_bytes > 0:
            raise ConfigError(f"gradient bucket size {bucket_bytes!r} bytes must be > 0")
        self.comm, self.average = dp_comm, average
        self.buckets = _build_buckets(list(named_params.items())[::-1], bucket_bytes)
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
        """Launch what is left (gradients never marked go as they are), wait, write back into ``p.grad``."""
        if self._next is None:
            raise RuntimeError("GradBucketer.finish() called before start()")
        self._launch(stop_at_pending=False)
        divisor = self.comm.size if self.average else None
        for bucket in self.buckets:
            if bucket.request is not None:
                bucket.complete(divisor)
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
            self._next += 1


class ExpertAwareBucketer:
    """The trainer's gradient sync under expert parallelism: dense gradients summed over the dp
    group, each expert's over ``grid.expert_dp`` (the ranks that hold that same expert; every other
    dp rank holds other experts). Same interface as ``GradBucketer``, sums (``average=False``)."""

    def __init__(self, named_params: dict[str, Parameter], grid, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        from ..nn.moe import is_expert_parameter

        experts = {n: p for n, p in named_params.items() if is_expert_parameter(n)}
        dense = {n: p for n, p in named_params.items() if n not in experts}
        self.parts = [GradBucketer(dense, grid.dp, bucket_bytes, average=False),
                      GradBucketer(experts, grid.expert_dp, bucket_bytes, average=False)]
        self._part_of = {name: part for part in self.parts for name in part._bucket_of}

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
            part.finish()


def all_reduce_grads(named_params: dict[str, Parameter], dp_comm, average: bool = True,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Plain path (no overlap): the same buckets and collectives as the overlapped one, so the
    numbers are bit-identical."""
    GradBucketer(named_params, dp_comm, bucket_bytes, average).all_reduce()
