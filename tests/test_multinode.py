"""The engine across nodes, on a virtual cluster of Linux namespaces with SLURM on it (tests/slurm/nodes.py).

The project's shape is "tp inside a node, pp (and dp) across nodes": these tests run the unmodified
jobs/*.sbatch over two virtual nodes that talk TCP through a bridge, with both launchers, and compare
float64 losses with one process. They run in the 1-rank launch only, and skip with the reason where the
machine cannot build the cluster (not root, no `ip`, SLURM not installed: `.ci/run` installs it).
Every wait is bounded; the cluster (daemons, namespaces, bridge) is removed when the module ends,
whatever happened.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from hpc_tp.models.config import load_config
from hpc_tp.plan.calibration import load_calibration
from hpc_tp.plan.clusters import get_cluster
from hpc_tp.plan.cost import Layout
from hpc_tp.plan.placement import compare_placements

sys.path.insert(0, str(Path(__file__).parent))
from slurm.cluster import missing_programs  # noqa: E402
from slurm.nodes import VirtualCluster, unavailable  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "jobs"
VENV = Path(sys.prefix)
# The small float64 run every training test here uses, and its one-process losses to compare with.
RUN = dict(model="tiny", micro_batch=4, global_batch=8, seq_len=16, lr=3e-3, dtype="float64")
# RUN's three steps as `hpc-tp train` flags, with no evaluation to speak of.
TINY_RUN = (
    *(item for key, value in RUN.items() for item in (f"--{key.replace('_', '-')}", str(value))),
    *("--steps", "3", "--eval-problems", "4", "--samples", "0"),
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("the virtual cluster's tests run in the 1-rank launch")
    missing = missing_programs()
    if missing:
        pytest.skip(f"SLURM not installed (missing {', '.join(missing)}): .ci/run installs it")
    reason = unavailable()
    if reason:
        pytest.skip(f"cannot build a virtual cluster here: {reason}")
    nodes = VirtualCluster(tmp_path_factory.mktemp("nodes"), nodes=2)
    try:
        nodes.start(timeout=60)
        yield nodes
        drained = time.monotonic() + 30  # a job step's allocation may still be COMPLETING
        while nodes.queue() and time.monotonic() < drained:
            time.sleep(0.5)
        assert not nodes.queue(), f"jobs left in the queue: {nodes.queue()}"
    finally:
        nodes.stop()
        assert not nodes.leftovers(), f"processes left after stopping the cluster: {nodes.leftovers()}"
        assert not nodes.network_file.exists()


def job_env(cluster, **settings) -> dict:
    """What a user's submitting shell would hold: the checkout's venv and code, the run's settings."""
    env = {
        "HPC_TP_VENV": str(VENV),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        # Open MPI's default placement: one rank per slot, node by node ("by core" with oversubscription
        # allowed, the Makefile's setting for one host, would put every rank on the first node).
        "PRTE_MCA_rmaps_default_mapping_policy": "slot",
    }
    return {**env, **{f"HPC_TP_{k.upper()}": str(v) for k, v in settings.items()}}


def train_settings(save, log, steps, tp, pp, dp=1, extra=""):
    return dict(
        model=RUN["model"],
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch=RUN["micro_batch"],
        global_batch=RUN["global_batch"],
        seq_len=RUN["seq_len"],
        steps=steps,
        lr=RUN["lr"],
        data="demo",
        save=save,
        save_every=100000,
        log=log,
        extra_args=f"--dtype float64 --eval-problems 4 --samples 0 {extra}".strip(),
    )


def one_process_losses(steps: int, **changes) -> list[float]:
    from hpc_tp.comm.mpi import self_comm
    from hpc_tp.train.settings import TrainSettings
    from hpc_tp.train.trainer import Trainer

    trainer = Trainer(TrainSettings(**{**RUN, "steps": steps, **changes}, progress=False), self_comm())
    return [trainer.train_step()["loss"] for _ in range(steps)]


