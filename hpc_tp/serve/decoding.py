"""Decode steps after a prefill, one new token per row: ``step(ids) -> logits``.

``Engine.generate`` and ``hpc-tp bench decode`` prefill a batch into a ``KVCache`` and then feed each
step's chosen ids back through one of two steppers; both give the same logits.

- ``GrowingStep``: each step runs ``GPTModel.infer`` over the filled slots only, with a key mask one
  slot longer than the last: the least arithmetic, but shapes and addresses change every step.
- ``FixedStep``: every step has the same shapes and reads and writes the same memory. It attends
  over all the cache's slots, a key mask on the device hiding those not filled yet, and the slot to
  write, the positions and that mask are device arrays that the step itself moves on. On a GPU that
  lets its first step be captured as a CUDA graph and every later one replay it: one launch per
  token instead of hundreds. A W1 decode step on an H200 is bound by the host's Python launching
  them (3.5 ms a token at batch 1 for ~0.05 ms of weight traffic), as vLLM found for its decode steps.

``step_view`` is the decode step of continuous batching (``serve.continuous``) over a paged cache:
every row its own request at its own length, writing its token at its own slot and attending over
its own blocks, gathered up to the longest row's length; its shapes change with the rows' count and
lengths. ``PagedSteps`` runs the same step at the fixed shapes of a bucket: the rows padded up to a
power of two (rows of length 0 that write to the scratch slot), each row's slots up to a power of two
of blocks, its inputs copied into arrays the bucket owns; so each bucket reads and writes the same
memory at every step, and where graphs are captured it is captured at its first step and replayed after,
one graph a bucket (vLLM keeps one a batch size). Where no graph is captured the batcher keeps
``step_view``'s step: without a replay the padding buys nothing, and on the CPU the bucketed step
measured no faster (``benchmarks/continuous_step.py``).

The capture's rules, its private memory pool and where it can run (``capturable``: on a GPU, tp = 1
or a tp group on NCCL) are ``hpc_tp.cuda_graph``'s. ``HPC_TP_CUDA_GRAPHS=0`` turns graphs off (an A/B, or a driver
that refuses a capture).
"""

from __future__ import annotations

import math

import numpy

from .. import backend, cuda_graph
from .blocks import SCRATCH, BlockManager, Sequence
from .kv_cache import KVCache, PagedKVCache, PagedView, SlotCache


def positions_after(lens, step: int, model):
    """Each row's position for decode step ``step`` (0: the first token after the prompt), clamped to
    the last learned position: a finished row runs on with positions nobody reads."""
    pos = lens + step
    if model.cfg.position == "learned":
        pos = numpy.minimum(pos, model.cfg.max_seq_len - 1)
    return pos


def decode_slots(blocks: BlockManager, seqs: list[Sequence]):
    """What ``step_view`` takes for a step of ``seqs``, each feeding one token at its length (their
    blocks for it reserved): (lens [B], slots [lanes, B, longest + 1]), each row's pool slots 0..its
    length in order and, past them, the scratch slot (masked)."""
    lens = numpy.array([seq.length for seq in seqs], dtype=numpy.int64)
    slots = numpy.full((blocks.layout.lanes, len(seqs), int(lens.max()) + 1), SCRATCH, dtype=numpy.int64)
    for i, seq in enumerate(seqs):
        slots[:, i, : lens[i] + 1] = blocks.slots(seq, lens[i] + 1)
    return lens, slots


def step_view(cache: PagedKVCache, lens, slots):
    """A continuous batch's decode step over a paged cache, in which each row is a sequence of its own
    from slot 0 (no padding): row r holds ``lens[r]`` tokens and feeds one at position ``lens[r]``,
    writes its K/V at its slot ``lens[r]`` and attends to its slots 0..lens[r] only. ``slots`` [lanes,
    B, W] (W > every length): each row's pool slots in order, its block tables spelled out (past its
    own, any slot: masked). Returns the step's ``PagedView`` of ``cache`` and key mask [B, W] (on the
    device)."""
    xp = backend.xp
    write, visible = _write_slots_and_mask(lens, slots)
    return PagedView(cache, xp.asarray(write), xp.asarray(slots), lens + 1), xp.asarray(visible)


def step_arguments(model, cache: PagedKVCache, ids, lens, slots):
    """``step_view``'s step feeding ``ids`` [B] (host) as ``model.infer``'s arguments: (ids [B, 1],
    positions [B, 1], key mask, ``PagedView``)."""
    xp = backend.xp
    view, visible = step_view(cache, lens, slots)
    positions = xp.asarray(positions_after(lens, 0, model)[:, None])
    return xp.asarray(ids, dtype=numpy.int64).reshape(-1, 1), positions, visible, view


def _write_slots_and_mask(lens, slots):
    """On the host: each row's slot to write [lanes, B, 1] (its slot ``lens[r]``) and its key mask [B, W]."""
    visible = numpy.arange(slots.shape[-1]) <= lens[:, None]
    return slots[:, numpy.arange(len(lens)), lens][:, :, None], visible


