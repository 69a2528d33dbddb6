"""LoRA under tensor parallelism: the adapted model's loss, logits and every adapter gradient equal one
process's at tp = world size (float64, 1e-10), the base weights stay frozen (no gradient buffer, bit-
unchanged by training), B = 0 makes step 0 the base model, and folding W += s A B for inference gives
the unfolded forward's numbers."""

import dataclasses
import types

import numpy as np
import pytest
from test_model import CONFIGS
from test_train import _truncate_to, losses, settings, shared_tmp
from tp_helpers import assert_grads_match, lm_batch, max_rel_err, same_loss_then_backward, same_random, tp_and_reference

from hpc_tp.comm.mpi import self_comm, world
from hpc_tp.errors import ConfigError
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.models.init import initialize
from hpc_tp.serve.loading import load_for_inference
from hpc_tp.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from hpc_tp.tensor_parallel.lora import LoRA
from hpc_tp.train.optim import AdamW
from hpc_tp.train.trainer import Trainer

pytestmark = pytest.mark.mpi(min_size=1)
LORA = dict(lora_rank=3, lora_alpha=5.0)


def randomize_adapters(model):
    """Random B (zero at initialisation, which would hide dA and the update), the same on every rank."""
    for name, p in model.named_parameters():
        if name.endswith("lora_b"):
            p.load_full(np.random.default_rng(len(name)).normal(0.0, 0.3, p.partition.full_shape))


def lora_pair(name, **extra):
    tp, ref = tp_and_reference()
    cfg = ModelConfig(**dict(CONFIGS[name], **LORA, **extra))
    par, one = GPTModel(cfg, tp, seed=3), GPTModel(cfg, ref, seed=3)
    for model in (par, one):
        randomize_adapters(model)
    return tp, par, one


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("name", ["gpt2-tied", "llama-gqa"])
def test_lora_model_matches_single_process(name, kv_heads):
    """One kv head at tp > 1 puts K/V segments on several ranks: their B is summed over the replicas."""
    tp, par, one = lora_pair(name, n_kv_heads=kv_heads)
    for seed in range(2):  # two micro-batches: each one's partial sums are summed over tp alone
        ids, targets = lm_batch(seed)
        same_loss_then_backward(par, one, ids, targets)
    assert_grads_match(par, one, tp, 1e-10)
    assert max_rel_err(par.logits(ids), one.logits(ids)) <= 1e-10
    trained = sorted(par.trainable_state())
    assert trained and all(n.endswith(("lora_a", "lora_b")) for n in trained)
    assert all(abs(p.grad).max() > 0 for p in par.trainable_state().values())


def test_frozen_parameters_have_no_gradient_buffer_and_the_count_is_the_adapters():
    tp, par, _ = lora_pair("llama-gqa")
    frozen = [p for p in par.parameters() if not p.trainable]
    assert frozen and all(p.grad is None for p in frozen)
    counted = sum(int(np.prod(p.partition.full_shape)) for p in par.trainable_state().values())
    assert counted == par.cfg.lora_parameters()
    total = sum(int(np.prod(p.partition.full_shape)) for p in par.parameters())
    assert total == par.cfg.parameter_count()


@pytest.mark.parametrize("name", ["gpt2-tied", "llama-gqa"])
def test_step_zero_is_the_base_model(name):
    tp, _ = tp_and_reference()
    base_cfg = ModelConfig(**CONFIGS[name])
    base, adapted = GPTModel(base_cfg, tp, seed=3), GPTModel(dataclasses.replace(base_cfg, **LORA), tp, seed=3)
    ids, _ = lm_batch()
    assert np.array_equal(adapted.logits(ids), base.logits(ids))


def test_training_moves_the_adapters_only():
    tp, par, _ = lora_pair("llama-gqa")
    before = {n: p.data.copy() for n, p in par.named_parameters() if not p.trainable}
    adapters = {n: p.data.copy() for n, p in par.trainable_state().items()}
    optimizer = AdamW(par.trainable_state(), lr=1e-2)
    for seed in range(3):
        ids, targets = lm_batch(seed)
        _, count, ctx = par.forward(ids, targets)
        par.backward(ctx, 1.0 / count)
        optimizer.step()
        par.zero_grad()
    for name, p in par.named_parameters():
        if name in before:
            assert np.array_equal(p.data, before[name]), name
        else:
            assert not np.array_equal(p.data, adapters[name]), name