def logged_losses(log: Path) -> list[float]:
    from hpc_tp.train.metrics import read_metrics

    return [r["loss"] for r in read_metrics(log) if "loss" in r]


def run_job(cluster, script, name, *options, env, timeout=120):
    out = cluster.dir / "jobs" / f"{name}.out"
    job = cluster.sbatch(script, f"--job-name={name}", f"--output={out}", *options, env=env)
    info = cluster.wait(job, timeout=timeout)
    return info, out.read_text(errors="replace") if out.exists() else "(no output file)"


def assert_same_losses(got, expected, tolerance=1e-12):
    assert len(got) == len(expected), (got, expected)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, expected))
    assert worst < tolerance, f"losses differ from one process by {worst:.2e}: {got} vs {expected}"


# ------------------------------------------------------------------ train.sbatch: tp inside, pp across


def train_job_env(cluster, launcher, settings) -> dict:
    env = job_env(cluster, launcher=launcher, **settings)
    if launcher == "mpirun":
        env["HPC_TP_MPIRUN"] = str(VENV / "bin" / "mpirun")
    return env


@pytest.mark.timeout(240)
def test_train_job_tp_inside_pp_across_two_nodes(cluster):
    """The unmodified train.sbatch, srun --mpi=pmix (the mpirun path: the preemption test below)."""
    jobs = cluster.dir / "jobs"
    log, steps = jobs / "two-nodes.jsonl", 4
    settings = train_settings(jobs / "two-nodes-ckpt", log, steps, tp=2, pp=2)
    info, out = run_job(
        cluster,
        JOBS / "train.sbatch",
        "two-nodes",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--time=5",
        env=train_job_env(cluster, "srun", settings),
    )
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    assert "on node[1-2]: 4 ranks, launched by: srun --mpi=pmix" in out
    assert "spans" not in out, "tp=2 with 2 ranks per node stays inside a node: no warning"
    assert_same_losses(logged_losses(log), one_process_losses(steps))


@pytest.mark.timeout(400)
def test_train_job_preempted_across_two_nodes_resumes_with_the_same_losses(cluster):
    """train.sbatch through mpirun over 2 nodes: USR1 to the batch script mid-run, every rank on both
    nodes checkpoints, the job requeues itself and resumes; the losses are one uninterrupted run's."""
    jobs, steps = cluster.dir / "jobs", 40
    out, log, save = jobs / "preempt.out", jobs / "preempt.jsonl", jobs / "preempt-ckpt"
    settings = train_settings(save, log, steps, tp=2, pp=2)
    job = cluster.sbatch(
        JOBS / "train.sbatch",
        "--job-name=preempt",
        f"--output={out}",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--time=10",
        env=train_job_env(cluster, "mpirun", settings),
    )
    deadline = time.monotonic() + 120
    # A USR1 before the ranks install their handler would kill them: wait for the trainer's line saying
    # it has, and for a few steps.
    while not (
        out.exists()
        and "checkpoint and stop" in out.read_text(errors="replace")
        and log.exists()
        and log.read_text().count('"loss"') >= 3
    ):
        assert time.monotonic() < deadline, out.read_text(errors="replace") if out.exists() else "(no output)"
        time.sleep(0.2)
    stopped = cluster.preempt(job, out)
    info = cluster.wait(job, timeout=240)
    text = out.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert f"resumed from {save}/step-{stopped:06d} at step {stopped}" in text
    assert text.count("hpc_tp job") == 2 and "was lost" not in text
    from hpc_tp.train.metrics import read_metrics

    assert [r["step"] for r in read_metrics(log) if "loss" in r] == list(range(1, steps + 1))
    assert_same_losses(logged_losses(log), one_process_losses(steps), tolerance=1e-9)


# ------------------------------------------------------------------ a node lost mid-run


