"""The whole model at tp = world size equals the one-process model: loss, logits and every gradient."""

import dataclasses
import re

import numpy as np
import pytest
from tp_helpers import assert_grads_match, lm_batch, max_rel_err, same_loss_then_backward, tp_and_reference

from hpc_tp.errors import ConfigError
from hpc_tp.models import GPTModel, ModelConfig

pytestmark = pytest.mark.mpi(min_size=1)

CONFIGS = {
    "gpt2-tied": dict(vocab_size=37, hidden=24, n_layers=2, n_heads=4, ffn_hidden=40, max_seq_len=16),
    "gpt2-untied-erf": dict(
        vocab_size=37,
        hidden=24,
        n_layers=2,
        n_heads=4,
        ffn_hidden=40,
        max_seq_len=16,
        tie_embeddings=False,
        activation="gelu",
    ),
    "llama-gqa": dict(
        vocab_size=37,
        hidden=24,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=40,
        max_seq_len=16,
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        bias=False,
        tie_embeddings=False,
    ),
}
# Qwen3: heads sized apart from hidden (4 x 8 != 24) and RMSNorm on each query and key head.
CONFIGS["qwen3-qk-norm"] = dict(CONFIGS["llama-gqa"], head_dim=8, qk_norm=True)
# Gemma 3: post-norms, GeGLU, scaled embeddings, a sliding window of 3 on the first layer (its own
# rope base) and a global second one, a query scale of its own, soft-capped logits.
GEMMA3_BLOCK = dict(  # what makes a Llama-shaped config Gemma 3's (the tests of other files use it too)
    n_kv_heads=1,
    qk_norm=True,
    activation="geglu",
    post_norms=True,
    scale_embeddings=True,
    tie_embeddings=True,
    sliding_window=3,
    rope_local_theta=100.0,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
    query_pre_attn_scalar=10.0,
    logit_softcap=2.0,
)
CONFIGS["gemma3"] = dict(CONFIGS["qwen3-qk-norm"], **GEMMA3_BLOCK, layer_types=["sliding_attention", "full_attention"])


def perturb_norm_gains(model):
    """Gains of 1 would hide a norm applied to the wrong axis: the same random gains on every rank."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.load_full(np.random.default_rng(len(name)).normal(1.0, 0.2, p.partition.full_shape))


@pytest.mark.parametrize("name", CONFIGS)
def test_model_matches_single_process(name):
    tp, ref = tp_and_reference()
    cfg = ModelConfig(**CONFIGS[name])
    par, one = GPTModel(cfg, tp, seed=3), GPTModel(cfg, ref, seed=3)
    perturb_norm_gains(par)
    perturb_norm_gains(one)
    ids, targets = lm_batch()
    same_loss_then_backward(par, one, ids, targets)
    assert_grads_match(par, one, tp, 1e-10)
    assert max_rel_err(par.logits(ids), one.logits(ids)) <= 1e-10


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-qk-norm", "gemma3"])
def test_micro_batches_accumulate_as_in_one_process(name, kv_heads, sequence_parallel):
    """Three micro-batches summed into the gradients. K/V heads fewer than the tp ranks are
    replicated, and only each micro-batch's increment may be summed over the replicas: the whole
    accumulated gradient once was, at every micro-batch (micro-batch i counted 2**(m-i) times).
    The query/key norm gains' gradients are summed over tp the same way."""
    tp, ref = tp_and_reference()
    cfg = ModelConfig(**dict(CONFIGS[name], n_kv_heads=kv_heads))
    par = GPTModel(dataclasses.replace(cfg, sequence_parallel=sequence_parallel), tp, seed=3)
    one = GPTModel(cfg, ref, seed=3)
    for seed in range(3):
        ids, targets = lm_batch(seed, t=8)
        for model in (par, one):
            loss, count, ctx = model.forward(ids, targets)
            model.backward(ctx, 1.0 / count)
    assert_grads_match(par, one, tp, 1e-10)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-qk-norm", "gemma3"])
