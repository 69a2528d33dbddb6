"""Selective recomputation (``hpc_tp.recompute``) gives the numbers of no recomputation.

Attention keeps Q, K, V and each query row's log-sum-exp but neither its softmax nor its dropout
masks, and rebuilds both in backward, block by block: the whole model's loss and every gradient
must match a run that keeps them, at tp = world size (1, 2, 4), with and without dropout, causal
(in several query blocks) and not, with grouped-query attention and RoPE, through the fused CPU
kernel and the composed path; one layer likewise with key padding (a fully masked sequence
included); and the trainer's losses and gradient norms must match over a few steps. Then the
planner's side: the memory it predicts and the settings that ask for it.
"""

import argparse
from dataclasses import replace

import numpy as np
import pytest

from hpc_tp import backend
from hpc_tp.comm.mpi import self_comm, world
from hpc_tp.errors import ConfigError
from hpc_tp.grid import ProcessGrid
from hpc_tp.kernels import cpu_attention
from hpc_tp.models import ModelConfig, load_config
from hpc_tp.nn import attention
from hpc_tp.pipeline import build_stage, pipeline_forward_backward
from hpc_tp.plan.clusters import engine_precision, get_cluster
from hpc_tp.plan.cost import Layout, predict
from hpc_tp.plan.memory import (
    MEGATRON,
    attention_mask_bytes,
    attention_score_bytes,
    layer_activation_bytes,
    stage_memory,
)
from hpc_tp.tensor_parallel.random import DropoutRNG
from hpc_tp.train.command import add_arguments, settings_from_args
from hpc_tp.train.settings import TrainSettings
from hpc_tp.train.trainer import Trainer

TOL = 1e-12
MICRO, SEQ = 2, 12
BASE = ModelConfig(vocab_size=31, hidden=32, n_layers=2, n_heads=4, max_seq_len=SEQ)
VARIANTS = {  # model config changes; 4 heads and 2 kv heads split over tp = 1, 2, 4
    "dropout": dict(dropout=0.1, attn_dropout=0.1),
    "no dropout": dict(),
    "bidirectional": dict(causal=False, attn_dropout=0.1),
    "gqa rope": dict(
        n_kv_heads=2,
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        bias=False,
        tie_embeddings=False,
        attn_dropout=0.1,
    ),
}


def step_grads(cfg, grid, batches, recompute):
    """Loss and this rank's gradients after one pipeline step of ``batches``."""
    model = build_stage(cfg, grid, "float64", seed=5)
    loss, _ = pipeline_forward_backward(
        model, batches, grid, 1.0 / (len(batches) * MICRO * SEQ), "1f1b", recompute, step=3
    )
    return loss, {name: backend.to_numpy(p.grad).copy() for name, p in model.named_parameters()}


def check_modes_agree(cfg, grid):
    """Selective and full recomputation against none: the loss, and every gradient relative to the largest."""
    rng = np.random.default_rng(0)
    batches = [
        (rng.integers(0, cfg.vocab_size, (MICRO, SEQ)), rng.integers(0, cfg.vocab_size, (MICRO, SEQ))) for _ in range(2)
    ]
    loss, grads = step_grads(cfg, grid, batches, "none")
    scale = max(float(np.abs(g).max()) for g in grads.values())
    for mode in ("selective", "full"):
        again, again_grads = step_grads(cfg, grid, batches, mode)
        assert abs(again - loss) <= TOL * abs(loss), (mode, again, loss)
        for name, grad in grads.items():
            err = float(np.abs(again_grads[name] - grad).max()) / scale
            assert err <= TOL, f"{mode} tp={grid.tp_size}: {name} differs by {err:.1e}"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("variant", VARIANTS)