@pytest.mark.timeout(400)
def test_node_lost_mid_run_then_resume_smaller_on_the_nodes_left(cluster):
    """node2 (ranks 2-3 of tp=2 x pp=2) is killed, slurmd and ranks, after the first checkpoints: the job
    ends within a bound naming node2 and its ranks, the latest checkpoint verifies, and train.sbatch
    resubmitted on node1 alone at tp=2 x pp=1 resumes from it with the losses of an uninterrupted run."""
    from hpc_tp.checkpoint.read import describe_checkpoint, verify_checkpoint

    jobs, steps = cluster.dir / "jobs", 30
    save, out = jobs / "lost-ckpt", jobs / "lost.out"
    settings = train_settings(save, jobs / "lost.jsonl", steps, tp=2, pp=2)
    settings["save_every"] = 5
    job = cluster.sbatch(
        JOBS / "train.sbatch",
        "--job-name=lost",
        f"--output={out}",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--time=10",
        env=job_env(cluster, launcher="srun", **settings),
    )
    deadline = time.monotonic() + 180
    while not (save / "step-000010").exists():
        assert time.monotonic() < deadline and cluster.job_info(job).get("JobState") in ("PENDING", "RUNNING"), (
            out.read_text(errors="replace") if out.exists() else "(no output)"
        )
        time.sleep(0.2)
    try:
        killed = time.monotonic()
        cluster.kill_node("node2")
        info = cluster.wait(job, timeout=120)
        ended_after = time.monotonic() - killed
        text = out.read_text(errors="replace")
        print(f"node2 killed: job {info['JobState']} {info['ExitCode']} {ended_after:.1f} s later")
        assert info["JobState"] == "FAILED", text
        assert "node node2 was lost during the job step (ranks 2-3 ran there)" in text
        assert ended_after < 90, f"the job took {ended_after:.0f} s to end after the node was lost"
        latest = describe_checkpoint(str(save))
        assert not verify_checkpoint(latest["path"]), f"{latest['path']} does not verify"

        resumed_log = jobs / "lost-resumed.jsonl"
        settings = train_settings(save, resumed_log, steps, tp=2, pp=1)
        info, text = run_job(
            cluster,
            JOBS / "train.sbatch",
            "lost-resumed",
            "--nodes=1",
            "--ntasks-per-node=2",
            "--cpus-per-task=1",
            "--time=10",
            "--exclude=node2",
            env=job_env(cluster, launcher="srun", **settings),
            timeout=240,
        )
        assert info["JobState"] == "COMPLETED", text
        stopped = latest["step"]
        assert f"resumed from {save}/step-{stopped:06d} at step {stopped}" in text, text
        expected = one_process_losses(steps)
        assert_same_losses(logged_losses(resumed_log), expected[stopped:], tolerance=1e-9)
    finally:
        cluster.revive_node("node2")


# ------------------------------------------------------------------ dp across nodes, tp across nodes


@pytest.mark.timeout(240)
def test_zero1_dp_across_nodes_tp_inside(cluster):
    """tp=2 on each node, dp=2 across them with the optimizer states sharded over dp (ZeRO-1)."""
    jobs, steps = cluster.dir / "jobs", 4
    settings = train_settings(
        jobs / "zero-ckpt", jobs / "zero.jsonl", steps, tp=2, pp=1, dp=2, extra="--distributed-optimizer"
    )
    info, out = run_job(
        cluster,
        JOBS / "train.sbatch",
        "zero",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--time=5",
        env=job_env(cluster, launcher="srun", **settings),
    )
    assert info["JobState"] == "COMPLETED", out
    assert "spans" not in out
    assert_same_losses(logged_losses(jobs / "zero.jsonl"), one_process_losses(steps))


def hpc_tp_step(cluster, *args, nodes=2, per_node=1, distribution="block", timeout=120):
    """`srun --mpi=pmix hpc-tp ARGS` over ``nodes`` nodes: one job step, output and exit status."""
    env = job_env(cluster)
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    return cluster.srun(
        "--mpi=pmix",
        f"--nodes={nodes}",
        f"--ntasks-per-node={per_node}",
        f"--distribution={distribution}",
        "--cpus-per-task=1",
        str(VENV / "bin" / "hpc-tp"),
        *args,
        timeout=timeout,
        env=env,
    )


