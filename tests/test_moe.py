"""Mixture-of-Experts: every (tp, ep) layout of the world gives the numbers of one process on the
whole batch (outputs, input gradients, every expert's and the router's gradients, dropped counts),
the dispatch loses or duplicates no token, the load-balancing gradient matches finite differences,
and a checkpoint saved at one ep loads at another with the same logits."""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from tp_helpers import max_rel_err

from hpc_tp.checkpoint import load_checkpoint, save_checkpoint
from hpc_tp.comm.mpi import self_comm, world
from hpc_tp.errors import ConfigError
from hpc_tp.grid import ProcessGrid
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.models.init import initialize
from hpc_tp.module import gather_full
from hpc_tp.nn.moe import MoEMLP, is_expert_parameter
from hpc_tp.tensor_parallel.experts import ExpertDispatcher

pytestmark = pytest.mark.mpi(min_size=1)
TOL = 1e-9
N, H, F, E = 6, 8, 12, 4  # tokens per data-parallel rank, hidden, expert ffn, experts


def _layouts(size):
    """(tp, ep) with tp * ep == world: experts over ep, each tensor-parallel over tp."""
    return [(t, size // t) for t in range(1, size + 1) if size % t == 0 and E % (size // t) == 0]


def _moe(comm, ep_comm, top_k, capacity_factor, shared=0, normalize=True):
    """``shared``: the width of a Qwen2-MoE shared expert (0: none); ``normalize``: renormalise the top k."""
    moe = MoEMLP(
        H,
        F,
        E,
        top_k,
        comm,
        ep_comm,
        capacity_factor,
        aux_loss_coef=0.3,
        shared_expert_ffn_hidden=shared,
        normalize_top_k=normalize,
    )
    initialize(moe, 0.5, 1, seed=3)
    moe.loss_scale = 0.7
    return moe


def _data(ranks, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((ranks, N, H)), rng.standard_normal((ranks, N, H))


@pytest.mark.parametrize(
    "top_k,capacity_factor,shared,normalize",
    [(1, 1.0, 0, True), (2, 0.5, 0, True), (2, 4.0, 0, True), (2, 0.5, 12, False)],
    ids=["top-1", "top-2-dropping", "top-2", "qwen2-moe-shared-expert-unnormalized"],
)
def test_every_layout_matches_one_process(top_k, capacity_factor, shared, normalize):
    comm = world()
    for tp, ep in _layouts(comm.size):
        grid = ProcessGrid(tp=tp, dp=ep, ep=ep, world=comm)
        x, dy = _data(ep)
        one = _moe(self_comm(), None, top_k, capacity_factor, shared, normalize)
        y_one, ctx_one = one.forward(x.reshape(1, ep * N, H))
        dx_one = one.backward(dy.reshape(1, ep * N, H), ctx_one)
        par = _moe(grid.tp, grid.ep, top_k, capacity_factor, shared, normalize)
        mine = slice(grid.coords.ep * N, (grid.coords.ep + 1) * N)
        y, ctx = par.forward(x[grid.coords.ep][None])
        dx = par.backward(dy[grid.coords.ep][None], ctx)
        assert max_rel_err(y, y_one[:, mine]) <= TOL and max_rel_err(dx, dx_one[:, mine]) <= TOL
        assert par.stats.dropped == one.stats.dropped and abs(par.stats.aux - one.stats.aux) <= TOL * one.stats.aux
        if capacity_factor < 1:  # fewer slots than assignments: some must have been dropped
            capacity = ctx_one[7].capacity
            assert capacity == -(-ep * N * top_k * capacity_factor // E)
            assert one.stats.dropped >= ep * N * top_k - E * capacity > 0
        assert grid.ep.all_reduce_scalar(par.aux_sum(ctx)) == pytest.approx(one.aux_sum(ctx_one), rel=TOL)
        ref = dict(one.named_parameters())
        names = [n for n, _ in par.named_parameters()]
        assert len(names) == 1 + 4 * E // ep + (5 if shared else 0) and set(names) <= set(ref)
        for name, p in par.named_parameters():
            g = gather_full(p.grad, p.partition, grid.tp)
            if not is_expert_parameter(name):  # each ep rank saw its own tokens: the dp all-reduce sums them
                g = grid.ep.all_reduce(g)
            assert max_rel_err(g, ref[name].grad) <= TOL, (tp, ep, name)


def test_dispatch_loses_and_duplicates_no_token():
    """Tag each assignment with (global token, choice); identity experts send the tags back."""
    comm = world()
    ep, k = comm.size, 2
    rng = np.random.default_rng(5)
    probs = rng.dirichlet(np.ones(E), size=ep * N)
    choices = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    reference = ExpertDispatcher(E, None, 0.75).plan(choices, probs)
    dispatcher = ExpertDispatcher(E, comm, 0.75)
    mine = slice(comm.rank * N, (comm.rank + 1) * N)
    plan = dispatcher.plan(choices[mine], probs[mine])
    tags = np.stack([plan.token + comm.rank * N, plan.choice], axis=1).astype(np.float64)
    received = dispatcher.dispatch(tags, plan)
    for e, rows in enumerate(received):
        expert = dispatcher.first_expert + e
        expected = [(t, j) for t, j in zip(reference.token, reference.choice) if choices[t, j] == expert]
        got = [tuple(map(int, r)) for r in rows]
        assert sorted(got) == sorted(expected) and len(set(got)) == len(got)  # same kept set: same drops
    assert np.array_equal(dispatcher.combine(received, plan, 2, tags.dtype), tags)
    kept = comm.all_reduce_scalar(len(plan.token))
    assert kept == len(reference.token) and kept + plan.dropped == ep * N * k and plan.dropped == reference.dropped > 0
    everything = dispatcher.plan(choices[mine], probs[mine], dropless=True)  # inference's plan
    assert everything.dropped == 0 and comm.all_reduce_scalar(len(everything.token)) == ep * N * k


@pytest.mark.parametrize("shared,normalize", [(0, True), (12, False)], ids=["mixtral", "qwen2-moe"])
def test_load_balancing_gradient_matches_finite_differences(shared, normalize):
    """J = <dy, y> + loss_scale * aux_sum: router, input, an expert weight and the shared expert's gate
    (Qwen2-MoE: unnormalised top k), central differences."""
    moe = _moe(self_comm(), None, 2, 1.0, shared, normalize)
    x, dy = (a[0][None] for a in _data(1, seed=2))

    def objective():
        y, ctx = moe.forward(x)
        return float((dy * y).sum()) + moe.loss_scale * moe.aux_sum(ctx), ctx

    _, ctx = objective()
    dx = moe.backward(dy, ctx)
    assert max(abs(g) for g in moe.router.grad.ravel()) > 0
    params = dict(moe.named_parameters())
    checked = [(moe.router.data, moe.router.grad), (x, dx)]
    checked += [(params[n].data, params[n].grad) for n in params if n in ("experts.1.fc1.weight", "shared_expert_gate")]
    assert len(checked) == (4 if shared else 3)
    for array, grad in checked:
        for index in {1: [(0,), (5,)], 2: [(0, 0), (0, 1), (0, 3)], 3: [(0, 1, 2), (0, 4, 5)]}[array.ndim]:
            keep = array[index]
            array[index] = keep + 1e-6
            up = objective()[0]
            array[index] = keep - 1e-6
            down = objective()[0]
            array[index] = keep
            assert abs((up - down) / 2e-6 - grad[index]) <= 1e-6 * max(1.0, abs(grad[index]))


def test_aux_loss_gradient_alone_matches_finite_differences():
    moe = _moe(self_comm(), None, 2, 4.0)
    x, _ = _data(1, seed=4)
    x = x[0][None]
    _, ctx = moe.forward(x)
    moe.backward(np.zeros_like(x), ctx)
    for index in [(0, 0), (3, 2), (7, 1)]:
        keep = moe.router.data[index]
        values = []
        for step in (1e-6, -1e-6):
            moe.router.data[index] = keep + step
            values.append(moe.loss_scale * moe.aux_sum(moe.forward(x)[1]))
        moe.router.data[index] = keep
        assert abs((values[0] - values[1]) / 2e-6 - moe.router.grad[index]) <= 1e-7


def test_experts_not_divisible_by_ep_is_a_clear_error():
    with pytest.raises(ConfigError, match="num_experts=6 is not divisible by expert-parallel size 4"):
        ExpertDispatcher(6, type("Group", (), {"size": 4, "rank": 0})(), 1.0)


# No biases: the K bias gradient is zero in exact math, so relative errors of it are round-off.
CONFIG = dict(
    vocab_size=37,
    hidden=16,
    n_layers=2,
    n_heads=4,
    ffn_hidden=24,
    max_seq_len=16,
    num_experts=E,
    top_k=2,
    moe_every=2,
    capacity_factor=1.0,
    bias=False,
)


# Qwen2-MoE's layout: experts narrower than the dense MLP, a shared expert, the top k kept unnormalised,
# MoE every layer but one kept dense.
QWEN2_MOE = dict(
    CONFIG,
    n_layers=3,
    moe_every=1,
    dense_layers=[1],
    expert_ffn_hidden=8,
    shared_expert_ffn_hidden=12,
    normalize_top_k=False,
)


@pytest.mark.parametrize("config", [CONFIG, QWEN2_MOE], ids=["moe-every-2", "qwen2-moe"])
def test_model_at_every_layout_matches_one_process(config):
    """Loss and every gradient of a GPT with MoE layers; each ep rank holds its own batch rows."""
    comm = world()
    cfg = ModelConfig(**config)
    rng = np.random.default_rng(7)
    for tp, ep in _layouts(comm.size):
        ids = rng.integers(0, 37, (ep, 8))
        targets = np.roll(ids, -1, axis=1)
        grid = ProcessGrid(tp=tp, dp=ep, ep=ep, world=comm)
        one = GPTModel(cfg, self_comm(), seed=5)
        assert sum(p.data.size for p in one.parameters()) == cfg.parameter_count()
        loss_one, count, ctx = one.forward(ids, targets)
        one.backward(ctx, 1.0 / count)
        par = GPTModel(cfg, grid.tp, seed=5, ep_comm=grid.ep)
        row = slice(grid.coords.ep, grid.coords.ep + 1)
        loss, _, ctx = par.forward(ids[row], targets[row])
        par.backward(ctx, 1.0 / count)
        assert grid.ep.all_reduce_scalar(loss) == pytest.approx(loss_one, rel=TOL)
        ref = dict(one.named_parameters())
        for name, p in par.named_parameters():
            g = gather_full(p.grad, p.partition, grid.tp)
            if not is_expert_parameter(name):  # replicated over ep like over dp: its ranks' sums add up
                g = grid.ep.all_reduce(g)
            assert max_rel_err(g, ref[name].grad) <= TOL, (tp, ep, name)


def test_checkpoint_saved_at_one_ep_loads_at_another():
    comm = world()
    cfg = ModelConfig(**CONFIG)
    ids = np.random.default_rng(6).integers(0, 37, (comm.size, 8))
    root = Path(comm.bcast_object(tempfile.mkdtemp(prefix="hpc_tp-moe-") if comm.rank == 0 else None))
    wide = ProcessGrid(tp=1, dp=comm.size, ep=comm.size, world=comm)  # experts spread, one row each
    deep = ProcessGrid(tp=comm.size, world=comm)  # every expert here, tp inside
    saved = GPTModel(cfg, wide.tp, seed=1, ep_comm=wide.ep)
    logits_saved = comm.all_gather(saved.logits(ids[comm.rank][None]))
    assert len(saved.moe_layers()) == 1 and saved.moe_layers()[0].stats.dropped > 0
    path = save_checkpoint(root, 1, saved.state(), {}, wide)
    loaded = GPTModel(cfg, deep.tp, seed=2, ep_comm=deep.ep)
    assert max_rel_err(loaded.logits(ids), logits_saved) > 1e-3  # different weights before loading
    load_checkpoint(path, loaded.state(), deep)
    assert max_rel_err(loaded.logits(ids), logits_saved) <= 1e-12
    back = GPTModel(cfg, wide.tp, seed=2, ep_comm=wide.ep)
    load_checkpoint(save_checkpoint(root, 2, loaded.state(), {}, deep), back.state(), wide)
    assert max_rel_err(comm.all_gather(back.logits(ids[comm.rank][None])), logits_saved) <= 1e-12
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(root)
