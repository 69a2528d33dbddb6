"""The tensor-parallel communication regions: each backward is its forward's adjoint,
<F x, y> == <x, F* y>, also when started with ``backward_async``; and a model's every collective
goes through one of these regions, so the adjoint tests cover what a training step runs."""

import sys

import numpy as np
import pytest
from tp_helpers import lm_batch

from hpc_tp.comm.mpi import world
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.tensor_parallel.mappings import REGIONS, Identity, MaxFromTensorParallel, Region

pytestmark = pytest.mark.mpi(min_size=1)


def _inner(a, b, kind, comm):
    """Inner product in the region's space: a replicated value counts once, sharded pieces sum over ranks."""
    local = float(np.vdot(a, b))
    return comm.all_reduce_scalar(local) if kind == "sharded" else local


def _random(kind, comm, seed, shape):
    # A replicated value is the same on every rank; a sharded one differs per rank.
    return np.random.default_rng(seed if kind == "replicated" else seed + 1000 * (comm.rank + 1)).standard_normal(shape)


@pytest.mark.parametrize("region_cls", REGIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("started", ["blocking", "async"])
def test_adjoint(region_cls, axis, started):
    comm = world()
    shape = (3, 4 * comm.size, 4 * comm.size)
    region = region_cls(comm, axis=axis)
    x = _random(region_cls.input_kind, comm, 1, shape)
    fx = region.forward(x.copy())
    y = _random(region_cls.output_kind, comm, 2, fx.shape)
    fty = region.backward(y.copy()) if started == "blocking" else region.backward_async(y.copy()).wait()
    assert fty.shape == x.shape
    lhs = _inner(fx, y, region_cls.output_kind, comm)
    rhs = _inner(x, fty, region_cls.input_kind, comm)
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0), (lhs, rhs)


@pytest.mark.parametrize("region_cls", REGIONS, ids=lambda c: c.__name__)
def test_backward_async_gives_what_backward_gives(region_cls):
    """The handle is waited after other work, as the column-parallel layer waits it after its weight gradient."""
    comm = world()
    region = region_cls(comm, axis=1)
    dy = _random(region_cls.output_kind, comm, 3, (2, 4 * comm.size, 5))
    pending = region.backward_async(dy.copy())
    other = np.ones(7) @ np.ones(7)  # work between start and wait
    assert other == 7.0
    assert np.array_equal(pending.wait(), region.backward(dy.copy()))


def test_identity_and_max():
    comm = world()
    x = _random("sharded", comm, 4, (3, 5))
    assert Identity().forward(x) is x and Identity().backward(x) is x
    everyone = np.stack(comm.allgather_object(x))
    assert np.array_equal(MaxFromTensorParallel(comm).forward(x.copy()), everyone.max(axis=0))


class _Recording:
    """A communicator that records each collective with the region that made it (None: none did)
    and the function that called it."""

    COLLECTIVES = ("all_reduce", "iall_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")

    def __init__(self, inner, calls):
        self._inner, self._calls = inner, calls

    def split(self, color, key):
        return _Recording(self._inner.split(color, key), self._calls)

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self.COLLECTIVES:
            return attr

        def call(*args, **kwargs):
            frame = sys._getframe(1)
            caller = frame.f_locals.get("self")
            made_by = type(caller).__name__ if isinstance(caller, (Region, MaxFromTensorParallel)) else None
            self._calls.append((name, made_by, f"{frame.f_code.co_filename}:{frame.f_code.co_name}"))
            return attr(*args, **kwargs)

        return call


# GQA with one KV head: its K/V gradients are summed over every tp rank that holds it; a MoE layer
# (one expert-parallel rank) in the sequence-parallel run.
CONFIG = dict(
    vocab_size=37,
    hidden=24,
    n_layers=2,
    n_heads=4,
    n_kv_heads=1,
    ffn_hidden=40,
    max_seq_len=16,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=True,
    tie_embeddings=True,
    num_experts=2,
    top_k=1,
    moe_every=2,
)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_every_collective_of_a_training_step_is_a_region(sequence_parallel):
    calls = []
    comm = _Recording(world(), calls)
    model = GPTModel(ModelConfig(**CONFIG, sequence_parallel=sequence_parallel), comm, seed=1)
    ids, targets = lm_batch(2, t=8)
    loss, count, ctx = model.forward(ids, targets)
    model.backward(ctx, 1.0 / count)
    model.logits(ids)
    direct = {(name, where) for name, made_by, where in calls if made_by is None}
    assert calls and not direct, f"collectives called outside a region: {sorted(direct)}"
    used = {made_by for _, made_by, _ in calls}
    assert used <= {c.__name__ for c in REGIONS} | {"MaxFromTensorParallel"}
    if comm.size > 1:  # at one rank the gathers and reduce-scatters send nothing and are not called
        plain = {"CopyToTensorParallel", "ReduceFromTensorParallel", "MaxFromTensorParallel"}
        sequence = {
            "GatherFromSequenceParallel",
            "ReduceScatterToSequenceParallel",
            "ScatterToTensorParallel",
            "GatherFromTensorParallel",
        }
        assert used == (plain | sequence if sequence_parallel else plain | {"GatherFromTensorParallel"})
