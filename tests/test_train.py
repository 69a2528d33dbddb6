"""The trainer: the same numbers in every layout, bit-identical reruns and resumes, the metrics log."""
import json

import numpy as np
import pytest

from hpc_tp.comm.mpi import self_comm, world
from hpc_tp.errors import ConfigError
from hpc_tp.train.metrics import read_metrics
from hpc_tp.train.settings import TrainSettings
from hpc_tp.train.trainer import Trainer


def settings(**changes) -> TrainSettings:
    base = dict(model="tiny", model_overrides={"dropout": 0.1, "attn_dropout": 0.1}, dtype="float64",
                micro_batch=2, global_batch=8, seq_len=12, steps=12, lr=3e-3, warmup=3, eval_problems=6,
                samples=0, progress=False)
    base.update(changes)
    return TrainSettings(**base)


def losses(settings, comm):
    return np.array([r["loss"] for r in Trainer(settings, comm).run().records])


def shared_tmp(tmp_path, comm):
    """One folder every rank of ``comm`` sees (rank 0's tmp_path)."""
    return comm.bcast_object(str(tmp_path))


@pytest.mark.mpi(min_size=1)
def test_same_seed_same_layout_is_bit_identical():
    comm = world()
    first, second = losses(settings(tp=comm.size), comm), losses(settings(tp=comm.size), comm)
    assert len(first) == 12 and np.array_equal(first, second)
    assert first[-1] < first[0]  # it learns


@pytest.mark.mpi(min_size=1)
def test_tensor_parallel_trajectory_equals_one_process():
    comm = world()
    steps = settings(steps=20, warmup=5)
    alone = losses(steps, self_comm())
    parallel = losses(settings(steps=20, warmup=5, tp=comm.size), comm)
    assert np.max(np.abs(parallel - alone) / np.abs(alone)) < 1e-9


