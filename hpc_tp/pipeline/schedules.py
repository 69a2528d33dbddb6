"""Pipeline schedules (GPipe, 1F1B) and the engine that runs one stage's part of a step.

A schedule is, for each stage, the order of its forward (F) and backward (B) passes over the
m micro-batches of a step:

    GPipe  F0 F1 ... F(m-1) B0 B1 ... B(m-1)          keeps all m micro-batches' activations
    1F1B   (pp-1-s warm-up forwards) then F B F B ... then the remaining backwards
           stage s keeps at most pp - s micro-batches' activations, whatever m is

Both leave the same bubble, (p-1)/(m+p-1) of a stage's time idle when stages cost the same;
1F1B only bounds the memory. Every stage runs its list in order and blocks only on messages
from its neighbours, whose lists produce them in the same micro-batch order, so no schedule
can wait on itself (tests/test_pipeline.py replays every small (pp, m) to check).

With ``recompute`` a block keeps only its input: backward reruns its forward first, with the
dropout generator set back to the micro-batch's position, so the masks are the same ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy

from .. import backend
from ..errors import ConfigError
from .p2p import ACTIVATION, GRADIENT, StageLink

FORWARD, BACKWARD = "F", "B"


def gpipe(micro_batches: int, stages: int, stage: int) -> list[tuple[str, int]]:
    return [(FORWARD, i) for i in range(micro_batches)] + [(BACKWARD, i) for i in range(micro_batches)]


def one_f_one_b(micro_batches: int, stages: int, stage: int) -> list[tuple[str, int]]:
    warmup = min(stages - 1 - stage, micro_batches)
    ops = [(FORWARD, i) for i in range(warmup)]
    for i in range(warmup, micro_batches):
        ops += [(FORWARD, i), (BACKWARD, i - warmup)]
    return ops + [(BACKWARD, i) for i in range(micro_batches - warmup, micro_batches)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


@dataclass
class PipelineStats:
    """What one stage did in a step: filled by ``pipeline_forward_backward(stats=...)``."""

    peak_micro_batches: int = 0   # most micro-batches whose activations were alive at once
    peak_bytes: int = 0           # bytes those activations held at that peak
    busy_seconds: float = 0.0     # forward and backward compute (tp collectives included)
    wait_seconds: float = 0.0     # blocked on a neighbouring stage's message
    seconds: float = 0.0          # the whole step on this stage


def pipeline_forward_backward(model, micro_batches, grid, scale: float, schedule: str = "1f1b",
                              recompute: bool = False, on_grads_final=None, step: int = 0,
                              first_sample: int = 0, stats: PipelineStats | None = None):
    """Forward and backward of this dp rank's ``micro_batches`` (a list of (ids, targets)) through
    the pipeline; gradients of ``scale * loss_sum`` accumulate into ``p.grad``.

    Returns (loss_sum, token_count) of this dp rank, the same on every stage. ``first_sample`` is
    the global batch index of this dp rank's first sequence: dropout masks are drawn per sample
    at (step, sample). ``on_grads_final(names)``
    is called once for every parameter, per block and for the embedding and head, as soon as
    its gradient is final for the step. With pp = 1 this is a plain loop over micro-batches.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if not micro_batches:
        raise ValueError("pipeline_forward_backward needs at least one micro-batch")
    shapes = {(numpy.shape(ids), numpy.shape(targets)) for ids, targets in micro_batches}
    if len(shapes) > 1:  # message buffers are sized from the first micro-batch, on every stage
        raise ValueError(f"micro-batches of a pipeline step must share one shape, got {sorted(shapes)}")
    t0 = time.perf_counter()
    runner = _StageRunner(model, micro_batches, grid, scale, recompute, on_grads_final, step, first_sample)
    for op, i in SCHEDULES[schedule](len(micro_batches), grid.pp_size, grid.coords.pp):
        (runner.forward if op == FORWARD else runner.backward)(i)
    busy = runner.op_seconds - runner.link.wait_seconds
    runner.link.finish()
    # One small broadcast gives every stage the loss the last one computed.
    totals = numpy.array([runner.loss_sum, runner.token_count], dtype=numpy.float64)
    grid.pp.broadcast(totals, root=grid.pp_size - 1)
    if stats is not None:
        stats.peak_micro_batches, stats.peak_bytes = runner.peak_micro_batches, runner.peak_bytes
        stats.wait_seconds = runner.link.wait_seconds
        stats.seconds = time.perf_counter() - t0
        stats.busy_seconds = busy
    return float(totals[0]), int(totals[1])


