"""``hpc-tp bench comm``: record fields, bus-bandwidth formulas, sizes and the JSON output. No speed asserted."""

import json

import pytest

from hpc_tp.bench import command
from hpc_tp.bench.comm import DEFAULT_OPS, OPS, benchmark_comm, element_count
from hpc_tp.bench.command import size_range
from hpc_tp.cli import build_parser, main
from hpc_tp.errors import ConfigError

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "p2p": lambda n: 1.0,
}  # nccl-tests' PERFORMANCE.md


@pytest.mark.mpi(min_size=1)
def test_records_are_sane(comm_world):
    n = comm_world.size
    records = benchmark_comm(comm_world, [8, 1000, 4096], iters=3, warmup=1)
    expected_ops = [name for name in DEFAULT_OPS if n >= OPS[name].min_ranks]
    assert [(r["op"], r["bytes"]) for r in records] == [
        (name, element_count(OPS[name], size, n) * 4) for name in expected_ops for size in (8, 1000, 4096)
    ]
    assert ("p2p" in expected_ops) == (n > 1)
    for r in records:
        assert r["ranks"] == n and r["iters"] == 3 and r["dtype"] == "float32" and r["link"] == "intra"
        for impl in ("project", "raw"):
            seconds, algbw = r[f"{impl}_time_s"], r[f"{impl}_algbw_GBps"]
            assert 0 < seconds < 1
            assert algbw == pytest.approx(r["bytes"] / seconds / 1e9)
            assert r[f"{impl}_busbw_GBps"] == pytest.approx(algbw * BUS_FACTOR[r["op"]](n))
        assert r["project_over_raw"] == pytest.approx(r["project_time_s"] / r["raw_time_s"])
    assert comm_world.allgather_object(records) == [records] * n  # every rank reports the same numbers


@pytest.mark.mpi(min_size=1)
def test_command_writes_json_on_rank_0(comm_world, tmp_path, capsys):
    path = comm_world.bcast_object(str(tmp_path / "out" / "comm.json"))
    assert (
        main(
            [
                "bench",
                "comm",
                "--sizes",
                "8:128",
                "--iters",
                "2",
                "--warmup",
                "0",
                "--ops",
                "all_reduce,p2p",
                "--json",
                path,
            ]
        )
        == 0
    )
    comm_world.barrier()
    printed = capsys.readouterr().out
    if comm_world.rank == 0:
        records = json.loads(open(path).read())
        ran = ["all_reduce", "p2p"] if comm_world.size > 1 else ["all_reduce"]
        assert [(r["op"], r["bytes"]) for r in records] == [(name, size) for name in ran for size in (8, 32, 128)]
        assert "all_reduce" in printed and "proj/raw" in printed
    else:
        assert printed == ""
    comm_world.barrier()  # rank 0 reads before tmp dirs go


def test_element_count_keeps_whole_pieces():
    assert element_count(OPS["all_reduce"], 8, 4) == 2
    assert element_count(OPS["all_gather"], 8, 4) == 4  # at least one element per rank
    assert element_count(OPS["reduce_scatter"], 100, 3) == 24


def test_size_range():
    assert size_range("8:4096") == [8, 32, 128, 512, 2048, 4096]
    assert size_range("8:64M")[-2:] == [32 << 20, 64 << 20]
    assert size_range("1K:4K:2") == [1024, 2048, 4096]
    assert size_range("512") == [512]


@pytest.mark.parametrize("text", ["8:4x", "0:8", "64:8", "8:64:1", "8:64:4:2", ":8"])
def test_bad_sizes(text):
    with pytest.raises(ConfigError, match="size"):
        size_range(text)


def test_bad_ops_and_iters():
    for argv, message in ((["--ops", "all_reduce,broadcast"], "unknown broadcast"), (["--iters", "0"], "--iters")):
        with pytest.raises(ConfigError, match=message):
            command.run(build_parser().parse_args(["bench", "comm", "--sizes", "8", *argv]))
