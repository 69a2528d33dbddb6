"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B) and the engine that runs one rank's part of a step.

A schedule is, for each rank, the order of its forward (F) and backward (B) passes over the
m micro-batches of a step, each through one of its chunks (see partition.py):

    GPipe  F0 F1 ... F(m-1) B0 B1 ... B(m-1)          keeps all m micro-batches' activations
    1F1B   (pp-1-s warm-up forwards) then F B F B ... then the remaining backwards
           stage s keeps at most pp - s micro-batches' activations, whatever m is

Both leave the same bubble, (p-1)/(m+p-1) of a stage's time idle when stages cost the same;
1F1B only bounds the memory. With V chunks per rank (``--virtual-stages``) 1F1B becomes
Megatron-LM's interleaved schedule (Narayanan et al. 2021, section 2.2.2): micro-batches go in
groups of pp, each group through chunk 0, then chunk 1, ..., and backwards in the reverse chunk
order, after 2 (pp-1-s) + (V-1) pp warm-up forwards. A pass now costs 1/V of a stage, so the
bubble shrinks to (p-1)/(V m) of the ideal time, for V times the messages. Like Megatron it
needs m to be a multiple of pp (with other m this ordering can deadlock).

Every rank runs its list in order and blocks only on messages from its neighbours, whose lists
produce them in an order that never needs a later op of the waiting rank, so no schedule can
wait on itself (tests/test_pipeline.py replays every small (pp, V, m) to check).

