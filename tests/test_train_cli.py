"""`hpc-tp train` as users start it: under mpiexec, with bad input, and `make run` itself."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_tp.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MPIEXEC = os.environ.get("MPIEXEC", str(BIN / "mpiexec"))
# `make run` must teach the model what an untrained one cannot guess (about 1% of answers).
MAKE_RUN_ACCURACY_BAR = 0.8


def mpi_train(n: int, *flags: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([MPIEXEC, "-n", str(n), str(BIN / "hpc-tp"), "train", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flags, message", [
    (["--tp", "2", "--dp", "2"], "world size 2 != tp*pp*dp = 2*1*2 = 4; layouts that fit: "),
    (["--tp", "3"], "world size 2 is not divisible by tp*pp = 3*1; layouts that fit: 1x1x2, 1x2x1, 2x1x1"),
    (["--global-batch", "12", "--micro-batch", "4"], "--global-batch 12 is not divisible by --micro-batch 4 x dp 2 = 8"),
    (["--data", "no/such/corpus.txt"], "corpus no/such/corpus.txt does not exist"),
    (["--seq-len", "64"], "--seq-len 64 is longer than the model's context: max_seq_len 32 (--model demo)"),
    (["--ep", "2", "--set", "num_experts=3", "--set", "top_k=1"], "--ep 2 does not divide num_experts=3"),
    (["--tp", "2", "--sequence-parallel", "--seq-len", "15"],
     "sequence length 15 is not divisible by tp=2 with sequence parallelism"),
])
def test_bad_input_is_one_line_on_rank_0_and_every_rank_fails(flags, message):
    run = mpi_train(2, "--steps", "2", *flags)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("hpc-tp: error:")]
    assert len(errors) == 1 and message in errors[0], run.stderr


def test_batch_log_gets_plain_progress_lines(tmp_path):
    log = tmp_path / "m.jsonl"
    run = mpi_train(2, "--tp", "2", "--steps", "6", "--model", "tiny", "--eval-problems", "4", "--log", str(log))
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stdout
    assert re.search(r"^step 6/6 loss \d+\.\d{4} tok/s \d+ eta 0s$", run.stdout, re.M), run.stdout
    assert "held-out accuracy" in run.stdout
    assert [r["step"] for r in read_metrics(log) if "loss" in r] == list(range(1, 7))


@pytest.mark.timeout(1500)  # a few minutes on an idle 2-core machine, ten under load
def test_make_run_learns_the_embedded_task(tmp_path):
    """The README's first command: trains 2-digit addition at tp=2 and passes the bar on held-out problems."""
    log = tmp_path / "run.jsonl"
    run = subprocess.run(["make", "-s", "run", f"RUN_ARGS=--log {log} --no-progress"], cwd=ROOT,
                         capture_output=True, text=True, timeout=1400)
    assert run.returncode == 0, run.stdout + run.stderr
    accuracy = [r["heldout_accuracy"] for r in read_metrics(log) if "heldout_accuracy" in r][-1]
    assert accuracy >= MAKE_RUN_ACCURACY_BAR, run.stdout
    assert f"held-out accuracy {100 * accuracy:.1f}%" in run.stdout
