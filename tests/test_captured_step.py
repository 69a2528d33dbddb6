"""The training step with its host values as device scalars (``train.captured_step``), on the CPU:
the same numbers as ``Trainer.train_step`` in every layout, a skipped float16 step skipped alike,
nothing inside read back by the host, the refusals, and the capture's order of events (a stand-in
for cupy). ``tests/test_gpu.py`` runs it captured on a card."""

import math

import numpy as np
import pytest
from test_cuda_graph import FakeCuda
from test_train import settings as train_settings
from tp_helpers import CaptureProbe

from hpc_tp.comm.mpi import world
from hpc_tp.errors import ConfigError
from hpc_tp.train import captured_step
from hpc_tp.train.captured_step import CapturedStep, check_capturable
from hpc_tp.train.schedule import lr_at
from hpc_tp.train.settings import TrainSettings
from hpc_tp.train.trainer import Trainer


def settings(**changes) -> TrainSettings:
    """test_train's run (tiny, float64, dropout: masks keyed by the step, which the device path must
    key alike) with clipping at work: the tiny model's first norms are above 0.5."""
    return train_settings(**{"steps": 8, "warmup": 2, "clip_grad": 0.5, **changes})


def pair(comm, step_class=CapturedStep, **changes):
    """Two trainers of the same run: one stepping eagerly, one through the device-scalar step."""
    eager, device = Trainer(settings(**changes), comm), Trainer(settings(**changes), comm)
    device.captured = step_class(device, capture=False)
    return eager, device


def largest_weight_error(a: Trainer, b: Trainer, comm) -> float:
    """Over every rank: max relative difference of the optimizer's weights (masters) and moments."""
    errors = [0.0]
    for name, p in a.precision.master.items():
        for x, y in (
            (p.data, b.precision.master[name].data),
            (a.optimizer.exp_avg[name], b.optimizer.exp_avg[name]),
            (a.optimizer.exp_avg_sq[name], b.optimizer.exp_avg_sq[name]),
        ):
            scale = max(float(np.abs(x).max()), 1e-300)
            errors.append(float(np.abs(np.asarray(x, "float64") - np.asarray(y, "float64")).max()) / scale)
    return max(comm.allgather_object(max(errors)))


def assert_same_records(eager: list[dict], device: list[dict], tol: float):
    for e, d in zip(eager, device, strict=True):
        assert e.keys() == d.keys()
        for key in ("loss", "grad_norm"):
            assert (math.isnan(e[key]) and math.isnan(d[key])) or abs(e[key] - d[key]) <= tol * abs(e[key]), key
        for key in ("skipped", "tokens", "lr", "loss_scale", "loss_scale_overflow"):
            assert e.get(key) == d.get(key), key


