"""``hpc-tp eval``: a checkpoint's loss and perplexity on a corpus are those of one process, at tp =
world size and with the windows split over data-parallel replicas (float64)."""

import json
import math

import numpy as np
import pytest
from test_generate import _model, write_checkpoint

from hpc_tp.cli import main
from hpc_tp.comm.mpi import self_comm, world
from hpc_tp.grid import ProcessGrid
from hpc_tp.tokenizer import ByteTokenizer
from hpc_tp.train.data import build_dataset

pytestmark = pytest.mark.mpi(min_size=1)
TEXT = "the quick brown fox jumps over the lazy dog; " * 12  # 540 bytes: 33 windows of 16


def reference_loss(corpus, cache, seq_len: int, windows: int) -> float:
    """Mean next-token cross entropy of the first ``windows`` windows, from one process's full logits."""
    model, dataset = _model("gpt2", self_comm()), build_dataset(str(corpus), seq_len, ByteTokenizer(), cache)
    ids, targets = dataset.get(range(windows))
    logits = model.logits(ids).astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(axis=-1)) + top[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return float((log_z - picked).mean())


@pytest.mark.parametrize("tp_flag", [None, "1"])
def test_eval_gives_one_process_loss_and_perplexity(tmp_path, tp_flag):
    comm = world()
    folder = comm.bcast_object(tmp_path)
    ckpt = write_checkpoint(folder / "ckpt", "gpt2", ProcessGrid(tp=comm.size, world=comm))
    if comm.rank == 0:
        (folder / "corpus.txt").write_text(TEXT)
    comm.barrier()
    flags = ["--tp", tp_flag] if tp_flag else []
    for windows in (None, 5):
        more = ["--max-windows", str(windows)] if windows else []
        code = main(
            [
                "eval",
                "--ckpt",
                str(ckpt),
                "--data",
                str(folder / "corpus.txt"),
                "--seq-len",
                "16",
                "--batch",
                "4",
                "--dtype",
                "float64",
                "--cache-dir",
                str(folder / "cache"),
                "--json",
                str(folder / "out.json"),
                *flags,
                *more,
            ]
        )
        comm.barrier()
        assert code == 0
        result = json.loads((folder / "out.json").read_text())
        counted = windows or (len(TEXT.encode()) - 1) // 16
        assert result["windows"] == counted and result["tokens"] == counted * 16
        assert result["tp"] == (1 if tp_flag else comm.size) and result["dp"] == (comm.size if tp_flag else 1)
        want = reference_loss(folder / "corpus.txt", folder / "cache", 16, counted)
        assert abs(result["loss"] - want) <= 1e-12 * want
        assert abs(result["perplexity"] - math.exp(want)) <= 1e-11 * math.exp(want)
        comm.barrier()
