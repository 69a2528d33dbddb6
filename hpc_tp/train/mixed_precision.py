"""Mixed precision: the model computes in float16 or bfloat16, the optimizer updates float32 masters.

    model weights (half) --forward/backward, loss x S--> products in half, summed in float32
      -> the masters' gradients are those float32 sums   (``module.grad_buffer``)
      -> norm x 1/S, finite check, AdamW on the masters of gradient x 1/S x clip
         (S is a power of two: unscaling inside those passes is exact and costs no pass of its own)
      -> model weights = half(masters)                    (``MixedPrecision.update``)

float16 keeps 5 exponent bits, so small gradients flush to zero unless the loss is scaled up
first: ``LossScaler`` multiplies it by S, and when a step's gradients overflow (inf/NaN on any
rank) the step is skipped and S halves; after ``growth_interval`` good steps in a row S doubles.
bfloat16 has float32's exponent range and needs no scaling (S = 1). For float32/float64 runs the
masters *are* the model's parameters and nothing is copied, so those runs are unchanged.

Checkpoints store the float32 masters (``master``), never the rounded half weights; loading
writes the masters and then ``sync_model`` rounds them into the model.
numpy has no bfloat16: it needs the ml_dtypes package (which cupy also uses for it).
"""

from __future__ import annotations

import math

from .. import backend
from ..errors import ConfigError
from ..module import Parameter

HALF = ("float16", "bfloat16")


class LossScaler:
    """Dynamic loss scale for float16: halve on overflow (the step is skipped), double after
    ``growth_interval`` finite steps in a row; never below ``min_scale``."""

    def __init__(
        self, scale: float = 2.0**16, growth_interval: int = 2000, factor: float = 2.0, min_scale: float = 1.0
    ):
        if not (scale > 0 and growth_interval >= 1 and factor > 1 and 0 < min_scale <= scale):
            raise ConfigError(
                f"loss scale {scale}, growth interval {growth_interval}, factor {factor}, "
                f"min {min_scale}: need scale >= min > 0, interval >= 1, factor > 1"
            )
        self.scale, self.growth_interval, self.factor, self.min_scale = float(scale), growth_interval, factor, min_scale
        self.good_steps = 0

    def update(self, finite: bool):
        if not finite:
            self.scale, self.good_steps = max(self.min_scale, self.scale / self.factor), 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale, self.good_steps = self.scale * self.factor, 0

    def device_update(self, finite, scale, good_steps):
        """``update`` on the device (the captured step): ``finite``, ``scale`` and ``good_steps`` are
        0-d arrays, the last two updated in place, chosen by the flag rather than a host branch."""
        xp = backend.xp_of(scale)
        grown = good_steps + 1
        grow = finite & (grown >= self.growth_interval)
        kept = xp.where(grow, scale * self.factor, scale)
        scale[...] = xp.where(finite, kept, xp.maximum(self.min_scale, scale / self.factor))
        good_steps[...] = xp.where(finite & ~grow, grown, 0)

    def state(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state(self, state: dict):
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


class MixedPrecision:
    """float32 masters for the half-precision ``params`` (name -> Parameter, updated in place: a
    parameter may be a view into a fused buffer). ``master`` is what the optimizer, the grad-norm
    clip and checkpoints see. ``sharded``: names whose masters the distributed optimizer holds in
    its pieces (``ShardedAdamW.masters``); ``master`` maps them to the model's own parameters."""

    def __init__(self, params: dict[str, Parameter], dtype: str, scaler: LossScaler | None = None, sharded=frozenset()):
        self.model = dict(params)
        self.half = dtype in HALF
        self.scaler = scaler if scaler is not None else LossScaler() if dtype == "float16" else None
        if not self.half:
            self.master = self.model
            return
        # The model's gradients are float32 already (module.grad_buffer): the masters use them as
        # they are, unscaled in place, rather than holding a second float32 copy.
        self.master = {
            name: p if name in sharded else Parameter(p.data.astype("float32"), p.partition, decay=p.decay, grad=p.grad)
            for name, p in self.model.items()
        }

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.scale

    def overflow_absorbed(self, finite: bool, loss: float) -> bool:
        """A skipped step that is float16 loss scaling at work, not a fault: the loss is finite, only
        the scaled gradients overflowed, and the scale can still halve (ask before ``update``)."""
        return (
            not finite and math.isfinite(loss) and self.scaler is not None and self.scaler.scale > self.scaler.min_scale
        )

    def record(self, finite: bool, loss: float) -> dict:
        """The step's log fields for float16 runs: the scale it ran at, and whether the scaler
        absorbed an overflow; {} otherwise."""
        if self.scaler is None:
            return {}
        return {"loss_scale": self.scaler.scale, "loss_scale_overflow": self.overflow_absorbed(finite, loss)}

    def update(self, finite: bool):
        """After the optimizer's step (or its skip): round the masters into the model, adjust the scale."""
        if self.half and finite:
            self.sync_model()
        if self.scaler is not None:
            self.scaler.update(finite)

    def device_update(self, finite, scale, good_steps):
        """``update`` without reading ``finite`` (a 0-d device array) on the host: the half weights are
        rounded from the masters whatever it says (a skipped step left the masters as they were, so
        they round to the weights the model holds); fp16's scale and count of good steps (0-d arrays)
        move in place."""
        self.sync_model()
        if self.scaler is not None:
            self.scaler.device_update(finite, scale, good_steps)

    def sync_model(self):
        if self.half:
            for name, p in self.model.items():
                if self.master[name] is not p:
                    p.data[...] = self.master[name].data

    def state(self) -> dict:
        """For the checkpoint's metadata (the scale a resumed run continues from)."""
        return {} if self.scaler is None else {"loss_scaler": self.scaler.state()}

    def load_state(self, state: dict | None):
        if self.scaler is not None and state and "loss_scaler" in state:
            self.scaler.load_state(state["loss_scaler"])