@pytest.mark.mpi(min_size=2)
def test_data_parallel_equals_one_data_parallel_rank():
    """tp x dp = (world/2) x 2 against (world/2) x 1 with the same global batch: each half of the
    world runs the dp=1 layout on its own."""
    comm = world()
    tp = comm.size // 2
    half = comm.split(color=comm.rank // tp, key=comm.rank)
    single = losses(settings(tp=tp, dp=1), half)
    both = losses(settings(tp=tp, dp=2), comm)
    assert np.max(np.abs(both - single) / np.abs(single)) < 1e-9


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("model", [{"sequence_parallel": True}, {"num_experts": 4, "top_k": 2, "capacity_factor": 1.0}],
                         ids=["sequence-parallel", "moe"])
def test_sequence_parallel_and_moe_train_like_one_process(model):
    comm = world()
    changes = dict(model, dropout=0.1)
    alone = losses(settings(model_overrides={**changes, "sequence_parallel": False}, steps=6), self_comm())
    parallel = losses(settings(model_overrides=changes, steps=6, tp=comm.size), comm)
    assert np.max(np.abs(parallel - alone) / alone) < 1e-9


PIPELINE_LAYOUTS = {2: [(1, 2, 1)], 4: [(1, 2, 2), (2, 2, 1), (1, 4, 1)]}  # (tp, pp, dp) per world size


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_layouts_train_like_one_process(schedule):
    comm = world()
    four_layers = {"n_layers": 4, "dropout": 0.1, "attn_dropout": 0.1}  # tied embeddings: synced across stages
    alone = losses(settings(model_overrides=four_layers, steps=6), self_comm())
    for tp, pp, dp in PIPELINE_LAYOUTS.get(comm.size, []):
        run = settings(model_overrides=four_layers, steps=6, tp=tp, pp=pp, dp=dp, schedule=schedule,
                       recompute=tp == 1)
        assert np.max(np.abs(losses(run, comm) - alone) / alone) < 1e-9, (tp, pp, dp)


@pytest.mark.mpi(min_size=1)
def test_resume_is_bit_identical_and_works_under_another_layout(tmp_path):
    comm = world()
    root = f"{shared_tmp(tmp_path, comm)}/ckpt"
    whole = losses(settings(tp=comm.size), comm)
    saving = Trainer(settings(tp=comm.size, save=root, save_every=6), comm).run()
    assert [r["loss"] for r in saving.records] == list(whole)  # saving changes nothing
    assert saving.checkpoint.name == "step-000012"

    _truncate_to(root, 6, comm)  # as if the run had been stopped after step 6
    tail = Trainer(settings(tp=comm.size, save=root, resume=True), comm).run()
    assert [r["step"] for r in tail.records] == list(range(7, 13))
    assert [r["loss"] for r in tail.records] == list(whole[6:])  # bit for bit

    if comm.size > 1:  # what tp=world saved, resumed by tp=1 x dp=world
        _truncate_to(root, 6, comm)
        moved = np.array([r["loss"] for r in
                          Trainer(settings(tp=1, dp=comm.size, save=root, resume=True), comm).run().records])
        assert np.max(np.abs(moved - whole[6:]) / whole[6:]) < 1e-9


def _truncate_to(root, step, comm):
    """Point ``latest`` back at ``step`` and drop later checkpoints, as if the run had stopped there."""
    from pathlib import Path
    import shutil

    comm.barrier()
    if comm.rank == 0:
        for folder in Path(root).glob("step-*"):
            if int(folder.name.split("-")[1]) > step:
                shutil.rmtree(folder)
        (Path(root) / "latest").write_text(f"step-{step:06d}\n")
    comm.barrier()


@pytest.mark.mpi(min_size=1)
def test_metrics_log_has_every_step(tmp_path):
    comm = world()
    log = f"{shared_tmp(tmp_path, comm)}/m.jsonl"
    Trainer(settings(tp=comm.size, steps=4, log=log), comm).run()
    if comm.rank == 0:
        records = read_metrics(log)
        steps = [r for r in records if "loss" in r]
        assert [r["step"] for r in steps] == [1, 2, 3, 4]
        for r in steps:
            assert {"lr", "grad_norm", "tokens_per_s", "step_s", "compute_s", "comm_s"} <= set(r)
            assert len(r["peak_mem_bytes"]) == comm.size and r["comm_s"] <= r["step_s"]
            assert abs(r["compute_s"] + r["comm_s"] - r["step_s"]) < 1e-9
        assert "heldout_accuracy" in records[-1]
        if comm.size > 1:
            assert any(r["comm_s"] > 0 for r in steps)


def test_bad_settings_name_the_value():
    comm = self_comm()
    cases = {"--global-batch 10 is not divisible by --micro-batch 4 x dp 1": dict(global_batch=10, micro_batch=4),
             "--seq-len 99 is longer than the model's context: max_seq_len 64": dict(seq_len=99),
             "world size 1 != tp*pp*dp = 2*1*1": dict(tp=2, dp=1),
             "corpus nowhere.txt does not exist": dict(data="nowhere.txt"),
             "--dtype 'float16': expected one of float32, float64": dict(dtype="float16"),
             "--resume needs --save DIR": dict(resume=True)}
    for message, change in cases.items():
        with pytest.raises(ConfigError) as e:
            Trainer(settings(**change), comm)
        assert message in str(e.value) and "\n" not in str(e.value)


def test_resume_refuses_another_model(tmp_path):
    Trainer(settings(steps=2, warmup=1, save=str(tmp_path)), self_comm()).run()
    with pytest.raises(ConfigError, match="holds another model .*hidden"):
        Trainer(settings(steps=4, save=str(tmp_path), resume=True, model_overrides={"hidden": 64}), self_comm()).run()
    with pytest.raises(ConfigError, match="seed=0.*asks 1"):
        Trainer(settings(steps=4, save=str(tmp_path), resume=True, seed=1), self_comm()).run()


def test_settings_round_trip_through_the_command_line():
    import argparse

    from hpc_tp.train.command import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = settings_from_args(parser.parse_args(["--tp", "2", "--set", "dropout=0.1", "--set", "norm=rmsnorm",
                                                   "--global-batch", "32", "--no-progress"]))
    assert parsed.tp == 2 and parsed.global_batch == 32 and not parsed.progress
    assert parsed.model_overrides == {"dropout": 0.1, "norm": "rmsnorm"}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        settings_from_args(parser.parse_args(["--set", "dropout"]))
    assert json.loads(json.dumps(parsed.to_dict()))["tp"] == 2


def test_init_starts_from_a_checkpoints_weights_with_a_fresh_optimizer(tmp_path):
    trained = Trainer(settings(steps=3, warmup=1, save=str(tmp_path / "a")), self_comm())
    trained.run()
    fresh = Trainer(settings(model="demo", steps=2, warmup=1, init=str(tmp_path / "a")), self_comm())
    assert fresh.cfg == trained.cfg and fresh.step == 0 and fresh.optimizer.step_count == 0
    for name, p in trained.params.items():
        assert np.array_equal(p.data, fresh.params[name].data), name
    assert fresh.tokenizer.identity == trained.tokenizer.identity
    with pytest.raises(ConfigError, match="no-such"):
        Trainer(settings(init=str(tmp_path / "no-such")), self_comm())


@pytest.mark.mpi(min_size=1)
def test_plan_auto_picks_a_layout_of_this_world():
    comm = world()
    trainer = Trainer(settings(plan="auto", steps=2, warmup=1), comm)
    s = trainer.settings
    assert s.plan is None and s.tp * s.pp * s.dp == comm.size
    assert (trainer.grid.tp_size, trainer.grid.pp_size, trainer.grid.dp_size) == (s.tp, s.pp, s.dp)
    assert len(trainer.run().records) == 2
    with pytest.raises(ConfigError, match="--plan auto cannot read the --init"):
        Trainer(settings(plan="auto", init="somewhere"), comm)
