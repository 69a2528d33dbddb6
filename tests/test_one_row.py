"""A decode step's one row on compiled calls (``nn.one_row``, ``kernels.one_row``) gives the composed
path's logits bit for bit: a GPT-2-like model (LayerNorm, biases, tanh GELU, learned positions) and a
Llama-like one (RMSNorm, GQA, RoPE with llama3 scaling, SwiGLU; once with a sliding window), int4 and
int8 weights, over a static batch's cache and over continuous batching's paged pools. One process:
the compiled step is tp = 1's (the quantized tests hold every tp to it)."""

from __future__ import annotations

import numpy as np
import pytest
from test_generate import CONFIGS, PROMPTS, larger_weights
from test_quantized import quantized_copy

from hpc_tp.comm.mpi import self_comm
from hpc_tp.kernels import int8_dot, one_row
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.nn import one_row as nn_one_row
from hpc_tp.serve import generate
from hpc_tp.serve.continuous import ContinuousBatcher
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.kv_cache import KVCache
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.tokenizer import ByteTokenizer

pytestmark = pytest.mark.skipif(not int8_dot.AVAILABLE, reason="needs numba and a CPU with avx512_vnni")
SHAPES = dict(vocab_size=300, hidden=128, ffn_hidden=256)  # four groups of 32 into every product
MODELS = {
    "gpt2": CONFIGS["gpt2"],
    "llama-gqa": CONFIGS["llama-gqa"],
    "llama-window": dict(CONFIGS["llama-gqa"], sliding_window=3),
}
STEPS = 6


def _model(name, fmt):
    cfg = ModelConfig(**dict(MODELS[name], **SHAPES))
    return quantized_copy(
        larger_weights(GPTModel(cfg, self_comm(), dtype="float64", seed=4)), self_comm(), fmt, "float32"
    )


@pytest.fixture
def compiled_calls(monkeypatch):
    """{name: calls} of the compiled one-row step's entry points, as ``nn.one_row`` makes them."""
    calls = {}

    class Counting:  # the kernels module as nn.one_row sees it, its calls counted
        def __getattr__(self, name):
            value = getattr(one_row, name)
            if not callable(value):
                return value

            def counted(*args):
                calls[name] = calls.get(name, 0) + 1
                return value(*args)

            return counted

    monkeypatch.setattr(nn_one_row, "one_row", Counting())
    return calls


def _cached_logits(model, batch):
    """A prompt's prefill logits and STEPS one-token steps' over a static batch's cache, ``batch`` rows alike."""
    prompt = np.array([PROMPTS[0]] * batch)
    width = prompt.shape[1]
    cache = KVCache.for_model(model, batch, width + STEPS)
    key_mask = np.ones((batch, width + STEPS), bool)
    logits = [model.infer(prompt, np.arange(width), key_mask[:, :width], cache)]
    for s in range(STEPS):
        ids = (np.argmax(logits[-1], axis=-1) * 7 + s) % SHAPES["vocab_size"]
        logits.append(model.infer(ids[:, None], np.array([width + s]), key_mask[:, : width + s + 1], cache))
    return logits


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("name", MODELS)
def test_a_static_caches_one_row_steps_are_the_composed_paths_bits(name, fmt, compiled_calls, monkeypatch):
    model = _model(name, fmt)
    monkeypatch.setattr(one_row, "ENABLED", False)
    composed = _cached_logits(model, 1)
    assert not compiled_calls
    monkeypatch.setattr(one_row, "ENABLED", True)
    compiled = _cached_logits(model, 1)
    layers = model.cfg.n_layers
    assert compiled_calls == dict.fromkeys(("attention_in", "mlp_in", "mlp_out"), STEPS * layers)
    for step, (got, want) in enumerate(zip(compiled, composed)):
        assert np.array_equal(got, want), f"step {step}: {np.abs(got - want).max()}"
    _cached_logits(model, 2)  # two rows a step: the composed path
    assert compiled_calls["mlp_out"] == STEPS * layers


def _served(model, prompts, monkeypatch):
    """Each request's greedy tokens and the logits each step chose them from, continuous batching's."""
    chosen, pick = {}, generate.next_token

    def spy(logits, params, rng):
        chosen.setdefault(params.seed, []).append(np.array(logits))
        return pick(logits, params, rng)

    monkeypatch.setattr(generate, "next_token", spy)
    params = [SamplingParams(max_new_tokens=STEPS, seed=i) for i in range(len(prompts))]
    out = ContinuousBatcher(Engine(model, ByteTokenizer()), 4).generate(prompts, params)
    return [c.ids for c, _ in out], chosen


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("name", MODELS)
def test_paged_one_row_steps_are_the_composed_paths_bits(name, fmt, compiled_calls, monkeypatch):
    """One request alone (every step one row: its attention compiled with the rest, over the pools), then
    two together (two rows a step: the composed path until one finishes)."""
    model = _model(name, fmt)
    for prompts in ([PROMPTS[0]], PROMPTS[:2]):
        compiled_calls.clear()
        monkeypatch.setattr(one_row, "ENABLED", False)
        want = _served(model, prompts, monkeypatch)
        assert not compiled_calls
        monkeypatch.setattr(one_row, "ENABLED", True)
        got = _served(model, prompts, monkeypatch)
        assert got[0] == want[0]
        for seed, logits in want[1].items():
            assert all(np.array_equal(g, w) for g, w in zip(got[1][seed], logits)), seed
        # one request: its steps after the prefill's token (the last token is not fed back)
        steps = (STEPS - 1) * model.cfg.n_layers if len(prompts) == 1 else 0
        assert compiled_calls == ({"paged_layer_in": steps, "mlp_out": steps} if steps else {})