LAYOUTS = {"tp": lambda n: dict(tp=n), "dp": lambda n: dict(dp=n), "tp2 dp2": lambda n: dict(tp=2, dp=n // 2)}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_scalar_steps_equal_the_eager_steps(layout):
    comm = world()
    if layout == "tp2 dp2" and comm.size != 4:
        pytest.skip("tp = 2 with dp = 2 needs 4 ranks")
    eager, device = pair(comm, **LAYOUTS[layout](comm.size))
    records = [(eager.train_step(), device.train_step()) for _ in range(4)]
    assert_same_records([e for e, _ in records], [d for _, d in records], 1e-12)
    assert any(e["grad_norm"] > 0.5 for e, _ in records)  # the clip coefficient was at work
    assert largest_weight_error(eager, device, comm) < 1e-12
    assert device.optimizer.step_count == eager.optimizer.step_count == 4


@pytest.fixture
def quiet_fp16():
    # The injected inf makes float16 sums overflow on purpose.
    with np.errstate(over="ignore", invalid="ignore"):
        yield


def overflow_at(trainer: Trainer, step: int, rank: int):
    """What a float16 overflow leaves behind: an inf in one gradient on ``rank``, at ``step``."""
    forward_backward = trainer._forward_backward

    def overflowing(*args):
        loss = forward_backward(*args)
        if trainer.step == step and trainer.grid.world.rank == rank:
            next(iter(trainer.params.values())).grad.flat[0] = np.inf
        return loss

    trainer._forward_backward = overflowing


@pytest.mark.mpi(min_size=1)
def test_a_float16_overflow_is_skipped_and_the_scale_moves_as_the_eager_steps_move_it(quiet_fp16):
    """An inf on the last rank at step 2: skipped on every rank, the scale halved, then doubled
    again after two good steps (growth interval 2)."""
    comm = world()
    eager, device = pair(comm, dtype="float16", dp=comm.size, clip_grad=1.0)
    for trainer in (eager, device):
        trainer.precision.scaler.growth_interval = 2
        overflow_at(trainer, 2, comm.size - 1)
    device.captured.load_host_state()
    eager_records = [eager.train_step() for _ in range(6)]
    device_records = [device.train_step() for _ in range(6)]
    assert [r["skipped"] for r in device_records] == [False, False, True, False, False, False]
    assert device_records[2]["loss_scale_overflow"] and math.isnan(device_records[2]["grad_norm"])
    assert [r["loss_scale"] for r in device_records] == [2.0**16, 2.0**16, 2.0**17, 2.0**16, 2.0**16, 2.0**17]
    assert_same_records(eager_records, device_records, 1e-12)
    assert largest_weight_error(eager, device, comm) < 1e-12
    assert all(np.array_equal(p.data, device.params[n].data) for n, p in eager.params.items())  # the half weights
    assert device.optimizer.step_count == eager.optimizer.step_count == 5
    assert device.precision.scaler.state() == eager.precision.scaler.state()


class HostRead(RuntimeError):
    pass


class RefusesHostReads(np.ndarray):
    """A numpy array that fails where the host would read a device value: ``float``, ``int``,
    ``bool`` (an ``if``), ``item`` and ``tolist``; what is computed from it inherits the refusal."""

    def _refuse(self, *args, **kwargs):
        raise HostRead("a host read of a device value inside the step")

    __float__ = __int__ = __bool__ = __index__ = item = tolist = _refuse


class Watched(CapturedStep):
    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype).view(RefusesHostReads)


@pytest.mark.mpi(min_size=1)
def test_nothing_inside_the_step_is_read_by_the_host():
    """The step's own arrays (inputs, learning rate, counters, loss scale) refuse host reads, and so
    does everything computed from them: the token count, the scale, the loss, the norm, the finite
    flag. Run as they are, the steps still equal the eager ones."""
    comm = world()
    eager, device = pair(comm, Watched, tp=comm.size)
    for _ in range(2):
        assert_same_records([eager.train_step()], [device.train_step()], 1e-12)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_step_makes_only_collectives_a_graph_holds(layout):
    """What a capture of the step records over NCCL groups: array collectives on the stream (the tp
    regions', the dp buckets', the sums and the agreement), no host call on any group of the grid (a
    scalar, an object, a barrier), which would run once at the capture and never at a replay."""
    probe = CaptureProbe(world())
    if layout == "tp2 dp2" and probe.size % 2:
        pytest.skip("needs an even world")
    trainer = Trainer(settings(**LAYOUTS[layout](probe.size)), probe)
    step = CapturedStep(trainer, capture=False)
    ids, targets = trainer.dataset.get(trainer.sampler.indices(0))
    ids_in, targets_in, work = step._for_shape(ids, targets)
    ids_in[...], targets_in[...], step.lr[...] = ids, targets, 1e-3
    probe.capturing = True
    work()
    probe.capturing = False
    assert "all_reduce" in probe.calls or probe.size == 1


HOST_READS = {
    "a count summed as a float": ("_summed", lambda summed: lambda value, group: float(summed(value, group))),
    "an if on the finite flag": ("_agreed_finite", lambda agreed: lambda *args: bool(agreed(*args))),
}


@pytest.mark.parametrize("where", HOST_READS)
def test_a_host_read_put_back_into_the_step_fails_the_test(monkeypatch, where):
    _, device = pair(world().split(color=world().rank, key=0), Watched)
    name, reading = HOST_READS[where]
    monkeypatch.setattr(captured_step, name, reading(getattr(captured_step, name)))
    with pytest.raises(HostRead):
        device.train_step()


def test_the_capture_runs_once_eagerly_then_replays_with_each_steps_inputs_copied_in(monkeypatch):
    import sys
    import types

    events = []
    cupy = types.ModuleType("cupy")
    cupy.cuda = FakeCuda(events)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    trainer = Trainer(settings(model_overrides={}), world().split(color=world().rank, key=0))
    trainer.captured = step = CapturedStep(trainer, capture=True)
    seen = []  # what the step's own arrays held at each run of its work and each launch: (ids, rate)

    def saw(event):
        ((ids_in, _, _),) = step._shapes.values()
        events.append(event)
        seen.append((ids_in.copy(), float(step.lr)))

    work = step._step
    step._step = lambda ids, targets: saw("work") or work(ids, targets)
    trainer.train_step()
    ((_, _, replayed),) = step._shapes.values()
    replayed._graph.launch = lambda: saw("launch")
    trainer.train_step()
    trainer.train_step()
    assert events == [
        "private pool",
        "on capture stream",
        "work",  # the first step, eager
        "begin capture",
        "work",  # recorded
        "end capture",
        "off capture stream",
        "default pool",
        "launch",
        "launch",
    ]
    batches = [(trainer.dataset.get(trainer.sampler.indices(i))[0], lr_at(i, 3e-3, 2, 8, 0.1)) for i in range(3)]
    for (ids, lr), (step_ids, step_lr) in zip(seen, [batches[0], batches[0], batches[1], batches[2]], strict=True):
        assert np.array_equal(ids, step_ids) and lr == step_lr  # copied in before the step's launch


def test_cuda_graph_on_the_cpu_is_one_line():
    with pytest.raises(
        ConfigError, match=r"^--cuda-graph: a step runs as a CUDA graph on a GPU only, not on --device cpu$"
    ):
        Trainer(settings(cuda_graph=True), world().split(color=world().rank, key=0))


def test_what_the_device_scalar_step_refuses():
    comm = world().split(color=world().rank, key=0)
    moe = Trainer(settings(model_overrides={"num_experts": 2}), comm)
    with pytest.raises(ConfigError, match=r"num_experts 2: MoE routing counts its tokens on the host"):
        CapturedStep(moe, capture=False)


@pytest.mark.mpi(min_size=2)
def test_pipelines_and_zero_1_are_refused_and_mpi_groups_are_not_captured(monkeypatch):
    comm = world()
    pipeline = Trainer(settings(pp=2, dp=comm.size // 2), comm)
    with pytest.raises(ConfigError, match=r"--pp 2: pipeline messages and the loss cross stages over MPI"):
        CapturedStep(pipeline, capture=False)
    zero = Trainer(settings(dp=comm.size, distributed_optimizer=True), comm)
    with pytest.raises(ConfigError, match=r"--distributed-optimizer \(ZeRO-1\)"):
        CapturedStep(zero, capture=False)
    # On a card with the groups on MPI: the first group that cannot be captured is named.
    tp = Trainer(settings(tp=comm.size, model_overrides={}), comm)
    monkeypatch.setattr(captured_step.cuda_graph, "capturable", lambda group: group.size == 1)
    with pytest.raises(
        ConfigError,
        match=rf"^--cuda-graph: the tp group of {comm.size} ranks runs its collectives on the host \(MPI\), not on NCCL$",
    ):
        check_capturable(settings(device="cuda", model_overrides={}), tp.cfg, tp.grid)


def test_a_captured_step_refuses_dropout(monkeypatch):
    trainer = Trainer(settings(), world().split(color=world().rank, key=0))
    monkeypatch.setattr(captured_step.cuda_graph, "capturable", lambda group: True)
    with pytest.raises(
        ConfigError, match=r"^--cuda-graph: dropout draws its masks on the host for each step; capture needs dropout 0$"
    ):
        check_capturable(settings(device="cuda"), trainer.cfg, trainer.grid)


def test_a_resumed_run_loads_its_adam_count_and_loss_scale_into_the_device_scalars(tmp_path, quiet_fp16):
    comm = world().split(color=world().rank, key=0)
    folder = str(tmp_path / "run")
    first = Trainer(settings(dtype="float16", save=folder), comm)
    first.captured = CapturedStep(first, capture=False)
    first.precision.scaler.growth_interval = 1  # the scale doubles every good step: a state to carry
    first.captured.load_host_state()
    for _ in range(2):
        first.train_step()
    first.save()
    second = Trainer(settings(dtype="float16", save=folder, resume=True), comm)
    second.captured = CapturedStep(second, capture=False)
    second.resume()
    assert float(second.captured.adam_steps) == 2 and float(second.captured.loss_scale) == 2.0**18
    second.precision.scaler.growth_interval = 1
    assert_same_records([first.train_step()], [second.train_step()], 1e-12)
