"""ZeRO-1 (Megatron-LM's distributed optimizer): AdamW with its states sharded over data parallelism.

Every dp rank holds the same parameters, so plain data parallelism keeps dp copies of Adam's two
moments and updates every element dp times. Here each rank owns one piece of every gradient bucket
(``grad_sync``: reduce-scatter instead of all-reduce, so only its piece is summed), keeps the
moments and the parameters' values for that piece alone, updates it, and an all-gather of the
updated pieces, in place in the bucket's storage, gives every rank the whole new parameters:

    reduce-scatter(grad buckets) -> norm of the pieces, summed over dp -> AdamW on the piece
    -> all-gather(updated pieces) -> parameters

The traffic is the all-reduce's (a reduce-scatter and an all-gather); the states take 1/dp of the
memory, and the update 1/dp of the time.

A piece is a run of the arena's flat gradient storage, where each parameter's gradient sits at an
offset with its own strides (a fused layer's views interleave). ``module.strided_like`` sees a flat
copy of the run the way the gradient sees the arena, so values, moments and a checkpoint's arrays
move between a parameter's shape and the flat layout by one assignment. Each element is labelled
with what the step needs of its parameter: weight decay or not (the piece is updated run by run
of one decay), and how many tp ranks hold it (the norm divides its square by that: per run, or
per element where runs are many, as with GQA's replicated K/V columns in every row of QKV).

The numbers are AdamW's, element for element: the same formula on the same values (only the sums
over dp and the norm's terms may be associated differently). Checkpoints hold whole states in the
parameters' shapes, so a run saved with ZeRO resumes without it and at any layout, and the other
way round; they stream them (``checkpoint.StreamedTensor``): a save gathers one bucket's state at
a time to the rank that writes it (the group first agrees that no rank failed, so a failure on one
rank fails the save on all within a bucket, not at the communication timeout), a load hands each
rank the tensors to take its pieces from, so neither holds the whole states a rank was spared.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import numpy

from .. import backend
from ..checkpoint.collective import agreed
from ..checkpoint.streamed import StreamedTensor
from ..module import Parameter, address, same_view, strided_like
from ..nn.moe import is_expert_parameter
from .optim import (
    AdamW,
    StateTensor,
    local_squares,
    reduce_squares,
    sum_of_squares,
    weighted_sum_of_squares,
    zero_states,
)


class _Run(NamedTuple):
    start: int  # [start, stop) of the piece
    stop: int
    label: object  # decay (bool) for the update; replicas (int) for the norm


# Past this many runs of one replica count in a piece (GQA's K/V columns replicated over tp alternate
# with Q's in every row of a fused QKV gradient), the norm reads the replica count per element.
MAX_NORM_RUNS = 16


class _Piece:
    """This rank's piece of one sharded bucket: the masters' values, the moments and the labelled runs.

    ``values``: the bucket's parameters as one run of the arena's parameter chunks, where the model
    was built in ``GradArena(..., params=True)`` (else None). Then the updated values are gathered
    straight into the parameters, and at float32/64 the master piece is the parameters' own piece."""

    def __init__(self, bucket, params: dict[str, Parameter], comm):
        self.bucket, self.comm = bucket, comm
        self.params = [(name, params[name]) for name in bucket.names]
        self.start, count = bucket.start, bucket.counts[comm.rank]
        self.values = (
            bucket.values
            if bucket.values is not None
            and all(same_view(self.image(bucket.values, p), p.data) for _, p in self.params)
            else None
        )
        xp = backend.xp_of(bucket.flat)
        if self.values is not None and self.values.dtype == bucket.flat.dtype:
            self.master = self.values[self.start : self.start + count]
        else:
            self.master = xp.empty(count, dtype=bucket.flat.dtype)
            self.take(self.master, {name: p.data for name, p in self.params})
        self.exp_avg, self.exp_avg_sq = xp.zeros_like(self.master), xp.zeros_like(self.master)
        self.runs, self.norm_runs, self.replicas = self._label()

    def publish(self) -> object:
        """Post the all-gather that brings every rank's updated piece into the parameters (or, without
        ``values``, into the spent gradient bucket, for ``unpack``); returns its request."""
        target = self.bucket.flat if self.values is None else self.values
        piece = target[self.start : self.start + self.master.size]
        if not same_view(piece, self.master):
            piece[...] = self.master  # a half model's weights rounded from their float32 masters
        return self.comm.iall_gather_flat(target, self.bucket.counts)

    def unpack(self):
        """After ``publish``'s gather: the parameters from the bucket (nothing where they are ``values``)."""
        if self.values is None:
            for _, p in self.params:
                p.data[...] = self.image(self.bucket.flat, p)

    def _label(self):
        """The piece's runs of one weight decay (the update), and of one replica count (the norm), or,
        where those are many, the replica count of every element. Storage no parameter sees is in
        neither (not updated, not counted)."""
        labels = numpy.zeros((2, self.bucket.flat.size), dtype=numpy.int32)  # on the host, for a device bucket too
        for _, p in self.params:
            strided_like(labels[0], p.grad, self.bucket.flat)[...] = 1 + p.decay
            strided_like(labels[1], p.grad, self.bucket.flat)[...] = p.partition.replicas
        piece = labels[:, self.start : self.start + self.master.size]
        runs = [_Run(a, b, label == 2) for a, b, label in _runs(piece[0])]
        norm_runs = _runs(piece[1])
        if len(norm_runs) <= MAX_NORM_RUNS:
            return runs, norm_runs, None
        return runs, None, backend.xp.asarray(piece[1].astype(numpy.uint16))

    def squares(self):
        """This rank's share of the squared gradient norm: each element's square over its replicas
        (a device scalar on the GPU: no transfer here)."""
        shard = self.bucket.shard
        if self.replicas is not None:
            return weighted_sum_of_squares(shard, self.replicas)
        return sum(sum_of_squares(shard[a:b]) / replicas for a, b, replicas in self.norm_runs)

    def image(self, flat, p: Parameter):
        """``p``'s elements in ``flat``, a copy laid out like the bucket's storage."""
        return strided_like(flat, p.grad, self.bucket.flat)

    @property
    def separate_master(self) -> bool:
        """The masters are a copy of their own (a half model's float32 ones, or parameters not laid
        out in the arena), not the parameters' own piece."""
        return self.master.base is None

    def gather(self, piece, failed: bool = False):
        """Every rank's ``piece`` (collective over the group) in one array laid out like the bucket,
        on the group's first rank (the one a checkpoint writes from), None elsewhere: the other
        ranks send their piece and hold nothing bucket-sized. The inverse of ``take``.

        First the group agrees that every rank is ready (``collective.agreed``): where one ``failed``
        before (its checkpoint's write) or fails making its part (the writer's bucket, out of
        memory), nothing moves and every rank raises, the failing one its own error, the others
        ``PeerFailure``, rather than wait in a gather a rank never joins."""
        outgoing = agreed(
            self.comm, lambda: self._outgoing(piece), failed, "this rank's checkpoint gathers were called off"
        )
        gathered = self.comm.igather_flat(outgoing, self.bucket.counts).wait()
        return gathered if self.comm.rank == 0 else None

    def _outgoing(self, piece):
        """What this rank passes to the gather: on the first rank the bucket with its own piece in
        place (the others' arrive around it), elsewhere the piece."""
        if self.comm.rank != 0:
            return piece
        flat = backend.xp_of(piece).empty(self.bucket.flat.shape, piece.dtype)  # the dtype the others send
        flat[self.start : self.start + piece.size] = piece
        return flat

    def take(self, piece, arrays: dict[str, object]):
        """``piece`` = this rank's part of the parameter-shaped ``arrays``."""
        for name, p in self.params:
            self.place(piece, p, arrays[name])

    def place(self, piece, p: Parameter, values):
        """Into ``piece`` (this rank's part of an array laid out like the bucket), the elements of
        ``values`` (``p``'s shape) whose place in the bucket falls in it: nothing bucket-sized."""
        base, view = self.bucket.flat, p.grad
        offset = (address(view) - address(base)) // view.itemsize
        _place(piece, self.start, values, offset, tuple(s // view.itemsize for s in view.strides))


class _Streamed:
    """One of a piece's states (a moment, or separate masters) as checkpoint tensors in the
    parameters' shapes (``checkpoint.StreamedTensor``), one bucket at a time. Saving, the first
    fetch gathers the bucket to the group's first rank, the one that writes it (the checkpoint
    fetches in the same order on every rank of the group; the others only send), and the last lets
    it go. Loading, each stored tensor puts the elements that fall in this rank's piece straight
    into the state (nothing bucket-sized); ``to_params``: the parameters get the loaded values too
    (rounded, in a half model), as they would holding the masters themselves."""

    def __init__(self, piece: _Piece, state, to_params: bool = False):
        self.piece, self.state, self.to_params = piece, state, to_params
        self.flat, self.left = None, 0  # the bucket being fetched; how many of its tensors are to come

    def tensors(self, prefix: str) -> dict[str, StreamedTensor]:
        return {
            prefix + name: StreamedTensor(
                p.partition, self.state.dtype, partial(self._fetch, p), partial(self._store, p)
            )
            for name, p in self.piece.params
        }

    def _fetch(self, p: Parameter, failed: bool = False):
        try:
            if not self.left:
                self.flat, self.left = None, len(self.piece.params)
                self.flat = self.piece.gather(self.state, failed)
            return None if self.flat is None else self.piece.image(self.flat, p)
        finally:  # counted even where the gather raised: the next bucket starts where the group's does
            self._done()

    def _store(self, p: Parameter, local):
        local = backend.xp_of(self.state).asarray(local)
        self.piece.place(self.state, p, local)
        if self.to_params:
            p.data[...] = local

    def _done(self):
        self.left -= 1
        if not self.left:
            self.flat = None


def _place(piece, start: int, values, offset: int, strides: tuple):
    """``piece[k - start] = values[i]`` for every index ``i`` of ``values`` whose place ``k = offset +
    i . strides`` (in elements) lies in ``[start, start + piece.size)``. The places must nest as a
    gradient's view into its arena run does (a block of rows of a wider buffer, or a run): positive
    strides, each at least what one index of its axis spans. The indices wholly inside are one
    strided view of ``piece``; at most two of the first axis straddle an edge, placed one axis down."""
    stop = start + piece.size
    last = offset + sum((n - 1) * s for n, s in zip(values.shape, strides))  # the last element's place
    if values.size == 0 or last < start or offset >= stop:
        return
    if start <= offset and last < stop:
        _as_strided(piece, offset - start, values.shape, strides)[...] = values
        return
    n, step = values.shape[0], strides[0]
    if n == 1:  # any stride: the axis has one index
        return _place(piece, start, values[0], offset, strides[1:])
    span = last - offset - (n - 1) * step + 1  # the places one index of the first axis covers
    if step < span or step <= 0:
        raise ValueError(f"_place: strides {strides} of shape {values.shape} do not nest")
    inside = range(max(0, -(-(start - offset) // step)), min(n, (stop - span - offset) // step + 1))
    if inside:
        _as_strided(piece, offset + inside.start * step - start, (len(inside), *values.shape[1:]), strides)[...] = (
            values[inside.start : inside.stop]
        )
    for i in sorted({(start - offset) // step, (stop - 1 - offset) // step}):
        if 0 <= i < n and i not in inside:
            _place(piece, start, values[i], offset + i * step, strides[1:])


def _as_strided(buffer, offset: int, shape: tuple, strides: tuple):
    """A view of the 1-D ``buffer`` from element ``offset``, with ``strides`` in elements."""
    strides = tuple(s * buffer.itemsize for s in strides)
    return backend.xp_of(buffer).lib.stride_tricks.as_strided(buffer[offset:], shape, strides)


def _runs(labels) -> list[_Run]:
    """[start, stop, label) of each run of one non-zero label."""
    edges = [0, *(numpy.flatnonzero(numpy.diff(labels)) + 1).tolist(), labels.size]
    return [_Run(a, b, int(labels[a])) for a, b in zip(edges, edges[1:]) if b > a and labels[a]]


class ShardedAdamW(AdamW):
    """AdamW over ``named_params`` (the masters) whose gradients ``bucketer`` (an
    ``ExpertAwareBucketer`` made with ``shard=True``) reduce-scatters. Parameters in buckets it
    all-reduces whole (the tied embedding of pp > 1) keep whole states, as in ``AdamW``."""

    def __init__(self, named_params: dict[str, Parameter], bucketer, lr: float, **kwargs):
        self._bucketer = bucketer
        super().__init__(named_params, lr, **kwargs)

    def _make_states(self):
        self.pieces: list[tuple[_Piece, bool]] = []  # (piece, of MoE experts)
        self._groups = {}
        whole: dict[str, Parameter] = {}
        for part in self._bucketer.parts:
            for bucket in part.buckets:
                if bucket.shard is None:
                    whole.update({name: self.params[name] for name in bucket.names})
                else:
                    experts = is_expert_parameter(bucket.names[0])
                    self.pieces.append((_Piece(bucket, self.params, part.comm), experts))
                    self._groups[experts] = part.comm  # the dp group its squares are summed over
        self.whole = whole
        self.exp_avg, self.exp_avg_sq = zero_states(whole), zero_states(whole)

    def step(self, lr: float | None = None, grad_scale: float = 1.0):
        self._advance(lr)
        gathers = []
        for piece, _ in self.pieces:
            for run in piece.runs:
                window = slice(run.start, run.stop)
                self._update(
                    piece.master[window],
                    piece.bucket.shard[window],
                    piece.exp_avg[window],
                    piece.exp_avg_sq[window],
                    run.label,
                    grad_scale,
                )
            gathers.append(piece.publish())
        for name, p in self.whole.items():
            self._update(p.data, p.grad, self.exp_avg[name], self.exp_avg_sq[name], p.decay, grad_scale)
        for (piece, _), gather in zip(self.pieces, gathers):
            gather.wait()
            piece.unpack()

    def state_bytes(self) -> int:
        pieces = sum(a.nbytes for piece, _ in self.pieces for a in (piece.exp_avg, piece.exp_avg_sq))
        masters = sum(piece.master.nbytes for piece, _ in self.pieces if piece.separate_master)
        return super().state_bytes() + pieces + masters

    def grad_norm(self, grid, skip=frozenset(), scale: float = 1.0) -> float:
        """The global norm: the pieces' squares summed over their dp groups, the whole ones' as
        ``global_grad_norm`` counts them. ``skip`` may only name whole parameters."""
        sharded = skip & self._bucketer.sharded_names
        if sharded:
            raise ValueError(
                f"ShardedAdamW.grad_norm: {sorted(sharded)} are sharded; only whole parameters can be left out"
            )
        partial = {False: 0.0, True: 0.0}  # this rank's pieces: dense, MoE experts
        for piece, experts in self.pieces:
            partial[experts] = partial[experts] + piece.squares()
        summed = [
            self._groups[kind].all_reduce_scalar(float(partial[kind])) if kind in self._groups else 0.0
            for kind in (False, True)
        ]
        whole = local_squares(self.whole, skip)
        return reduce_squares(summed[0] + float(whole[0]), summed[1] + float(whole[1]), grid) * scale

    def state_tensors(self) -> dict[str, StateTensor | StreamedTensor]:
        """Whole states in the parameters' shapes: the whole parameters' own arrays, and the pieces'
        streamed (a save gathers them bucket by bucket over the dp groups: save on every rank; a
        load takes each rank's pieces from what it reads, no collective)."""
        states = super().state_tensors()
        for piece, _ in self.pieces:
            for kind in ("exp_avg", "exp_avg_sq"):
                states.update(_Streamed(piece, getattr(piece, kind)).tensors(f"optim.{kind}."))
        return states

    def masters(self, params: dict[str, Parameter]) -> dict[str, Parameter | StreamedTensor]:
        """The masters as checkpoints hold them: the parameters themselves where they are the masters
        (float32/64 models), streamed from the pieces where the masters are separate (``separate_master``),
        the streamed ones last, bucket by bucket."""
        streamed = {}
        for piece, _ in self.pieces:
            if piece.separate_master:
                streamed.update(_Streamed(piece, piece.master, to_params=True).tensors(""))
        return {**{name: p for name, p in params.items() if name not in streamed}, **streamed}
