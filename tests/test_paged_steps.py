"""Continuous batching's decode step at a bucket's fixed shapes (``serve.decoding.PagedSteps``): rows
padded to a power of two, each row's slots to a power of two of blocks, the padding rows writing to the
scratch slot. Its logits are the eager step's as rows join and leave and the buckets change (float64,
at tp = world size); each bucket is captured at its first step and replayed after (over a stand-in for
cupy); graphs are taken only on a GPU, at tp = 1 or over NCCL. The device's own check is gpu-check's (test_gpu.py)."""

import types

import numpy as np
import pytest
from test_cuda_graph import fake_cupy as fake_cupy  # noqa: F401, PLC0414 (the fixture, used by its name)
from test_generate import CONFIGS, _model, larger_weights
from tp_helpers import CaptureProbe, max_rel_err, tp_and_reference

from hpc_tp import backend
from hpc_tp.bench import gpu_check as G
from hpc_tp.kernels import paged_attention
from hpc_tp.serve import decoding
from hpc_tp.serve.blocks import PagedLayout
from hpc_tp.serve.decoding import PagedSteps, paged_steps
from hpc_tp.serve.kv_cache import PagedKVCache


def _cache(model, block_size=4, units=40):
    return PagedKVCache.for_model(model, units, PagedLayout.of(model.cfg, block_size))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("attention", ["paged-kernel", "gathered"])
@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("name", ["gpt2", "llama-window", "qwen-moe"])
def test_bucketed_steps_give_the_eager_steps_logits_as_rows_join_and_leave(name, block_size, attention, monkeypatch):
    """``gpu_check.CONTINUOUS_STEPS``: batches of 1 to 6 rows of 1 to 17 tokens, each row prefilled as
    it joins; with the CPU's kernel reading each row's own slots, and with every row's slots gathered up
    to the step's width and masked (the device's path, here over the bucket's padded slots)."""
    if attention == "gathered":
        monkeypatch.setattr(paged_attention, "supported", lambda q, pool: False)
    buckets, step = [], PagedSteps.step

    def spy(self, ids, lens, slots):
        buckets.append(self.bucket(len(lens), slots.shape[-1]))
        return step(self, ids, lens, slots)

    monkeypatch.setattr(PagedSteps, "step", spy)
    tp, _ = tp_and_reference()
    (eager, _), (fixed, replayed) = (
        G.continuous_step_logits("cpu", fixed, CONFIGS[name], larger_weights, tp, block_size) for fixed in (False, True)
    )
    assert len(fixed) == len(eager) == len(G.CONTINUOUS_STEPS) and not replayed
    assert all(f.shape == e.shape for f, e in zip(fixed, eager))
    assert max(max_rel_err(f, e) for f, e in zip(fixed, eager)) <= 1e-12
    assert [width for width, _ in buckets] == [1, 4, 4, 6, 6, 4, 6, 1, 1, 4, 4, 2, 2, 2, 2]
    assert {keys for _, keys in buckets} == {8, 16, 32}


