"""Mixed precision on the CPU (numpy float16): fp32 masters, dynamic loss scaling, checkpoints of masters."""

import math

import h5py
import numpy as np
import pytest

from hpc_tp.backend import resolve_dtype
from hpc_tp.errors import ConfigError
from hpc_tp.train.mixed_precision import LossScaler, MixedPrecision
from hpc_tp.train.settings import TrainSettings
from hpc_tp.train.trainer import Trainer


def _trainer(dtype, world=None, **kw):
    kw = {"steps": 20, "global_batch": 8, "progress": False, "samples": 0, **kw}
    return Trainer(TrainSettings(dtype=dtype, **kw), world=world)


@pytest.fixture
def quiet_fp16():
    # Scaled float16 sums overflow on purpose now and then: the skipped step is the expected outcome.
    with np.errstate(over="ignore", invalid="ignore"):
        yield


def test_loss_scaler_halves_on_overflow_and_grows_after_good_steps():
    scaler = LossScaler(scale=1024.0, growth_interval=3)
    scaler.update(False)
    assert (scaler.scale, scaler.good_steps) == (512.0, 0)
    for _ in range(2):
        scaler.update(True)
    assert scaler.scale == 512.0
    scaler.update(True)
    assert (scaler.scale, scaler.good_steps) == (1024.0, 0)
    floor = LossScaler(scale=2.0, min_scale=1.0)
    floor.update(False), floor.update(False)
    assert floor.scale == 1.0


def test_bad_scaler_settings_and_unknown_dtype_are_one_line_errors():
    with pytest.raises(ConfigError, match="loss scale 0"):
        LossScaler(scale=0)
    with pytest.raises(ConfigError, match="--dtype 'float17'"):
        TrainSettings(dtype="float17").check()


def test_bfloat16_needs_ml_dtypes():
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="ml_dtypes"):
            TrainSettings(dtype="bfloat16").check()
    else:
        assert resolve_dtype("bfloat16").itemsize == 2


def test_full_precision_runs_share_the_parameters():
    t = _trainer("float32")
    assert t.precision.master is t.precision.model and t.precision.loss_scale == 1.0


def test_fp16_follows_fp32_and_keeps_fp32_masters(quiet_fp16):
    fp32, fp16 = _trainer("float32"), _trainer("float16")
    fp16.precision.scaler = LossScaler(scale=2.0**10)  # low enough that no step of this run overflows
    records = {name: [t.train_step() for _ in range(6)] for name, t in (("fp32", fp32), ("fp16", fp16))}
    assert not any(r["skipped"] for r in records["fp16"])
    losses = {name: [r["loss"] for r in rs] for name, rs in records.items()}
    # Step 1 sees the same batch and initial weights rounded to fp16: the same loss to fp16 precision.
    assert abs(losses["fp16"][0] - losses["fp32"][0]) < 2e-3 * losses["fp32"][0]
    assert all(abs(a - b) < 0.01 * b for a, b in zip(losses["fp16"], losses["fp32"])), losses
    assert losses["fp16"][-1] < 0.7 * losses["fp16"][0]
    for name, p in fp16.params.items():
        master = fp16.precision.master[name]
        assert p.data.dtype == np.float16 and master.data.dtype == np.float32
        assert master.grad.dtype == np.float32
        np.testing.assert_array_equal(p.data, master.data.astype(np.float16))
    for kind in fp16.optimizer.state_tensors().values():
        assert kind.data.dtype == np.float32