def stage_parameter_groups(model) -> dict[str, list[str]]:
    """Parameter names by the piece of the stage whose backward finalises them: "head", "embedding"
    and "layers.<global index>". A tied copy of the embedding on a last stage belongs to the head."""
    groups: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        if name.startswith("layers."):
            key = "layers." + name.split(".")[1]
        elif name.startswith(("final_norm.", "head.")) or (name.startswith("embed.") and not model.has_embedding):
            key = "head"
        else:
            key = "embedding"
        groups.setdefault(key, []).append(name)
    return groups


class _StageRunner:
    def __init__(self, model, micro_batches, grid, scale, recompute, on_grads_final, step, first_sample):
        self.model, self.micro_batches, self.scale, self.recompute = model, micro_batches, scale, recompute
        self.on_grads_final, self.step, self.first_sample = on_grads_final, step, first_sample
        self.is_first, self.is_last = grid.is_first_stage, grid.is_last_stage
        self.link = StageLink(grid.pp, model.hidden_shape(*numpy.shape(micro_batches[0][0])),
                              backend.xp.dtype(model.dtype))
        model.set_loss_scale(scale)  # the MoE layers' load-balancing term joins the loss at this scale
        self.groups = stage_parameter_groups(model)
        self.ctxs = {}            # micro-batch -> (embedding ctx, per-block ctx or input, head ctx)
        self.ctx_bytes = {}
        self.backwards_left = len(micro_batches)
        self.loss_sum, self.token_count = 0.0, 0
        self.peak_micro_batches = self.peak_bytes = 0
        self.op_seconds = 0.0
        if self.link.has_previous:
            self.link.post_activation_receive(0)

    def _at(self, i):
        self.model.rng.set_position(self.step, self.first_sample + i * len(self.micro_batches[0][0]))

    def forward(self, i):
        t0 = time.perf_counter()
        self._at(i)
        ids, targets = self.micro_batches[i]
        embed_ctx = head_ctx = None
        if self.is_first:
            x, embed_ctx = self.model.embed_forward(backend.xp.asarray(ids))
        else:
            x = self.link.activation(i)
            if i + 1 < len(self.micro_batches):
                self.link.post_activation_receive(i + 1)
        saved = []
        for block in self.model.layers:
            if self.recompute:
                saved.append(x)
                x, _ = block.forward(x)
            else:
                x, block_ctx = block.forward(x)
                saved.append(block_ctx)
        if self.is_last:
            loss_sum, count, head_ctx = self.model.head_forward(x, backend.xp.asarray(targets))
            self.loss_sum += loss_sum
            self.token_count += count
        else:
            self.link.send_activation(x, i)
            self.link.post_gradient_receive(i)
        self.ctxs[i] = (embed_ctx, saved, head_ctx)
        self._measure(i)
        self.op_seconds += time.perf_counter() - t0

    def backward(self, i):
        t0 = time.perf_counter()
        self._at(i)
        embed_ctx, saved, head_ctx = self.ctxs.pop(i)
        self.ctx_bytes.pop(i, None)
        self.backwards_left -= 1
        final = self.backwards_left == 0
        if self.is_last:
            dx = self.model.head_backward(head_ctx, self.scale)
            self._final(final, "head")
        else:
            dx = self.link.gradient(i)
            self.link.wait_send(ACTIVATION, i)
        for index, block, block_saved in zip(reversed(self.model.layer_ids), reversed(self.model.layers.items),
                                             reversed(saved)):
            if self.recompute:
                with self.model.uncounted():
                    block_ctx = block.forward(block_saved)[1]
            else:
                block_ctx = block_saved
            dx = block.backward(dx, block_ctx)
            self._final(final, f"layers.{index}")
        if self.is_first:
            self.model.embed_backward(dx, embed_ctx)
            self._final(final, "embedding")
        else:
            self.link.wait_send(GRADIENT, i - 1)
            self.link.send_gradient(dx, i)
        self.op_seconds += time.perf_counter() - t0

    def _final(self, final, group):
        if final and self.on_grads_final is not None and self.groups.get(group):
            self.on_grads_final(self.groups[group])

    def _measure(self, i):
        self.ctx_bytes[i] = _held_bytes(self.ctxs[i])
        if len(self.ctxs) > self.peak_micro_batches:
            self.peak_micro_batches = len(self.ctxs)
        self.peak_bytes = max(self.peak_bytes, sum(self.ctx_bytes.values()))


def _held_bytes(obj, seen=None) -> int:
    """Bytes of the arrays a ctx keeps alive; views count their base once."""
    seen = set() if seen is None else seen
    if isinstance(obj, (tuple, list)):
        return sum(_held_bytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(_held_bytes(o, seen) for o in obj.values())
    if hasattr(obj, "nbytes") and hasattr(obj, "shape"):
        base = obj if getattr(obj, "base", None) is None else obj.base
        if id(base) in seen:
            return 0
        seen.add(id(base))
        return int(base.nbytes)
    return 0
