"""BERT encoder: a Hugging Face BERT folder written here with random weights, converted, matches a plain
numpy post-LN reference at every tp (padding masked); its backward agrees with finite differences and
with tp=1; ``hpc-tp embed`` pools L2-normalised sentence embeddings that do not depend on padding."""

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from tp_helpers import assert_grads_match

from hpc_tp.checkpoint import convert, load_checkpoint
from hpc_tp.checkpoint.importers.source import open_source
from hpc_tp.comm.mpi import self_comm
from hpc_tp.errors import ConfigError
from hpc_tp.grid import ProcessGrid
from hpc_tp.models.bert import BertModel
from hpc_tp.models.config import ModelConfig
from hpc_tp.serve import embed

mpi = pytest.mark.mpi(min_size=1)
VOCAB, HIDDEN, LAYERS, HEADS, FFN, CONTEXT, TYPES = 50, 16, 2, 4, 32, 24, 2
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [f"w{i}" for i in range(VOCAB - 4)]


def bert_source(seed=0, prefix="bert."):
    rng = np.random.default_rng(seed)
    h = HIDDEN
    config = {
        "model_type": "bert",
        "architectures": ["BertModel"],
        "vocab_size": VOCAB,
        "hidden_size": h,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "intermediate_size": FFN,
        "max_position_embeddings": CONTEXT,
        "type_vocab_size": TYPES,
        "layer_norm_eps": 1e-12,
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
    }
    e = prefix + "embeddings."
    t = {
        e + "word_embeddings.weight": rng.normal(0, 0.5, (VOCAB, h)),
        e + "position_embeddings.weight": rng.normal(0, 0.5, (CONTEXT, h)),
        e + "token_type_embeddings.weight": rng.normal(0, 0.5, (TYPES, h)),
        e + "LayerNorm.weight": 1 + rng.normal(0, 0.1, h),
        e + "LayerNorm.bias": rng.normal(0, 0.1, h),
        prefix + "pooler.dense.weight": rng.normal(0, 0.3, (h, h)),
        prefix + "pooler.dense.bias": np.zeros(h),
    }
    for i in range(LAYERS):
        p = f"{prefix}encoder.layer.{i}."
        for name, (n_out, n_in) in (
            ("attention.self.query", (h, h)),
            ("attention.self.key", (h, h)),
            ("attention.self.value", (h, h)),
            ("attention.output.dense", (h, h)),
            ("intermediate.dense", (FFN, h)),
            ("output.dense", (h, FFN)),
        ):
            t[p + name + ".weight"] = rng.normal(0, 0.3, (n_out, n_in))
            t[p + name + ".bias"] = rng.normal(0, 0.3, n_out)
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + name + ".weight"] = 1 + rng.normal(0, 0.1, h)
            t[p + name + ".bias"] = rng.normal(0, 0.1, h)
    return config, t


