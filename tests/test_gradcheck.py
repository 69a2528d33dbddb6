"""Finite-difference checks of every layer's hand-written backward at tp=1 (float64)."""

import numpy as np
import pytest

from hpc_tp.comm.mpi import self_comm
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.models.init import initialize
from hpc_tp.nn import attention
from hpc_tp.nn.attention import ParallelAttention
from hpc_tp.nn.mlp import ParallelMLP
from hpc_tp.nn.norms import LayerNorm, RMSNorm
from hpc_tp.tensor_parallel import ColumnParallelLinear, RowParallelLinear

B, T, H = 2, 5, 12
EPS = 1e-6


def _probe_indices(shape, rng, count=6):
    flat = rng.choice(int(np.prod(shape)), size=min(count, int(np.prod(shape))), replace=False)
    return [np.unravel_index(i, shape) for i in flat]


def _fd_check(module, x, call=lambda m, x: m.forward(x)):
    """Loss = <forward(x), w> for a fixed random w; compare analytic with central differences."""
    rng = np.random.default_rng(0)
    y, ctx = call(module, x)
    w = rng.standard_normal(y.shape)
    module.zero_grad()
    dx = module.backward(w.copy(), ctx)

    def loss():
        return float(np.vdot(call(module, x)[0], w))

    targets = [(x, dx)] + [(p.data, p.grad) for p in module.parameters()]
    for value, grad in targets:
        for idx in _probe_indices(value.shape, rng):
            old = value[idx]
            value[idx] = old + EPS
            up = loss()
            value[idx] = old - EPS
            down = loss()
            value[idx] = old
            numeric = (up - down) / (2 * EPS)
            assert abs(numeric - grad[idx]) <= 1e-6 * max(1.0, abs(numeric)), (idx, numeric, grad[idx])


def _init(m):
    initialize(m, std=0.4, n_layers=1, seed=1)
    for p in m.parameters():  # non-trivial gains and biases
        p.data += np.random.default_rng(2).normal(0, 0.1, p.data.shape)
    return m


X = np.random.default_rng(1).standard_normal((B, T, H))
C = self_comm()


@pytest.mark.parametrize(
    "layer",
    [
        lambda: ColumnParallelLinear(H, 8, C),
        lambda: RowParallelLinear(8, H, C, input_is_parallel=False),
        lambda: LayerNorm(H, 1),
        lambda: RMSNorm(H, 1),
        lambda: ParallelMLP(H, 16, C, "gelu_tanh"),
        lambda: ParallelMLP(H, 16, C, "gelu"),
        lambda: ParallelMLP(H, 16, C, "swiglu"),
        lambda: ParallelAttention(H, 6, 2, C, causal=True, rope_theta=100.0),
        lambda: ParallelAttention(H, 3, 3, C, causal=False),
        lambda: ParallelAttention(H, 6, 2, C, causal=True, rope_theta=100.0, window=2),
        lambda: ParallelAttention(H, 4, 2, C, rope_theta=100.0, head_dim=6, qk_norm_eps=1e-6),
    ],
    ids=[
        "column",
        "row",
        "layernorm",
        "rmsnorm",
        "mlp-gelu-tanh",
        "mlp-gelu-erf",
        "mlp-swiglu",
        "attn-gqa-rope",
        "attn-bidir",
        "attn-sliding-window",
        "attn-qk-norm-head-dim",
    ],
)
def test_layer_gradients(layer, monkeypatch):
    monkeypatch.setattr(attention, "QUERY_BLOCK", 2)  # T = 5: causal blocks of 2, 2 and 1 queries
    m = _init(layer())
    x = X if not isinstance(m, RowParallelLinear) else np.random.default_rng(3).standard_normal((B, T, 8))
    _fd_check(m, x.copy())


def test_model_loss_gradients():
    cfg = ModelConfig(vocab_size=11, hidden=H, n_layers=2, n_heads=3, ffn_hidden=16, max_seq_len=8)
    model = GPTModel(cfg, C, seed=4)
    ids = np.random.default_rng(5).integers(0, 11, (B, T))
    targets = np.roll(ids, -1, 1)

    def loss():
        s, n, _ = model.forward(ids, targets)
        return s / n

    s, n, ctx = model.forward(ids, targets)
    model.backward(ctx, 1.0 / n)
    rng = np.random.default_rng(6)
    for name, p in model.named_parameters():
        for idx in _probe_indices(p.data.shape, rng, 3):
            old = p.data[idx]
            p.data[idx] = old + EPS
            up = loss()
            p.data[idx] = old - EPS
            down = loss()
            p.data[idx] = old
            numeric = (up - down) / (2 * EPS)
            assert abs(numeric - p.grad[idx]) <= 1e-6 * max(1.0, abs(numeric)), (name, idx, numeric, p.grad[idx])
