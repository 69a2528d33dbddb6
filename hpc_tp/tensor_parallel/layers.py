"""Column- and row-parallel linear layers (weights stored [in, out] so ``y = x @ W`` needs no transpose).

Each layer holds its communication regions (``mappings.py``) and calls them by name: the column
layer its f, the row layer its g. With ``sequence_parallel`` the same layers take the sequence
regions instead: f all-gathers the input's sequence shards, g reduce-scatters along the sequence.

A column-parallel layer may carry several output segments in one fused weight (Q, K, V or
gate, up): one GEMM, while each segment stays its own Parameter (a view into the buffer)
with its own Partition, so checkpoints and importers see plain logical tensors.

With ``quantize`` ("int8" or "int4", inference only) a layer keeps its weight quantized
(``kernels.quantized``): each logical weight is then the Parameters ``weight.codes``, ``weight.scale``
(and ``weight.min``), cut as the weight is (by columns, or by rows: a row split must keep whole groups).

Loaded for inference (``tensor_parallel.packing``), a layer keeps its weight in the layout its products
read: quantized codes interleaved (``QuantizedMatrix.pack``), bfloat16 in panels
(``kernels.bf16_panels``). Its Parameters then give their values when read, and take no more.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .. import backend
from ..comm.base import Communicator
from ..errors import ConfigError
from ..kernels import bf16_dot, bf16_panels, blas, quantized
from ..kernels.functional import cast
from ..module import Module, Parameter, grad_buffer, param_buffer, replicated, split
from .lora import ColumnAdapter, LoRA, RowAdapter
from .mappings import (
    SEQUENCE_AXIS,
    CopyToTensorParallel,
    GatherFromSequenceParallel,
    GatherFromTensorParallel,
    Identity,
    ReduceFromTensorParallel,
    ReduceScatterToSequenceParallel,
    ScatterToTensorParallel,
)


@dataclass(frozen=True)
class Segment:
    """One logical output block of a column-parallel weight.

    ``parts`` pieces of ``full // parts`` columns; this rank holds piece ``index``, shared with
    ``replicas`` tp ranks (grouped-query K/V heads when tp > kv heads). ``replica_comm`` groups
    the ranks holding the same piece: their gradients are summed across it.
    """

    name: str
    full: int
    parts: int
    index: int
    replicas: int = 1
    replica_comm: Communicator | None = None


def _flat(x):
    return x.reshape(-1, x.shape[-1])


def product(a, b, keep_sums: bool = False):
    """``a @ b`` (``a`` [..., k], ``b`` [k, n], a ``QuantizedMatrix`` or a ``PanelMatrix``) in ``a``'s dtype, through
    ``kernels.blas`` (``kernels.quantized``): a product of half-precision operands comes back as float32
    sums, and activations keep the model's dtype (pipeline messages and buffers are allocated for it).
    ``keep_sums``: return those float32 sums as they are (partial products that are summed over tp
    before they are rounded)."""
    matmul = quantized.matmul if isinstance(b, quantized.QuantizedMatrix) else blas.matmul
    y = matmul(_flat(a), b).reshape(a.shape[:-1] + (b.shape[1],))
    return y if keep_sums else cast(y, a.dtype)


class QuantizedWeight(Module):
    """The Parameters of a weight kept quantized: ``codes``, ``scale`` (and ``min``), views of
    ``matrix``'s arrays, each cut as ``partition`` cuts the logical weight [K, N] (its rows counted
    in each part's own rows). Inference only: no gradients."""

    def __init__(self, matrix: quantized.QuantizedMatrix, partition):
        k, n = partition.full_shape
        for part, array in matrix.arrays():
            shape = (quantized.part_rows(part, k, matrix.bits), n)
            # an empty gradient: nothing trains a quantized weight (the trainer refuses such models)
            no_grad = backend.xp.zeros(0, array.dtype)
            setattr(self, part, Parameter(array, replace(partition, full_shape=shape), grad=no_grad))

    def read_from_packed(self, matrix: quantized.QuantizedMatrix, cols: slice):
        """Each Parameter's data read from columns ``cols`` of ``matrix``, packed: the stored arrays
        it viewed are dropped with the matrix's."""
        for name, p in self.named_parameters():
            p.data = quantized.PackedPart(matrix, name, cols)


