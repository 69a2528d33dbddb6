"""``hpc-tp bench step``: the FLOP formula, the record's fields and their relations, the JSON file. No speed asserted."""

import json

import numpy as np
import pytest
from tp_helpers import CaptureProbe

from hpc_tp.backend import HUGE_PAGE_TUNABLE, heap_huge_pages_requested, huge_page_bytes
from hpc_tp.bench import command
from hpc_tp.bench.step import build_blocks, step_flops
from hpc_tp.cli import build_parser, main
from hpc_tp.errors import ConfigError
from hpc_tp.models.config import ModelConfig, load_config
from hpc_tp.tensor_parallel.sequence_parallel import scatter_sequence


def test_w1_flops_by_hand():
    # Per layer and forward: QKV 1024x768x2304, out 1024x768x768, fc1 and fc2 1024x768x3072, scores and P V
    # 4 x 12 heads x 256 x 256 x 64 each; times 2 FLOPs per multiply-add, 3 for forward+backward, 4 layers.
    n = 4 * 256
    gemms = n * 768 * 2304 + n * 768 * 768 + 2 * n * 768 * 3072 + 2 * 4 * 12 * 256 * 256 * 64
    assert step_flops(load_config("w1", n_layers=4), batch=4, seq=256) == 2 * 3 * 4 * gemms


def test_flops_follow_gqa_and_swiglu():
    cfg = ModelConfig(hidden=64, n_heads=8, n_kv_heads=2, ffn_hidden=96, activation="swiglu", n_layers=1)
    n, kv = 2 * 10, 2 * 8
    forward = 2 * n * (64 * (64 + 2 * kv) + 64 * 64 + 3 * 64 * 96) + 4 * n * 10 * 64
    assert step_flops(cfg, batch=2, seq=10) == 3 * forward


