"""Sequence parallelism at tp = world size gives the numbers of the plain tensor-parallel run
(loss, logits, every gradient; float64, dropout on; Mixture-of-Experts layers too), and a block
keeps 1/tp of the activations the one-process block keeps."""

import numpy as np
import pytest
from test_model import CONFIGS as MODEL_CONFIGS
from tp_helpers import lm_batch, max_rel_err, same_random, tp_and_reference

from hpc_tp.errors import ConfigError
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.models.init import initialize
from hpc_tp.module import gather_full
from hpc_tp.nn.block import TransformerBlock
from hpc_tp.nn.sequence_parallel import held_bytes
from hpc_tp.tensor_parallel.mappings import local_chunk
from hpc_tp.tensor_parallel.random import DropoutRNG

pytestmark = pytest.mark.mpi(min_size=1)
TOL = 1e-9
CONFIGS = {
    "gpt2-dropout": dict(
        vocab_size=37, hidden=24, n_layers=2, n_heads=4, ffn_hidden=40, max_seq_len=16, dropout=0.2, attn_dropout=0.1
    ),
    "llama-gqa": MODEL_CONFIGS["llama-gqa"],
    # The MoE layer gathers the sequence its tensor-parallel experts need; some assignments are dropped.
    "moe-dropout": dict(
        vocab_size=37,
        hidden=24,
        n_layers=2,
        n_heads=4,
        ffn_hidden=40,
        max_seq_len=16,
        dropout=0.2,
        num_experts=4,
        top_k=2,
        capacity_factor=0.75,
        aux_loss_coef=0.1,
        bias=False,
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_sequence_parallel_matches_plain_tensor_parallel(name):
    tp, _ = tp_and_reference()
    ids, targets = lm_batch(1, t=8)
    runs = {}
    for sp in (False, True):
        model = GPTModel(ModelConfig(**CONFIGS[name], sequence_parallel=sp), tp, seed=4)
        loss, count, ctx = model.forward(ids, targets)
        model.backward(ctx, 1.0 / count)
        runs[sp] = (model, loss, model.logits(ids))
    (plain, loss_plain, logits_plain), (sp, loss_sp, logits_sp) = runs[False], runs[True]
    for moe_plain, moe_sp in zip(plain.moe_layers(), sp.moe_layers()):  # the same routing, the same drops
        assert moe_sp.stats.dropped == moe_plain.stats.dropped > 0
    assert abs(loss_sp - loss_plain) <= TOL * abs(loss_plain)
    assert max_rel_err(logits_sp, logits_plain) <= TOL
    full = {n: gather_full(p.grad, p.partition, tp) for n, p in plain.named_parameters()}
    assert sorted(full) == sorted(n for n, _ in sp.named_parameters())
    largest = max(np.abs(g).max() for g in full.values())
    for n, p in sp.named_parameters():
        g = gather_full(p.grad, p.partition, tp)
        # The K bias gradient is zero in exact math: its round-off is measured against the largest gradient.
        err = np.abs(g - full[n]).max() / (largest if n.endswith("k.bias") else np.abs(full[n]).max())
        assert err <= TOL, f"{n}: {err:.2e}"


def _block(comm, sp: bool):
    cfg = ModelConfig(
        hidden=24, n_heads=4, ffn_hidden=48, max_seq_len=16, dropout=0.2, attn_dropout=0.1, sequence_parallel=sp
    )
    block = TransformerBlock(cfg, comm, 0, DropoutRNG(7))
    initialize(block, 0.3, 1, 5)
    return block


def test_block_keeps_one_tp_th_of_the_activations():
    tp, alone = tp_and_reference()
    x = same_random(2, 2, 8, 24)
    dy = same_random(3, 2, 8, 24)
    one, plain, sp = _block(alone, False), _block(tp, False), _block(tp, True)
    y_one, ctx_one = one.forward(x)
    _, ctx_plain = plain.forward(x)
    y_sp, ctx_sp = sp.forward(local_chunk(x, tp, axis=1).copy())
    assert max_rel_err(tp.all_gather(y_sp, axis=1), y_one) <= TOL
    assert (
        max_rel_err(
            tp.all_gather(sp.backward(local_chunk(dy, tp, axis=1).copy(), ctx_sp), axis=1), one.backward(dy, ctx_one)
        )
        <= TOL
    )
    # Predicted (Korthikanti et al.): every saved activation is split by heads or by sequence.
    assert held_bytes(ctx_sp) * tp.size == held_bytes(ctx_one)
    if tp.size > 1:  # plain tp keeps norm, dropout and residual inputs whole
        assert held_bytes(ctx_sp) < held_bytes(ctx_plain) < held_bytes(ctx_one)


@pytest.mark.mpi(min_size=2)
def test_sequence_length_tp_does_not_divide_is_a_clear_error():
    tp, _ = tp_and_reference()
    model = GPTModel(ModelConfig(**CONFIGS["gpt2-dropout"], sequence_parallel=True), tp)
    ids, targets = lm_batch(1, t=tp.size + 1)
    with pytest.raises(ConfigError, match=f"sequence length {tp.size + 1} is not divisible by tp={tp.size}"):
        model.forward(ids, targets)
