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
    return subprocess.run(
        [MPIEXEC, "-n", str(n), str(BIN / "hpc-tp"), "train", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "2", "--dp", "2"], "world size 2 != tp*pp*dp = 2*1*2 = 4; layouts that fit: "),
        (["--tp", "3"], "world size 2 is not divisible by tp*pp = 3*1; layouts that fit: 1x1x2, 1x2x1, 2x1x1"),
        (
            ["--global-batch", "12", "--micro-batch", "4"],
            "--global-batch 12 is not divisible by --micro-batch 4 x dp 2 = 8",
        ),
        (["--data", "no/such/corpus.txt"], "corpus no/such/corpus.txt does not exist"),
        (["--seq-len", "64"], "--seq-len 64 is longer than the model's context: max_seq_len 32 (--model demo)"),
        (["--ep", "2", "--set", "num_experts=3", "--set", "top_k=1"], "--ep 2 does not divide num_experts=3"),
        (
            ["--tp", "2", "--sequence-parallel", "--seq-len", "15"],
            "sequence length 15 is not divisible by tp=2 with sequence parallelism",
        ),
    ],
)
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


@pytest.mark.parametrize(
    "flags, layout",
    [
        (["--pp", "2", "--virtual-stages", "2"], "on tp=1 pp=2 dp=1 micro-batch=2 1f1b V=2, 4 micro-batches a step,"),
        (
            ["--pp", "2", "--schedule", "gpipe", "--recompute", "selective"],
            "on tp=1 pp=2 dp=1 micro-batch=2 selective gpipe, 4 micro-batches a step,",
        ),
        (["--tp", "2", "--sequence-parallel"], "on tp=2 pp=1 dp=1 micro-batch=8 sp, 1 micro-batch a step,"),
    ],
    ids=["interleaved", "gpipe", "tp"],
)
def test_start_up_line_names_the_schedule_as_plan_does(flags, layout):
    """The "training ..." line shows the layout as `hpc-tp plan` prints it: the schedule, V and the
    micro-batches a step at pp > 1, sequence parallelism and recomputation when on."""
    run = mpi_train(
        2,
        "--model",
        "tiny",
        "--set",
        "n_layers=4",
        "--global-batch",
        "8",
        "--steps",
        "1",
        "--eval-problems",
        "2",
        "--no-progress",
        *flags,
    )
    assert run.returncode == 0, run.stderr
    assert re.search(r"^training .*\(4 layers, hidden 32\) " + re.escape(layout), run.stdout, re.M), run.stdout


def test_plan_auto_line_shows_the_chosen_virtual_stages():
    """--plan auto prints its choice as the plan's table and the start-up line do (V included)."""
    run = mpi_train(
        2,
        "--model",
        "tiny",
        "--set",
        "n_layers=8",
        "--set",
        "hidden=192",
        "--set",
        "n_heads=3",
        "--global-batch",
        "2",
        "--seq-len",
        "32",
        "--steps",
        "1",
        "--eval-problems",
        "2",
        "--no-progress",
        "--plan",
        "auto",
    )
    assert run.returncode == 0, run.stderr
    chosen = re.search(
        r"^--plan auto: (tp=1 pp=2 dp=1 micro-batch=1 1f1b V=\d, 2 micro-batches a step): fastest", run.stdout, re.M
    )
    assert chosen and f"on {chosen[1]}," in run.stdout, run.stdout


@pytest.mark.timeout(1500)  # a few minutes on an idle 2-core machine, ten under load
def test_make_run_learns_the_embedded_task(tmp_path):
    """The README's first command: trains 2-digit addition at tp=2 and passes the bar on held-out problems."""
    log = tmp_path / "run.jsonl"
    run = subprocess.run(
        ["make", "-s", "run", f"RUN_ARGS=--log {log} --no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    accuracy = [r["heldout_accuracy"] for r in read_metrics(log) if "heldout_accuracy" in r][-1]
    assert accuracy >= MAKE_RUN_ACCURACY_BAR, run.stdout
    assert f"held-out accuracy {100 * accuracy:.1f}%" in run.stdout


def test_lora_rank_set_trains_the_adapters_and_says_so(tmp_path):
    log = tmp_path / "lora.jsonl"
    flags = ["--tp", "2", "--set", "lora_rank=4", "--steps", "8", "--lr", "1e-2", "--samples", "0"]
    run = mpi_train(2, *flags, "--eval-problems", "4", "--no-progress", "--log", str(log))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "LoRA rank 4: 0.02M trained" in run.stdout
    losses = [r["loss"] for r in read_metrics(log) if "loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0]
