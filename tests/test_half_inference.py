"""Inference with half-precision weights (``--dtype bfloat16|float16``): prefill and KV-cached decode
steps at tp = the world size give one process's logits at the same precision, and stay close to
float32's; products run through ``kernels.small_m`` (few rows) and its blockwise widening (prefill)."""
import numpy as np
import pytest

from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.serve.generate import left_pad
from hpc_tp.serve.kv_cache import KVCache
from hpc_tp.train.mixed_precision import resolve_dtype
from test_generate import CONFIGS, PROMPTS, larger_weights
from tp_helpers import max_rel_err, tp_and_reference

pytestmark = pytest.mark.mpi(min_size=1)
pytest.importorskip("ml_dtypes")

# A vocabulary and MLP large enough that the head and fc1 take the few-row kernels at tp <= 2, and
# the blockwise widening elsewhere.
CONFIG = dict(CONFIGS["llama-gqa"], vocab_size=600, hidden=64, ffn_hidden=600)
STEPS = 3
# Across tp the row-parallel partial products are summed in float32 and rounded once, as one process
# rounds its whole product; only the order of the float32 sums differs, so a value at a rounding
# boundary of the 16-bit activations rounds the other way now and then (largest seen at tp = 2 and 4:
# 3.1e-6 bfloat16; 8.8e-4 float16, about one float16 step of the logits).
SAME_PRECISION = {"bfloat16": 1e-4, "float16": 3e-3}
# Against float32: every activation keeps 8 bits of mantissa (bfloat16) or 11 (float16); largest
# seen 3.5e-2 and 1.3e-2 with these weights (std 0.3, larger than a trained model's).
AGAINST_FLOAT32 = {"bfloat16": 6e-2, "float16": 2.5e-2}


def _logits(comm, dtype):
    """Prefill logits of PROMPTS (left-padded) at their real tokens, then STEPS decode steps', as float64."""
    model = larger_weights(GPTModel(ModelConfig(**CONFIG), comm, dtype=resolve_dtype(dtype), seed=4))
    tokens, key_mask, positions = left_pad(PROMPTS, STEPS, pad_id=0)
    width = tokens.shape[1]
    cache = KVCache.for_model(model, len(PROMPTS), width + STEPS)
    prefill = model.infer(tokens, positions, key_mask[:, :width], cache, all_positions=True)
    out = [prefill[key_mask[:, :width]]]
    ids, lens = np.argmax(np.asarray(prefill[:, -1], np.float32), axis=-1), np.array([len(p) for p in PROMPTS])
    for s in range(STEPS):
        key_mask[:, width + s] = True
        out.append(model.infer(ids[:, None], (lens + s)[:, None], key_mask[:, :width + s + 1], cache))
        ids = (ids * 7 + 3) % CONFIG["vocab_size"]  # fixed follow-ups: every run feeds the same tokens
    return [np.asarray(o, np.float64) for o in out]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tp_gives_one_process_logits_at_the_same_precision(dtype):
    tp, one = tp_and_reference()
    for step, (got, want) in enumerate(zip(_logits(tp, dtype), _logits(one, dtype))):
        assert max_rel_err(got, want) <= SAME_PRECISION[dtype], f"step {step}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_logits_close_to_float32(dtype):
    tp, _ = tp_and_reference()
    for step, (got, want) in enumerate(zip(_logits(tp, dtype), _logits(tp, "float32"))):
        assert max_rel_err(got, want) <= AGAINST_FLOAT32[dtype], f"step {step}"
