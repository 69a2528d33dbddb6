"""Checkpoints: saved at one layout, loaded at another, exactly; plain HDF5 readable from anywhere;
corruption, a missing shard and a failed save are caught; old steps are pruned; ``hpc-tp inspect``."""

import dataclasses
import json
import os
import re
import shutil
import tempfile
import zlib
from functools import partial
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc_tp.checkpoint import (
    CheckpointError,
    StreamedTensor,
    describe_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from hpc_tp.checkpoint import read as checkpoint_read
from hpc_tp.checkpoint import write as checkpoint_write
from hpc_tp.cli import main
from hpc_tp.comm.mpi import self_comm
from hpc_tp.errors import ConfigError
from hpc_tp.grid import ProcessGrid, factorizations
from hpc_tp.module import Parameter, Partition, replicated, split

mpi = pytest.mark.mpi(min_size=1)

# name -> (logical shape, split axis or None for replicated)
SPECS = {
    "col.weight": ((3, 8), 1),  # column-parallel
    "row.weight": ((8, 3), 0),  # row-parallel
    "norm.gain": ((6,), None),  # replicated
    "embed.weight": ((11, 3), 0),  # vocab padding: 11 rows in pieces of ceil(11 / tp)
    "kv.weight": ((3, 4), 1),  # fewer pieces than tp ranks: pairs of ranks share one
    "optim.exp_avg.col.weight": ((3, 8), 1),  # an optimizer state, float32
}


def full_tensor(name):
    return np.random.default_rng(zlib.crc32(name.encode())).standard_normal(SPECS[name][0])


def partition(name, tp, tp_rank) -> Partition:
    shape, axis = SPECS[name]
    if axis is None:
        return Partition(shape, replicas=tp)
    parts = max(1, tp // 2) if name.startswith("kv.") else tp
    return split(shape, axis, parts, tp_rank // (tp // parts), replicas=tp // parts)


def make_tensors(grid, fill=True):
    """This rank's parameters for its pipeline stage; padding (and, unfilled, everything) holds 99,
    so a save that wrote padding or a load that left stale values would show."""
    tensors = {}
    for name in sorted(SPECS)[grid.coords.pp :: grid.pp_size]:
        part = partition(name, grid.tp_size, grid.coords.tp)
        if name == "col.weight":  # a strided view into a fused buffer, as QKV is
            data = np.zeros((part.local_shape[0], 2 * part.local_shape[1]))[:, ::2]
        else:
            data = np.zeros(part.local_shape, np.float32 if name.startswith("optim.") else np.float64)
        tensors[name] = Parameter(data, part)
        if fill:
            tensors[name].load_full(full_tensor(name))
        padding = np.ones(part.local_shape, bool)
        padding[part.valid_local()] = not fill
        data[padding] = 99
    return tensors


def assert_hold_full_tensors(tensors):
    for name, tensor in tensors.items():
        expected = Parameter(np.zeros(tensor.data.shape, tensor.data.dtype), tensor.partition)
        expected.load_full(full_tensor(name))
        assert np.array_equal(tensor.data, expected.data), name


def as_streamed(tensors, fetched: list) -> dict:
    """``tensors`` as StreamedTensors that note each fetch in ``fetched`` and load into the tensors'
    own data, in reverse name order (not the order a save plans in)."""

    def fetch(name, failed):
        fetched.append(name)
        return tensors[name].data

    def store(name, local):
        tensors[name].data[...] = local

    return {
        name: StreamedTensor(
            tensors[name].partition, tensors[name].data.dtype, partial(fetch, name), partial(store, name)
        )
        for name in sorted(tensors, reverse=True)
    }


@pytest.fixture
def root(comm_world):
    """A folder every rank agrees on."""
    path = comm_world.bcast_object(tempfile.mkdtemp(prefix="hpc_tp-ckpt-") if comm_world.rank == 0 else None)
    yield Path(path)
    comm_world.barrier()
    if comm_world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def alone():
    return ProcessGrid(tp=1, world=self_comm())


@pytest.fixture
def everywhere(comm_world):
    return ProcessGrid(tp=comm_world.size, world=comm_world)


@mpi
def test_every_layout_loads_at_tp1_and_at_tp_world(comm_world, root, alone, everywhere):
    for step, (tp, pp, dp) in enumerate(factorizations(comm_world.size)):
        grid = ProcessGrid(tp=tp, pp=pp, dp=dp, world=comm_world)
        meta = {"layout": [tp, pp, dp], "config": {"d_model": 8}}
        path = save_checkpoint(root, step, make_tensors(grid), meta, grid, keep=0)
        pieces = {t["name"]: t["pieces"] for t in describe_checkpoint(path)["tensors"]}
        assert pieces == {
            "col.weight": tp,
            "row.weight": tp,
            "norm.gain": 1,
            "embed.weight": tp,
            "kv.weight": max(1, tp // 2),
            "optim.exp_avg.col.weight": tp,
        }
        for target in (alone, everywhere):
            tensors = make_tensors(target, fill=False)
            assert load_checkpoint(path, tensors, target) == meta
            assert_hold_full_tensors(tensors)


@mpi
def test_bfloat16_tensors_load_back_bit_for_bit_at_tp1_and_at_tp_world(comm_world, root, alone, everywhere):
    """HDF5 has no bfloat16: h5py stores its bits as opaque 2-byte elements, which read back as raw
    bytes until the tensor's dtype attribute says what they are. Into float32 they widen exactly."""
    bfloat16 = pytest.importorskip("ml_dtypes").bfloat16
    full = np.random.default_rng(3).standard_normal((8, 6)).astype(bfloat16)

    def tensors(grid, dtype):
        part = split((8, 6), 1, grid.tp_size, grid.coords.tp)
        tensor = Parameter(np.zeros(part.local_shape, dtype), part)
        return {"w": tensor}

    saved = tensors(everywhere, bfloat16)
    saved["w"].load_full(full)
    path = save_checkpoint(root, 1, saved, {}, everywhere)
    for target in (alone, everywhere):
        for dtype in (bfloat16, np.float32):
            loaded = tensors(target, dtype)
            load_checkpoint(path, loaded, target)
            part = loaded["w"].partition
            got, want = loaded["w"].data[part.valid_local()], full.astype(dtype)[part.local_slice()]
            assert got.dtype == dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))


@mpi
def test_master_is_plain_hdf5_readable_after_a_move_from_another_folder(
    comm_world, root, alone, everywhere, monkeypatch
):
    path = save_checkpoint(root, 7, make_tensors(everywhere), {"step": 7}, everywhere)
    comm_world.barrier()
    if comm_world.rank == 0:
        moved = Path(shutil.move(path, root / "elsewhere" / "ckpt"))
        monkeypatch.chdir(root / "elsewhere")
        with h5py.File("ckpt/master.h5", "r") as f:
            assert json.loads(f.attrs["meta"]) == {"step": 7}
            for name, (shape, axis) in SPECS.items():
                ds = f[f"tensors/{name}"]
                assert ds.shape == shape and ds.attrs["split_axis"] == (-1 if axis is None else axis)
                assert ds.attrs["dtype"] == ("float32" if name.startswith("optim.") else "float64")
                assert np.array_equal(ds[...], full_tensor(name).astype(ds.dtype)), name
        monkeypatch.chdir(tempfile.gettempdir())
        tensors = make_tensors(alone, fill=False)
        load_checkpoint(moved, tensors, alone)
        assert_hold_full_tensors(tensors)
        assert verify_checkpoint(moved) == []
    comm_world.barrier()


def flip_bytes(shard, dataset):
    with h5py.File(shard, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(shard, "r+b") as fh:
        fh.seek(offset)
        original = fh.read(8)
        fh.seek(offset)
        fh.write(bytes(b ^ 0xFF for b in original))


@mpi
def test_a_corrupted_piece_fails_verification_and_load(comm_world, root, alone, everywhere):
    path = save_checkpoint(root, 1, make_tensors(everywhere), {}, everywhere)
    comm_world.barrier()
    if comm_world.rank == 0:
        flip_bytes(path / "shards" / "rank-00000.h5", "tensors/row.weight")
    comm_world.barrier()
    problems = verify_checkpoint(path)
    assert len(problems) == 1 and "'row.weight': checksum mismatch" in problems[0] and "rank-00000.h5" in problems[0]
    for grid in (everywhere, alone):  # at tp=world only rank 0 reads the bad piece: every rank raises anyway
        with pytest.raises(ConfigError, match="'row.weight': checksum mismatch"):
            load_checkpoint(path, make_tensors(grid, fill=False), grid)


@mpi
def test_a_missing_shard_is_an_error_not_zeros(comm_world, root, alone, everywhere):
    path = save_checkpoint(root, 1, make_tensors(everywhere), {}, everywhere)
    comm_world.barrier()
    shard = f"shards/rank-{comm_world.size - 1:05d}.h5"
    if comm_world.rank == 0:
        os.remove(path / shard)
    comm_world.barrier()
    assert any(f"{shard} is missing" in p for p in verify_checkpoint(path))
    with pytest.raises(ConfigError, match=f"{shard} is missing"):
        load_checkpoint(path, make_tensors(alone, fill=False), alone)


@mpi
def test_a_failed_save_leaves_the_previous_checkpoint(comm_world, root, everywhere, monkeypatch):
    first = save_checkpoint(root, 1, make_tensors(everywhere), {"version": 1}, everywhere)
    real_piece_values = checkpoint_write._piece_values

    def fail_on_last_rank(data, partition):
        if comm_world.rank == comm_world.size - 1:
            raise OSError("disk full (injected)")
        return real_piece_values(data, partition)

    monkeypatch.setattr(checkpoint_write, "_piece_values", fail_on_last_rank)
    for step in (2, 1):  # a new step, and over the existing one
        with pytest.raises(CheckpointError, match="disk full"):
            save_checkpoint(root, step, make_tensors(everywhere), {"version": 2}, everywhere)
        assert sorted(os.listdir(root)) == ["latest", "step-000001"]
        assert latest_checkpoint(root) == first
        tensors = make_tensors(everywhere, fill=False)
        assert load_checkpoint(root, tensors, everywhere) == {"version": 1}
        assert_hold_full_tensors(tensors)
    monkeypatch.undo()
    save_checkpoint(root, 1, make_tensors(everywhere), {"version": 2}, everywhere)
    assert sorted(os.listdir(root)) == ["latest", "step-000001"]
    assert load_checkpoint(root, make_tensors(everywhere, fill=False), everywhere) == {"version": 2}


@mpi
def test_streamed_tensors_are_fetched_by_every_rank_in_order_and_stored_on_load(
    comm_world, root, everywhere, monkeypatch
):
    """Every rank fetches every streamed tensor once per save, in the order given, though only dp
    rank 0 writes (a fetch may be a collective), and so even when the writer fails at its first
    piece; the checkpoint is the one plain tensors make, and a load at another layout hands each
    tensor its local array (padding zero)."""
    grid = ProcessGrid(tp=1, dp=comm_world.size, world=comm_world)
    tensors, fetched = make_tensors(grid), []
    path = save_checkpoint(root, 1, as_streamed(tensors, fetched), {"v": 1}, grid)
    assert fetched == sorted(tensors, reverse=True) and verify_checkpoint(path) == []
    loaded = make_tensors(everywhere, fill=False)
    assert load_checkpoint(path, as_streamed(loaded, []), everywhere) == {"v": 1}
    assert_hold_full_tensors(loaded)

    def fail_on_rank_0(*args):
        if comm_world.rank == 0:
            raise OSError("disk full (injected)")
        return real_piece_values(*args)

    real_piece_values = checkpoint_write._piece_values
    monkeypatch.setattr(checkpoint_write, "_piece_values", fail_on_rank_0)
    fetched.clear()
    with pytest.raises(CheckpointError, match="rank 0: OSError: disk full"):
        save_checkpoint(root, 2, as_streamed(tensors, fetched), {"v": 2}, grid)
    assert fetched == sorted(tensors, reverse=True) and latest_checkpoint(root) == path


@mpi
def test_a_writer_whose_fetch_delivers_elsewhere_fails_the_save_on_every_rank(comm_world, root):
    """A fetch that gathers to one rank returns None on the others; should that be a rank that
    writes the tensor, the save fails on every rank, after the remaining tensors were fetched (a
    peer may wait in their gathers), and the checkpoint before stays the latest."""
    grid = ProcessGrid(tp=1, dp=comm_world.size, world=comm_world)
    tensors, fetched = make_tensors(grid), []
    path = save_checkpoint(root, 1, as_streamed(tensors, fetched), {"v": 1}, grid)
    streamed, fetched[:] = as_streamed(tensors, fetched), []
    lost = list(streamed)[1]
    streamed[lost] = dataclasses.replace(streamed[lost], fetch=lambda failed: fetched.append(lost))  # returns None
    with pytest.raises(CheckpointError, match=re.escape(f"rank 0: CheckpointError: streamed tensor {lost!r}")):
        save_checkpoint(root, 2, streamed, {"v": 2}, grid)
    assert fetched == list(streamed) and latest_checkpoint(root) == path


@mpi
def test_keep_prunes_the_oldest_steps(comm_world, root, everywhere):
    tensors = make_tensors(everywhere)
    for step in range(1, 5):
        save_checkpoint(root, step, tensors, {"step": step}, everywhere, keep=2)
    assert sorted(os.listdir(root)) == ["latest", "step-000003", "step-000004"]
    assert latest_checkpoint(root) == root / "step-000004"
    save_checkpoint(root, 2, tensors, {"step": 2}, everywhere, keep=2)  # a rerun from an earlier step stays
    assert sorted(os.listdir(root)) == ["latest", "step-000002", "step-000003", "step-000004"]
    assert latest_checkpoint(root) == root / "step-000002"


@mpi
def test_load_errors_name_the_tensor_and_shapes(comm_world, root, alone, everywhere):
    path = save_checkpoint(root, 1, make_tensors(everywhere), {}, everywhere)
    wrong_shape = make_tensors(alone, fill=False) | {"norm.gain": Parameter(np.zeros(5), replicated((5,), 1))}
    with pytest.raises(ConfigError, match=r"'norm.gain' has shape \(6,\) in the checkpoint but \(5,\) in the model"):
        load_checkpoint(path, wrong_shape, alone)
    tensors = make_tensors(everywhere, fill=False)
    if comm_world.rank == comm_world.size - 1:  # missing on one rank only: every rank raises
        tensors["lm_head.weight"] = Parameter(np.zeros((2, 2)), replicated((2, 2), 1))
    with pytest.raises(ConfigError, match=r"'lm_head.weight' \(shape \(2, 2\)\) is not in the checkpoint"):
        load_checkpoint(path, tensors, everywhere)


def note_reads(monkeypatch, call=0, error=None) -> list:
    """A list of the tensors this rank reads from now on (``read_verified``, in order); its
    ``call``-th read raises ``error`` instead, where one is given."""
    real, reads = checkpoint_read.read_verified, []

    def noted(f, name, start, stop):
        reads.append(name)
        if error is not None and len(reads) == call:
            raise error
        return real(f, name, start, stop)

    monkeypatch.setattr(checkpoint_read, "read_verified", noted)
    return reads


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("max_agreements", [64, 2])
def test_a_corrupt_slice_one_rank_reads_stops_every_rank_at_that_tensor(
    comm_world, root, everywhere, monkeypatch, max_agreements
):
    """At tp = world each rank reads only its own columns of col.weight, the first tensor; the last
    rank's are corrupted. Every rank raises that rank's error, in one line, and no rank reads a
    tensor after it (the ranks agree after each tensor), where the others used to read all six;
    with at most 2 agreements the six tensors go 3 to a step, and the others stop after the third."""
    monkeypatch.setattr(checkpoint_read, "MAX_AGREEMENTS", max_agreements)
    path = save_checkpoint(root, 1, make_tensors(everywhere), {}, everywhere)
    last = comm_world.size - 1
    comm_world.barrier()
    if comm_world.rank == 0:
        flip_bytes(path / "shards" / f"rank-{last:05d}.h5", "tensors/col.weight")
    comm_world.barrier()
    tensors = make_tensors(everywhere, fill=False)
    assert list(tensors)[0] == "col.weight" and len(tensors) == 6
    reads = note_reads(monkeypatch)
    with pytest.raises(ConfigError) as raised:
        load_checkpoint(path, tensors, everywhere)
    assert re.fullmatch(
        rf"rank {last}: checkpoint \S+: tensor 'col.weight': checksum mismatch at 1 of \d+ indices "
        rf"along axis 1 \(first: \d+, stored in \S*rank-{last:05d}.h5\); the file is corrupted",
        str(raised.value),
    ), str(raised.value)
    assert reads == list(tensors)[: 1 if comm_world.rank == last or max_agreements >= 6 else 3]


@pytest.mark.mpi(min_size=2)
def test_a_store_failing_on_one_rank_stops_every_rank_at_that_tensor(comm_world, root, everywhere):
    """The last rank's second StreamedTensor.store raises: every rank raises that error, having
    read and stored nothing after the second tensor."""
    path = save_checkpoint(root, 1, make_tensors(everywhere), {}, everywhere)
    streamed, stored = as_streamed(make_tensors(everywhere, fill=False), []), []
    second, last = list(streamed)[1], comm_world.size - 1

    def store(name, real, local):
        if name == second and comm_world.rank == last:
            raise RuntimeError("no room to store (injected)")
        stored.append(name)
        real(local)

    noted = {name: dataclasses.replace(t, store=partial(store, name, t.store)) for name, t in streamed.items()}
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path, noted, everywhere)
    assert str(raised.value) == f"rank {last}: RuntimeError: no room to store (injected)"
    assert stored == list(streamed)[: 1 if comm_world.rank == last else 2]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("failing", [None, "fewest", "most"])
def test_ranks_loading_different_tensors_agree_position_by_position(comm_world, root, monkeypatch, failing):
    """Pipeline stages load different tensors, in numbers of their own: here rank r loads the first
    1 + 5 r / (world - 1) of the six (rank 0 one, the last all). The load fills each rank's own;
    a read failing at rank 0's only tensor stops every rank after its first, and one failing at the
    last rank's sixth reaches rank 0 five tensors past its own (it kept agreeing, reading nothing)."""
    grid = ProcessGrid(tp=1, dp=comm_world.size, world=comm_world)
    path = save_checkpoint(root, 1, make_tensors(grid), {"v": 1}, grid)
    last = comm_world.size - 1
    everything = make_tensors(grid, fill=False)
    mine = dict(list(everything.items())[: 1 + 5 * comm_world.rank // last])
    failing_rank, call = {None: (None, 0), "fewest": (0, 1), "most": (last, 6)}[failing]
    injected = ConfigError("injected read failure") if comm_world.rank == failing_rank else None
    reads = note_reads(monkeypatch, call, injected)
    if failing is None:
        assert load_checkpoint(path, mine, grid) == {"v": 1}
        assert_hold_full_tensors(mine)
        assert reads == list(mine)
        return
    with pytest.raises(ConfigError) as raised:
        load_checkpoint(path, mine, grid)
    assert re.fullmatch(rf"rank {failing_rank}: checkpoint \S+: injected read failure", str(raised.value))
    assert reads == list(mine)[:call]


@mpi
def test_inspect_shows_config_tensors_and_verification(comm_world, root, everywhere, capsys):
    meta = {
        "config": {
            "family": "gpt2",
            "vocab_size": 11,
            "d_model": 8,
            "n_layers": 2,
            "n_heads": 2,
            "comment": "long enough to be listed key by key",
        },
        "step": 3,
        "rng": list(range(624)),
    }
    path = save_checkpoint(root, 3, make_tensors(everywhere), meta, everywhere, files={"tokenizer.json": b"{}"})
    assert (path / "tokenizer.json").read_bytes() == b"{}"
    capsys.readouterr()
    assert main(["inspect", str(root)]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in SPECS)
    assert "11x3" in text and '"gpt2"' in text and "<list of 624>" in text and "tokenizer.json" in text
    assert "verify      OK" in text
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 3 and info["problems"] == [] and info["meta"] == meta
    assert {t["name"]: tuple(t["shape"]) for t in info["tensors"]} == {n: s for n, (s, _) in SPECS.items()}


@mpi
def test_a_resave_that_dies_between_its_renames_keeps_the_old_step(comm_world, root, everywhere):
    first = save_checkpoint(root, 1, make_tensors(everywhere), {"version": 1}, everywhere)
    comm_world.barrier()
    if comm_world.rank == 0:  # the state a crash right after setting step 1 aside leaves
        os.rename(first, root / ".old-step-000001")
        (root / ".tmp-step-000001").mkdir()
    comm_world.barrier()
    assert latest_checkpoint(root) == root / ".old-step-000001"
    tensors = make_tensors(everywhere, fill=False)
    assert load_checkpoint(root, tensors, everywhere) == {"version": 1}
    assert_hold_full_tensors(tensors)
    save_checkpoint(root, 1, make_tensors(everywhere), {"version": 2}, everywhere)  # the rerun replaces it
    assert sorted(os.listdir(root)) == ["latest", "step-000001"]
    assert load_checkpoint(root, make_tensors(everywhere, fill=False), everywhere) == {"version": 2}


@mpi
def test_a_truncated_master_file_is_one_clear_error(comm_world, root, alone, everywhere):
    path = save_checkpoint(root, 1, make_tensors(everywhere), {}, everywhere)
    comm_world.barrier()
    if comm_world.rank == 0:
        os.truncate(path / "master.h5", (path / "master.h5").stat().st_size // 2)
    comm_world.barrier()
    with pytest.raises(ConfigError, match="master.h5: .*truncated"):
        describe_checkpoint(path)
    with pytest.raises(ConfigError, match="truncated"):
        load_checkpoint(path, make_tensors(alone, fill=False), alone)


def test_a_file_system_without_room_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """HDF5 crashes on a full disk (a write error at close), and the half-written folder would fill
    it: the save measures what it will write against the free space first."""
    grid = ProcessGrid(tp=1, world=self_comm())
    first = save_checkpoint(tmp_path, 1, make_tensors(grid), {"v": 1}, grid)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint_write.shutil, "disk_usage", lambda path: usage._replace(free=2**20))
    with pytest.raises(ConfigError, match=r"checkpoint step 2: [\d.]+ MiB to write, 1\.0 MiB free in "):
        save_checkpoint(tmp_path, 2, make_tensors(grid), {"v": 2}, grid)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000001"] and latest_checkpoint(tmp_path) == first


class _FlushRecorder:
    """An h5py file that notes its collective calls (this h5py has no MPI driver: opened plainly)."""

    open_plainly = h5py.File

    def __init__(self, path, mode="r", driver=None, comm=None):
        self.file, self.calls = _FlushRecorder.open_plainly(path, mode), [driver]
        _FlushRecorder.last = self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.calls.append("close")
        self.file.close()

    def flush(self):
        self.calls.append("flush")
        self.file.flush()

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __getitem__(self, key):
        return self.file[key]


def test_the_parallel_hdf5_path_writes_one_file_and_a_failed_piece_still_closes_it(tmp_path, monkeypatch):
    """The one-file path (parallel HDF5 builds) at one rank: it loads and verifies like the shard
    path; a rank whose piece fails still reaches the collective flush and close (else, at several
    ranks, the others would wait there forever), then the save fails and step 1 stays."""
    grid = ProcessGrid(tp=1, world=self_comm())
    monkeypatch.setattr(checkpoint_write, "COLLECTIVE_IO", True)
    monkeypatch.setattr(checkpoint_write.h5py, "File", _FlushRecorder)
    path = save_checkpoint(tmp_path, 1, make_tensors(grid), {"v": 1}, grid)
    monkeypatch.undo()
    assert _FlushRecorder.last.calls == ["mpio", "flush", "close"] and not (path / "shards").exists()
    assert verify_checkpoint(path) == []
    tensors = make_tensors(grid, fill=False)
    assert load_checkpoint(path, tensors, grid) == {"v": 1}
    assert_hold_full_tensors(tensors)

    monkeypatch.setattr(checkpoint_write, "COLLECTIVE_IO", True)
    monkeypatch.setattr(checkpoint_write.h5py, "File", _FlushRecorder)
    monkeypatch.setattr(checkpoint_write, "_piece_values", lambda *args: (_ for _ in ()).throw(OSError("device lost")))
    with pytest.raises(CheckpointError, match="device lost"):
        save_checkpoint(tmp_path, 2, make_tensors(grid), {"v": 2}, grid)
    assert _FlushRecorder.last.calls == ["mpio", "flush", "close"]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000001"]


def test_the_parallel_hdf5_path_fetches_every_streamed_tensor_though_a_write_failed(tmp_path, monkeypatch):
    """The one-file path writes streamed tensors as plain ones, and a rank whose first write fails
    still fetches the rest (its peers may wait in those fetches) before the collective flush."""
    grid = ProcessGrid(tp=1, world=self_comm())
    tensors, fetched = make_tensors(grid), []
    monkeypatch.setattr(checkpoint_write, "COLLECTIVE_IO", True)
    monkeypatch.setattr(checkpoint_write.h5py, "File", _FlushRecorder)
    path = save_checkpoint(tmp_path, 1, as_streamed(tensors, fetched), {"v": 1}, grid)
    monkeypatch.setattr(checkpoint_write, "_piece_values", lambda *args: (_ for _ in ()).throw(OSError("device lost")))
    with pytest.raises(CheckpointError, match="device lost"):
        save_checkpoint(tmp_path, 2, as_streamed(tensors, fetched), {"v": 2}, grid)
    assert fetched == 2 * sorted(tensors, reverse=True) and _FlushRecorder.last.calls == ["mpio", "flush", "close"]
    monkeypatch.undo()
    loaded = make_tensors(grid, fill=False)
    assert load_checkpoint(path, loaded, grid) == {"v": 1} and verify_checkpoint(path) == []
    assert_hold_full_tensors(loaded)


def test_latest_falls_back_to_the_highest_complete_step(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step, complete in ((1, True), (3, True), (4, False)):
        (tmp_path / f"step-{step:06d}").mkdir()
        if complete:
            (tmp_path / f"step-{step:06d}" / "master.h5").touch()
    (tmp_path / "latest").write_text("step-000009\n")  # dangling: a crash between rename and pointer
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000003"
    (tmp_path / "latest").write_text("step-000001\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"
    assert "neither a checkpoint folder" in verify_checkpoint(tmp_path / "step-000004")[0]