@pytest.mark.parametrize("layer", ["column", "row"])
def test_adapter_gradients_match_finite_differences(layer):
    """dL/dA and dL/dB of L = sum(y * w) against central differences, on one process."""
    _, ref = tp_and_reference()
    lora = LoRA(2, 1.5)
    if layer == "column":
        m = ColumnParallelLinear(5, 6, ref, lora=lora)
    else:
        m = RowParallelLinear(6, 5, ref, input_is_parallel=True, lora=lora)
    initialize(m, std=0.3, n_layers=1, seed=1)
    for name, p in m.named_parameters():
        p.load_full(same_random(len(name), *p.partition.full_shape))
    x = same_random(7, 2, 3, 5 if layer == "column" else 6)
    w = same_random(8, 2, 3, 6 if layer == "column" else 5)
    y, ctx = m.forward(x)
    m.backward(w.copy(), ctx)
    for name, p in m.named_parameters():
        if not name.startswith("lora"):
            continue
        numeric = np.zeros_like(p.data)
        for i in np.ndindex(p.data.shape):
            kept = p.data[i]
            p.data[i] = kept + 1e-6
            up = float((m.forward(x)[0] * w).sum())
            p.data[i] = kept - 1e-6
            down = float((m.forward(x)[0] * w).sum())
            p.data[i] = kept
            numeric[i] = (up - down) / 2e-6
        assert max_rel_err(p.grad, numeric) <= 1e-7, name


@pytest.mark.parametrize("name", ["gpt2-tied", "llama-gqa"])
def test_folded_weights_give_the_unfolded_forward(name):
    tp, par, _ = lora_pair(name)
    ids, _ = lm_batch()
    unfolded = par.logits(ids)
    for module in par.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.fold_adapter()
    assert not par.trainable_state()  # the adapters are gone from the model
    assert max_rel_err(par.logits(ids), unfolded) <= 1e-10


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(lora_rank=-1), "lora_rank=-1: expected an integer >= 0"),
        (dict(lora_rank=4, lora_alpha=0), "lora_alpha=0: expected a number > 0"),
        (dict(lora_rank=4, num_experts=4), "lora_rank=4 with num_experts=4"),
        (dict(lora_rank=4, sequence_parallel=True), "lora_rank=4 with sequence_parallel=True"),
        (dict(lora_rank=4, quantize="int8"), "lora_rank=4 with quantize='int8'"),
    ],
)
def test_what_lora_does_not_do_is_one_clear_line(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")) as e:
        ModelConfig(**dict(CONFIGS["llama-gqa"], **values))
    assert "\n" not in str(e.value)


def lora_settings(**changes):
    return settings(**{"model_overrides": {"lora_rank": 4}, "lr": 1e-2, **changes})


@pytest.mark.mpi(min_size=1)
def test_fine_tune_learns_resumes_and_loads_folded_for_inference(tmp_path):
    """A base model trained and saved; LoRA started from it (--init) learns at tp = world as at tp = 1,
    its checkpoint resumes bit for bit, holds the base unchanged, and loads folded for inference."""
    comm = world()
    root = shared_tmp(tmp_path, comm)
    base = Trainer(settings(steps=4, save=f"{root}/base"), comm).run().checkpoint
    alone = losses(lora_settings(init=str(base)), self_comm())
    assert alone[-1] < alone[0]  # it learns
    tuned = Trainer(lora_settings(init=str(base), tp=comm.size, save=f"{root}/lora", save_every=6), comm)
    whole = np.array([r["loss"] for r in tuned.run().records])
    assert np.max(np.abs(whole - alone) / alone) < 1e-9
    # only the adapters' gradients go through the dp buckets, ZeRO's pieces and the pipeline's groups
    layouts = [dict(dp=comm.size), dict(dp=comm.size, distributed_optimizer=True)]
    layouts += [dict(pp=2, dp=comm.size // 2)] if comm.size > 1 else []
    for layout in layouts:
        spread = losses(lora_settings(init=str(base), **layout), comm)
        assert np.max(np.abs(spread - alone) / alone) < 1e-9, layout
    before = Trainer(settings(steps=4, init=str(base), tp=comm.size), comm).model.state()
    for name, p in tuned.model.state().items():
        if not p.trainable:
            assert np.array_equal(p.data, before[name].data), name
    args = types.SimpleNamespace(ckpt=f"{root}/lora", tp=comm.size, pp=1, device="cpu", dtype="float64")
    _, folded, _ = load_for_inference(args)
    assert not folded.trainable_state()
    ids, _ = lm_batch(v=folded.cfg.vocab_size)
    with tuned.model.inference(), folded.inference():  # no dropout
        assert max_rel_err(folded.logits(ids), tuned.model.logits(ids)) <= 1e-10
    _truncate_to(f"{root}/lora", 6, comm)
    tail = losses(lora_settings(init=str(base), tp=comm.size, save=f"{root}/lora", resume=True), comm)
    assert list(tail) == list(whole[6:])  # bit for bit
