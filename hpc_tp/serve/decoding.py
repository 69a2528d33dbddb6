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
its own blocks, gathered up to the longest row's length. It runs eagerly, its shapes changing with
the rows' lengths: no CUDA graph is captured for it yet.

The capture's rules, its private memory pool and where it can run (``capturable``: tp = 1 on a
GPU) are ``hpc_tp.cuda_graph``'s. ``HPC_TP_CUDA_GRAPHS=0`` turns graphs off (an A/B, or a driver
that refuses a capture).
"""

from __future__ import annotations

import numpy

from .. import backend, cuda_graph
from .kv_cache import KVCache, PagedKVCache, PagedView, SlotCache


def positions_after(lens, step: int, model):
    """Each row's position for decode step ``step`` (0: the first token after the prompt), clamped to
    the last learned position: a finished row runs on with positions nobody reads."""
    pos = lens + step
    if model.cfg.position == "learned":
        pos = numpy.minimum(pos, model.cfg.max_seq_len - 1)
    return pos


def step_view(cache: PagedKVCache, lens, slots):
    """A continuous batch's decode step over a paged cache, in which each row is a sequence of its own
    from slot 0 (no padding): row r holds ``lens[r]`` tokens and feeds one at position ``lens[r]``,
    writes its K/V at its slot ``lens[r]`` and attends to its slots 0..lens[r] only. ``slots`` [lanes,
    B, W] (W > every length): each row's pool slots in order, its block tables spelled out (past its
    own, any slot: masked). Returns the step's ``PagedView`` of ``cache`` and key mask [B, W] (on the
    device)."""
    xp = backend.xp
    visible = numpy.arange(slots.shape[-1]) <= lens[:, None]
    write = slots[:, numpy.arange(len(lens)), lens][:, :, None]
    return PagedView(cache, xp.asarray(write), xp.asarray(slots), lens + 1), xp.asarray(visible)


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
    """The stepper for the decode steps ``cache`` has slots left for: a captured ``FixedStep`` on a
    GPU at tp = 1 when there are at least ``GRAPH_MIN_STEPS`` (``graphs`` None: unless
    ``HPC_TP_CUDA_GRAPHS=0``; False: never), else ``GrowingStep``."""
    if graphs is None:
        graphs = cuda_graph.enabled()
    if graphs and cuda_graph.capturable(model.comm) and cache.max_len - cache.length >= GRAPH_MIN_STEPS:
        return FixedStep(model, cache, key_mask, lens, capture=True)
    return GrowingStep(model, cache, key_mask, lens)
