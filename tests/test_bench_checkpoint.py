"""`hpc-tp bench checkpoint`: the record's structure, and that the timed load really restores the tensors."""

from pathlib import Path

import numpy as np
import pytest

from hpc_tp.bench.checkpoint import benchmark_checkpoint, format_record
from hpc_tp.comm.mpi import world
from hpc_tp.grid import ProcessGrid
from hpc_tp.models import GPTModel, load_config
from hpc_tp.train.optim import AdamW


@pytest.mark.mpi(min_size=1)
def test_checkpoint_benchmark_reports_both_paths(tmp_path):
    comm = world()
    grid = ProcessGrid(tp=comm.size, world=comm)
    model = GPTModel(load_config("tiny", vocab_size=258), grid.tp, dtype="float32", seed=3)
    before = {name: p.data.copy() for name, p in model.state().items()}
    folder = Path(comm.bcast_object(str(tmp_path)))  # rank 0's folder for every rank
    if comm.rank == 0:
        (folder / "mine.txt").write_text("the user's")  # --dir may hold anything: it is left alone
    record = benchmark_checkpoint(grid, model, AdamW(model.state(), lr=1e-3), folder, repeats=2)
    comm.barrier()
    assert [p.name for p in folder.iterdir()] == ["mine.txt"] and (folder / "mine.txt").read_text() == "the user's"
    assert record["ranks"] == comm.size and record["tensors"] == 3 * len(before)
    expected = sum(int(np.prod(p.partition.full_shape)) * 4 for p in model.state().values()) * 3
    assert record["logical_bytes"] == expected
    for key in ("save", "load", "np_save", "np_load"):
        assert record[f"{key}_s"] > 0 and record[f"{key}_mb_per_s"] > 0
    for name, p in model.state().items():
        assert np.array_equal(p.data, before[name]), name
    assert "np.save" in format_record(record)
