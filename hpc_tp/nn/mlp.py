"""The MLP, the textbook case of tensor parallelism: Y = act(X A) B.

A is column-parallel, so each rank applies the elementwise activation to its own columns
with no communication; B is row-parallel, and one all-reduce sums the partial outputs.
SwiGLU (and Gemma's GeGLU, the same with a tanh GELU) fuses gate and up projections into one
column-parallel GEMM.
"""

from __future__ import annotations

from ..backend import xp_of
from ..comm.base import Communicator
from ..errors import ConfigError
from ..kernels import functional as F
from ..module import Module
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, Segment
from ..tensor_parallel.lora import LoRA

ACTIVATIONS = {
    "gelu_tanh": (F.gelu_tanh_forward, F.gelu_tanh_backward),
    "gelu": (F.gelu_erf_forward, F.gelu_erf_backward),
    "silu": (F.silu_forward, F.silu_backward),
}
GATED = {"swiglu": "silu", "geglu": "gelu_tanh"}  # a gated MLP's name -> the activation of its gate


class ParallelMLP(Module):
    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        comm: Communicator,
        activation: str = "gelu_tanh",
        bias: bool = True,
        dtype="float64",
        sequence_parallel: bool = False,
        quantize: str | None = None,
        lora: LoRA | None = None,
    ):
        if activation not in GATED and activation not in ACTIVATIONS:
            raise ConfigError(f"activation {activation!r} is not one of {', '.join([*ACTIVATIONS, *GATED])}")
        if ffn_hidden % comm.size:
            raise ConfigError(f"ffn hidden size {ffn_hidden} is not divisible by tensor-parallel size {comm.size}")
        self.gated = activation in GATED
        self.act_forward, self.act_backward = ACTIVATIONS[GATED.get(activation, activation)]
        segments = (
            [Segment("gate", ffn_hidden, comm.size, comm.rank), Segment("up", ffn_hidden, comm.size, comm.rank)]
            if self.gated
            else None
        )
        # what both linears are built with (their weights' precision, or format, the layout, the adapters)
        storage = dict(dtype=dtype, sequence_parallel=sequence_parallel, quantize=quantize, lora=lora)
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, comm, bias, segments=segments, **storage)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, comm, bias, input_is_parallel=True, **storage)
        self.local = ffn_hidden // comm.size

    def forward(self, x):
        h, fc1_ctx = self.fc1.forward(x)
        if self.gated:
            inner, saved = F.gated_forward(h, self.local, self.act_forward)
        else:
            inner, saved = self.act_forward(h)
        y, fc2_ctx = self.fc2.forward(inner)
        return y, (fc1_ctx, saved, fc2_ctx)

    def backward(self, dy, ctx):
        fc1_ctx, saved, fc2_ctx = ctx
        dinner = self.fc2.backward(dy, fc2_ctx)
        if self.gated:
            act_ctx, act, up = saved
            dh = xp_of(dinner).concatenate([self.act_backward(dinner * up, act_ctx), dinner * act], axis=-1)
        else:
            dh = self.act_backward(dinner, saved)
        return self.fc1.backward(dh, fc1_ctx)
