"""Module and Parameter: the ground floor every layer, checkpoint, optimizer and importer stands on.

A Parameter holds this rank's slice of a logical tensor and a ``Partition`` that says how the
logical tensor is cut: its full shape, the split axis (None = replicated), how many parts and
which one this rank holds, and how many ranks of the group hold the same part. Checkpoints
read and write the slice, the optimizer keeps states of the same shape, and the gradient norm
divides a shard's contribution by its replica count, all from this one description.

Modules have explicit backward: ``y, ctx = m.forward(x)`` and ``dx = m.backward(dy, ctx)``.
The ctx (not the module) holds saved activations, so several micro-batches can be in flight.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy

from . import backend
from .errors import ConfigError


@dataclass(frozen=True)
class Partition:
    """How one logical tensor is cut across a group of ranks.

    ``full_shape`` is the logical shape stored in checkpoints. Along ``axis`` the tensor is cut
    into ``parts`` equal pieces of ``ceil(full/parts)``; the last piece may run past the logical
    end (vocab padding), and those padded rows/columns belong to no checkpoint.
    ``replicas`` ranks of the group hold this same piece (tp/parts; tp for a replicated tensor).
    ``group`` names the process group the tensor is split over ("tp" or "ep").
    """

    full_shape: tuple
    axis: int | None = None
    parts: int = 1
    index: int = 0
    replicas: int = 1
    group: str = "tp"

    @property
    def local_shape(self) -> tuple:
        if self.axis is None:
            return tuple(self.full_shape)
        shape = list(self.full_shape)
        shape[self.axis] = -(-shape[self.axis] // self.parts)
        return tuple(shape)

    def local_range(self) -> tuple[int, int]:
        """[start, stop) along the split axis in logical coordinates, clipped to the logical end."""
        if self.axis is None:
            return 0, 0
        n = self.local_shape[self.axis]
        start = self.index * n
        return min(start, self.full_shape[self.axis]), min(start + n, self.full_shape[self.axis])

    def local_slice(self) -> tuple:
        """Index into the logical tensor that gives this rank's (unpadded) slice."""
        if self.axis is None:
            return tuple(slice(None) for _ in self.full_shape)
        start, stop = self.local_range()
        return tuple(slice(start, stop) if d == self.axis else slice(None) for d in range(len(self.full_shape)))

    def valid_local(self) -> tuple:
        """Index into the local array that excludes padding past the logical end."""
        if self.axis is None:
            return tuple(slice(None) for _ in self.full_shape)
        start, stop = self.local_range()
        return tuple(slice(0, stop - start) if d == self.axis else slice(None) for d in range(len(self.full_shape)))


def replicated(shape, replicas: int) -> Partition:
    """Every one of ``replicas`` ranks (the tp group) holds the whole tensor."""
    return Partition(tuple(shape), replicas=replicas)


def split(shape, axis: int, parts: int, index: int, replicas: int = 1, group: str = "tp") -> Partition:
    return Partition(tuple(shape), axis, parts, index, replicas, group)


def gather_full(local, partition: Partition, comm):
    """The logical tensor reassembled from every rank's unpadded piece (for checks and exports)."""
    pieces = comm.allgather_object((partition.local_slice(), backend.to_numpy(local[partition.valid_local()])))
    full = numpy.zeros(partition.full_shape, dtype=local.dtype)
    for index, piece in pieces:
        full[index] = piece
    return full


def grad_dtype(dtype):
    """float32 for float16/bfloat16 parameters (``grad_buffer``), else their own dtype."""
    dtype = numpy.dtype(dtype)
    return numpy.dtype("float32") if dtype.itemsize < 4 else dtype


class _Building:
    frozen = False  # set by ``frozen``: parameters made meanwhile get no gradient


@contextmanager
def frozen(on: bool = True):
    """Parameters made inside are frozen when ``on`` (LoRA's base weights): ``grad_buffer`` gives None,
    so they have no gradient and nothing trains them, and ``param_buffer`` keeps them out of a
    GradArena, whose slots stand beside gradients. ``frozen(False)`` inside makes trainable ones again
    (the adapters)."""
    before, _Building.frozen = _Building.frozen, on
    try:
        yield
    finally:
        _Building.frozen = before


def grad_buffer(data):
    """None for a parameter made inside ``frozen()``. Else a zeroed gradient for ``data``: float32 when ``data`` is float16/bfloat16, as Megatron-LM's
    main_grad. Micro-batches, bias and norm sums over tokens, and the replicas' sums then add up in
    float32, not in a format with 8 or 11 significant bits. On the CPU a weight gradient's half
    product is rounded before it is added; on a GPU cuBLAS sums it into the float32 buffer directly
    (``kernels.cublas``). Other dtypes keep their own. Inside ``with GradArena(...)`` it is a slice of the arena
    (for ``data`` from ``param_buffer``, the slice beside it)."""
    if _Building.frozen:
        return None
    xp = backend.xp_of(data)
    if GradArena.active is not None:
        paired = GradArena.active.gradient_of(data)
        return paired if paired is not None else GradArena.active.zeros(data.shape, grad_dtype(data.dtype), xp)
    return xp.zeros(data.shape, dtype=grad_dtype(data.dtype))