class GrowingStep:
    """``key_mask`` [B, max_len] (host, bool): the prompt's real slots set; ``lens`` [B] prompt lengths."""

    def __init__(self, model, cache: KVCache, key_mask, lens):
        self.model, self.cache, self.key_mask, self.lens = model, cache, key_mask, lens
        self.width = cache.length
        self.uses_graph = False

    def close(self):
        pass

    def step(self, ids):
        xp, slot = backend.xp, self.cache.length
        self.key_mask[:, slot] = True
        pos = positions_after(self.lens, slot - self.width, self.model)
        return self.model.infer(
            xp.asarray(ids).reshape(-1, 1),
            xp.asarray(pos[:, None]),
            xp.asarray(self.key_mask[:, : slot + 1]),
            self.cache,
        )


class FixedStep:
    """As ``GrowingStep``, every step with the same shapes and addresses; ``capture``: replay the
    first step as a CUDA graph (a device run only)."""

    def __init__(self, model, cache: KVCache, key_mask, lens, capture: bool = False):
        xp = backend.xp
        self.model, self.cache = model, cache
        self.ids = xp.zeros((len(lens), 1), dtype=numpy.int64)
        self.positions = xp.asarray(positions_after(lens, 0, model)[:, None].astype(numpy.int64))
        self.slot = xp.full((1,), cache.length, dtype=numpy.int64)
        self._prompt = xp.asarray(key_mask)  # only the prompt's slots: decoded slots come from ``slot``
        self._slots = xp.arange(cache.max_len)
        self._decoded = self._slots >= cache.length
        self._last = model.cfg.max_seq_len - 1 if model.cfg.position == "learned" else None
        self._view = SlotCache(cache, self.slot)
        self._replay = cuda_graph.Replayed(self._run, "decoding") if capture and xp is not numpy else None

    @property
    def uses_graph(self) -> bool:
        return self._replay is not None and not self._replay.failed

    def step(self, ids):
        self.ids[:, 0] = backend.xp.asarray(ids).reshape(-1)
        logits = self._run() if self._replay is None else self._replay()
        self.cache.length += 1  # the host's count; the device's is ``slot``
        return logits

    def _run(self):
        """One step, all on the device: the mask of every filled slot, the model, then slot and
        positions one on."""
        xp = backend.xp_of(self.slot)
        visible = self._prompt | (self._decoded & (self._slots <= self.slot))
        logits = self.model.infer(self.ids, self.positions, visible, self._view)
        self.slot += 1
        self.positions += 1
        if self._last is not None:
            xp.minimum(self.positions, self._last, out=self.positions)
        return logits

    def close(self):
        if self._replay is not None:
            self._replay.close()


# The first step runs eagerly and is then traced again to be captured: on an H200 (W1) that first
# step took 18-21 ms against 8-11 ms eager, while each replay saved 3-7 ms, so a batch
# needs about three replays after it for the capture to pay.
GRAPH_MIN_STEPS = 4


def decode_stepper(model, cache: KVCache, key_mask, lens, graphs: bool | None = None):
    """The stepper for the decode steps ``cache`` has slots left for: a captured ``FixedStep`` where
    the tp group can be captured (``cuda_graph.capturable``) and at least ``GRAPH_MIN_STEPS`` are
    left (``graphs`` None: unless ``HPC_TP_CUDA_GRAPHS=0``; False: never), else ``GrowingStep``."""
    if graphs is None:
        graphs = cuda_graph.enabled()
    if graphs and cuda_graph.capturable(model.comm) and cache.max_len - cache.length >= GRAPH_MIN_STEPS:
        return FixedStep(model, cache, key_mask, lens, capture=True)
    return GrowingStep(model, cache, key_mask, lens)


class PagedStep:
    """``step_view``'s step at fixed shapes and addresses: ``width`` rows, each over ``keys`` slots, its
    inputs copied before every call into arrays it owns (``_Staged``: one copy to the device). The
    rows past a batch's own have length 0 at the scratch slot: they write their K/V where nobody reads
    and see that one slot, so their logits (never read) stay finite. ``capture``: the first call runs
    eagerly and is captured as a CUDA graph that every later call replays (a device, where the tp group can be captured)."""

    def __init__(self, model, cache: PagedKVCache, width: int, keys: int, capture: bool = False):
        lanes = cache.layout.lanes
        self.model, self.width = model, width
        shapes = {"ids": (width, 1), "positions": (width, 1), "query_slots": (width,)}
        self.inputs = _Staged(shapes | {"write": (lanes, width, 1), "read": (lanes, width, keys)}, (width, keys))
        on = self.inputs.on_device
        self.counts = numpy.ones(width, dtype=numpy.int64)  # on the host: what the CPU's paged kernel reads
        self.view = PagedView(cache, on["write"], on["read"], self.counts)
        self.view.query_slots = on["query_slots"]  # the view's own copy would not follow the steps
        what = f"the continuous decode step of {width} rows over {keys} slots"
        self._replay = cuda_graph.Replayed(self._run, what) if capture else None

    @property
    def uses_graph(self) -> bool:
        return self._replay is not None and not self._replay.failed

    def step(self, ids, lens, slots):
        """As ``step_arguments``' step: ``ids`` [B] (host) fed by rows of ``lens`` [B] over ``slots``
        [lanes, B, W] (B <= width, W <= keys). Logits [B, V] (None where ``model.infer`` returns none:
        a pipeline stage's rank that does not sample); a replay overwrites them."""
        rows, staged = len(lens), self.inputs.on_host
        lens = numpy.pad(lens, (0, self.width - rows))
        staged["read"][...] = SCRATCH
        staged["read"][:, :rows, : slots.shape[-1]] = slots
        staged["write"][...], staged["mask"][...] = _write_slots_and_mask(lens, staged["read"])
        staged["ids"][:, 0] = numpy.pad(ids, (0, self.width - rows))
        staged["positions"][:, 0] = positions_after(lens, 0, self.model)
        staged["query_slots"][...] = lens
        self.counts[:] = lens + 1
        self.inputs.copy()
        logits = self._run() if self._replay is None else self._replay()
        return None if logits is None else logits[:rows]

    def _run(self):
        on = self.inputs.on_device
        return self.model.infer(on["ids"], on["positions"], on["mask"], self.view)

    def close(self):
        if self._replay is not None:
            self._replay.close()


