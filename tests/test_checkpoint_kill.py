"""A rank killed (SIGKILL) in the middle of a save never damages the checkpoint before it."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from hpc_tp.checkpoint import latest_checkpoint, load_checkpoint, verify_checkpoint
from hpc_tp.comm.mpi import self_comm
from hpc_tp.grid import ProcessGrid
from hpc_tp.models import GPTModel, load_config

BIN = Path(sys.executable).parent
MPIEXEC = os.environ.get("MPIEXEC", str(BIN / "mpiexec"))

# Rank 1 writes half of its shard file of step 2 and is killed; the launcher then takes rank 0 down.
SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from hpc_tp.checkpoint import save_checkpoint, write
    from hpc_tp.comm.mpi import world
    from hpc_tp.grid import ProcessGrid
    from hpc_tp.models import GPTModel, load_config

    root = sys.argv[1]
    grid = ProcessGrid(tp=2, world=world())
    model = GPTModel(load_config("tiny", vocab_size=258), grid.tp, dtype="float64", seed=1)
    save_checkpoint(root, 1, model.state(), {"step": 1}, grid)
    for p in model.parameters():
        p.data += 1.0  # step 2 differs everywhere
    original = write._write_shard

    def killed_mid_write(path, mine, tensors):
        if grid.world.rank == 1:
            path.write_bytes(b"\\x89HDF\\r\\n\\x1a\\n half a shard")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(path, mine, tensors)

    write._write_shard = killed_mid_write
    save_checkpoint(root, 2, model.state(), {"step": 2}, grid)
    print("save of step 2 returned: the kill did not happen")
""")


def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path):
    script = tmp_path / "die.py"
    script.write_text(SCRIPT)
    root = tmp_path / "ckpt"
    run = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode != 0 and "returned" not in run.stdout, run.stdout + run.stderr
    assert not (root / "step-000002").exists()
    assert latest_checkpoint(root) == root / "step-000001"
    assert verify_checkpoint(root) == []

    grid = ProcessGrid(tp=1, world=self_comm())
    saved = GPTModel(load_config("tiny", vocab_size=258), grid.tp, dtype="float64", seed=1)
    loaded = GPTModel(load_config("tiny", vocab_size=258), grid.tp, dtype="float64", seed=2)
    assert load_checkpoint(root, loaded.state(), grid)["step"] == 1
    for name, p in saved.state().items():
        assert np.array_equal(p.data, loaded.state()[name].data), name