def param_buffer(shape, dtype, fill: float = 0.0):
    """Storage for a parameter, filled with ``fill``. Inside ``with GradArena(..., params=True)`` it
    is a slot of the arena's parameter chunks, element for element beside the gradient
    ``grad_buffer`` then gives it, so a gradient bucket's parameters are one contiguous run too:
    the distributed optimizer gathers the updated values straight into them."""
    xp = backend.xp
    if GradArena.active is not None and GradArena.active.params and not _Building.frozen:
        return GradArena.active.param_slot(tuple(numpy.atleast_1d(shape)), numpy.dtype(dtype), xp, fill)
    return xp.full(shape, fill, dtype=dtype)


# The chunk size of the trainer's GradArena, so the size of a data-parallel bucket (the planner's cost
# model counts the buckets with it).
DEFAULT_BUCKET_BYTES = 25 * 2**20


class GradArena:
    """Gradients stored back to back in flat chunks of ``chunk_bytes`` (one dtype per chunk; a
    larger gradient gets a chunk of its own), so that a data-parallel bucket is one slice of a chunk
    and is all-reduced in place: no copy into a bucket and back, and no second gradient-sized buffer
    (Megatron-LM's contiguous gradient buffer, PyTorch DDP's gradient views). Every ``grad_buffer``
    made inside ``with GradArena(chunk_bytes) as arena:`` comes from it. A chunk is allocated
    uninitialised and only the slices handed out are zeroed, so on the CPU the unused end of the
    last chunk never becomes resident.

    ``params=True``: ``param_buffer`` lays the parameters out the same way, in ``param_chunks``
    (chunk i holds, at each offset, the parameter element whose gradient is at that offset of
    chunk i)."""

    active: GradArena | None = None

    def __init__(self, chunk_bytes: int, params: bool = False):
        if not chunk_bytes > 0:
            raise ConfigError(f"gradient bucket size {chunk_bytes!r} bytes must be > 0")
        self.chunk_bytes = chunk_bytes
        self.chunks: list = []
        self.used: list[int] = []  # elements handed out of each chunk
        self._open: dict = {}  # (gradient dtype, parameter dtype) -> the chunk small gradients of it go to
        self.params = params
        self.param_chunks: list = []  # with params: one per chunk (None where no parameter slot was made)
        self._paired: dict = {}  # address of a parameter slot -> its gradient

    def __enter__(self) -> GradArena:
        if GradArena.active is not None:
            raise RuntimeError("GradArena blocks do not nest")
        GradArena.active = self
        return self

    def __exit__(self, *exc):
        GradArena.active = None

    def zeros(self, shape, dtype, xp):
        index, start = self._take(shape, numpy.dtype(dtype), None, xp)
        view = self.chunks[index][start : start + math.prod(shape)].reshape(shape)
        view[...] = 0
        return view

    def param_slot(self, shape, dtype, xp, fill: float = 0.0):
        """A parameter's storage and, remembered for ``gradient_of``, its zeroed gradient beside it."""
        index, start = self._take(shape, grad_dtype(dtype), dtype, xp)
        if self.param_chunks[index] is None:
            self.param_chunks[index] = xp.empty(self.chunks[index].size, dtype=dtype)
        size = math.prod(shape)
        data = self.param_chunks[index][start : start + size].reshape(shape)
        data[...] = fill
        grad = self.chunks[index][start : start + size].reshape(shape)
        grad[...] = 0
        self._paired[address(data)] = grad
        return data

    def gradient_of(self, data):
        """The gradient ``param_slot`` made beside ``data`` (the whole slot only), else None."""
        grad = self._paired.get(address(data)) if data.size else None
        return grad if grad is not None and grad.shape == data.shape else None

    def _take(self, shape, dtype, param_dtype, xp) -> tuple[int, int]:
        """(chunk, offset) of ``shape`` new elements of ``dtype``; a parameter slot goes to a chunk of
        its own parameter dtype."""
        size, key = math.prod(shape), (dtype, param_dtype)
        if size * dtype.itemsize >= self.chunk_bytes:
            index = self._new_chunk(size, dtype, xp)
        else:
            index = self._open.get(key)
            if index is None or (self.used[index] + size) * dtype.itemsize > self.chunk_bytes:
                index = self._open[key] = self._new_chunk(self.chunk_bytes // dtype.itemsize, dtype, xp)
        start = self.used[index]
        self.used[index] += size
        return index, start

    def _new_chunk(self, size: int, dtype, xp) -> int:
        self.chunks.append(xp.empty(size, dtype=dtype))
        self.param_chunks.append(None)
        self.used.append(0)
        return len(self.chunks) - 1

    def locate(self, array) -> tuple[int, int, int]:
        """(chunk index, start, stop): the elements of a chunk that ``array`` (a gradient, or a
        strided view into a fused one) spans; ValueError if it is not in this arena."""
        low = address(array)
        span = sum((n - 1) * s for n, s in zip(array.shape, array.strides)) + array.itemsize if array.size else 0
        for index, chunk in enumerate(self.chunks):
            offset = low - address(chunk)
            if chunk.dtype == array.dtype and 0 <= offset and offset + span <= chunk.nbytes:
                return index, offset // array.itemsize, (offset + span) // array.itemsize
        raise ValueError("a gradient outside the GradArena: build the model inside `with GradArena(...)`")


def address(array) -> int:
    """Where ``array``'s first element lives (host or device)."""
    return array.ctypes.data if isinstance(array, numpy.ndarray) else array.data.ptr


def same_view(a, b) -> bool:
    """``a`` and ``b`` are the same elements of the same memory."""
    return (
        a.shape == b.shape
        and a.strides == b.strides
        and a.dtype.itemsize == b.dtype.itemsize
        and (a.size == 0 or address(a) == address(b))
    )


def strided_like(buffer, view, base):
    """``buffer`` (1-D, one element per element of the 1-D ``base``) seen the way ``view`` sees
    ``base``: the same offset, shape and strides in elements. A gradient's ``view`` into an arena run
    ``base`` gives the same parameter's place in a flat copy of that run (values, optimizer states,
    labels), whatever its strides."""
    if buffer.shape != base.shape or base.ndim != 1:
        raise ValueError(f"strided_like: a 1-D buffer of {base.shape} elements, not {buffer.shape}")
    offset = (address(view) - address(base)) // view.itemsize
    strides = tuple(s // view.itemsize * buffer.itemsize for s in view.strides)
    if isinstance(buffer, numpy.ndarray):
        return numpy.lib.stride_tricks.as_strided(buffer[offset:], view.shape, strides)
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    return cupy.lib.stride_tricks.as_strided(buffer[offset:], view.shape, strides)


class Parameter:
    """This rank's slice of a logical tensor, its gradient, and how it is partitioned.

    ``data`` may be a view into a fused buffer (QKV, gate/up); it is always updated in place.
    ``grad`` is ``grad_buffer(data)`` unless given (a view into a fused layer's buffer).
    ``decay`` is False for biases and norm gains (AdamW applies no weight decay to them).
    ``grad`` is None for a frozen parameter (made inside ``frozen()``): layers skip its gradient.
    """

    __slots__ = ("data", "grad", "partition", "decay")

    def __init__(self, data, partition: Partition, grad=None, decay: bool = True):
        if tuple(data.shape) != partition.local_shape:
            raise ValueError(f"parameter data {tuple(data.shape)} does not match partition {partition.local_shape}")
        self.data = data
        self.grad = grad_buffer(data) if grad is None else grad
        self.partition = partition
        self.decay = decay

    @property
    def shape(self):
        return self.data.shape

    @property
    def trainable(self) -> bool:
        return self.grad is not None

    def load_full(self, full):
        """Set this rank's slice from the logical (unpadded) tensor; padding stays zero."""
        full = backend.xp.asarray(full, dtype=self.data.dtype)
        if tuple(full.shape) != tuple(self.partition.full_shape):
            raise ValueError(
                f"tensor shape {tuple(full.shape)} does not match logical shape {self.partition.full_shape}"
            )
        self.data[...] = 0
        self.data[self.partition.valid_local()] = full[self.partition.local_slice()]


class Module:
    """Parameters and sub-modules are found from attributes, in the order they were set.
    Attributes whose name starts with "_" are references the module uses but does not own."""

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        for name, value in vars(self).items():
            if name.startswith("_"):
                continue
            if isinstance(value, Parameter):
                yield prefix + name, value
            elif isinstance(value, Module):
                yield from value.named_parameters(f"{prefix}{name}.")

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def modules(self) -> Iterator[Module]:
        """This module and the sub-modules it owns, depth first."""
        yield self
        for name, value in vars(self).items():
            if not name.startswith("_") and isinstance(value, Module):
                yield from value.modules()

    def state(self) -> dict[str, Parameter]:
        return dict(self.named_parameters())

    def trainable_state(self) -> dict[str, Parameter]:
        """The parameters that have gradients (all of them unless some were built ``frozen``)."""
        return {name: p for name, p in self.named_parameters() if p.trainable}

    def zero_grad(self):
        for p in self.parameters():
            if p.trainable:
                p.grad[...] = 0

    def local_bytes(self) -> int:
        return sum(p.data.nbytes for p in self.parameters())


class ModuleList(Module):
    """An indexed list of modules whose parameters are named ``0.``, ``1.``, ..."""

    def __init__(self, modules):
        self.items = list(modules)

    def named_parameters(self, prefix: str = ""):
        for i, m in enumerate(self.items):
            yield from m.named_parameters(f"{prefix}{i}.")

    def modules(self):
        yield self
        for m in self.items:
            yield from m.modules()

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]
