"""Inference with half-precision weights (``--dtype bfloat16|float16``): prefill and KV-cached decode
steps at tp = the world size give one process's logits at the same precision, and stay close to
float32's; products run through ``kernels.bf16_dot`` (bfloat16 on a CPU with avx512_bf16), or
``kernels.small_m`` (few rows) and its blockwise widening (prefill). bfloat16 weights packed for
inference (``kernels.bf16_panels``) give the same logits, and their values to a checkpoint save."""

import json

import numpy as np
import pytest
from test_generate import CONFIGS, PROMPTS, larger_weights
from tp_helpers import max_rel_err, tp_and_reference

from hpc_tp.backend import resolve_dtype
from hpc_tp.kernels import bf16_dot, bf16_panels
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.serve.generate import left_pad
from hpc_tp.serve.kv_cache import KVCache
from hpc_tp.tensor_parallel.packing import pack_for_inference

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


def _model(comm, dtype, tied=False):
    config = ModelConfig(**dict(CONFIG, tie_embeddings=tied))
    return larger_weights(GPTModel(config, comm, dtype=resolve_dtype(dtype), seed=4))


def _logits(comm, dtype, model=None):
    """Prefill logits of PROMPTS (left-padded) at their real tokens, then STEPS decode steps', as float64
    (of ``model`` where given, else of a new model of ``dtype``)."""
    model = _model(comm, dtype) if model is None else model
    tokens, key_mask, positions = left_pad(PROMPTS, STEPS, pad_id=0)
    width = tokens.shape[1]
    cache = KVCache.for_model(model, len(PROMPTS), width + STEPS)
    prefill = model.infer(tokens, positions, key_mask[:, :width], cache, all_positions=True)
    out = [prefill[key_mask[:, :width]]]
    ids, lens = np.argmax(np.asarray(prefill[:, -1], np.float32), axis=-1), np.array([len(p) for p in PROMPTS])
    for s in range(STEPS):
        key_mask[:, width + s] = True
        out.append(model.infer(ids[:, None], (lens + s)[:, None], key_mask[:, : width + s + 1], cache))
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


def test_generate_command_loads_a_checkpoint_in_bfloat16(tmp_path):
    """``hpc-tp generate --dtype bfloat16`` rounds the checkpoint's weights to 16 bits (half float32's
    bytes) and writes the completions the same model gives in-process at the same tp."""
    from test_generate import write_checkpoint

    from hpc_tp.cli import main
    from hpc_tp.comm.mpi import world
    from hpc_tp.grid import ProcessGrid
    from hpc_tp.serve.generate import Engine
    from hpc_tp.serve.loading import load_for_inference
    from hpc_tp.serve.sampling import SamplingParams
    from hpc_tp.tokenizer import ByteTokenizer

    comm = world()
    folder = comm.bcast_object(tmp_path if comm.rank == 0 else None)
    ckpt = write_checkpoint(folder / "ckpt", "llama-gqa", ProcessGrid(tp=comm.size, world=comm), ByteTokenizer())
    texts = ["Hello", "tensor parallel", "x"]
    if comm.rank == 0:
        (folder / "in.jsonl").write_text("".join(f'{{"prompt": "{t}"}}\n' for t in texts))
    comm.barrier()
    assert (
        main(
            [
                "generate",
                "--ckpt",
                str(ckpt),
                "--prompts",
                str(folder / "in.jsonl"),
                "--out",
                str(folder / "out.jsonl"),
                "--max-new-tokens",
                "5",
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    comm.barrier()
    got = (folder / "out.jsonl").read_text().splitlines()
    args = type("Args", (), {"ckpt": str(ckpt), "tp": None, "dtype": "bfloat16", "device": "cpu"})()
    _, model, tokenizer = load_for_inference(args)
    full = GPTModel(ModelConfig(**CONFIGS["llama-gqa"]), comm, dtype="float32")
    assert model.local_bytes() * 2 == full.local_bytes()
    lead = comm.rank == 0  # the engine takes the prompts on world rank 0 and answers there
    out = Engine(model, tokenizer).generate(
        [list(t.encode()) for t in texts] if lead else None,
        [SamplingParams(max_new_tokens=5)] * len(texts) if lead else None,
    )
    if lead:
        assert [json.loads(line)["completion"] for line in got] == [w.text for w in out[0]]


def test_bfloat16_widening_path_forced(monkeypatch):
    """With ``kernels.bf16_dot`` off (a CPU without avx512_bf16) tp still gives one process's logits,
    and where it is on, its logits are the widening path's up to the order of the float32 sums."""
    tp, one = tp_and_reference()
    native = _logits(tp, "bfloat16")
    monkeypatch.setattr(bf16_dot, "AVAILABLE", False)
    widened = _logits(tp, "bfloat16")
    for step, (got, want, alone) in enumerate(zip(native, widened, _logits(one, "bfloat16"))):
        assert max_rel_err(want, alone) <= SAME_PRECISION["bfloat16"], f"step {step}"
        assert max_rel_err(got, want) <= SAME_PRECISION["bfloat16"], f"step {step}"


def _packed(comm, tied):
    model = _model(comm, "bfloat16", tied)
    pack_for_inference(model)
    return model


@pytest.mark.skipif(not bf16_dot.AVAILABLE, reason="needs numba and a CPU with avx512_bf16")
@pytest.mark.parametrize("tied", [True, False])
def test_packed_weights_keep_their_values_and_give_the_same_logits(tied):
    """``pack_for_inference`` (what loading for inference calls) keeps every bfloat16 weight matrix the
    products read in panels only (the head's as W.T: a tied embedding then looks its rows up from
    them, an untied one stays as it is), and every Parameter still reads the values it held; the
    logits at tp = the world size are one packed process's, and the unpacked model's, up to the order
    of the float32 sums. (A checkpoint save reads each Parameter's piece as ``data[valid_local()]``.)"""
    tp, one = tp_and_reference()
    model = _model(tp, "bfloat16", tied)
    loaded = {name: np.array(p.data) for name, p in model.named_parameters()}
    pack_for_inference(model)
    for name, p in model.named_parameters():
        products_read_it = len(p.shape) == 2 and (tied or name != "embed.weight")
        assert isinstance(p.data, bf16_panels.PanelValues) == products_read_it, name
        piece = p.partition.valid_local()
        assert np.array_equal(p.data[piece].view(np.uint16), loaded[name][piece].view(np.uint16)), name
    packed = _logits(tp, "bfloat16", model)
    alone = _logits(one, "bfloat16", _packed(one, tied))
    unpacked = _logits(tp, "bfloat16", _model(tp, "bfloat16", tied))
    for step, (got, one_process, plain) in enumerate(zip(packed, alone, unpacked)):
        assert max_rel_err(got, one_process) <= SAME_PRECISION["bfloat16"], f"step {step}"
        assert max_rel_err(got, plain) <= SAME_PRECISION["bfloat16"], f"step {step}"
