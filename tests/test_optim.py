"""Optimizer, gradient norm, clipping, lr schedule and dp gradient buckets: every layout gives the
numbers of one process."""

import math
import zlib

import numpy as np
import pytest
from conftest import world_size

from hpc_tp.comm.mpi import self_comm
from hpc_tp.errors import ConfigError
from hpc_tp.grid import ProcessGrid, factorizations
from hpc_tp.module import GradArena, Parameter, grad_buffer, replicated, split
from hpc_tp.train.grad_sync import GradBucketer, all_reduce_grads
from hpc_tp.train.optim import AdamW, agree_finite, clip_coefficient, global_grad_norm
from hpc_tp.train.schedule import lr_at

pytestmark = pytest.mark.mpi(min_size=1)


def _mixed_partitions(tp: int, rank: int) -> dict:
    """name -> (partition, decay): every way a tensor-parallel layer cuts its parameters."""
    kv_parts = min(tp, 2)  # GQA with 2 KV heads: replicated in pairs when tp > 2
    return {
        "col.weight": (split((5, 8), 1, tp, rank), True),
        "row.weight": (split((8, 5), 0, tp, rank), True),
        "kv.weight": (split((5, 4), 1, kv_parts, rank // (tp // kv_parts), replicas=tp // kv_parts), True),
        "embed.weight": (split((7, 3), 0, tp, rank), True),  # 7 rows: the last piece is padded at tp 2 and 4
        "norm.weight": (replicated((5,), tp), False),
    }


def _full(name: str, shape, seed: int):
    """The same logical tensor on every rank for a given (name, seed)."""
    return np.random.default_rng([zlib.crc32(name.encode()), seed]).standard_normal(shape)


def _local(full, partition):
    local = np.zeros(partition.local_shape)
    local[partition.valid_local()] = full[partition.local_slice()]
    return local


def _padding(partition):
    mask = np.ones(partition.local_shape, dtype=bool)
    mask[partition.valid_local()] = False
    return mask


def _mixed_params(tp: int, rank: int, grad_seed: int, prefix: str = "") -> dict:
    return {
        prefix + name: Parameter(
            _local(_full(name, part.full_shape, 0), part),
            part,
            grad=_local(_full(prefix + name, part.full_shape, grad_seed), part),
            decay=decay,
        )
        for name, (part, decay) in _mixed_partitions(tp, rank).items()
    }


def _set_grads(named: dict, seed: int, scale: float = 1.0):
    for name, p in named.items():
        p.grad[...] = scale * _local(_full(name, p.partition.full_shape, seed), p.partition)


def _full_sum_of_squares(names_and_shapes, seed: int) -> float:
    return sum(float(np.sum(_full(name, shape, seed) ** 2)) for name, shape in names_and_shapes)


# -- AdamW ------------------------------------------------------------------------------------------------


def test_adamw_sharded_equals_full_then_sliced():
    grid = ProcessGrid(tp=world_size())
    assert self_comm().size == 1
    sharded = _mixed_params(grid.tp_size, grid.coords.tp, grad_seed=1)
    full = _mixed_params(1, 0, grad_seed=1)
    optimizers = [AdamW(sharded, lr=1e-2), AdamW(full, lr=1e-2)]
    for step in range(4):
        for named in (sharded, full):
            _set_grads(named, seed=step + 1)
        for optimizer in optimizers:
            optimizer.step(lr_at(step, 1e-2, warmup_steps=2, total_steps=4))
    states, full_states = (optimizer.state_tensors() for optimizer in optimizers)
    assert sorted(states) == sorted(f"optim.{kind}.{name}" for kind in ("exp_avg", "exp_avg_sq") for name in sharded)
    for name, p in sharded.items():
        part = p.partition
        for local, reference in [
            (p.data, full[name].data),
            (states[f"optim.exp_avg.{name}"].data, full_states[f"optim.exp_avg.{name}"].data),
            (states[f"optim.exp_avg_sq.{name}"].data, full_states[f"optim.exp_avg_sq.{name}"].data),
        ]:
            assert local.shape == part.local_shape
            # Elementwise updates: bit-identical, not merely close.
            np.testing.assert_array_equal(local[part.valid_local()], reference[part.local_slice()], err_msg=name)
            assert np.all(local[_padding(part)] == 0), f"{name}: padding moved"
        assert states[f"optim.exp_avg.{name}"].partition is part
    assert all(optimizer.step_count == 4 for optimizer in optimizers)


def test_adamw_decays_only_where_asked_and_updates_views_in_place():
    fused = np.ones((3, 4))
    decayed = Parameter(fused[:, :2], replicated((3, 2), 1))
    kept = Parameter(fused[:, 2:], replicated((3, 2), 1), decay=False)
    AdamW({"w": decayed, "b": kept}, lr=0.5, weight_decay=0.1).step()  # zero gradients: only decay moves them
    assert decayed.data.base is fused
    np.testing.assert_array_equal(fused[:, :2], 1 - 0.5 * 0.1)
    np.testing.assert_array_equal(fused[:, 2:], 1.0)


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": -1.0}, {"lr": 1.0, "betas": (0.9, 1.0)}, {"lr": 1.0, "eps": 0.0}, {"lr": 1.0, "weight_decay": -0.1}],
    ids=str,
)
def test_adamw_rejects_bad_settings(kwargs):
    with pytest.raises(ConfigError):
        AdamW({}, **kwargs)


# -- gradient norm, clipping, finiteness ------------------------------------------------------------------


@pytest.mark.parametrize("tp,pp,dp", factorizations(world_size()))
def test_global_grad_norm_equals_norm_of_full_gradients(tp, pp, dp):
    grid = ProcessGrid(tp=tp, pp=pp, dp=dp)
    stage = grid.coords.pp
    # Each stage holds its own mix; the tied embedding sits on the first and last stage with the
    # same gradient and is counted by the first only. Gradients are equal across dp, as after the dp all-reduce.
    named = _mixed_params(tp, grid.coords.tp, grad_seed=7, prefix=f"layers.{stage}.")
    tied = split((7, 3), 0, tp, grid.coords.tp)
    if grid.is_first_stage or grid.is_last_stage:
        named["tied.weight"] = Parameter(
            np.zeros(tied.local_shape), tied, grad=_local(_full("tied.weight", (7, 3), 7), tied)
        )
    skip = {"tied.weight"} if grid.is_last_stage and not grid.is_first_stage else set()
    shapes = [
        (f"layers.{s}.{name}", part.full_shape)
        for s in range(pp)
        for name, (part, _) in _mixed_partitions(1, 0).items()
    ]
    expected = math.sqrt(_full_sum_of_squares(shapes + [("tied.weight", (7, 3))], seed=7))
    norm = global_grad_norm(named, grid, skip)
    assert abs(norm - expected) <= 1e-12 * expected, (norm, expected)


def test_clipping_scales_the_update_to_max_norm(monkeypatch):
    """``clip_coefficient`` of the global norm, applied inside AdamW's update, updates as if the
    gradients had been scaled to the clipped norm first (the same bits, fused or numpy)."""
    from hpc_tp.train import cpu_optim

    grid = ProcessGrid(tp=world_size())
    named = _mixed_params(grid.tp_size, grid.coords.tp, grad_seed=3)
    full_norm = math.sqrt(_full_sum_of_squares([(n, p.partition.full_shape) for n, p in named.items()], seed=3))
    assert global_grad_norm(named, grid) == pytest.approx(full_norm, rel=1e-12)
    for max_norm in (0.0, -1.0, 2 * full_norm):  # disabled, disabled, not needed
        assert clip_coefficient(full_norm, max_norm) == 1.0
    scale = clip_coefficient(full_norm, 1.0)
    assert scale == pytest.approx(1.0 / full_norm, rel=1e-5)
    for fused in (True, False):
        monkeypatch.setattr(cpu_optim, "ENABLED", fused and cpu_optim.ENABLED)
        clipped = {n: Parameter(p.data.copy(), p.partition, decay=p.decay) for n, p in named.items()}
        prescaled = {n: Parameter(p.data.copy(), p.partition, decay=p.decay) for n, p in named.items()}
        for n, p in named.items():
            clipped[n].grad[...] = p.grad
            prescaled[n].grad[...] = p.grad * scale
        AdamW(clipped, lr=0.1).step(grad_scale=scale)
        AdamW(prescaled, lr=0.1).step()
        assert global_grad_norm(prescaled, grid) == pytest.approx(1.0, rel=1e-5)
        for n in named:
            assert np.array_equal(clipped[n].data, prescaled[n].data)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_bad_gradient_anywhere_makes_every_rank_skip(bad):
    """One rank's inf or NaN gradient makes its global norm inf/NaN, and ``agree_finite`` says so
    on every rank."""
    grid = ProcessGrid(tp=1)
    named = _mixed_params(1, 0, grad_seed=5)
    assert agree_finite(grid, global_grad_norm(named, grid), 1.0)
    if grid.world.rank == grid.world.size - 1:
        named["row.weight"].grad[2, 1] = bad
    assert not agree_finite(grid, global_grad_norm(named, grid), 1.0)
    assert not agree_finite(ProcessGrid(tp=1), 1.0, np.nan)  # a NaN loss alike


# -- schedule ---------------------------------------------------------------------------------------------


def test_lr_schedule_warmup_peak_and_end():
    lr = [lr_at(step, 1.0, warmup_steps=4, total_steps=10) for step in range(12)]
    assert lr[:4] == [0.25, 0.5, 0.75, 1.0]  # the last warmup step takes the peak
    assert lr[4] < 1.0 and all(a >= b for a, b in zip(lr[3:], lr[4:]))
    assert lr[6] == pytest.approx(0.55)  # half way through the decay: (peak + min) / 2
    assert lr[9] == pytest.approx(0.1) and lr[11] == pytest.approx(0.1)
    assert lr_at(0, 3e-4, warmup_steps=0, total_steps=1, min_lr_ratio=0.0) == 0.0


@pytest.mark.parametrize(
    "args",
    [(-1, 1.0, 2, 10), (0, 0.0, 2, 10), (0, 1.0, 11, 10), (0, 1.0, 2, 0), (0, 1.0, 2.5, 10), (0, 1.0, 2, 10, 1.5)],
    ids=str,
)
def test_lr_schedule_rejects_bad_arguments(args):
    with pytest.raises(ConfigError) as error:
        lr_at(*args)
    assert "\n" not in str(error.value)


# -- data-parallel gradient buckets -----------------------------------------------------------------------


def _dp_params(rank: int) -> tuple[dict, GradArena]:
    """Gradients that differ per rank, in an arena of 128-byte chunks: two of them non-contiguous
    views of one fused buffer (192 bytes: a chunk of its own), one float32 (a chunk of its dtype)."""
    with GradArena(128) as arena:
        fused_grad = grad_buffer(np.zeros((4, 6)))
        named = {
            "fused.a": Parameter(np.zeros((4, 2)), replicated((4, 2), 1), grad=fused_grad[:, :2]),
            "fused.b": Parameter(np.zeros((4, 4)), replicated((4, 4), 1), grad=fused_grad[:, 2:]),
            "half": Parameter(np.zeros((3, 3), np.float32), replicated((3, 3), 1)),
            "w1": Parameter(np.zeros((5, 3)), replicated((5, 3), 1)),  # 120 bytes: w2 starts a new chunk
            "w2": Parameter(np.zeros((2, 2)), replicated((2, 2), 1)),
            "w3": Parameter(np.zeros((7,)), replicated((7,), 1)),
        }
    for name, p in named.items():
        p.grad[...] = _full(name, p.grad.shape, rank)
    return named, arena


def _launched(bucket) -> bool:
    return bucket.request is not None


@pytest.mark.parametrize("average", [True, False])
def test_bucketer_overlapped_and_plain_paths_give_the_mean_over_ranks(average):
    grid = ProcessGrid(tp=1, dp=world_size())
    dp, rank = grid.dp.size, grid.dp.rank
    (overlapped, arena), (plain, plain_arena) = _dp_params(rank), _dp_params(rank)
    bucketer = GradBucketer(overlapped, grid.dp, arena, average=average)
    # Reverse allocation order (backward's), a fused gradient whole in one bucket.
    assert [b.names for b in bucketer.buckets] == [["w3", "w2"], ["w1"], ["half"], ["fused.b", "fused.a"]]

    bucketer.start()
    first, second = bucketer.buckets[:2]
    bucketer.mark_ready(*second.names)
    assert not _launched(second)  # waits for the bucket before it, so every rank issues the same order
    bucketer.mark_ready(*first.names)
    assert _launched(first) == _launched(second) == (dp > 1)
    rest = [name for bucket in bucketer.buckets[2:] for name in bucket.names]
    np.random.default_rng(rank).shuffle(rest)  # a different order on every rank
    for name in rest[:-1]:  # the last is never marked: finish() sends it anyway
        bucketer.mark_ready(name)
    bucketer.finish()
    all_reduce_grads(plain, grid.dp, plain_arena, average=average)

    for name, p in overlapped.items():
        expected = sum(_full(name, p.grad.shape, r) for r in range(dp)) / (dp if average else 1)
        np.testing.assert_allclose(p.grad, expected, rtol=1e-6 if p.grad.dtype == np.float32 else 1e-12, err_msg=name)
        np.testing.assert_array_equal(p.grad, plain[name].grad, err_msg=name)


def test_buckets_are_the_gradients_own_storage():
    """A bucket is the arena's memory under its gradients, exactly: summed in place, nothing copied."""
    named, arena = _dp_params(0)
    bucketer = GradBucketer(named, ProcessGrid(tp=1, dp=world_size()).dp, arena)
    for bucket in bucketer.buckets:
        grads = [named[name].grad for name in bucket.names]
        assert all(np.shares_memory(g, bucket.flat) for g in grads)
        assert sum(g.size for g in grads) == bucket.flat.size  # no gap, no overlap
        assert bucket.flat.base is arena.chunks[arena.locate(grads[0])[0]]


def test_grad_arena_chunks_and_misuse():
    with GradArena(64) as arena:
        a, b = grad_buffer(np.ones(5)), grad_buffer(np.ones(3))  # 40 + 24 bytes: one chunk
        big = grad_buffer(np.ones((3, 4), np.float16))  # a float32 gradient of 48 bytes: its own dtype's chunk
        c = grad_buffer(np.ones(1))  # 8 more float64 bytes do not fit: a new chunk
        with pytest.raises(RuntimeError, match="do not nest"):
            with GradArena(64):
                pass
    assert big.dtype == np.float32 and not any(x.any() for x in (a, b, big, c))
    assert [arena.locate(x) for x in (a, b, big, c)] == [(0, 0, 5), (0, 5, 8), (1, 0, 12), (2, 0, 1)]
    assert arena.locate(big[:, 1:3]) == (1, 1, 11)  # a strided view spans from its first element to its last
    assert grad_buffer(np.ones(2)).base is None  # outside the block: a plain array
    with pytest.raises(ValueError, match="outside the GradArena"):
        arena.locate(np.zeros(5))
    with pytest.raises(ConfigError, match="must be > 0"):
        GradArena(0)


def test_bucketer_reports_misuse():
    grid = ProcessGrid(tp=1, dp=world_size())
    named, arena = _dp_params(grid.dp.rank)
    bucketer = GradBucketer(named, grid.dp, arena)
    with pytest.raises(RuntimeError, match="before start"):
        bucketer.mark_ready("w1")
    bucketer.start()
    with pytest.raises(KeyError, match="nope"):
        bucketer.mark_ready("nope")
    bucketer.mark_ready("w1")
    with pytest.raises(RuntimeError, match="twice"):
        bucketer.mark_ready("w1")
    bucketer.finish()
    with pytest.raises(ValueError, match="outside the GradArena"):
        GradBucketer({"w": Parameter(np.zeros(3), replicated((3,), 1))}, grid.dp, GradArena(128))


def _adamw_run(dtype, fused: bool, monkeypatch, steps: int = 3):
    """Parameters after ``steps`` AdamW updates: a decayed weight, a column block of a fused
    weight (a strided view) and a bias, with numba's loops or with numpy's code."""
    from hpc_tp.train import cpu_optim

    monkeypatch.setattr(cpu_optim, "ENABLED", fused and cpu_optim.ENABLED)
    rng = np.random.default_rng(0)
    buffer = rng.standard_normal((6, 10)).astype(dtype)
    params = {
        "w": Parameter(rng.standard_normal((4, 6)).astype(dtype), replicated((4, 6), 1)),
        "qkv.k": Parameter(buffer[:, 3:7], replicated((6, 4), 1)),
        "b": Parameter(rng.standard_normal(6).astype(dtype), replicated((6,), 1), decay=False),
    }
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        for p in params.values():
            p.grad[...] = rng.standard_normal(p.grad.shape)
        opt.step(lr=1e-2 / (step + 1))
    return [p.data.copy() for p in params.values()] + [buffer.copy()]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_adamw_gives_numpys_bits(dtype, monkeypatch):
    from hpc_tp.train import cpu_optim

    if not cpu_optim.ENABLED:
        pytest.skip("numba is not installed (or HPC_TP_CPU_KERNELS=0)")
    fused, composed = _adamw_run(dtype, True, monkeypatch), _adamw_run(dtype, False, monkeypatch)
    for a, b in zip(fused, composed, strict=True):
        assert a.dtype == np.dtype(dtype) and np.array_equal(a, b)
    assert not np.array_equal(fused[-1][:, :3], fused[-1][:, 3:7])  # the view was updated in its buffer


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_sum_of_squares(dtype):
    from hpc_tp.train import cpu_optim

    if not cpu_optim.ENABLED:
        pytest.skip("numba is not installed (or HPC_TP_CPU_KERNELS=0)")
    x = np.random.default_rng(1).standard_normal((9, 40)).astype(dtype)
    for view in (x, x[:, 5:17], x[3]):
        assert cpu_optim.fused(view)
        exact = float((view.astype("float64") ** 2).sum())
        assert cpu_optim.sum_of_squares(view) == pytest.approx(exact, rel=1e-13)
    for bad in (np.inf, -np.inf, np.nan):  # the trainer's fault check reads this off the norm
        y = x.copy()
        y[4, 20] = bad
        assert not math.isfinite(cpu_optim.sum_of_squares(y)) and math.isfinite(cpu_optim.sum_of_squares(y[:4]))
    assert not cpu_optim.fused(x[:, ::2]) and not cpu_optim.fused(x.astype("float16"))
