"""Communicator correctness: every collective's values, in every dtype, and the flat pairs' adjoints
(the tensor-parallel regions' adjoint tests are in test_regions.py)."""

import numpy as np
import pytest

from hpc_tp.comm.mpi import world

pytestmark = pytest.mark.mpi(min_size=1)


def _dtype(name):
    """numpy's dtype; bfloat16 through ml_dtypes (its arrays travel as uint16 bits or float32 sums)."""
    if name == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.dtype(name)


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_collectives_values(dtype):
    comm = world()
    n, r = comm.size, comm.rank
    dtype = _dtype(dtype)
    x = np.full((2, 3), float(r + 1), dtype)
    assert np.all(comm.all_reduce(x.copy()) == n * (n + 1) / 2)
    assert np.all(comm.all_reduce(x.copy(), op="max") == n)
    g = comm.all_gather(np.full((2, 1), float(r), dtype), axis=1)
    assert g.shape == (2, n) and np.all(g[0] == np.arange(n)) and g.dtype == dtype
    rs = comm.reduce_scatter(np.tile(np.arange(n, dtype=float)[:, None], (1, 2)).astype(dtype), axis=0)
    assert rs.shape == (1, 2) and np.all(rs == r * n) and rs.dtype == dtype
    b = comm.broadcast(np.full(3, float(r), dtype), root=n - 1)
    assert np.all(b == n - 1)
    a2a = comm.all_to_all((np.arange(n, dtype=float)[:, None] + 10 * r).astype(dtype))
    assert np.all(a2a[:, 0] == np.arange(n) * 10 + r)
    handle = comm.iall_reduce(np.ones(4, dtype))
    got = handle.wait()
    assert np.all(got == n) and got.dtype == dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2])
def test_gather_and_scatter_along_any_axis(dtype, axis):
    """Shards of every rank, gathered along an inner axis (each lands in place through a derived
    datatype) and reduce-scattered back (packed rank-major), against numpy on the full arrays."""
    comm = world()
    n, r = comm.size, comm.rank
    dtype = _dtype(dtype)
    shards = [np.random.default_rng(rank).integers(-8, 8, (3, 2, 4)).astype(dtype) for rank in range(n)]
    gathered = comm.all_gather(shards[r], axis=axis)
    assert gathered.dtype == dtype and np.array_equal(gathered, np.concatenate(shards, axis=axis))
    full = [np.concatenate([s * (rank + 1) for s in shards], axis=axis) for rank in range(n)]
    part = comm.reduce_scatter(full[r], axis=axis)
    want = np.split(sum(f.astype("float64") for f in full), n, axis=axis)[r]
    assert part.dtype == dtype and part.flags.c_contiguous and np.array_equal(part.astype("float64"), want)


