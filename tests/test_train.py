"""The trainer: the same numbers in every layout, bit-identical reruns and resumes, the metrics log."""

import json

import numpy as np
import pytest
from tp_helpers import max_rel_err

from hpc_tp.comm.mpi import self_comm, world
from hpc_tp.errors import ConfigError
from hpc_tp.models import load_config
from hpc_tp.module import gather_full
from hpc_tp.train.expert_parallel import check_expert_parallel
from hpc_tp.train.metrics import read_metrics
from hpc_tp.train.settings import TrainSettings
from hpc_tp.train.trainer import Trainer


def settings(**changes) -> TrainSettings:
    base = dict(
        model="tiny",
        model_overrides={"dropout": 0.1, "attn_dropout": 0.1},
        dtype="float64",
        micro_batch=2,
        global_batch=8,
        seq_len=12,
        steps=12,
        lr=3e-3,
        warmup=3,
        eval_problems=6,
        samples=0,
        progress=False,
    )
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
@pytest.mark.parametrize(
    "model",
    [
        {"sequence_parallel": True},
        {"num_experts": 4, "top_k": 2, "capacity_factor": 1.0},
        {"sequence_parallel": True, "num_experts": 4, "top_k": 2, "capacity_factor": 1.0},
    ],
    ids=["sequence-parallel", "moe", "sequence-parallel-moe"],
)
def test_sequence_parallel_and_moe_train_like_one_process(model):
    comm = world()
    changes = dict(model, dropout=0.1)
    alone = losses(settings(model_overrides={**changes, "sequence_parallel": False}, steps=6), self_comm())
    parallel = losses(settings(model_overrides=changes, steps=6, tp=comm.size), comm)
    assert np.max(np.abs(parallel - alone) / alone) < 1e-9


# Dropout off: the ep=1 reference runs micro-batches ep times larger, whose masks are drawn for another shape.
# No biases: the K bias gradient is round-off (zero in exact math), which AdamW blows up to a full step.
MOE = {"num_experts": 4, "top_k": 2, "capacity_factor": 1.0, "bias": False}
EXPERT_LAYOUTS = {2: [(1, 1, 2, 2)], 4: [(1, 1, 4, 4), (1, 1, 4, 2), (2, 1, 2, 2), (1, 2, 2, 2)]}  # (tp, pp, dp, ep)


def moe_settings(**changes) -> TrainSettings:
    return settings(**{**dict(model_overrides=MOE, steps=4, warmup=1, eval_problems=1), **changes})


@pytest.mark.mpi(min_size=2)
def test_expert_parallel_trains_like_ep_1():
    """An ep group routes its ranks' micro-batches together, so ep=N with one micro-batch per rank
    is ep=1 with the group's rows as one micro-batch (here: one process). Losses, grad norms (each
    expert counted once), MoE counts and every final parameter agree; expert gradients are summed
    over expert_dp when two ranks hold the same expert (dp=4, ep=2)."""
    comm = world()
    references = {}
    for tp, pp, dp, ep in EXPERT_LAYOUTS.get(comm.size, []):
        micro = 8 // dp
        if micro * ep not in references:
            one = Trainer(moe_settings(micro_batch=micro * ep), self_comm())
            references[micro * ep] = one, one.run().records
        ref, ref_records = references[micro * ep]
        par = Trainer(moe_settings(tp=tp, pp=pp, dp=dp, ep=ep, micro_batch=micro), comm)
        records = par.run().records
        for key in ("loss", "grad_norm", "moe_aux"):
            got, want = np.array([r[key] for r in records]), np.array([r[key] for r in ref_records])
            assert np.max(np.abs(got - want) / np.abs(want)) < 1e-9, (tp, pp, dp, ep, key)
        assert [r["moe_dropped"] for r in records] == [r["moe_dropped"] for r in ref_records]
        assert sum(r["moe_dropped"] for r in records) > 0
        assert np.allclose([r["moe_load"] for r in records], [r["moe_load"] for r in ref_records], rtol=0, atol=1e-12)
        for name, p in par.params.items():
            assert max_rel_err(gather_full(p.data, p.partition, par.grid.tp), ref.params[name].data) < 1e-9, name
        experts = comm.allgather_object(
            sorted(n for n in par.params if ".experts." in n)
            if par.grid.coords.tp == 0 and par.grid.coords.dp < ep
            else []
        )
        assert sorted(sum(experts, [])) == sorted(n for n in ref.params if ".experts." in n)  # each once per group