def test_parameter_bytes_per_rank(name):
    """Sharded bytes are total/tp (vocab rounded up to whole shards); replicated ones are whole on every rank."""
    tp, _ = tp_and_reference()
    cfg = ModelConfig(**CONFIGS[name])
    model = GPTModel(cfg, tp)
    sharded = replicated = 0
    for _, p in model.named_parameters():
        full = int(np.prod(p.partition.full_shape)) * p.data.itemsize
        if p.partition.axis is None:
            replicated += full
        else:
            sharded += int(np.prod(p.partition.local_shape)) * p.data.itemsize
            assert (
                p.partition.local_shape[p.partition.axis] * p.partition.parts
                >= p.partition.full_shape[p.partition.axis]
            )
    assert model.local_bytes() == sharded + replicated
    kv_parts = min(tp.size, cfg.n_kv_heads)
    total = cfg.parameter_count() * 8
    matrices = 1 if cfg.tie_embeddings else 2  # the embedding, and the head where it has its own
    vocab_pad = (-(-cfg.vocab_size // tp.size) * tp.size - cfg.vocab_size) * cfg.hidden * 8 * matrices // tp.size
    kv_extra = cfg.n_layers * 2 * cfg.hidden * cfg.n_kv_heads * cfg.head_dim * 8 * (1 / kv_parts - 1 / tp.size)
    expected = (total - replicated) / tp.size + replicated + vocab_pad + kv_extra
    assert abs(model.local_bytes() - expected) < 1e-6 * total
    assert cfg.parameter_count() == sum(int(np.prod(p.partition.full_shape)) for _, p in model.named_parameters())


def test_heads_not_divisible_error_lists_working_tp():
    from hpc_tp.comm.mpi import self_comm
    from hpc_tp.nn.attention import check_heads

    with pytest.raises(
        ConfigError,
        match=r"6 attention heads with 6 kv heads cannot be split over tp=4; tp values that work: 1, 2, 3, 6",
    ):
        check_heads(6, 6, 4)
    with pytest.raises(ConfigError, match=r"8 attention heads with 2 kv heads cannot be split over tp=3"):
        check_heads(8, 2, 3)
    check_heads(8, 2, 4)  # kv heads replicated over 2 ranks each
    with pytest.raises(ConfigError, match="unknown model config keys: hiden"):
        ModelConfig.from_dict({"hiden": 3})
    del self_comm


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(tie_embeddings="False"), "tie_embeddings='False': expected true or false"),
        (dict(causal=1), "causal=1: expected true or false"),
        (dict(dropout="0.1"), "dropout='0.1': expected a probability 0 <= p < 1"),
        (dict(attn_dropout=1.0), "attn_dropout=1.0: expected a probability"),
        (dict(init_std="x"), "init_std='x': expected a number > 0"),
        (dict(norm_eps=-1), "norm_eps=-1: expected a number > 0"),
        (dict(rope_theta=float("nan")), "rope_theta=nan: expected a number > 0"),
        (dict(rope_scaling=[8.0]), "rope_scaling=[8.0]: expected an object or null"),
        (dict(num_experts=2, capacity_factor="1"), "capacity_factor='1': expected a number > 0"),
        (dict(qk_norm="yes"), "qk_norm='yes': expected true or false"),
        (dict(head_dim=0), "head_dim=0: expected a positive integer"),
        (dict(hidden=30, n_heads=4), "hidden=30 is not divisible by n_heads=4; set head_dim"),
        (dict(position="rope", head_dim=7), "rope needs an even head size, got 7"),
        (dict(sliding_window=-2), "sliding_window=-2: expected an integer >= 0 (0: none)"),
        (dict(sliding_window=4, causal=False), "sliding_window=4: needs causal attention"),
        (dict(layer_types=["sliding_attention"]), "expected a list of 2 layer types"),
        (dict(layer_types=["local", "full_attention"]), "layer_types entry 'local': expected one of"),
        (dict(logit_softcap=-1.0), "logit_softcap=-1.0: expected a number >= 0"),
        (dict(query_pre_attn_scalar=0), "query_pre_attn_scalar=0: expected a number > 0 or null"),
        (dict(num_experts=2, dense_layers=[2]), "dense_layers=[2]: expected a list of layer indices 0 .. 1"),
        (dict(num_experts=2, shared_expert_ffn_hidden=-1), "shared_expert_ffn_hidden=-1: expected an integer >= 0"),
        (dict(num_experts=2, expert_ffn_hidden=0), "expert_ffn_hidden=0: expected a positive integer"),
        (dict(normalize_top_k="no"), "normalize_top_k='no': expected true or false"),
    ],
)
def test_config_values_of_the_wrong_type_or_range_are_one_clear_line(values, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_dict(values)


def test_set_reads_true_and_false_as_python_and_json_spell_them():
    from hpc_tp.models.config import parse_overrides

    assert parse_overrides(["bias=False", "causal=true", "tie_embeddings=True", "norm=rmsnorm", "dropout=0.1"]) == {
        "bias": False,
        "causal": True,
        "tie_embeddings": True,
        "norm": "rmsnorm",
        "dropout": 0.1,
    }


def test_sequence_longer_than_context_is_clear_error():
    tp, _ = tp_and_reference()
    model = GPTModel(ModelConfig(**CONFIGS["gpt2-tied"]), tp)
    ids = np.zeros((1, 17), dtype=np.int64)
    with pytest.raises(ConfigError, match="sequence length 17 exceeds the model's max_seq_len 16"):
        model.forward(ids, ids)