class _Staged:
    """Int64 arrays of ``shapes`` (by name) and a bool ``mask`` of ``mask_shape``, views of one buffer
    on the host (``on_host``) and of one on the device (``on_device``): written on the host, one copy
    (``copy``) moves them all, where an array at a time cost a transfer and a launch each. On the CPU
    the two buffers are one."""

    def __init__(self, shapes: dict, mask_shape: tuple):
        sizes = [math.prod(shape) for shape in shapes.values()]
        numbers = 8 * sum(sizes)
        self.host = numpy.zeros(numbers + math.prod(mask_shape), dtype=numpy.uint8)
        self.device = backend.xp.asarray(self.host)  # numpy's is the host buffer itself
        self.on_host, self.on_device = (_views(b, shapes, sizes, numbers, mask_shape) for b in (self.host, self.device))

    def copy(self):
        if self.device is not self.host:
            self.device.set(self.host)


def _views(buffer, shapes: dict, sizes: list, numbers: int, mask_shape: tuple) -> dict:
    ints, views, start = buffer[:numbers].view(numpy.int64), {}, 0
    for (name, shape), size in zip(shapes.items(), sizes):
        views[name] = ints[start : start + size].reshape(shape)
        start += size
    views["mask"] = buffer[numbers:].view(bool).reshape(mask_shape)
    return views


class PagedSteps:
    """A ``PagedStep`` for each bucket that a continuous batch's decode steps fall in, made at its
    first use: the rows padded up to a power of two (at most ``rows``, the batch's), each row's slots
    up to a power of two of blocks (at most those of ``max_len`` slots). A server so keeps at most
    (ceil(log2 rows) + 1) x (ceil(log2 blocks) + 1) steps, each with its graph where ``capture``."""

    def __init__(self, model, cache: PagedKVCache, rows: int, max_len: int, capture: bool):
        self.model, self.cache, self.rows, self.capture = model, cache, rows, capture
        self.most_blocks = cache.layout.blocks_for(max_len)
        self.buckets: dict[tuple[int, int], PagedStep] = {}

    def bucket(self, rows: int, slots: int) -> tuple[int, int]:
        """(width, keys) of a step of ``rows`` rows over ``slots`` slots."""
        blocks = self.cache.layout.blocks_for(slots)
        blocks = min(_power_of_two(blocks), max(self.most_blocks, blocks))
        return min(_power_of_two(rows), self.rows), blocks * self.cache.block_size

    def step(self, ids, lens, slots):
        """``PagedStep.step`` in the bucket of ``len(lens)`` rows over ``slots.shape[-1]`` slots."""
        key = self.bucket(len(lens), slots.shape[-1])
        if key not in self.buckets:
            self.buckets[key] = PagedStep(self.model, self.cache, *key, capture=self.capture)
        return self.buckets[key].step(ids, lens, slots)

    @property
    def uses_graph(self) -> bool:
        return any(step.uses_graph for step in self.buckets.values())

    def close(self):
        """Every bucket's graph and its memory given back."""
        for step in self.buckets.values():
            step.close()
        self.buckets.clear()


def _power_of_two(n: int) -> int:
    """The least power of two >= ``n`` (>= 1)."""
    return 1 << (n - 1).bit_length()


def paged_steps(model, cache: PagedKVCache, rows: int, max_len: int, fixed: bool | None = None) -> PagedSteps | None:
    """The ``PagedSteps`` that continuous batching's decode steps take where they run alone, or None
    (``step_view``'s eager step). ``fixed`` None: where graphs are captured (``cuda_graph.capturable``), unless
    ``HPC_TP_CUDA_GRAPHS=0``; True: wherever the batcher runs (eagerly where graphs are not
    captured); False: never."""
    capture = cuda_graph.enabled() and cuda_graph.capturable(model.comm)
    if not (capture if fixed is None else fixed):
        return None
    return PagedSteps(model, cache, rows, max_len, capture)