def test_selective_recompute_gives_the_gradients_of_none(variant, fused, monkeypatch):
    monkeypatch.setattr(attention, "QUERY_BLOCK", 5)  # causal: three query blocks of 5, 5 and 2
    if not fused:
        monkeypatch.setattr(cpu_attention, "supported", lambda *arrays: False)
    check_modes_agree(replace(BASE, **VARIANTS[variant]), ProcessGrid(world().size, 1, 1, world()))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_selective_attention_with_key_padding(causal, fused, monkeypatch):
    """One grouped-query attention layer (RoPE, attention dropout) over key-padded sequences, one of
    them all padding (its rows fully masked): keeping only the rows' log-sum-exp gives the output,
    input gradient and parameter gradients of keeping the softmax, on this rank's heads."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", 5)
    if not fused:
        monkeypatch.setattr(cpu_attention, "supported", lambda *arrays: False)
    rng = np.random.default_rng(4)
    layer = attention.ParallelAttention(
        32, 4, 2, world(), causal=causal, rope_theta=10000.0, dropout=0.1, rng=DropoutRNG(7), dtype="float64"
    )
    for _, p in layer.named_parameters():
        p.data[...] = rng.standard_normal(p.data.shape) * 0.3
    x, dy = rng.standard_normal((3, SEQ, 32)), rng.standard_normal((3, SEQ, 32))
    key_mask = (rng.random((3, SEQ)) > 0.3).astype("int64")
    key_mask[1] = 0

    def run(selective):
        layer.recompute_scores = selective
        for _, p in layer.named_parameters():
            p.grad[...] = 0.0
        y, ctx = layer.forward(x, key_mask=key_mask)
        dx = layer.backward(dy, ctx)
        return [y, dx] + [p.grad.copy() for _, p in layer.named_parameters()]

    kept = run(False)
    for got, want in zip(run(True), kept, strict=True):
        assert np.isfinite(got).all() and np.max(np.abs(got - want)) <= TOL * max(1.0, np.max(np.abs(want)))


@pytest.mark.skipif(not backend.cuda_available(), reason="no CUDA device (cupy missing or no GPU visible)")
@pytest.mark.parametrize("variant", ["dropout", "gqa rope"])
def test_selective_recompute_on_the_device(variant, monkeypatch):
    monkeypatch.setattr(attention, "QUERY_BLOCK", 5)
    backend.use("cuda")
    try:
        check_modes_agree(replace(BASE, **VARIANTS[variant]), ProcessGrid(1, 1, 1, self_comm()))
    finally:
        backend.use("cpu")


@pytest.mark.mpi(min_size=1)
def test_trainer_with_selective_recompute_trains_like_without():
    comm = world()
    runs = {}
    for mode in ("none", "selective", True):  # True: the old spelling of full
        settings = TrainSettings(
            model="tiny",
            model_overrides={**VARIANTS["gqa rope"], "n_layers": 2},
            dtype="float64",
            tp=comm.size,
            micro_batch=2,
            global_batch=4,
            seq_len=12,
            steps=3,
            lr=3e-3,
            warmup=1,
            samples=0,
            eval_problems=4,
            progress=False,
            recompute=mode,
        )
        records = Trainer(settings, comm).run().records
        runs[mode] = np.array([[r["loss"], r["grad_norm"]] for r in records])
    for mode in ("selective", True):
        assert np.max(np.abs(runs[mode] - runs["none"]) / runs["none"]) < TOL, mode


# -- the planner and the settings ------------------------------------------------------------------------


def test_selective_keeps_all_but_the_scores():
    # Megatron's list without its 5 a s^2 b / t of softmax, dropout mask and output: s b h (10 + 24 / t).
    h, a, s, b = 64, 8, 128, 2
    cfg = ModelConfig(vocab_size=64, hidden=h, n_layers=1, n_heads=a, max_seq_len=s)
    for t in (1, 2, 4):
        assert layer_activation_bytes(cfg, b, s, t, 2, MEGATRON, selective=True) == s * b * h * (10 + 24 // t)
    # The engine keeps each query row's log-sum-exp instead: a b s / t values, float32 at least.
    for t, elem in ((1, 8), (2, 4), (4, 2)):
        assert layer_activation_bytes(cfg, b, s, t, elem, selective=True) == layer_activation_bytes(
            cfg, b, s, t, elem
        ) - attention_score_bytes(cfg, b, s, t, elem) + b * a // t * s * max(elem, 4)
    gpt2, precision = load_config("gpt2"), engine_precision("float32")
    for attn_dropout in (0.0, 0.1):
        cfg = replace(gpt2, attn_dropout=attn_dropout)
        kept = {
            mode: stage_memory(cfg, 1, 1, 0, range(12), 4, 1024, 1, "1f1b", mode, precision)
            for mode in ("none", "selective", "full")
        }
        assert kept["full"].activations < kept["selective"].activations < kept["none"].activations
        # Backward makes the softmax again block by block: of one layer only its redrawn dropout masks are whole.
        assert kept["selective"].recompute_peak == attention_mask_bytes(cfg, 4, 1024, 1, 4)
        assert kept["selective"].recompute_peak == (12 * 1024 * 1024 * 4 * 4 if attn_dropout else 0)
        assert kept["selective"].recompute_peak < kept["full"].recompute_peak


def test_selective_costs_between_none_and_full():
    cfg, cluster = load_config("gpt2"), get_cluster("cpu-2core")
    compute = {
        mode: predict(cfg, Layout(1, 1, 1, 4, mode), 4, 1024, cluster).compute_s
        for mode in ("none", "selective", "full")
    }
    assert compute["none"] < compute["selective"] < compute["full"]
    # 2 s h more per token and layer, against 3 x (24 h^2 + 4 s h): under 5% at s = 1024, h = 768.
    assert compute["selective"] / compute["none"] < 1.05
    assert Layout(1, 1, 1, 1, True).recompute == "full"
    assert Layout(1, 1, 1, 1, "selective").describe() == "tp=1 pp=1 dp=1 micro-batch=1 selective"


def test_recompute_settings_and_flag():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parse = lambda *flags: settings_from_args(parser.parse_args(list(flags))).recompute
    assert (parse(), parse("--recompute"), parse("--recompute", "selective")) == ("none", "full", "selective")
    settings = TrainSettings(recompute=True)
    settings.check()
    assert settings.recompute == "full"
    with pytest.raises(ConfigError) as e:
        TrainSettings(recompute="partial").check()
    assert str(e.value) == "--recompute 'partial': expected none, selective, full"