def test_needed_flops_count_only_the_pairs_a_causal_query_sees():
    w1 = load_config("w1", n_layers=4)
    skipped = 2 * 3 * 4 * 2 * 4 * 12 * (256 * 256 - 256 * 257 // 2) * 64  # upper-triangle pairs of both products
    assert step_flops(w1, batch=4, seq=256) - step_flops(w1, batch=4, seq=256, needed_only=True) == skipped
    bidirectional = ModelConfig(hidden=64, n_heads=4, ffn_hidden=96, n_layers=1, causal=False)
    assert step_flops(bidirectional, 2, 10, needed_only=True) == step_flops(bidirectional, 2, 10)


def test_huge_page_request_is_read_from_the_glibc_tunables():
    assert heap_huge_pages_requested({"GLIBC_TUNABLES": f"glibc.malloc.trim_threshold=1:{HUGE_PAGE_TUNABLE}"})
    assert not heap_huge_pages_requested({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert not heap_huge_pages_requested({"GLIBC_TUNABLES": f"{HUGE_PAGE_TUNABLE}:glibc.malloc.hugetlb=0"})  # last wins
    assert not heap_huge_pages_requested({})
    measured = huge_page_bytes()
    assert measured is None or 0 <= measured[0] <= measured[1]


@pytest.mark.mpi(min_size=1)
def test_command_writes_consistent_record(comm_world, tmp_path, capsys):
    path = comm_world.bcast_object(str(tmp_path / "out" / "step.json"))
    assert (
        main(
            [
                "bench",
                "step",
                "--model",
                "tiny",
                "--layers",
                "1",
                "--seq-len",
                "8",
                "--micro-batch",
                "2",
                "--repeats",
                "3",
                "--warmup",
                "1",
                "--threads",
                "1",
                "--json",
                path,
            ]
        )
        == 0
    )
    comm_world.barrier()
    printed = capsys.readouterr().out
    if comm_world.rank == 0:
        r = json.loads(open(path).read())
        assert (r["tp"], r["layers"], r["hidden"], r["seq_len"], r["micro_batch"]) == (comm_world.size, 1, 32, 8, 2)
        assert r["dtype"] == "float32" and r["threads_per_rank"] == 1 and r["repeats"] == 3
        assert (r["nodes"], r["ranks_per_node"]) == (1, comm_world.size)  # every rank on this one host
        assert isinstance(r["malloc_retained"], bool)
        assert r["huge_pages_requested"] == heap_huge_pages_requested()
        assert len(r["huge_page_bytes"]) == comm_world.size
        assert all(h is None or 0 <= h[0] <= h[1] for h in r["huge_page_bytes"])
        assert "huge pages:" in printed
        assert len(r["step_s_all"]) == 3 and min(r["step_s_all"]) > 0
        assert r["step_s"] >= sorted(r["step_s_all"])[1]  # the slowest rank's median, at least rank 0's
        assert r["compute_s"] + r["comm_s"] == pytest.approx(r["step_s"])
        assert r["comm_s"] >= 0 and (r["comm_s"] > 0) == (comm_world.size > 1)
        assert r["flops"] == step_flops(load_config("tiny", n_layers=1), 2, 8)
        assert r["achieved_flops"] == pytest.approx(r["flops"] / r["step_s"])
        assert r["mfu"] == pytest.approx(r["achieved_flops"] / (r["gemm_peak_flops_per_rank"] * r["tp"]))
        assert len(r["gemm_peak_samples"]) == 3 and r["gemm_peak_flops_per_rank"] == sorted(r["gemm_peak_samples"])[1]
        needed = step_flops(load_config("tiny", n_layers=1), 2, 8, needed_only=True)
        assert r["floor_s"] == pytest.approx(needed / (max(r["gemm_peak_samples"]) * r["tp"]))
        assert "floor" in printed
        assert len(r["peak_mem_bytes"]) == comm_world.size and min(r["peak_mem_bytes"]) > 0
        assert "MFU" in printed and "GEMM peak" in printed
    else:
        assert printed == ""
    comm_world.barrier()  # rank 0 reads before tmp dirs go


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "0"], "--layers 0"),
        (["--micro-batch", "-1"], "--micro-batch"),
        (["--warmup", "-1"], "--warmup"),
        (["--model", "nope"], "nope"),
    ],
)
def test_bad_options(argv, message):
    with pytest.raises(ConfigError, match=message):
        command.run(build_parser().parse_args(["bench", "step", *argv]))


@pytest.mark.mpi(min_size=1)
def test_sequence_parallel_blocks_get_their_shard(comm_world, monkeypatch):
    """With sequence parallelism the blocks take [B, T/tp, H]: fed the whole sequence, each rank
    would gather tp copies and time tp times the work the FLOP count assumes."""
    from hpc_tp.bench import step
    from hpc_tp.comm.mpi import world
    from hpc_tp.models.gpt import GPTModel

    seen = []
    original = GPTModel.blocks_forward
    monkeypatch.setattr(GPTModel, "blocks_forward", lambda self, x, *a: seen.append(x.shape) or original(self, x, *a))
    cfg = load_config("tiny", n_layers=1, sequence_parallel=True)
    step.benchmark_step(world(), cfg, batch=2, seq=8, repeats=1, warmup=0)
    assert set(seen) == {(2, 8 // comm_world.size, 32)}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_the_step_makes_only_collectives_a_graph_holds(comm_world, sequence_parallel):
    """What ``--cuda-graph`` captures at tp > 1 over NCCL: the blocks' forward and backward make array
    collectives on the stream only, no host call, which would run once at the capture and never again."""
    probe = CaptureProbe(comm_world)
    cfg = load_config("tiny", n_layers=2, sequence_parallel=sequence_parallel)
    model = build_blocks(cfg, probe, "float64")
    x = np.random.default_rng(1).standard_normal((2, 8, cfg.hidden))
    if sequence_parallel and probe.size > 1:
        x = scatter_sequence(x, probe)
    probe.capturing = True
    out, ctxs = model.blocks_forward(x)
    model.blocks_backward(out * 0.01, ctxs)
    assert probe.calls or probe.size == 1
