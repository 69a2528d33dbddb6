"""The HPC-center side, against a real SLURM (munged + slurmctld + slurmd started here, tests/slurm/cluster.py)
and a real Lmod: the sbatch scripts of jobs/, the launch checks of hpc_tp.launch under srun, and
`make install-prefix` + `module load`.

These run in the 1-rank pytest launch only (unmarked). Every wait is bounded: jobs are polled with a
timeout and cancelled when it runs out; the cluster's daemons, and anything a job left, are stopped
when the module ends. They skip, saying what to install, where slurmctld/munge or lmod are missing
(`.ci/run` installs them) or when not root (slurmd and SlurmUser=root need it).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent))
from slurm.cluster import SlurmCluster, missing_programs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "jobs"
SCRIPTS = sorted(JOBS.glob("*.sbatch"))
LMOD_INIT = Path("/usr/share/lmod/lmod/init/bash")
VENV = Path(sys.prefix)
# Open MPI as root, more ranks than cores (the Makefile exports the same; repeated for a bare pytest run).
OPEN_MPI_ROOT = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}

single_launch = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="SLURM tests run in the 1-rank launch")


def _job_env(**extra):
    return {**OPEN_MPI_ROOT, "HPC_TP_VENV": str(VENV), "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node SLURM for this module's tests, stopped (with whatever its jobs left) when they end.

    Preemption (test_train_job_resumes_after_usr1_and_requeue): SLURM holds a requeued job for about two
    minutes (Reason=BeginTime), so the test releases it with ``start_now``, a few seconds after the requeue
    (a launch in the same second as the old credential's revocation is refused); a USR1 that arrives before
    the ranks install their handler kills them, so the test waits for the trainer's line saying it has.
    """
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("SLURM tests run in the 1-rank launch")
    missing = missing_programs()
    if missing:
        pytest.skip(
            f"SLURM not installed (missing {', '.join(missing)}): "
            "apt-get install -y slurmctld slurmd slurm-client munge (.ci/run does)"
        )
    if os.geteuid() != 0:
        pytest.skip("the test SLURM runs slurmd and SlurmUser=root: needs root")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start(timeout=60)
        yield cluster
        queue = cluster.queue()
        assert not queue, f"jobs left in the queue after this module's tests: {queue}"
    finally:
        cluster.stop()
        left = cluster.leftovers()
        assert not left, f"processes left after stopping the test SLURM: {left}"


def _pmix_works(cluster) -> bool:
    probe = cluster.srun("--mpi=pmix", "-n", "1", "true", timeout=30)
    return probe.returncode == 0


def _run_job(cluster, script, name, *options, env, timeout=60):
    """Submit as job ``name``, wait (cancelling on timeout), and return (scontrol info, output text)."""
    out = cluster.dir / "jobs" / f"{name}.out"
    job = cluster.sbatch(script, f"--job-name={name}", f"--output={out}", *options, env=env)
    info = cluster.wait(job, timeout=timeout)
    return info, out.read_text(errors="replace") if out.exists() else "(no output file)"


# ------------------------------------------------------------------ the scripts themselves (no SLURM needed)


def _launcher_block(path):
    text = path.read_text()
    match = re.search(r"^# ---- launcher:.*?^# ---- end of launcher block ----$", text, re.S | re.M)
    assert match, f"{path.name}: no launcher block"
    return match.group(0)


def test_scripts_share_one_launcher_block_and_parse():
    assert {p.name for p in SCRIPTS} >= {"train.sbatch", "generate.sbatch", "convert.sbatch", "bench.sbatch"}
    blocks = {p.name: _launcher_block(p) for p in SCRIPTS}
    first = blocks["bench.sbatch"]
    for name, block in blocks.items():
        assert block == first, f"{name}: launcher block differs from bench.sbatch's (keep them identical)"
    for path in SCRIPTS:
        subprocess.run(["bash", "-n", str(path)], check=True, timeout=10)
        head = path.read_text().split("#SBATCH", 1)[0]
        assert "Resources" in head and "edit" in head, f"{path.name}: document resources and what to edit at the top"


def test_train_script_forwards_usr1_and_requeues():
    text = (JOBS / "train.sbatch").read_text()
    for needle in (
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "trap forward_usr1 USR1",
        'kill -USR1 "$step_pid"',
        'scontrol requeue "$SLURM_JOB_ID"',
        "--resume",
    ):
        assert needle in text, f"train.sbatch: expected {needle!r}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_preflight_passes_or_names_the_issue(script, tmp_path):
    """Each script checks that `hpc-tp` has the subcommand and flags it uses; one whose command has not
    landed stops with rc 2 and a pointer to the DEPENDS ON line at its top."""
    env = dict(os.environ, **_job_env(HPC_TP_PREFLIGHT_ONLY="1", HPC_TP_LAUNCHER="mpirun"))
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    if result.returncode == 0:
        assert "preflight ok" in result.stdout
    else:
        assert result.returncode == 2, result.stderr
        assert "see DEPENDS ON" in result.stderr
        assert "DEPENDS ON:" in script.read_text().split("#SBATCH", 1)[0]
    if script.name == "bench.sbatch":
        assert result.returncode == 0, f"hpc-tp bench comm exists: {result.stderr}"