def write_bert(folder: Path, config, tensors, tokenizer=True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers, processors

        tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        tk.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
        tk.save(str(folder / "tokenizer.json"))
    return folder


# -- the reference (plain numpy, float64) -----------------------------------------------------------------
def layer_norm(x, w, b, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def bert_reference(t, ids, type_ids, key_mask, prefix="bert."):
    erf = np.vectorize(math.erf)
    lin = lambda z, name: z @ t[name + ".weight"].T + t[name + ".bias"]  # noqa: E731
    e = prefix + "embeddings."
    b, n = ids.shape
    x = (
        t[e + "word_embeddings.weight"][ids]
        + t[e + "position_embeddings.weight"][:n]
        + t[e + "token_type_embeddings.weight"][type_ids]
    )
    x = layer_norm(x, t[e + "LayerNorm.weight"], t[e + "LayerNorm.bias"])
    d = HIDDEN // HEADS
    for i in range(LAYERS):
        p = f"{prefix}encoder.layer.{i}."
        q, k, v = (
            lin(x, p + f"attention.self.{m}").reshape(b, n, HEADS, d).transpose(0, 2, 1, 3)
            for m in ("query", "key", "value")
        )
        scores = np.where(key_mask[:, None, None, :] > 0, q @ k.transpose(0, 1, 3, 2) / np.sqrt(d), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        a = (probs @ v).transpose(0, 2, 1, 3).reshape(b, n, HIDDEN)
        x = layer_norm(
            x + lin(a, p + "attention.output.dense"),
            t[p + "attention.output.LayerNorm.weight"],
            t[p + "attention.output.LayerNorm.bias"],
        )
        m = lin(x, p + "intermediate.dense")
        m = lin(0.5 * m * (1 + erf(m / np.sqrt(2))), p + "output.dense")
        x = layer_norm(x + m, t[p + "output.LayerNorm.weight"], t[p + "output.LayerNorm.bias"])
    return x


def pooled_reference(t, ids):
    """One sentence alone (no padding): mean of its states, L2-normalised."""
    ids = np.array([ids])
    states = bert_reference(t, ids, np.zeros_like(ids), np.ones_like(ids))[0]
    mean = states.mean(axis=0)
    return mean / np.linalg.norm(mean)


def converted(shared_dir, comm, tokenizer=True, prefix="bert."):
    config, tensors = bert_source(prefix=prefix)
    if comm.rank == 0:
        source = write_bert(shared_dir / "hf", config, tensors, tokenizer)
        convert.replace_folder(
            shared_dir / "ckpt", False, lambda temp: convert.write_checkpoint(open_source(source), temp)
        )
    comm.barrier()
    return shared_dir / "ckpt", tensors


def tiny_config(**overrides):
    return ModelConfig(
        **{
            **dict(
                vocab_size=VOCAB,
                hidden=HIDDEN,
                n_layers=LAYERS,
                n_heads=HEADS,
                ffn_hidden=FFN,
                max_seq_len=CONTEXT,
                norm_eps=1e-12,
                activation="gelu",
                causal=False,
                family="bert",
                type_vocab_size=TYPES,
            ),
            **overrides,
        }
    )


# -- the model ----------------------------------------------------------------------------------------------
@mpi
@pytest.mark.parametrize("prefix", ["bert.", ""])
def test_token_states_match_reference_at_every_tp(shared_dir, comm_world, prefix):
    ckpt, tensors = converted(shared_dir, comm_world, prefix=prefix)
    grid = ProcessGrid(tp=comm_world.size, world=comm_world)
    meta = load_checkpoint(ckpt, {}, grid)
    model = BertModel(ModelConfig.from_dict(meta["config"]), grid.tp)
    load_checkpoint(ckpt, model.state(), grid)
    ids = np.array([[2, 7, 9, 30, 3, 0, 0], [2, 49, 5, 5, 11, 12, 3]])
    mask = np.array([[1, 1, 1, 1, 1, 0, 0], [1] * 7])
    types = np.array([[0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1]])
    states, _ = model.forward(ids, mask, types)
    expected = bert_reference(tensors, ids, types, mask, prefix)
    assert float(np.abs(states - expected).max() / np.abs(expected).max()) < 1e-9


def test_backward_matches_finite_differences():
    model = BertModel(tiny_config(), self_comm(), seed=3)
    rng = np.random.default_rng(0)
    ids, types = rng.integers(0, VOCAB, (2, 5)), rng.integers(0, TYPES, (2, 5))
    mask = np.array([[1, 1, 1, 0, 0], [1] * 5])
    dy = rng.standard_normal((2, 5, HIDDEN))
    states, ctx = model.forward(ids, mask, types)
    model.zero_grad()
    model.backward(dy, ctx)
    params = model.parameters()
    direction = [rng.standard_normal(p.data.shape) for p in params]
    analytic = sum(float((p.grad * v).sum()) for p, v in zip(params, direction))

    def loss(step):
        for p, v in zip(params, direction):
            p.data += step * v
        value = float((model.forward(ids, mask, types)[0] * dy).sum())
        for p, v in zip(params, direction):
            p.data -= step * v
        return value

    eps = 1e-5
    numeric = (loss(eps) - loss(-eps)) / (2 * eps)
    assert abs(numeric - analytic) <= 1e-6 * abs(analytic)


@mpi
def test_gradients_at_tp_equal_one_process(comm_world):
    cfg = tiny_config()
    par, ref = BertModel(cfg, comm_world, seed=1), BertModel(cfg, self_comm(), seed=1)
    rng = np.random.default_rng(2)
    ids, types = rng.integers(0, VOCAB, (2, 6)), rng.integers(0, TYPES, (2, 6))
    mask = np.array([[1, 1, 1, 1, 0, 0], [1] * 6])
    dy = rng.standard_normal((2, 6, HIDDEN))
    for model in (par, ref):
        states, ctx = model.forward(ids, mask, types)
        model.backward(dy, ctx)
    assert_grads_match(par, ref, comm_world)


def test_encoder_config_is_checked():
    with pytest.raises(ConfigError, match="causal=False"):
        BertModel(tiny_config(causal=True), self_comm())


# -- hpc-tp embed -------------------------------------------------------------------------------------------
def embed_args(ckpt, **values):
    return argparse.Namespace(
        **{
            **dict(
                ckpt=str(ckpt),
                tp=None,
                dtype="float64",
                device="cpu",
                text=None,
                inputs=None,
                out=None,
                batch_size=2,
                token_states=False,
            ),
            **values,
        }
    )


@mpi
@pytest.mark.parametrize("dtype, tol", [("float64", 1e-9), ("bfloat16", 2e-2)])
def test_embed_pools_normalised_embeddings_that_ignore_padding(shared_dir, comm_world, dtype, tol):
    """bfloat16: weights and activations in 16 bits, sums in float32: within ``tol`` of float64's
    embeddings and states (largest seen 7.6e-3)."""
    ckpt, tensors = converted(shared_dir, comm_world)
    texts = ["w1 w2 w3 w4 w5", "w7", "w9 w9 w40", "w3 w2"]
    inputs, out = shared_dir / "in.jsonl", shared_dir / "out.jsonl"
    if comm_world.rank == 0:
        lines = [{"text": t, "id": f"s{i}"} for i, t in enumerate(texts)] + [{"ids": [2, 44, 3]}]
        inputs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    comm_world.barrier()
    assert embed.run(embed_args(ckpt, inputs=str(inputs), out=str(out), token_states=True, dtype=dtype)) == 0
    if comm_world.rank == 0:
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["id"] for r in records] == ["s0", "s1", "s2", "s3", 4]
        ids = [[2] + [WORDS.index(w) for w in t.split()] + [3] for t in texts] + [[2, 44, 3]]
        for record, row in zip(records, ids):
            expected = pooled_reference(tensors, row)
            vector = np.array(record["embedding"])
            assert record["tokens"] == len(row)
            assert np.isclose(np.linalg.norm(vector), 1.0, atol=tol)
            assert float(np.abs(vector - expected).max()) < tol
            states = bert_reference(tensors, np.array([row]), np.zeros((1, len(row)), int), np.ones((1, len(row))))
            assert np.abs(np.array(record["token_states"]) - states[0]).max() < tol * np.abs(states).max()


@mpi
def test_embed_errors_are_one_line(shared_dir, comm_world):
    ckpt, _ = converted(shared_dir, comm_world, tokenizer=False)
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        embed.run(embed_args(ckpt, text=["hello"]))
    bad = shared_dir / "bad.jsonl"
    if comm_world.rank == 0:
        bad.write_text('{"ids": [2, 3]}\n{"ids": [2, 999]}\n')
    comm_world.barrier()
    with pytest.raises(ConfigError, match=r'line 2: "ids" must be a list of integers in \[0, 50\), got 999 at index 1'):
        embed.run(embed_args(ckpt, inputs=str(bad)))


@mpi
@pytest.mark.parametrize(
    "lines, message",
    [
        ('{"ids": 7}', r'line 1: "ids" must be a list of integers in \[0, 50\), got 7$'),
        ('{"ids": [2, true]}', r'line 1: "ids" must be a list of integers in \[0, 50\), got true at index 1$'),
        ('{"ids": [2, 3], "type_ids": null}', r'line 1: "type_ids" must be a list of integers in \[0, 2\), got null$'),
        ('{"ids": [2, 3], "type_ids": [0]}', r"line 1: 1 type_ids for 2 tokens$"),
        ('{"ids": [2, 3], "id": [1]}', r'line 1: "id" \[1\]: expected a string or an integer$'),
        ('{"ids": [2, 3], "id": 1}\n{"ids": [2, 4], "id": 1.0}', r'line 2: "id" 1.0: expected a string or an integer$'),
        ('{"ids": [2, 3], "id": 1}\n{"ids": [2, 4], "id": 1}', r'line 2: "id" 1 is used twice'),
        ('{"text": 5}', r'line 1: "text" 5: expected a string$'),
        ('{"text": "\\ud800"}', r"line 1: text is not valid Unicode: surrogates not allowed at character 0$"),
        (json.dumps({"ids": [2] * 30}), r"line 1: 30 tokens; expected 1 to max_seq_len=24$"),
    ],
    ids=[
        "ids-not-a-list",
        "ids-bool",
        "type-ids-null",
        "type-ids-short",
        "id-list",
        "id-float",
        "id-twice",
        "text-not-a-string",
        "text-lone-surrogate",
        "ids-too-long",
    ],
)
def test_embed_refuses_a_malformed_line_on_every_rank(shared_dir, comm_world, lines, message):
    """A wrong type was a TypeError traceback and an MPI abort: now one line naming the line and the field."""
    ckpt, _ = converted(shared_dir, comm_world)
    bad = shared_dir / "bad.jsonl"
    if comm_world.rank == 0:
        bad.write_text(lines + "\n")
    comm_world.barrier()
    with pytest.raises(ConfigError, match=message) as error:
        embed.run(embed_args(ckpt, inputs=str(bad)))
    assert "\n" not in str(error.value)


@mpi
def test_embed_refuses_a_text_longer_than_the_context(shared_dir, comm_world):
    """As over-long ids: a text is never cut to max_seq_len silently (it was, whatever its length)."""
    ckpt, _ = converted(shared_dir, comm_world)
    long = " ".join(["w5"] * (CONTEXT - 1))  # with [CLS] and [SEP]: one token too many
    with pytest.raises(ConfigError, match=rf"^--text 2: {CONTEXT + 1} tokens; expected 1 to max_seq_len={CONTEXT}$"):
        embed.run(embed_args(ckpt, text=["w1 w2", long]))
    out = shared_dir / "out.jsonl"
    assert embed.run(embed_args(ckpt, text=[" ".join(["w5"] * (CONTEXT - 2))], out=str(out))) == 0
    if comm_world.rank == 0:
        assert json.loads(out.read_text())["tokens"] == CONTEXT