@pytest.mark.parametrize("length", [1, 7, 64])
@pytest.mark.parametrize("native", [True, False], ids=["mpi", "generic"])
def test_flat_reduce_scatter_and_all_gather_are_adjoint(length, native):
    """ZeRO's pair on pieces of unequal size (some empty when the buffer is shorter than the
    group): the values, and <RS x, y> == <x, AG y> summed over the ranks. ``generic`` is the
    Communicator's own form (all-reduce based), which the NCCL and host-staged transports use."""
    from hpc_tp.comm.base import Communicator
    from hpc_tp.train.grad_sync import shard_counts

    comm = world()
    n, r = comm.size, comm.rank
    call = (lambda name: getattr(comm, name)) if native else (lambda name: getattr(Communicator, name).__get__(comm))
    counts = shard_counts(length, n)
    assert sum(counts) == length and max(counts) - min(counts) <= 1
    start = sum(counts[:r])
    xs = [np.random.default_rng(rank).standard_normal(length) for rank in range(n)]
    summed = xs[r].copy()
    piece = call("ireduce_scatter_flat")(summed, counts).wait()
    assert piece.shape == (counts[r],) and np.shares_memory(piece, summed[:1]) or not counts[r]  # in place, in front
    np.testing.assert_allclose(piece, sum(xs)[start : start + counts[r]], rtol=1e-14)
    y = np.random.default_rng(100 + r).standard_normal(counts[r])
    gathered = np.full(length, np.nan)
    gathered[start : start + counts[r]] = y
    assert call("iall_gather_flat")(gathered, counts).wait() is gathered
    ys = comm.allgather_object(y)
    assert np.array_equal(gathered, np.concatenate(ys))  # every piece exactly, on every rank
    lhs = comm.all_reduce_scalar(float(np.dot(piece, y)))
    rhs = comm.all_reduce_scalar(float(np.dot(xs[r], gathered)))
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0), (lhs, rhs)


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
@pytest.mark.parametrize("counts", ["even", "uneven"])
@pytest.mark.parametrize("root", ["first", "last"])
@pytest.mark.parametrize("native", [True, False], ids=["mpi", "generic"])
def test_flat_gather_to_one_rank_is_adjoint_to_a_scatter(dtype, counts, root, native):
    """The gather to one rank (ZeRO's checkpoint gather) on pieces of any sizes, some empty: root
    gets every piece bit for bit, the others keep their piece alone; and <G x, y> on root ==
    <x, S y> summed over the ranks, S scattering root's y into the pieces. ``generic`` is the
    Communicator's own form (point to point), which the NCCL and host-staged transports use."""
    from hpc_tp.comm.base import Communicator
    from hpc_tp.train.grad_sync import shard_counts

    comm = world()
    n, r = comm.size, comm.rank
    root = 0 if root == "first" else n - 1
    gather = comm.igather_flat if native else Communicator.igather_flat.__get__(comm)
    counts = shard_counts(7, n) if counts == "even" else [(3 * rank + 1) % 5 for rank in range(n)]  # 4: 1, 4, 2, 0
    length, start = sum(counts), sum(counts[:r])
    # Small integers: exact in every dtype, so both sides of the identity are exact sums.
    xs = [np.random.default_rng(rank).integers(-8, 8, counts[rank]).astype(_dtype(dtype)) for rank in range(n)]
    if r == root:
        x = np.full(length, np.nan, xs[r].dtype)
        x[start : start + counts[r]] = xs[r]
    else:
        x = xs[r].copy()
    assert gather(x, counts, root).wait() is x
    if r == root:
        assert x.dtype == xs[r].dtype and np.array_equal(
            x.view(f"u{x.itemsize}"), np.concatenate(xs).view(f"u{x.itemsize}")
        )
    else:
        assert x.shape == (counts[r],) and np.array_equal(x, xs[r])
    y = comm.broadcast(np.random.default_rng(100).integers(-8, 8, length).astype("float64"), root=root)
    scattered = y[start : start + counts[r]]  # S y: root's y, this rank's piece of it
    lhs = comm.all_reduce_scalar(float(np.dot(x.astype("float64"), y)) if r == root else 0.0)
    rhs = comm.all_reduce_scalar(float(np.dot(xs[r].astype("float64"), scattered)))
    assert lhs == rhs, (lhs, rhs)


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_point_to_point_ring(dtype):
    comm = world()
    n, r = comm.size, comm.rank
    out = np.full(5, float(r), _dtype(dtype))
    buf = np.empty(5, _dtype(dtype))
    send = comm.isend(out, (r + 1) % n, tag=7)
    got = comm.irecv(buf, (r - 1) % n, tag=7).wait()
    send.wait()
    assert np.all(got == (r - 1) % n)
    assert comm.seconds >= 0 and comm.bytes > 0


def test_split_groups_and_grid_layout():
    from hpc_tp.errors import ConfigError
    from hpc_tp.grid import ProcessGrid, factorizations

    comm = world()
    for tp, pp, dp in factorizations(comm.size):
        grid = ProcessGrid(tp, pp, dp, world=comm)
        assert grid.tp.size == tp and grid.pp.size == pp and grid.dp.size == dp
        # tp groups are neighbouring ranks, dp the outermost axis
        assert grid.tp.allgather_object(comm.rank) == list(
            range(comm.rank - comm.rank % tp, comm.rank - comm.rank % tp + tp)
        )
        assert grid.coords.dp == comm.rank // (tp * pp)
        assert not grid.tp_spans_nodes
    with pytest.raises(ConfigError, match=r"world size .* != tp\*pp\*dp"):
        ProcessGrid(tp=comm.size + 1, pp=1, dp=1, world=comm)
