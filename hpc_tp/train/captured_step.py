"""The training step with its host values kept on the device, so that it can run as one CUDA graph.

``Trainer`` launches a step from the host, and reads values back between its passes: the token count
(all-reduced as a Python float), the loss, the gradient norm, the finite check over the world, the
clip coefficient; ``loss_scale / tokens`` goes into every micro-batch's backward as a float, and a
non-finite step is skipped by an ``if``. A graph cannot hold any of that. ``CapturedStep`` runs the
same step with each of them a 0-d array on the device, read by no host code inside the step:

    before the step (host -> device, into arrays that outlive it): the batch's ids and targets,
        the learning rate (a function of the step index alone)
    the step: tokens summed over dp; scale = S / tokens; forward + backward of each micro-batch
        (``pipeline_forward_backward`` at pp = 1, the loss sum kept on the device); the loss summed
        over dp; the norm through the tp/pp all-reduces; finite agreed over tp and dp; the clip
        coefficient; AdamW with bias corrections from the device's count of finite steps, every
        weight and moment kept where the flag is false; half weights rounded from the masters;
        float16's loss scale halved or grown by the flag
    after the step: one read-back of [loss, norm, finite, tokens, S before, S after, good steps],
        which the host keeps as its copy of the optimizer's count and the scaler (for checkpoints)

On a GPU whose groups can all be captured (``cuda_graph.capturable``) the step is a
``cuda_graph.Replayed``, one per input shape: the first step runs eagerly, every later one replays.
On the CPU the same code runs on numpy 0-d arrays: that is how the tests hold it to
``Trainer.train_step`` (float64, 1e-12) and check that nothing in it reads a value back.
``cpu_optim``'s numba update takes host floats, so this step's AdamW is the composed one
(``optim.composed_adamw``, the same bits); the norm's sums of squares still use its kernels on numpy
arrays, whose results are host numbers there anyway.
"""

from __future__ import annotations

from .. import backend, cuda_graph
from ..errors import ConfigError
from ..tensor_parallel.vocab import IGNORE_INDEX
from .data import check_tokens
from .optim import device_grad_norm

REPORT = ("loss", "grad_norm", "finite", "tokens", "loss_scale", "scale_after", "good_steps_after")


def check_capturable(settings, cfg, grid):
    """One ConfigError line on what keeps ``--cuda-graph`` from capturing this run's step."""
    why = None
    if settings.device != "cuda":
        why = f"a step runs as a CUDA graph on a GPU only, not on --device {settings.device}"
    elif cfg.dropout or cfg.attn_dropout:
        why = "dropout draws its masks on the host for each step; capture needs dropout 0"
    else:
        for axis in ("tp", "dp", "ep", "expert_dp"):
            group = getattr(grid, axis)
            if not cuda_graph.capturable(group):
                why = f"the {axis} group of {group.size} ranks runs its collectives on the host (MPI), not on NCCL"
                break
    if why is None:
        why = _device_scalar_refusal(settings, cfg, grid)
    if why is not None:
        raise ConfigError(f"--cuda-graph: {why}")


def _device_scalar_refusal(settings, cfg, grid) -> str | None:
    """What the device-scalar step itself does not run, captured or not."""
    if grid.pp_size > 1:
        return f"--pp {grid.pp_size}: pipeline messages and the loss cross stages over MPI, from the host; needs pp = 1"
    if settings.distributed_optimizer and grid.dp_size > 1:
        return "--distributed-optimizer (ZeRO-1) gathers its pieces with host-driven collectives; not on this step yet"
    if cfg.num_experts:
        return f"num_experts {cfg.num_experts}: MoE routing counts its tokens on the host; needs a dense model"
    return None