@pytest.mark.timeout(240)
def test_tp_across_nodes_runs_and_warns(cluster):
    """One rank per node and tp=2: every all-reduce crosses the network. It trains, with the losses of
    one process, and says so; `bench step` (tp = the world) says so too."""
    log = cluster.dir / "jobs" / "tp-across.jsonl"
    train = hpc_tp_step(
        cluster,
        "train",
        *TINY_RUN,
        "--tp",
        "2",
        "--log",
        str(log),
    )
    assert train.returncode == 0, train.stdout + train.stderr
    assert "a tensor-parallel group of 2 ranks spans 2 nodes" in train.stderr
    assert_same_losses(logged_losses(log), one_process_losses(3))
    bench = hpc_tp_step(
        cluster,
        "bench",
        "step",
        "--model",
        "tiny",
        "--seq-len",
        "16",
        "--micro-batch",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "0",
    )
    assert bench.returncode == 0, bench.stdout + bench.stderr
    assert "a tensor-parallel group of 2 ranks spans 2 nodes" in bench.stderr
    assert "hpc-tp bench step" in bench.stdout


def test_planner_keeps_tp_inside_a_node_when_a_layout_fits():
    """Even with a network as fast as the node's links, tp across nodes is not proposed while a layout
    with tp inside a node fits (no cluster needed: the planner alone)."""
    from dataclasses import replace

    from hpc_tp.plan.search import search

    base = get_cluster("cpu-2core")
    plan = search(load_config("tiny"), 4, 8, 16, replace(base, devices_per_node=2, inter_bw=base.intra_bw))
    assert plan.ranked and all(p.layout.tp <= 2 for p in plan.ranked)
    assert any(r.kind == "nodes" and r.layout["tp"] == 4 for r in plan.rejected)
    one_per_node = search(load_config("tiny"), 2, 8, 16, replace(base, devices_per_node=1))
    assert all(p.layout.tp == 1 for p in one_per_node.ranked)