def _no_backward(quantize):
    if quantize is not None:
        raise ConfigError(f"weights kept quantized ({quantize}) are for inference: they have no backward")


def add_weight_grad(grad, x2, dy2):
    """``grad += x2.T @ dy2`` summed into the buffer (beta = 1), without a temporary product."""
    blas.matmul(x2.T, dy2, out=grad, accumulate=True)


class ColumnParallelLinear(Module):
    """``y = x W + b`` with W [in, out] split by output columns: each rank computes its out / tp
    columns of y from the whole input.

    What crosses the wire (x [B, T, in] over tp ranks), all of it through the layer's regions:
      f forward     nothing, every rank holds x. Sequence parallel: all-gather of the [B, T/tp, in]
                    shards into x, done again in backward (only the shard is kept in between).
      f backward    all-reduce of the input gradient [B, T, in], running while the weight gradient
                    is computed. Sequence parallel: reduce-scatter of it to [B, T/tp, in].
      gather_output all-gather of y [B, T, out / tp] to [B, T, out] forward; backward keeps this
                    rank's columns of the gradient and sends nothing.
      K/V segments held by several ranks (tp > kv heads): all-reduce of each one's weight and bias
                    gradient increment ([in, width] and [width]) over the ranks holding it, backward.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        bias: bool = True,
        gather_output: bool = False,
        segments: list[Segment] | None = None,
        dtype="float64",
        sequence_parallel: bool = False,
        quantize: str | None = None,
        lora: LoRA | None = None,
    ):
        if segments is None:
            if out_features % comm.size:
                raise ConfigError(f"output size {out_features} is not divisible by tensor-parallel size {comm.size}")
            segments = [Segment("", out_features, comm.size, comm.rank)]
        if gather_output and (len(segments) > 1 or segments[0].parts != comm.size):
            raise ValueError("gather_output needs a single segment split over the whole tp group")
        self.segments = segments
        self.f = GatherFromSequenceParallel(comm, SEQUENCE_AXIS) if sequence_parallel else CopyToTensorParallel(comm)
        self.output_region = GatherFromTensorParallel(comm) if gather_output else Identity()
        widths = [s.full // s.parts for s in segments]
        self.out_local = sum(widths)
        self.quantize = quantize
        if quantize is None:
            self._weight = param_buffer((in_features, self.out_local), dtype)
            self._weight_grad = grad_buffer(self._weight)  # None: frozen (LoRA)
        else:
            bits = quantized.bits_of(quantize, "quantize")
            quantized.check_rows(in_features, 1, "a column-parallel layer", bits)
            self._weight = quantized.QuantizedMatrix.zeros(in_features, self.out_local, bits, backend.xp)
        self._bias = param_buffer(self.out_local, dtype) if bias else None
        self._bias_grad = grad_buffer(self._bias) if bias else None
        self.params: list[tuple[str, Parameter]] = []
        self.columns: list[slice] = []
        # K/V weights reach every replica's query heads through an f over the replica group: their
        # gradient is that f's backward.
        self._replica_regions: list[tuple[CopyToTensorParallel, slice]] = []
        # each segment's weight (a Parameter, or a QuantizedWeight), with its columns
        self._weight_parts: list[tuple[Parameter | QuantizedWeight, slice]] = []
        b_partitions = []  # each segment's LoRA B: its weight's partition
        start = 0
        for seg, width in zip(segments, widths):
            cols = slice(start, start + width)
            start += width
            self.columns.append(cols)
            if seg.replica_comm is not None and seg.replica_comm.size > 1:
                self._replica_regions.append((CopyToTensorParallel(seg.replica_comm), cols))
            prefix = f"{seg.name}." if seg.name else ""
            partition = split((in_features, seg.full), 1, seg.parts, seg.index, seg.replicas)
            b_partitions.append((prefix, partition))
            if quantize is None:
                grad = None if self._weight_grad is None else self._weight_grad[:, cols]
                weight = Parameter(self._weight[:, cols], partition, grad=grad)
                self._weight_parts.append((weight, cols))
                self.params.append((prefix + "weight", weight))
            else:
                parts = QuantizedWeight(self._weight.columns(cols), partition)
                self._weight_parts.append((parts, cols))
                self.params.extend(parts.named_parameters(prefix + "weight."))
            if bias:
                self.params.append(
                    (
                        prefix + "bias",
                        Parameter(
                            self._bias[cols],
                            split((seg.full,), 0, seg.parts, seg.index, seg.replicas),
                            grad=None if self._bias_grad is None else self._bias_grad[cols],
                            decay=False,
                        ),
                    )
                )
        # the trained low-rank update of a frozen weight (None: none, or folded into the weight)
        self._adapter = (
            None if lora is None else ColumnAdapter(lora, in_features, b_partitions, self.columns, comm, dtype)
        )

    def named_parameters(self, prefix: str = ""):
        for name, p in self.params + ([] if self._adapter is None else self._adapter.params):
            yield prefix + name, p

    def fold_adapter(self):
        """W += s A B and the adapter dropped: the same outputs from the plain product (inference)."""
        if self._adapter is not None:
            self._adapter.fold(self._weight)
            self._adapter = None

    def pack_for_inference(self):
        """The fused weight in the layout its products read, kept once (``QuantizedMatrix.pack``,
        ``bf16_panels.PanelMatrix``)."""
        if self.quantize is not None and self._weight.pack():
            for parts, cols in self._weight_parts:
                parts.read_from_packed(self._weight, cols)
        elif self.quantize is None and bf16_dot.packs(self._weight):
            self._weight = bf16_panels.PanelMatrix(self._weight)
            for weight, cols in self._weight_parts:
                weight.data = bf16_panels.PanelValues(self._weight, cols)

    def quantized_weight(self):
        """The fused weight as its products read it where it is kept quantized (a ``QuantizedMatrix``) and
        the bias (None: none), for a caller that runs the product itself (``nn.one_row``); None: not quantized."""
        return None if self.quantize is None else (self._weight, self._bias)

    def forward(self, x):
        x_all = self.f.forward(x)
        y = product(x_all, self._weight)
        if self._adapter is not None:
            self._adapter.forward(x_all, y)
        if self._bias is not None:
            y += self._bias
        return self.output_region.forward(y), x

    def backward(self, dy, x):
        _no_backward(self.quantize)
        dy2 = _flat(self.output_region.backward(dy))
        x = self.f.forward(x)  # x itself; under sequence parallelism the sequence gathered again
        dx = product(dy2, self._weight.T).reshape(x.shape)
        if self._adapter is not None:  # its part of dx is partial like the base one: summed by f too
            dx += self._adapter.input_grad(_flat(x), dy2).reshape(x.shape)
        pending = self.f.backward_async(dx)  # overlaps the weight gradient below
        self._add_param_grads(_flat(x), dy2)
        return pending.wait()

    def _add_param_grads(self, x2, dy2):
        """This micro-batch's weight and bias gradients, added into the buffers. A K/V segment
        held by several replicas (tp > kv heads) saw only its own query heads' share: its
        increment alone is summed over the replicas, then what earlier micro-batches left is
        added back (summing the accumulated gradient would count each earlier micro-batch again)."""
        b_grad = None if self._adapter is None else self._adapter.b_grad
        buffers = [b for b in (self._weight_grad, self._bias_grad, b_grad) if b is not None]
        earlier = [[b[..., cols].copy() for b in buffers] for _, cols in self._replica_regions]
        for _, cols in self._replica_regions:
            for b in buffers:
                b[..., cols] = 0
        if self._weight_grad is not None:
            add_weight_grad(self._weight_grad, x2, dy2)
        if self._bias_grad is not None:
            self._bias_grad += dy2.sum(axis=0, dtype=self._bias_grad.dtype)
        if self._adapter is not None:
            self._adapter.add_b_grad(x2, dy2)
        for (f, cols), kept in zip(self._replica_regions, earlier):
            for b, before in zip(buffers, kept):
                b[..., cols] = f.backward(b[..., cols].copy()) + before


class RowParallelLinear(Module):
    """``y = x W + b`` with W [in, out] split by input rows: each rank multiplies its in / tp slice
    of x and g sums the partial products; the bias is added once, after the sum.
    ``input_is_parallel``: x arrives split already (the output of a column-parallel layer).

    What crosses the wire (y [B, T, out] over tp ranks), all of it through the layer's regions:
      g forward     all-reduce of the partial product [B, T, out], in place. Sequence parallel:
                    reduce-scatter of it to [B, T/tp, out], the bias added to the shard.
      g backward    nothing. Sequence parallel: all-gather of the output gradient's [B, T/tp, out]
                    shards to [B, T, out].
      an input not split yet: forward keeps this rank's slice [B, T, in / tp] and sends nothing;
                    backward all-gathers the input gradient to [B, T, in].
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        bias: bool = True,
        input_is_parallel: bool = True,
        dtype="float64",
        sequence_parallel: bool = False,
        quantize: str | None = None,
        lora: LoRA | None = None,
    ):
        if in_features % comm.size:
            raise ConfigError(f"input size {in_features} is not divisible by tensor-parallel size {comm.size}")
        self.input_region = Identity() if input_is_parallel else ScatterToTensorParallel(comm)
        self.g = (
            ReduceScatterToSequenceParallel(comm, SEQUENCE_AXIS)
            if sequence_parallel
            else ReduceFromTensorParallel(comm)
        )
        partition = split((in_features, out_features), 0, comm.size, comm.rank)
        self.quantize = quantize
        # the weight as the products read it where that is not the Parameter's data: quantized, or packed
        self._matrix = None
        if quantize is None:
            self.weight = Parameter(param_buffer((in_features // comm.size, out_features), dtype), partition)
        else:
            bits = quantized.bits_of(quantize, "quantize")
            quantized.check_rows(in_features, comm.size, "a row-parallel layer", bits)
            self._matrix = quantized.QuantizedMatrix.zeros(in_features // comm.size, out_features, bits, backend.xp)
            self.weight = QuantizedWeight(self._matrix, partition)
        self.bias = (
            Parameter(param_buffer(out_features, dtype), replicated((out_features,), comm.size), decay=False)
            if bias
            else None
        )
        # the trained low-rank update of a frozen weight (None: none, or folded into the weight)
        self._adapter = None if lora is None else RowAdapter(lora, in_features, out_features, comm, dtype)

    def named_parameters(self, prefix: str = ""):
        yield from super().named_parameters(prefix)
        for name, p in [] if self._adapter is None else self._adapter.params:
            yield prefix + name, p

    def fold_adapter(self):
        """W += s A B and the adapter dropped: the same outputs from the plain product (inference)."""
        if self._adapter is not None:
            self._adapter.fold(self.weight.data)
            self._adapter = None

    def pack_for_inference(self):
        """The weight in the layout its products read, kept once (``QuantizedMatrix.pack``,
        ``bf16_panels.PanelMatrix``)."""
        if self.quantize is not None and self._matrix.pack():
            self.weight.read_from_packed(self._matrix, slice(None))
        elif self.quantize is None and bf16_dot.packs(self.weight.data):
            self._matrix = bf16_panels.PanelMatrix(self.weight.data)
            self.weight.data = bf16_panels.PanelValues(self._matrix)

    def quantized_weight(self):
        """``ColumnParallelLinear.quantized_weight``'s pair for this layer."""
        return None if self.quantize is None else (self._matrix, None if self.bias is None else self.bias.data)

    def forward(self, x):
        x = self.input_region.forward(x)
        # g sums the partial products: half ones as float32 sums, rounded once after, as one process rounds them
        weight = self.weight.data if self._matrix is None else self._matrix
        partial = product(x, weight, keep_sums=self.g.comm.size > 1)
        if self._adapter is not None:
            self._adapter.forward(x, partial)
        y = cast(self.g.forward(partial), x.dtype)
        if self.bias is not None:
            y += self.bias.data
        return y, x

    def backward(self, dy, x):
        _no_backward(self.quantize)
        dy2, x2 = _flat(self.g.backward(dy)), _flat(x)
        if self.bias is not None and self.bias.trainable:
            self.bias.grad += dy2.sum(axis=0, dtype=self.bias.grad.dtype)
        dx = product(dy2, self.weight.data.T).reshape(x.shape)
        if self._adapter is not None:
            dx += self._adapter.input_grad(x2, dy2).reshape(x.shape)
        if self.weight.trainable:  # frozen (LoRA): a third of backward's products saved
            add_weight_grad(self.weight.grad, x2, dy2)
        return self.input_region.backward(dx)