def test_an_overflow_is_skipped_and_halves_the_scale(quiet_fp16):
    t = _trainer("float16")
    t.train_step()
    scale = t.precision.loss_scale
    masters = {n: p.data.copy() for n, p in t.precision.master.items()}
    weights = {n: p.data.copy() for n, p in t.params.items()}
    steps = t.optimizer.step_count
    forward_backward = t._forward_backward

    def overflowing(*args):
        loss = forward_backward(*args)
        next(iter(t.params.values())).grad.flat[0] = np.inf  # what an fp16 overflow leaves behind
        return loss

    t._forward_backward = overflowing
    record = t.train_step()
    assert record["skipped"] and math.isnan(record["grad_norm"])
    assert t.precision.loss_scale == scale / 2 and t.optimizer.step_count == steps
    for name, p in t.precision.master.items():
        np.testing.assert_array_equal(p.data, masters[name])
        np.testing.assert_array_equal(t.params[name].data, weights[name])
    t._forward_backward = forward_backward
    assert not t.train_step()["skipped"] and t.optimizer.step_count == steps + 1


def test_checkpoints_store_fp32_masters_and_resume_the_scale(tmp_path, quiet_fp16):
    t = _trainer("float16", save=str(tmp_path), steps=3)
    for _ in range(3):
        t.train_step()
    folder = t.save()
    name, master = next(iter(t.precision.master.items()))
    with h5py.File(folder / "master.h5", "r") as f:
        stored = f[f"tensors/{name}"]
        assert stored.dtype == np.float32
        np.testing.assert_array_equal(
            stored[...][master.partition.local_slice()], master.data[master.partition.valid_local()]
        )
    t.precision.scaler.scale = 8.0
    t.save()  # the latest checkpoint now carries scale 8
    again = _trainer("float16", save=str(tmp_path), steps=3, resume=True)
    again.resume()
    assert again.precision.loss_scale == 8.0
    for n, p in again.precision.master.items():
        np.testing.assert_array_equal(p.data, t.precision.master[n].data)
        np.testing.assert_array_equal(again.params[n].data, p.data.astype(np.float16))


def test_masters_share_the_float32_grads_and_the_update_rounds_masters_into_the_model():
    from hpc_tp.module import Parameter, replicated

    p = Parameter(np.array([1.0, 2.0**-20], dtype=np.float16), replicated((2,), 1))
    mp = MixedPrecision({"w": p}, "float16", LossScaler(scale=4.0))
    assert mp.master["w"].grad is p.grad and p.grad.dtype == np.float32
    mp.master["w"].data[...] = [3.0, 5.0]
    mp.update(True)
    np.testing.assert_array_equal(p.data, np.array([3.0, 5.0], dtype=np.float16))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_models_accumulate_gradients_in_float32(dtype):
    """Every gradient of a half model is float32, and a bias gradient summed over 8192 tokens and
    two micro-batches keeps float32's precision (a bfloat16 sum would be off by ~0.4% at best)."""
    from hpc_tp.comm.mpi import world
    from hpc_tp.models.config import load_config
    from hpc_tp.models.gpt import GPTModel
    from hpc_tp.tensor_parallel.layers import RowParallelLinear

    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    dtype = resolve_dtype(dtype)
    model = GPTModel(load_config("tiny"), world(), dtype=dtype.name)
    assert {p.grad.dtype for _, p in model.named_parameters()} == {np.dtype("float32")}
    masters = MixedPrecision(dict(model.named_parameters()), dtype.name).master  # no second float32 copy
    assert all(masters[name].grad is p.grad for name, p in model.named_parameters())
    layer = RowParallelLinear(4, 3, world(), dtype=dtype.name)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8192, 4)).astype(dtype)
    exact = np.zeros(3)
    for _ in range(2):
        dy = (1.0 + rng.random((8192, 3))).astype(dtype)
        _, ctx = layer.forward(x)
        layer.backward(dy, ctx)
        exact += dy.astype("float64").sum(axis=0)
    assert np.max(np.abs(layer.bias.grad - exact) / exact) < 1e-6


@pytest.mark.mpi(min_size=2)
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(comm_world, quiet_fp16):
    t = _trainer("float16", world=comm_world, global_batch=8)
    t.train_step()
    scale = t.precision.loss_scale
    forward_backward = t._forward_backward

    def overflowing(*args):
        loss = forward_backward(*args)
        if comm_world.rank == comm_world.size - 1:
            next(iter(t.params.values())).grad.flat[0] = np.inf
        return loss

    t._forward_backward = overflowing
    assert t.train_step()["skipped"]
    assert comm_world.allgather_object(t.precision.loss_scale) == [scale / 2] * comm_world.size