With ``recompute`` "full" a block keeps only its input: backward reruns its forward first, with
the dropout generator set back to the micro-batch's position, so the masks are the same ones.
"selective" keeps everything but attention's softmax outputs and dropout masks, which attention's
backward recomputes, the generator set back the same way (``hpc_tp.recompute``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy

from .. import backend
from ..errors import ConfigError
from ..recompute import recompute_mode
from .p2p import ACTIVATION, GRADIENT, StageLink
from .partition import model_chunks

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


def interleaved_one_f_one_b(micro_batches: int, stages: int, stage: int, chunks: int) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved 1F1B: (F/B, chunk, micro-batch) for ``stage`` holding ``chunks`` chunks."""
    if micro_batches % stages:
        raise ConfigError(
            f"{micro_batches} micro-batches per step: the interleaved schedule (--virtual-stages "
            f"{chunks}) needs a multiple of --pp {stages}"
        )
    passes = micro_batches * chunks

    def nth(k, op):  # the k-th forward (backward) pass of this rank
        group, offset = divmod(k, stages * chunks)
        chunk, i = divmod(offset, stages)
        return op, chunk if op == FORWARD else chunks - 1 - chunk, group * stages + i

    warmup = min(2 * (stages - 1 - stage) + (chunks - 1) * stages, passes)
    ops = [nth(k, FORWARD) for k in range(warmup)]
    for k in range(passes - warmup):
        ops += [nth(warmup + k, FORWARD), nth(k, BACKWARD)]
    return ops + [nth(k, BACKWARD) for k in range(passes - warmup, passes)]


def stage_ops(
    schedule: str, micro_batches: int, stages: int, stage: int, chunks: int = 1
) -> list[tuple[str, int, int]]:
    """What ``stage`` runs in a step, in order: (F/B, chunk, micro-batch)."""
    if chunks == 1:
        return [(op, 0, i) for op, i in SCHEDULES[schedule](micro_batches, stages, stage)]
    if schedule != "1f1b":
        raise ConfigError(
            f"--schedule {schedule} runs one chunk per rank: --virtual-stages {chunks} needs "
            "--schedule 1f1b (the interleaved 1F1B schedule)"
        )
    return interleaved_one_f_one_b(micro_batches, stages, stage, chunks)


@dataclass
class PipelineStats:
    """What one stage did in a step: filled by ``pipeline_forward_backward(stats=...)``."""

    peak_micro_batches: int = 0  # most micro-batches whose activations were alive at once (with V
    # chunks: most passes of a micro-batch through a chunk, each 1/V of it)
    peak_bytes: int = 0  # bytes those activations held at that peak
    busy_seconds: float = 0.0  # forward and backward compute (tp collectives included)
    wait_seconds: float = 0.0  # blocked on a neighbouring stage's message
    seconds: float = 0.0  # the whole step on this stage


def pipeline_forward_backward(
    model,
    micro_batches,
    grid,
    scale: float,
    schedule: str = "1f1b",
    recompute: str | bool = "none",
    on_grads_final=None,
    step: int = 0,
    first_sample: int = 0,
    stats: PipelineStats | None = None,
    on_device: bool = False,
):
    """Forward and backward of this dp rank's ``micro_batches`` (a list of (ids, targets)) through
    the pipeline; gradients of ``scale * loss_sum`` accumulate into ``p.grad``. ``recompute``: a
    ``hpc_tp.recompute`` mode (or True for full).

    Returns (loss_sum, token_count) of this dp rank, the same on every stage. ``first_sample`` is
    the global batch index of this dp rank's first sequence: dropout masks are drawn per sample
    at (step, sample). ``on_grads_final(names)``
    is called once for every parameter, per block and for the embedding and head, as soon as
    its gradient is final for the step (with chunks: each chunk's after its last backward). The
    rank's chunks come from the model's layers (``model_chunks``). With pp = 1 this is a plain loop
    over micro-batches. ``on_device`` (pp = 1 only: the loss crosses stages through the host): the
    loss sum and count stay 0-d arrays on the device, for a step captured as a CUDA graph.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if not micro_batches:
        raise ValueError("pipeline_forward_backward needs at least one micro-batch")
    shapes = {(numpy.shape(ids), numpy.shape(targets)) for ids, targets in micro_batches}
    if len(shapes) > 1:  # message buffers are sized from the first micro-batch, on every stage
        raise ValueError(f"micro-batches of a pipeline step must share one shape, got {sorted(shapes)}")
    t0 = time.perf_counter()
    chunks = model_chunks(model)
    ops = stage_ops(schedule, len(micro_batches), grid.pp_size, grid.coords.pp, len(chunks))
    if on_device and grid.pp_size > 1:
        raise ValueError("pipeline_forward_backward(on_device=True) runs at pp = 1 only")
    runner = _StageRunner(
        model, chunks, micro_batches, grid, scale, recompute, on_grads_final, step, first_sample, on_device
    )
    for op, chunk, i in ops:
        (runner.forward if op == FORWARD else runner.backward)(chunk, i)
    busy = runner.op_seconds - runner.link.wait_seconds
    runner.link.finish()
    if on_device:
        totals = (runner.loss_sum, runner.token_count)
    else:  # one small broadcast gives every stage the loss the last one computed
        totals = numpy.array([runner.loss_sum, runner.token_count], dtype=numpy.float64)
        grid.pp.broadcast(totals, root=grid.pp_size - 1)
    if stats is not None:
        stats.peak_micro_batches, stats.peak_bytes = runner.peak_micro_batches, runner.peak_bytes
        stats.wait_seconds = runner.link.wait_seconds
        stats.seconds = time.perf_counter() - t0
        stats.busy_seconds = busy
    return totals if on_device else (float(totals[0]), int(totals[1]))


def stage_parameter_groups(model) -> dict[str, list[str]]:
    """Parameter names by the piece of the stage whose backward finalises them: "head", "embedding"
    and "layers.<global index>". A tied copy of the embedding on a last stage belongs to the head.
    Frozen parameters (LoRA's base weights) have no gradient and belong to none."""
    groups: dict[str, list[str]] = {}
    for name in model.trainable_state():
        if name.startswith("layers."):
            key = "layers." + name.split(".")[1]
        elif name.startswith(("final_norm.", "head.")) or (name.startswith("embed.") and not model.has_embedding):
            key = "head"
        else:
            key = "embedding"
        groups.setdefault(key, []).append(name)
    return groups


class _StageRunner:
    def __init__(
        self, model, chunks, micro_batches, grid, scale, recompute, on_grads_final, step, first_sample, on_device
    ):
        mode = recompute_mode(recompute)
        self.on_device = on_device
        self.model, self.micro_batches, self.scale, self.recompute = model, micro_batches, scale, mode == "full"
        model.set_selective_recompute(mode == "selective")
        self.on_grads_final, self.step, self.first_sample = on_grads_final, step, first_sample
        # Each chunk's blocks with their global layer indices, in forward order.
        self.chunks = [[(model.layer_ids[p], model.layers.items[p]) for p in positions] for positions in chunks]
        self.link = StageLink(
            grid.pp, model.hidden_shape(*numpy.shape(micro_batches[0][0])), backend.xp.dtype(model.dtype), len(chunks)
        )
        model.set_loss_scale(scale)  # the MoE layers' load-balancing term joins the loss at this scale
        self.groups = stage_parameter_groups(model)
        self.ctxs = {}  # (chunk, micro-batch) -> (embedding ctx, per-block ctx or input, head ctx)
        self.ctx_bytes = {}
        self.backwards_left = [len(micro_batches)] * len(chunks)  # a chunk's gradients are final at 0
        self.loss_sum, self.token_count = 0.0, 0
        self.peak_micro_batches = self.peak_bytes = 0
        self.op_seconds = 0.0
        for chunk in range(len(chunks)):
            if self.link.has_previous(chunk):
                self.link.post_activation_receive(chunk, 0)

    def _at(self, i):
        self.model.rng.set_position(self.step, self.first_sample + i * len(self.micro_batches[0][0]))

    def forward(self, chunk, i):
        t0 = time.perf_counter()
        self._at(i)
        ids, targets = self.micro_batches[i]
        embed_ctx = head_ctx = None
        if not self.link.has_previous(chunk):
            x, embed_ctx = self.model.embed_forward(backend.xp.asarray(ids))
        else:
            x = self.link.activation(chunk, i)
            if i + 1 < len(self.micro_batches):
                self.link.post_activation_receive(chunk, i + 1)
        saved = []
        for _, block in self.chunks[chunk]:
            if self.recompute:
                saved.append(x)
                x, _ = block.forward(x)
            else:
                x, block_ctx = block.forward(x)
                saved.append(block_ctx)
        if not self.link.has_next(chunk):
            loss_sum, count, head_ctx = self.model.head_forward(x, backend.xp.asarray(targets), self.on_device)
            self.loss_sum += loss_sum
            self.token_count += count
        else:
            self.link.send_activation(x, chunk, i)
            self.link.post_gradient_receive(chunk, i)
        self.ctxs[chunk, i] = (embed_ctx, saved, head_ctx)
        self._measure((chunk, i))
        self.op_seconds += time.perf_counter() - t0

    def backward(self, chunk, i):
        t0 = time.perf_counter()
        self._at(i)
        embed_ctx, saved, head_ctx = self.ctxs.pop((chunk, i))
        self.ctx_bytes.pop((chunk, i), None)
        self.backwards_left[chunk] -= 1
        final = self.backwards_left[chunk] == 0
        if not self.link.has_next(chunk):
            dx = self.model.head_backward(head_ctx, self.scale)
            self._final(final, "head")
        else:
            dx = self.link.gradient(chunk, i)
            self.link.wait_send(ACTIVATION, chunk, i)
        for (index, block), block_saved in zip(reversed(self.chunks[chunk]), reversed(saved)):
            if self.recompute:
                with self.model.uncounted():
                    block_ctx = block.forward(block_saved)[1]
            else:
                block_ctx = block_saved
            dx = block.backward(dx, block_ctx)
            del block_ctx  # else a recomputed set stays alive through the next block's rerun: two at once
            self._final(final, f"layers.{index}")
        if not self.link.has_previous(chunk):
            self.model.embed_backward(dx, embed_ctx)
            self._final(final, "embedding")
        else:
            self.link.wait_send(GRADIENT, chunk, i - 1)
            self.link.send_gradient(dx, chunk, i)
        self.op_seconds += time.perf_counter() - t0

    def _final(self, final, group):
        if final and self.on_grads_final is not None and self.groups.get(group):
            self.on_grads_final(self.groups[group])

    def _measure(self, key):
        self.ctx_bytes[key] = _held_bytes(self.ctxs[key])
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