class CapturedStep:
    """``trainer``'s step with its host values as device scalars; ``capture``: each input shape's
    step as a ``cuda_graph.Replayed`` (a GPU whose groups can be captured), else run as it is."""

    def __init__(self, trainer, capture: bool):
        why = _device_scalar_refusal(trainer.settings, trainer.cfg, trainer.grid)
        if why is not None:
            raise ConfigError(f"the device-scalar step: {why}")
        self.trainer, self.capture = trainer, capture
        self.lr = self.zeros((), "float64")
        self.adam_steps = self.zeros((), "float64")  # finite steps taken: AdamW's bias corrections
        self.loss_scale = self.zeros((), "float64")
        self.good_steps = self.zeros((), "float64")  # float16: finite steps since the scale last moved
        self.load_host_state()
        self._shapes = {}  # (ids shape, targets shape) -> (ids, targets, the step's work)

    @staticmethod
    def zeros(shape, dtype):
        """Every array the step owns (a test makes them refuse host reads)."""
        return backend.xp.zeros(shape, dtype)

    def load_host_state(self):
        """The host's optimizer count and loss scaler into the device scalars (at the start, and
        after a checkpoint is loaded)."""
        precision = self.trainer.precision
        self.adam_steps[...] = self.trainer.optimizer.step_count
        self.loss_scale[...] = precision.loss_scale
        self.good_steps[...] = 0 if precision.scaler is None else precision.scaler.good_steps

    def run(self, ids, targets, lr: float) -> dict:
        """One step on this host batch at ``lr``: the trainer's record fields (loss, grad_norm,
        skipped, tokens and the scaler's), from one read-back after the step."""
        ids_in, targets_in, work = self._for_shape(ids, targets)
        ids_in[...] = ids  # copied into the addresses the graph reads
        targets_in[...] = targets
        self.lr[...] = lr
        values = dict(zip(REPORT, backend.to_numpy(work()).tolist()))
        precision, finite = self.trainer.precision, values["finite"] == 1.0
        check_tokens(values["tokens"], self.trainer.step)
        scaling = precision.record(finite, values["loss"])  # the scaler as the step found it
        self.trainer.optimizer.step_count += finite
        if precision.scaler is not None:
            precision.scaler.scale, precision.scaler.good_steps = values["scale_after"], int(values["good_steps_after"])
        return dict(
            loss=values["loss"],
            grad_norm=values["grad_norm"],
            skipped=not finite,
            tokens=int(values["tokens"]),
            **scaling,
        )

    @property
    def replayed(self) -> bool:
        """Whether every input shape's step is replayed from a CUDA graph (not eager, no capture failed)."""
        works = [work for _, _, work in self._shapes.values()]
        return bool(works) and all(isinstance(w, cuda_graph.Replayed) and not w.failed for w in works)

    def _for_shape(self, ids, targets):
        key = (ids.shape, targets.shape)
        if key not in self._shapes:
            ids_in, targets_in = self.zeros(ids.shape, ids.dtype), self.zeros(targets.shape, targets.dtype)

            def step():
                return self._step(ids_in, targets_in)

            work = cuda_graph.Replayed(step, "the training step") if self.capture else step
            self._shapes[key] = ids_in, targets_in, work
        return self._shapes[key]

    def _step(self, ids, targets):
        """The step's device work; returns the REPORT values as one float64 array."""
        t = self.trainer
        grid, xp = t.grid, backend.xp_of(self.lr)
        scale_before = self.loss_scale.copy()
        tokens = _summed((targets != IGNORE_INDEX).sum().astype("float64"), grid.dp)
        loss_sum = t._forward_backward(ids, targets, self.loss_scale / tokens, True)  # fp16: scaled grads
        loss = _summed(loss_sum, grid.dp) / tokens
        unscale = 1.0 / self.loss_scale  # a power of two: exact
        norm = device_grad_norm(t.optimizer.params, grid, t.tied_copies) * unscale
        finite = _agreed_finite(grid, norm, loss)
        max_norm = t.settings.clip_grad
        clip = xp.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0) if max_norm > 0 else 1.0
        t.optimizer.device_step(self.lr, unscale * clip, finite, self.adam_steps + 1)
        self.adam_steps += finite
        t.precision.device_update(finite, self.loss_scale, self.good_steps)
        logged_norm = xp.where(finite, norm, float("nan"))
        return xp.stack([loss, logged_norm, finite, tokens, scale_before, self.loss_scale, self.good_steps])


def _summed(value, group):
    """A 0-d array summed over ``group`` on the device (a copy: ``value`` is left as it was)."""
    buffer = value.astype("float64").reshape(1)
    group.all_reduce(buffer)
    return buffer.reshape(())


def _agreed_finite(grid, norm, loss):
    """True (a 0-d bool array) where every rank of the step's groups found its norm and loss finite:
    ``optim.agree_finite`` without the host (at pp = 1 the tp and dp groups cover the world)."""
    xp = backend.xp_of(norm)
    bad = (~(xp.isfinite(norm) & xp.isfinite(loss))).astype("float64").reshape(1)
    for group in (grid.tp, grid.dp):
        group.all_reduce(bad)
    return bad.reshape(()) == 0