def test_float16_cross_entropy_and_norms_do_not_overflow():
    """A float16 sum of 4096 token losses near 30, or of the squares of a row with std 30, passes
    65504: both are computed in float32 and only the activations' results are rounded to float16."""
    from hpc_tp.comm.mpi import self_comm
    from hpc_tp.kernels import functional as F
    from hpc_tp.tensor_parallel.vocab import VocabParallelCrossEntropy

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((4, 1024, 64)) * 16).astype(np.float16)
    targets = rng.integers(0, 64, (4, 1024))
    ce = VocabParallelCrossEntropy(64, self_comm())
    loss, count, ctx = ce.forward(logits, targets)
    want, _, _ = ce.forward(logits.astype(np.float32), targets)
    assert math.isfinite(loss) and abs(loss - want) <= 1e-6 * want and loss > 65504
    assert ce.backward(ctx, 1.0 / count).dtype == np.float16
    x = (rng.standard_normal((4, 1024)) * 30).astype(np.float16)
    gain, bias = np.ones(1024, np.float16), np.zeros(1024, np.float16)
    for forward, backward, args in (
        (F.layernorm_forward, F.layernorm_backward, (gain, bias, 1e-5)),
        (F.rmsnorm_forward, F.rmsnorm_backward, (gain, 1e-5)),
    ):
        y, saved = forward(x, *args)
        y32, _ = forward(x.astype(np.float32), *(a.astype(np.float32) for a in args[:-1]), args[-1])
        assert y.dtype == np.float16 and np.abs(y.astype(np.float32) - y32).max() < 1e-2 and np.abs(y).max() > 1
        dx, *param_grads = backward(np.ones_like(x), gain, saved)
        assert dx.dtype == np.float16 and np.isfinite(dx).all()
        # the gain (and bias) gradients stay float32, the dtype of their buffers: summed over tokens
        # in float32 and never rounded to float16 on the way
        assert all(g.dtype == np.float32 and np.isfinite(g).all() for g in param_grads)


def test_loss_scale_overflows_are_not_bad_steps(quiet_fp16):
    """--max-bad-steps 1 with float16: an overflow the scaler absorbs (finite loss, the scale halves)
    is logged, not rolled back; a non-finite loss still is a bad step."""
    t = _trainer("float16", steps=3, max_bad_steps=1, eval_problems=4)
    forward_backward = t._forward_backward

    def overflowing(*args):
        loss = forward_backward(*args)
        next(iter(t.params.values())).grad.flat[0] = np.inf
        return loss

    t._forward_backward = overflowing
    records = t.run().records
    assert [r["loss_scale_overflow"] for r in records] == [True] * 3 and all(r["skipped"] for r in records)
    assert [r["loss_scale"] for r in records] == [2.0**16, 2.0**15, 2.0**14]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(dp=2)], ids=["tp", "pp", "dp"])
def test_bfloat16_trains_at_every_layout_over_mpi(comm_world, layout):
    """bfloat16 has no MPI datatype: its bits travel as uint16 and its sums go through float32; and
    numpy's bfloat16 product comes back float32, so the layers return activations in the model's
    dtype (a pipeline message of another dtype would be refused)."""
    pytest.importorskip("ml_dtypes")
    dp = comm_world.size // (layout.get("tp", 1) * layout.get("pp", 1))
    t = _trainer("bfloat16", world=comm_world, steps=6, eval_problems=2, **{**layout, "dp": dp})
    records = t.run().records
    assert not any(r["skipped"] for r in records) and records[-1]["loss"] < records[0]["loss"]
    assert all(p.data.dtype.name == "bfloat16" for p in t.params.values())