def test_buckets_are_powers_of_two_of_rows_and_of_blocks_within_the_batch_and_the_context():
    _, one = tp_and_reference()
    model = _model("gpt2", one)
    steps = PagedSteps(model, _cache(model), rows=6, max_len=20, capture=False)
    assert [steps.bucket(rows, 5)[0] for rows in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    # blocks of 4: 1, 1, 2, 3, 4, 5 blocks -> 1, 1, 2, 4, 4 and 5 (the 5 blocks of 20 slots, not 8)
    assert [steps.bucket(1, slots)[1] for slots in (1, 4, 5, 9, 16, 17)] == [4, 4, 8, 16, 16, 20]


def test_each_bucket_is_captured_at_its_first_step_and_replayed_after(fake_cupy):  # noqa: F811
    """Over the stand-in (which runs the captured call and launches nothing): a bucket's first step is
    eager and then captured, its next steps are launches, another bucket gets a capture of its own, and
    closing gives every graph's pool back. The inputs are copied in before each step: the padded
    arrays the bucket owns hold the last step's rows."""
    events = fake_cupy()
    _, one = tp_and_reference()
    model = _model("gpt2", one)
    steps = PagedSteps(model, _cache(model), rows=4, max_len=32, capture=True)

    def step(lens):
        lens = np.array(lens)
        slots = (np.arange(4 * len(lens)).reshape(1, len(lens), 4) + 4)[..., : lens.max() + 1]
        events.append(f"step of {len(lens)}")
        return steps.step(np.arange(len(lens)) + 3, lens, slots)

    assert step([2]).shape == (1, model.cfg.vocab_size)
    step([1])
    step([0, 2, 1])
    step([3, 1, 1])
    captured = ["private pool", "on capture stream", "begin capture", "end capture", "off capture stream"]
    assert events == (
        ["step of 1", *captured, "default pool", "step of 1", "launch"]
        + ["step of 3", *captured, "default pool", "step of 3", "launch"]
    )
    bucket = steps.buckets[(4, 4)]
    staged = bucket.inputs.on_device
    assert staged["ids"][:, 0].tolist() == [3, 4, 5, 0] and bucket.counts.tolist() == [4, 2, 2, 1]
    assert staged["write"][0, :, 0].tolist() == [7, 9, 13, 0]  # each row's slot at its length; padding: scratch
    assert staged["mask"].sum(axis=1).tolist() == [4, 2, 2, 1] and staged["query_slots"].tolist() == [3, 1, 1, 0]
    assert steps.uses_graph and len(steps.buckets) == 2
    steps.close()
    assert events[-2:] == ["pool freed", "pool freed"] and not steps.buckets


def test_a_step_s_inputs_reach_the_device_in_one_copy(monkeypatch):
    """``_Staged`` over a stand-in device array (a numpy subclass whose ``set`` copies and is counted):
    writing the host views changes nothing on the device until the one copy moves every array."""
    copies = []

    class OnDevice(np.ndarray):
        def set(self, host):
            copies.append(host.nbytes)
            self[...] = host

    monkeypatch.setattr(backend, "xp", types.SimpleNamespace(asarray=lambda a: np.array(a).view(OnDevice)))
    staged = decoding._Staged({"ids": (2, 1), "read": (1, 2, 3)}, (2, 3))
    staged.on_host["read"][0, 1] = [7, 8, 9]
    staged.on_host["mask"][1, :2] = True
    assert not staged.on_device["read"].any() and not staged.on_device["mask"].any()
    staged.copy()
    assert copies == [8 * (2 + 6) + 6]
    assert staged.on_device["read"].tolist() == [[[0, 0, 0], [7, 8, 9]]]
    assert staged.on_device["mask"].tolist() == [[False] * 3, [True, True, False]]


@pytest.mark.mpi(min_size=1)
def test_the_batcher_takes_fixed_steps_where_graphs_are_captured_or_where_asked(monkeypatch):
    tp, one = tp_and_reference()

    def chosen(comm, fixed=None):
        model = _model("gpt2", comm)
        steps = paged_steps(model, _cache(model), 4, 32, fixed)
        return None if steps is None else ("captured" if steps.capture else "eager")

    assert chosen(one) is None and chosen(one, fixed=True) == "eager"  # the CPU: step_view's step unless asked
    monkeypatch.setattr(backend, "device", "cuda")  # only the choice is made here; nothing runs on it
    assert chosen(one) == "captured" and chosen(one, fixed=False) is None
    monkeypatch.setenv("HPC_TP_CUDA_GRAPHS", "0")
    assert chosen(one) is None and chosen(one, fixed=True) == "eager"
    monkeypatch.delenv("HPC_TP_CUDA_GRAPHS")
    assert chosen(tp) == ("captured" if tp.size == 1 else None)  # MPI collectives are not captured
    nccl_like = CaptureProbe(tp)
    nccl_like.stream_ordered = True  # as NCCLCommunicator: its collectives are captured with the kernels
    assert chosen(nccl_like) == "captured"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["gpt2", "llama-window", "qwen-moe"])
def test_a_bucket_s_step_makes_only_collectives_a_graph_holds(name):
    """What a capture of a bucket's step records at tp > 1 over NCCL: array collectives on the stream,
    no host call, which would run once at the capture and never at a replay."""
    probe = CaptureProbe(tp_and_reference()[0])
    model = _model(name, probe)
    steps = PagedSteps(model, _cache(model), rows=4, max_len=32, capture=False)
    lens = np.array([3, 5, 1])
    slots = np.arange(lens.size * 8).reshape(1, lens.size, 8) + 4
    steps.step(np.arange(lens.size), lens, slots)  # the bucket's eager first step
    probe.capturing = True
    steps.step(np.arange(lens.size), lens + 1, slots)
    assert probe.calls or probe.size == 1  # each layer's all-reduces, the head's gather