# ------------------------------------------------------------------ jobs on the test SLURM


@single_launch
def test_bench_job_with_mpiexec_writes_json(slurm):
    env = _job_env(
        HPC_TP_LAUNCHER="mpirun",
        HPC_TP_MPIRUN=str(VENV / "bin" / "mpiexec"),
        HPC_TP_BENCH_ARGS="--sizes 8:1024 --iters 2",
        HPC_TP_JSON="out.json",
    )
    info, out = _run_job(
        slurm,
        JOBS / "bench.sbatch",
        "bench-mpiexec",
        "--nodes=1",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--time=5",
        env=env,
    )
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    assert "launched by: " + str(VENV / "bin" / "mpiexec") + " -n 2" in out
    records = json.loads((slurm.dir / "jobs" / "out.json").read_text())
    assert {r["op"] for r in records} == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    assert {r["bytes"] for r in records} == {8, 32, 128, 512, 1024}
    assert all(r["ranks"] == 2 and r["iters"] == 2 and r["project_time_s"] > 0 for r in records)


@single_launch
def test_bench_job_picks_its_launcher(slurm):
    """No HPC_TP_LAUNCHER: srun --mpi=pmix where it really starts (libpmix present), else the venv's mpirun."""
    expected = "srun --mpi=pmix" if _pmix_works(slurm) else str(VENV / "bin" / "mpirun")
    env = _job_env(HPC_TP_BENCH_ARGS="--sizes 8:64 --iters 1 --warmup 0 --ops all_reduce", HPC_TP_JSON="auto.json")
    info, out = _run_job(
        slurm,
        JOBS / "bench.sbatch",
        "bench-auto",
        "--nodes=1",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--time=5",
        env=env,
    )
    assert info["JobState"] == "COMPLETED", out
    assert f"launched by: {expected}" in out
    assert len(json.loads((slurm.dir / "jobs" / "auto.json").read_text())) == 3


CHECK = "from hpc_tp.launch import check_launch; check_launch(); print('launch ok')"


@single_launch
def test_srun_without_pmi_is_a_world_of_one(slurm):
    result = slurm.srun(
        "--mpi=none", "-n", "2", "--cpus-per-task=1", sys.executable, "-c", CHECK, timeout=60, env=_job_env()
    )
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "SLURM_STEP_NUM_TASKS=2 but MPI formed a world of one" in out
    assert "launch ok" not in out