@pytest.mark.mpi(min_size=2)
def test_resume_across_expert_parallel_sizes(tmp_path):
    """Saved with the experts spread over ep=world, resumed with all of them on every rank
    (ep=1, tensor-parallel over the world), and back: each continues the uninterrupted run."""
    comm = world()
    root = shared_tmp(tmp_path, comm)
    spread = dict(dp=comm.size, ep=comm.size, micro_batch=8 // comm.size)
    deep = dict(tp=comm.size, micro_batch=8)  # ep=1, dp=1: the same routing groups as spread
    whole = losses(moe_settings(**deep), comm)
    for saver, resumer, folder in ((spread, deep, f"{root}/spread"), (deep, spread, f"{root}/deep")):
        Trainer(moe_settings(save=folder, save_every=2, **saver), comm).run()
        _truncate_to(folder, 2, comm)
        tail = losses(moe_settings(save=folder, resume=True, **resumer), comm)
        assert len(tail) == 2 and np.max(np.abs(tail - whole[2:]) / whole[2:]) < 1e-9, (saver, resumer)


PIPELINE_LAYOUTS = {2: [(1, 2, 1)], 4: [(1, 2, 2), (2, 2, 1), (1, 4, 1)]}  # (tp, pp, dp) per world size


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_layouts_train_like_one_process(schedule):
    comm = world()
    four_layers = {"n_layers": 4, "dropout": 0.1, "attn_dropout": 0.1}  # tied embeddings: synced across stages
    alone = losses(settings(model_overrides=four_layers, steps=6), self_comm())
    for tp, pp, dp in PIPELINE_LAYOUTS.get(comm.size, []):
        run = settings(model_overrides=four_layers, steps=6, tp=tp, pp=pp, dp=dp, schedule=schedule, recompute=tp == 1)
        assert np.max(np.abs(losses(run, comm) - alone) / alone) < 1e-9, (tp, pp, dp)


INTERLEAVED_LAYOUTS = {2: [(1, 2, 1)], 4: [(1, 2, 2), (2, 2, 1)]}  # (tp, pp, dp) at 2 virtual stages per rank


@pytest.mark.mpi(min_size=2)
def test_interleaved_layouts_train_like_one_process():
    comm = world()
    four_layers = {"n_layers": 4, "dropout": 0.1, "attn_dropout": 0.1}  # 4 chunks at pp=2: one layer each
    alone = losses(settings(model_overrides=four_layers, steps=6), self_comm())
    for tp, pp, dp in INTERLEAVED_LAYOUTS.get(comm.size, []):
        run = settings(model_overrides=four_layers, steps=6, tp=tp, pp=pp, dp=dp, virtual_stages=2, recompute=tp == 1)
        assert np.max(np.abs(losses(run, comm) - alone) / alone) < 1e-9, (tp, pp, dp)


@pytest.mark.mpi(min_size=2)
def test_interleaved_checkpoints_resume_under_other_layouts(tmp_path):
    """Parameter names keep the whole model's layer indices: what pp=2 x V=2 saved, pp=2 x V=1 and
    pp=1 continue, and pp=2 x V=2 continues what pp=1 saved, each as the uninterrupted run."""
    comm = world()
    root = shared_tmp(tmp_path, comm)
    four_layers = {"n_layers": 4, "dropout": 0.1, "attn_dropout": 0.1}
    whole = losses(settings(model_overrides=four_layers, steps=6), self_comm())
    interleaved = dict(pp=2, dp=comm.size // 2, virtual_stages=2)
    staged, flat = dict(pp=2, dp=comm.size // 2), dict(dp=comm.size)
    for index, (saver, resumer) in enumerate(((interleaved, staged), (interleaved, flat), (flat, interleaved))):
        folder = f"{root}/{index}"
        Trainer(settings(model_overrides=four_layers, steps=6, save=folder, save_every=3, **saver), comm).run()
        _truncate_to(folder, 3, comm)
        tail = losses(settings(model_overrides=four_layers, steps=6, save=folder, resume=True, **resumer), comm)
        assert len(tail) == 3 and np.max(np.abs(tail - whole[3:]) / whole[3:]) < 1e-9, (saver, resumer)


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
        moved = np.array(
            [r["loss"] for r in Trainer(settings(tp=1, dp=comm.size, save=root, resume=True), comm).run().records]
        )
        assert np.max(np.abs(moved - whole[6:]) / whole[6:]) < 1e-9


@pytest.mark.mpi(min_size=2)
def test_dropout_drops_the_same_elements_however_the_batch_is_split():
    """Masks are keyed by each sample's place in the global batch, not by micro-batch or dp rank:
    the default split (one piece per dp rank at pp=1, 2*pp pieces at pp>1) changes nothing."""
    comm = world()
    whole = losses(settings(micro_batch=None, steps=4), self_comm())  # one piece of 8
    for split in (settings(micro_batch=1, steps=4), settings(micro_batch=None, steps=4, dp=comm.size)):
        got = losses(split, self_comm() if split.dp is None else comm)
        assert np.max(np.abs(got - whole) / whole) < 1e-9, (split.micro_batch, split.dp)


def _truncate_to(root, step, comm):
    """Point ``latest`` back at ``step`` and drop later checkpoints, as if the run had stopped there."""
    import shutil
    from pathlib import Path

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
    cases = {
        "--global-batch 10 is not divisible by --micro-batch 4 x dp 1": dict(global_batch=10, micro_batch=4),
        "--seq-len 99 is longer than the model's context: max_seq_len 64": dict(seq_len=99),
        "world size 1 != tp*pp*dp = 2*1*1": dict(tp=2, dp=1),
        "corpus nowhere.txt does not exist": dict(data="nowhere.txt"),
        "--dtype 'int8': expected one of float32, float64": dict(dtype="int8"),
        "--resume needs --save DIR": dict(resume=True),
        "--ep 0: expected a positive integer": dict(ep=0),
        "--virtual-stages 2 runs the interleaved 1F1B schedule: use --schedule 1f1b, not gpipe": dict(
            virtual_stages=2, schedule="gpipe"
        ),
        "--virtual-stages 2 needs a pipeline (--pp > 1)": dict(virtual_stages=2),
        "--ep 2 must divide the data-parallel size 1": dict(ep=2, model_overrides=MOE),
    }
    for message, change in cases.items():
        with pytest.raises(ConfigError) as e:
            Trainer(settings(**change), comm)
        assert message in str(e.value) and "\n" not in str(e.value)


def test_expert_parallel_needs_experts_it_can_spread():
    dense = load_config("tiny")
    check_expert_parallel(1, dense)
    with pytest.raises(ConfigError, match=r"--ep 2 needs a Mixture-of-Experts model \(num_experts > 0"):
        check_expert_parallel(2, dense)
    with pytest.raises(ConfigError, match="--ep 4 does not divide num_experts=6"):
        check_expert_parallel(4, load_config("tiny", num_experts=6))


def test_resume_refuses_another_model(tmp_path):
    Trainer(settings(steps=2, warmup=1, save=str(tmp_path)), self_comm()).run()
    with pytest.raises(ConfigError, match="holds another model .*hidden"):
        Trainer(settings(steps=4, save=str(tmp_path), resume=True, model_overrides={"hidden": 64}), self_comm()).run()
    with pytest.raises(ConfigError, match="seed=0.*asks 1"):
        Trainer(settings(steps=4, save=str(tmp_path), resume=True, seed=1), self_comm()).run()


def test_resume_may_turn_sequence_parallelism_on_or_off(tmp_path):
    """A layout, not a model: the checkpoint holds the same tensors either way."""
    dropout = settings().model_overrides
    Trainer(
        settings(steps=2, warmup=1, save=str(tmp_path), model_overrides={**dropout, "sequence_parallel": True}),
        self_comm(),
    ).run()
    resumed = Trainer(settings(steps=3, warmup=1, save=str(tmp_path), resume=True), self_comm()).run()
    assert [r["step"] for r in resumed.records] == [3]


def test_interleaved_needs_micro_batches_a_multiple_of_pp():
    assert settings(global_batch=8, micro_batch=1, virtual_stages=2).micro_batch_for(1, 4) == 1
    with pytest.raises(
        ConfigError,
        match=r"/ \(--micro-batch 1 x dp 1\) = 6 micro-batches per step: the interleaved "
        r"schedule \(--virtual-stages 2\) needs a multiple of --pp 4",
    ):
        settings(global_batch=6, micro_batch=1, virtual_stages=2).micro_batch_for(1, 4)


def test_settings_round_trip_through_the_command_line():
    import argparse

    from hpc_tp.train.command import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = settings_from_args(
        parser.parse_args(
            ["--tp", "2", "--set", "dropout=0.1", "--set", "norm=rmsnorm", "--global-batch", "32", "--no-progress"]
        )
    )
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
    if comm.size > 1:  # the planner keeps the --ep asked for: only layouts whose dp it divides
        moe = Trainer(moe_settings(plan="auto", ep=2, steps=1, warmup=0), comm)
        assert moe.grid.ep_size == 2 and moe.settings.dp % 2 == 0