@pytest.mark.timeout(240)
def test_plan_auto_reads_the_launch_placement(cluster):
    """Ranks dealt round-robin over 2 nodes x 2 (srun --distribution=cyclic): every tp group of 2 would
    straddle the nodes, so `--plan auto` picks tp = 1, from the launch it runs in."""
    log = cluster.dir / "jobs" / "plan-auto-cyclic.jsonl"
    run = hpc_tp_step(
        cluster, "train", *TINY_RUN, "--plan", "auto", "--log", str(log), per_node=2, distribution="cyclic"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    chosen = next(line for line in run.stdout.splitlines() if line.startswith("--plan auto: "))
    assert chosen.startswith("--plan auto: tp=1 "), chosen
    assert "spans 2 nodes" not in run.stderr, run.stderr


# ------------------------------------------------------------------ generate and serve across nodes


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """A checkpoint of the tiny model after a few float64 steps, written by one process."""
    save = tmp_path_factory.mktemp("small-ckpt") / "ckpt"
    result = subprocess.run(
        [
            str(VENV / "bin" / "hpc-tp"),
            "train",
            *TINY_RUN,
            "--save",
            str(save),
            "--no-progress",
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return save


GENERATE = ("--prompt", "12+34=", "--max-new-tokens", "6", "--dtype", "float64")


@pytest.mark.timeout(240)
def test_generate_across_two_nodes_matches_one_process(cluster, small_checkpoint):
    alone = subprocess.run(
        [str(VENV / "bin" / "hpc-tp"), "generate", "--checkpoint", str(small_checkpoint), *GENERATE],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert alone.returncode == 0, alone.stderr
    spread = hpc_tp_step(cluster, "generate", "--checkpoint", str(small_checkpoint), "--tp", "2", *GENERATE)
    assert spread.returncode == 0, spread.stderr
    assert spread.stdout == alone.stdout and alone.stdout.strip()
    assert "spans 2 nodes" in spread.stderr  # serving is tp only: across nodes, tp spans them


@pytest.mark.timeout(240)
def test_serve_across_two_nodes_answers_from_another_namespace(cluster, small_checkpoint):
    """`hpc-tp serve` at tp=2 over two nodes, rank 0 listening on node1's address; this process (in the
    root namespace, across the bridge) asks for a greedy completion and gets what one process generates."""
    import urllib.request

    port = 18000 + os.getpid() % 1000
    host = cluster.address("node1")
    env = {**cluster.env, **job_env(cluster), "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    name = f"serve-{os.getpid()}"
    server = subprocess.Popen(
        [
            "srun",
            f"--job-name={name}",
            "--mpi=pmix",
            "--nodes=2",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            str(VENV / "bin" / "hpc-tp"),
            "serve",
            "--checkpoint",
            str(small_checkpoint),
            "--dtype",
            "float64",
            "--host",
            host,
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        request = urllib.request.Request(
            f"http://{host}:{port}/v1/completions",
            method="POST",
            data=json.dumps({"prompt": "12+34=", "max_tokens": 6, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json"},
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    answer = json.loads(response.read())
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, server.communicate(timeout=10)
                time.sleep(0.5)
    finally:
        cluster._run("scancel", f"--name={name}", check=False)
        out, err = server.communicate(timeout=60)
    alone = subprocess.run(
        [str(VENV / "bin" / "hpc-tp"), "generate", "--checkpoint", str(small_checkpoint), *GENERATE],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert answer["choices"][0]["text"] and answer["choices"][0]["text"] in alone.stdout, (answer, alone.stdout)
    assert f"listening on http://{host}:{port} (tp=2" in out, out + err


# ------------------------------------------------------------------ the two links, measured apart


@pytest.mark.timeout(240)
def test_bench_comm_measures_intra_and_inter_node_links_apart(cluster):
    """With the nodes' links throttled to 100 Mbit/s, `bench comm` over 2 nodes x 2 ranks reports the
    inter-node ping-pong at that rate and the intra-node one (shared memory) far above it."""
    path = cluster.dir / "jobs" / "links.json"
    cluster.throttle("100mbit")
    try:
        result = hpc_tp_step(
            cluster,
            "bench",
            "comm",
            "--ops",
            "p2p_intra,p2p_inter,all_reduce",
            "--sizes",
            "4M",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
            str(path),
            per_node=2,
        )
    finally:
        cluster.throttle(None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 ranks on 2 node(s)" in result.stdout
    records = {r["op"]: r for r in json.loads(path.read_text())}
    assert {op: r["link"] for op, r in records.items()} == {
        "p2p_intra": "intra",
        "p2p_inter": "inter",
        "all_reduce": "inter",
    }
    limit = 100e6 / 8 / 1e9  # GB/s
    assert records["p2p_inter"]["raw_algbw_GBps"] < 1.1 * limit, records["p2p_inter"]
    assert records["p2p_intra"]["raw_algbw_GBps"] > 3 * limit, records["p2p_intra"]
    # The file is a calibration: the planner prices each link class apart and so ranks tp inside a node first.
    two_per_node = get_cluster("cpu-2core").with_overrides(devices_per_node=2)
    calibration = load_calibration([path])
    network = calibration.network(two_per_node)
    assert network.inter["p2p"].bw < 1.1 * limit * 1e9 < 3 * limit * 1e9 < network.intra["p2p"].bw
    w1 = load_config("w1", vocab_size=258)
    placed = compare_placements(w1, Layout(2, 2, 1, 4), 8, 256, two_per_node, calibration)
    assert [(p.prediction.layout.placement, p.tp_spans_nodes) for p in placed] == [("block", False), ("cyclic", True)]