@single_launch
def test_srun_with_pmix_forms_the_world(slurm):
    if not _pmix_works(slurm):
        pytest.skip("this SLURM cannot load its pmix plugin (apt-get install libpmix-dev; .ci/run does)")
    code = CHECK + "; from mpi4py import MPI; print('size', MPI.COMM_WORLD.Get_size())"
    result = slurm.srun(
        "--mpi=pmix", "-n", "2", "--cpus-per-task=1", sys.executable, "-c", code, timeout=60, env=_job_env()
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("launch ok") == 2 and result.stdout.count("size 2") == 2


@single_launch
def test_lone_python_in_an_allocation_is_fine(slurm, tmp_path):
    """Inside sbatch -n 2, SLURM_NTASKS=2 describes the allocation: a plain `python` (no srun) is not a mistake."""
    script = tmp_path / "lone.sbatch"
    script.write_text(f'#!/bin/bash\necho ntasks=$SLURM_NTASKS\n{sys.executable} -c "{CHECK}"\n')
    info, out = _run_job(slurm, script, "lone", "-n", "2", "--cpus-per-task=1", "--time=5", env=_job_env())
    assert info["JobState"] == "COMPLETED", out
    assert "ntasks=2" in out and "launch ok" in out


# ------------------------------------------------------------------ make install-prefix + module load


@single_launch
@pytest.mark.timeout(300)
def test_install_prefix_then_module_load(tmp_path):
    if not LMOD_INIT.exists():
        pytest.skip("Lmod not installed: apt-get install -y lmod (.ci/run does)")
    if shutil.which("make") is None:
        pytest.skip("make not installed")
    prefix = tmp_path / "apps" / "hpc_tp" / "0.1.0"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "VIRTUAL_ENV")}
    make = subprocess.run(
        ["make", "-C", str(REPO), "install-prefix", f"PREFIX={prefix}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert make.returncode == 0, make.stdout[-3000:] + make.stderr[-3000:]
    version = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    moduledir = prefix / "modulefiles" / "hpc_tp"
    assert (moduledir / f"{version}.lua").exists() and (moduledir / version).exists()
    site = list(prefix.glob("lib/python3*/site-packages/hpc_tp/cli.py"))
    assert site, "the package is copied into the prefix (not an editable install)"

    tcl_only = tmp_path / "tcl" / "hpc_tp"  # the Tcl modulefile alone (Lmod prefers .lua when both are there)
    tcl_only.mkdir(parents=True)
    shutil.copy(moduledir / version, tcl_only / version)
    for modulepath in (prefix / "modulefiles", tmp_path / "tcl"):
        shell = (
            f"source {LMOD_INIT}; module use {modulepath}; module load hpc_tp/{version} || exit 3; "
            "command -v hpc-tp; hpc-tp --version; hpc-tp --help; echo HPC_TP_HOME=$HPC_TP_HOME OMP_NUM_THREADS=$OMP_NUM_THREADS; "
            "module unload hpc_tp; echo after=$(command -v hpc-tp)"
        )
        clean = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin", "LMOD_ALLOW_ROOT_USE": "yes"}
        result = subprocess.run(
            ["bash", "--noprofile", "--norc", "-c", shell], env=clean, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == str(prefix / "bin" / "hpc-tp"), result.stdout
        assert f"hpc-tp {version}" in lines and "MPI tensor-parallel transformer engine" in result.stdout
        assert f"HPC_TP_HOME={prefix} OMP_NUM_THREADS=1" in result.stdout
        assert lines[-1] == "after=", "module unload takes hpc-tp off PATH"


# ------------------------------------------------------------------ preemption: USR1, checkpoint, requeue, resume


def _wait_for_text(path, text, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise AssertionError(
        f"{path.name}: no {text!r} within {timeout}s:\n"
        + (path.read_text(errors="replace") if path.exists() else "(no file)")
    )


@single_launch
@pytest.mark.timeout(420)
def test_train_job_resumes_after_usr1_and_requeue(slurm):
    from hpc_tp.comm.mpi import self_comm
    from hpc_tp.train.metrics import read_metrics
    from hpc_tp.train.settings import TrainSettings
    from hpc_tp.train.trainer import Trainer

    jobs = slurm.dir / "jobs"
    out, log, save = jobs / "preempt.out", jobs / "preempt.jsonl", jobs / "preempt-ckpt"
    run = dict(model="tiny", micro_batch=4, global_batch=8, seq_len=16, steps=400, lr=3e-3, dtype="float64")
    env = _job_env(
        HPC_TP_LAUNCHER="mpirun",
        HPC_TP_MPIRUN=str(VENV / "bin" / "mpiexec"),
        HPC_TP_MODEL="tiny",
        HPC_TP_TP="2",
        HPC_TP_PP="1",
        HPC_TP_DP="1",
        HPC_TP_MICRO_BATCH="4",
        HPC_TP_GLOBAL_BATCH="8",
        HPC_TP_SEQ_LEN="16",
        HPC_TP_STEPS=str(run["steps"]),
        HPC_TP_LR="3e-3",
        HPC_TP_DATA="demo",
        HPC_TP_SAVE=str(save),
        HPC_TP_SAVE_EVERY="100000",
        HPC_TP_LOG=str(log),
        HPC_TP_EXTRA_ARGS="--dtype float64 --eval-problems 4 --samples 0",
    )
    job = slurm.sbatch(
        JOBS / "train.sbatch",
        "--job-name=preempt",
        f"--output={out}",
        "--nodes=1",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--time=10",
        env=env,
    )
    _wait_for_text(out, "checkpoint and stop", timeout=120)
    _wait_for_text(out, "step 20/", timeout=120)  # well inside the run
    stopped = slurm.preempt(job, out)
    _wait_for_text(out, f"resumed from {save}/step-{stopped:06d} at step {stopped}", timeout=180)
    info = slurm.wait(job, timeout=240)
    text = out.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert "requeueing job" in text and text.count("hpc_tp job") == 2

    steps = [r for r in read_metrics(log) if "loss" in r]
    numbers = [r["step"] for r in steps]
    assert numbers == list(range(1, run["steps"] + 1)), "every step once: resumed where it stopped"
    reference = Trainer(TrainSettings(**run, progress=False), self_comm())
    expected = [reference.train_step()["loss"] for _ in range(stopped + 5)]
    got = [r["loss"] for r in steps[: stopped + 5]]
    assert max(abs(a - b) / b for a, b in zip(got, expected)) < 1e-9  # the same losses as one uninterrupted run
