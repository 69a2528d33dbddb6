"""Faults and bad input end in bounded time with a message that names the cause, and lose nothing.

- A rank of a real 4-rank ``hpc-tp train`` job killed with SIGKILL (tests/inject_fault.py): the job
  ends, the last checkpoint verifies, ``--resume`` continues with the same losses. (Hangs, raises and
  mismatched collectives: tests/test_watchdog.py.)
- NaN/inf injected into the weights of a running trainer: the step is skipped on every rank, and
  after --max-bad-steps the run rolls back and replays the very losses of a run without the fault.
- Bad values and bad files for every command: one ``hpc-tp: error:`` line, a non-zero exit, no
  traceback, no file overwritten.
"""

import subprocess
from pathlib import Path

import h5py
import pytest
from test_train import settings, shared_tmp
from test_watchdog import BIN, JOB_TIMEOUT, MPIEXEC, ROOT, TRAIN, inject

from hpc_tp.checkpoint import verify_checkpoint
from hpc_tp.comm.mpi import self_comm, world
from hpc_tp.train.metrics import read_metrics
from hpc_tp.train.trainer import NumericalFault, Trainer


def test_a_killed_rank_ends_the_job_and_resume_continues_with_the_same_losses(tmp_path):
    save, log = tmp_path / "ckpt", tmp_path / "killed.jsonl"
    flags = ["--save", str(save), "--save-every", "4", "--comm-timeout", "10"]
    killed = inject("kill", 2, 7, *flags, "--log", str(log), cache=tmp_path)
    assert killed.returncode != 0
    assert "process rank 2" in killed.stderr and "signal 9" in killed.stderr, killed.stderr
    assert verify_checkpoint(save) == [] and (save / "latest").read_text().strip() == "step-000004"
    before = {r["step"]: r["loss"] for r in read_metrics(log) if "loss" in r}
    assert sorted(before) == list(range(1, 8))  # the kill came before step 8

    resumed_log = tmp_path / "resumed.jsonl"
    resumed = subprocess.run(
        [
            MPIEXEC,
            "-n",
            "4",
            str(BIN / "hpc-tp"),
            *TRAIN,
            "--cache-dir",
            str(tmp_path),
            *flags,
            "--resume",
            "--log",
            str(resumed_log),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT,
    )
    assert resumed.returncode == 0, resumed.stderr
    after = {r["step"]: r["loss"] for r in read_metrics(resumed_log) if "loss" in r}
    assert sorted(after) == [5, 6, 7, 8]
    assert [after[s] for s in (5, 6, 7)] == [before[s] for s in (5, 6, 7)]  # bit for bit


class PoisonedTrainer(Trainer):
    """Writes ``value`` into one weight on the last rank before the steps in ``at`` (first time only)."""

    def __init__(self, *args, value=float("nan"), at=(4,), **kwargs):
        super().__init__(*args, **kwargs)
        self.value, self.pending = value, list(at)

    def train_step(self):
        if self.pending and self.step == self.pending[0]:
            self.pending.pop(0)
            if self.grid.world.rank == self.grid.world.size - 1:
                next(iter(self.params.values())).data.flat[0] = self.value
        return super().train_step()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_steps_are_skipped_then_rolled_back_without_losing_a_step(tmp_path, value):
    comm = world()
    root = f"{shared_tmp(tmp_path, comm)}/ckpt"
    clean = [r["loss"] for r in Trainer(settings(tp=comm.size, steps=6, warmup=2), comm).run().records]
    faulty = PoisonedTrainer(
        settings(tp=comm.size, steps=6, warmup=2, save=root, save_every=2, max_bad_steps=2), comm, value=value, at=(2,)
    )
    records = faulty.run().records
    assert [r["step"] for r in records] == [1, 2, 3, 4, 3, 4, 5, 6]  # 3, 4 bad, then replayed from 2
    assert [r["skipped"] for r in records] == [False] * 2 + [True] * 2 + [False] * 4
    assert any(
        "2 steps in a row with a non-finite loss or gradient (up to step 4): rolled back to" in m
        and m.endswith("step 2")
        for m in faulty.messages
    )
    kept = [r["loss"] for r in records if not r["skipped"]]
    assert kept == clean  # the rollback lost nothing: the losses of a run without the fault


@pytest.mark.mpi(min_size=1)
def test_a_bad_step_never_becomes_a_checkpoint(tmp_path):
    comm = world()
    root = Path(shared_tmp(tmp_path, comm)) / "ckpt"
    result = PoisonedTrainer(settings(tp=comm.size, steps=6, save=str(root), save_every=2), comm, at=(3,)).run()
    assert [r["skipped"] for r in result.records] == [False] * 3 + [True] * 3  # no rollback asked for
    # The saves due after steps 4 and 6 (the last) wait for a good step, which never comes.
    assert (root / "latest").read_text().strip() == "step-000002" and result.checkpoint.name == "step-000002"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000002"]


@pytest.mark.mpi(min_size=1)
def test_no_checkpoint_to_roll_back_to_is_a_clear_error(tmp_path):
    comm = world()
    trainer = PoisonedTrainer(settings(tp=comm.size, steps=8, max_bad_steps=2), comm, at=(2,))
    with pytest.raises(
        NumericalFault,
        match=r"^2 steps in a row with a non-finite loss or gradient \(up to step 4\) "
        r"and no checkpoint to roll back to",
    ):
        trainer.run()


@pytest.mark.mpi(min_size=1)
def test_a_fault_that_comes_back_after_a_rollback_stops_the_run(tmp_path):
    comm = world()
    root = f"{shared_tmp(tmp_path, comm)}/ckpt"
    trainer = PoisonedTrainer(
        settings(tp=comm.size, steps=8, save=root, save_every=2, max_bad_steps=2), comm, at=(2, 2)
    )
    with pytest.raises(NumericalFault, match=r"again after rolling back to .*step-000002: the fault repeats"):
        trainer.run()


def test_settings_of_the_fault_handling_are_checked():
    from hpc_tp.errors import ConfigError

    for change, message in [
        (dict(comm_timeout=-1.0), "--comm-timeout -1.0: expected seconds >= 0"),
        (dict(comm_timeout=float("inf")), "--comm-timeout inf"),
        (dict(max_bad_steps=-2), "--max-bad-steps -2: expected an integer >= 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            Trainer(settings(**change), self_comm())


@pytest.mark.mpi(min_size=1)
def test_a_new_run_never_saves_over_an_earlier_one(tmp_path):
    """Without --resume, every rank refuses a --save folder holding checkpoints, before any step;
    with it, the run continues there."""
    from hpc_tp.errors import ConfigError

    comm = world()
    root = Path(shared_tmp(tmp_path, comm)) / "ckpt"
    Trainer(settings(tp=comm.size, steps=2, warmup=1, save=str(root)), comm).run()
    for save in (root, root / "step-000002"):  # a root of checkpoints, or one checkpoint (e.g. --init's)
        with pytest.raises(ConfigError, match=r"already holds checkpoints \(latest: step-000002\): pass --resume"):
            Trainer(settings(tp=comm.size, steps=2, warmup=1, save=str(save)), comm)
    resumed = Trainer(settings(tp=comm.size, steps=3, warmup=1, save=str(root), resume=True), comm).run()
    assert [r["step"] for r in resumed.records] == [3]
    assert (root / "latest").read_text().strip() == "step-000003"


def test_output_checks_create_nothing(tmp_path):
    from hpc_tp.errors import ConfigError
    from hpc_tp.paths import check_output_file, check_output_folder

    check_output_folder(tmp_path / "new" / "deeper", "--save")  # folders the writer will create
    check_output_file(tmp_path / "new" / "m.jsonl", "--log")
    (tmp_path / "afile").write_text("kept")
    for check, path, message in [
        (check_output_file, tmp_path, "is a folder: expected a file"),
        (check_output_folder, tmp_path / "afile", "is a file: expected a folder"),
        (check_output_file, tmp_path / "afile" / "x", "afile is not a folder"),
        (check_output_folder, "/proc/x/y", "cannot create files in /proc"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check(path, "--out")
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]  # no probe file, no folder left behind


# -- bad input on the command line ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A good checkpoint and metrics log, and bad files of every kind a user can hand over."""
    folder = tmp_path_factory.mktemp("inputs")
    Trainer(settings(steps=2, warmup=1, save=str(folder / "ck"), log=str(folder / "m.jsonl")), self_comm()).run()
    (folder / "garbage").mkdir()
    (folder / "garbage" / "master.h5").write_text("x")
    (folder / "emptydir").mkdir()
    (folder / "bad.jsonl").write_text("not json\n")
    (folder / "bad.jinja").write_text("{% for m in messages %}unclosed\n")
    (folder / "empty.jsonl").write_text("")
    (folder / "surrogate.jsonl").write_text('{"prompt": "fine"}\n{"prompt": "\\ud800"}\n')  # a lone surrogate
    (folder / "binary.txt").write_bytes(b"\xff\xfe\x00bad")
    (folder / "bad.gguf").write_bytes(bytes(range(256)) * 4)
    (folder / "hf").mkdir()
    (folder / "hf" / "config.json").write_text("{")
    corrupt = folder / "ckcorrupt"
    subprocess.run(["cp", "-r", str(folder / "ck"), str(corrupt)], check=True)
    shard = next(corrupt.glob("step-*/shards/*.h5"))
    with h5py.File(shard, "r+") as f:
        tensor = f["tensors"][next(iter(f["tensors"]))]
        values = tensor[...]
        values.flat[0] += 1
        tensor[...] = values
    return folder


BAD_INPUT = [
    ("train --steps 0", "--steps 0: expected a positive integer"),
    ("train --lr nan", "--lr nan: expected a finite number > 0"),
    ("train --lr inf", "--lr inf: expected a finite number > 0"),
    ("train --clip-grad nan", "--clip-grad nan: expected a finite number >= 0"),
    ("train --comm-timeout -1", "--comm-timeout -1.0: expected seconds >= 0"),
    ("train --max-bad-steps -1", "--max-bad-steps -1: expected an integer >= 0"),
    ("train --cuda-graph", "--cuda-graph: a step runs as a CUDA graph on a GPU only, not on --device cpu"),
    ("train --model nosuch", "--model 'nosuch' is neither a preset"),
    ("train --model bad.jsonl", "model config bad.jsonl: not valid JSON"),
    ("train --set nosuchkey=1", "unknown model config keys: nosuchkey"),
    ("train --set n_heads=3", "is not divisible by n_heads=3"),
    ("train --tokenizer bad.jsonl", "bad.jsonl is not a Hugging Face tokenizer.json"),
    ("train --data emptydir", "corpus folder emptydir has no .txt files"),
    ("train --data binary.txt", "corpus file binary.txt is not UTF-8 text"),
    ("train --init garbage", "checkpoint garbage: "),
    ("train --init ckcorrupt", "checksum mismatch"),
    ("train --save bad.jsonl", "--save bad.jsonl is a file: expected a folder"),
    ("train --log emptydir", "--log emptydir is a folder: expected a file"),
    ("train --save bad.jsonl/ck", "--save bad.jsonl/ck: bad.jsonl is not a folder"),
    ("train --save /proc/ck", "--save /proc/ck: cannot create files in /proc"),
    ("train --save ck", "--save ck already holds checkpoints (latest: step-000002): pass --resume"),
    ("train --init ck --save ck", "--save ck already holds checkpoints"),
    ("train --log bad.jsonl/m.jsonl", "--log bad.jsonl/m.jsonl: bad.jsonl is not a folder"),
    ("train --log /proc/m.jsonl", "--log /proc/m.jsonl: cannot create files in /proc"),
    ("train --data binary.txt --cache-dir bad.jsonl/c", "--cache-dir bad.jsonl/c: bad.jsonl is not a folder"),
    ("train --data bad.jsonl", "--data bad.jsonl: conversations need a chat template"),
    ("train --data bad.jsonl --chat-template bad.jinja", "--chat-template bad.jinja: not a Jinja template"),
    ("train --pp-layers a,b", "--pp-layers 'a,b': expected comma-separated layer counts"),
    ("generate --ckpt garbage --prompt hi", "checkpoint garbage: "),
    ("generate --ckpt ckcorrupt --prompt hi", "checksum mismatch"),
    ("generate --ckpt ck --prompts bad.jsonl", "--prompts bad.jsonl:1: not a JSON line"),
    ("generate --ckpt ck --prompts empty.jsonl", "--prompts empty.jsonl: no prompts in it"),
    ("generate --ckpt ck --prompts surrogate.jsonl", "prompt 2: text is not valid Unicode"),
    ("generate --ckpt ck --prompt hi --top-p 2", "top_p=2.0: expected a number in (0, 1]"),
    ("generate --ckpt ck --prompt hi --max-new-tokens 1000", "needs 1001 positions"),
    ("generate --ckpt ck --prompts empty.jsonl --out emptydir", "--out emptydir is a folder: expected a file"),
    ("generate --ckpt ck --prompt hi --tp 0", "--tp 0: expected a positive integer"),
    ("embed --ckpt ck --text hi --out bad.jsonl/e.jsonl", "--out bad.jsonl/e.jsonl: bad.jsonl is not a folder"),
    ("convert emptydir -o out", "emptydir: no config.json"),
    ("convert hf -o out", "hf/config.json: cannot read it as JSON"),
    ("convert bad.gguf -o out", "bad.gguf: not a GGUF file"),
    ("convert hf -o bad.jsonl/out", "--output bad.jsonl/out: bad.jsonl is not a folder"),
    ("inspect garbage", "checkpoint garbage: master.h5 is not an HDF5 file"),
    ("inspect emptydir", "emptydir is neither a checkpoint folder"),
    ("export garbage -o out", "checkpoint garbage: master.h5 is not an HDF5 file"),
    ("export ck -o ck", "output ck already exists"),
    ("export ck -o bad.jsonl/out", "--output bad.jsonl/out: bad.jsonl is not a folder"),
    ("plot empty.jsonl", "metrics log empty.jsonl: the metrics log is empty"),
    ("plot bad.jsonl", "metrics log bad.jsonl:1: not a JSON line"),
    ("plot m.jsonl --metric nosuch", "no record has both 'step' and 'nosuch'"),
    ("plot m.jsonl -o bad.jsonl", "--output bad.jsonl: expected an image file ending in one of"),
    ("plot m.jsonl -o bad.jsonl/loss.png", "--output bad.jsonl/loss.png: bad.jsonl is not a folder"),
    ("bench comm --sizes abc", "size 'abc': expected a positive whole number"),
    ("bench comm --json emptydir", "--json emptydir is a folder"),
    ("bench comm --json bad.jsonl/c.json", "--json bad.jsonl/c.json: bad.jsonl is not a folder"),
    ("bench step --json /proc/s.json", "--json /proc/s.json: cannot create files in /proc"),
    ("bench step --layers 0", "--layers 0: expected a positive whole number"),
    ("bench decode --prompt-len 100000", "exceeds the model's max_seq_len"),
    ("bench checkpoint --dir bad.jsonl", "--dir bad.jsonl is a file"),
    ("serve --ckpt ck --batch-window-ms nan", "--batch-window-ms nan"),
    ("serve --ckpt ck --max-batch-prefill-tokens 0", "--max-batch-prefill-tokens 0: expected an integer >= 1"),
    ("serve --ckpt ck --prefill-chunk 0", "--prefill-chunk 0: expected an integer >= 1"),
    ("eval --ckpt ck --data m.jsonl --seq-len 0", "--seq-len 0: expected a positive whole number"),
    ("eval --ckpt ck --data m.jsonl --json emptydir", "--json emptydir is a folder: expected a file"),
    ("serve --ckpt ck --chat-template nosuch.jinja", "--chat-template nosuch.jinja: cannot read it (No such file"),
    ("serve --ckpt ck --chat-template binary.txt", "--chat-template binary.txt: cannot read it"),
    ("serve --ckpt ck --chat-template bad.jinja", "--chat-template bad.jinja: not a Jinja template"),
    ("plan --json emptydir", "--json emptydir is a folder: expected a file"),
    ("plan --serve-batch -1", "--serve-batch -1: expected a positive whole number"),
    ("plan --micro-batch 0", "--micro-batch 0: expected a positive whole number"),
    ("plan --efficiency 5", "--efficiency 5.0: expected a share of the peak FLOP/s in (0, 1]"),
    ("verify --batch 0", "--batch 0: expected a positive integer"),
    ("verify --tolerance nan", "--tolerance nan: expected a finite relative error >= 0"),
    ("verify --tolerance -1", "--tolerance -1.0: expected a finite relative error >= 0"),
]


@pytest.mark.parametrize("command, message", BAD_INPUT, ids=[c for c, _ in BAD_INPUT])
def test_bad_input_is_one_clear_line_and_overwrites_nothing(files, command, message, monkeypatch, capsys):
    """``hpc-tp`` in this process (a subprocess each costs seconds): any exception but the project's
    clear error would fail the test with its traceback."""
    from hpc_tp import cli

    monkeypatch.chdir(files)
    paths = lambda: {p for p in files.rglob("*") if "cache" not in p.parts}  # noqa: E731
    before, listed = {p: p.read_bytes() for p in paths() if p.is_file()}, paths()
    steps = (["--steps", "2"] if "--steps" not in command else []) + (
        ["--cache-dir", "cache"] if "--cache-dir" not in command else []
    )
    steps = steps if command.startswith("train") else []
    assert cli.main(command.split() + steps) != 0
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hpc-tp: error:")]
    assert len(errors) == 1 and message in errors[0], errors
    assert {p: p.read_bytes() for p in before} == before and paths() == listed  # nothing new, not even a probe
