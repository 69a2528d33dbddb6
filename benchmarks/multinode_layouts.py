"""The seed's rule, measured: tp inside a node and pp across, against tp across and pp inside, over a
throttled link between two virtual nodes (tests/slurm/nodes.py: root, network namespaces, SLURM).

    python benchmarks/multinode_layouts.py [--rate 200mbit] [--model w1] [--steps 4] [--rounds 2]

Both runs train the same model at the same layout, tp=2 x pp=2 on 2 nodes x 2 ranks; only the rank
placement differs: ``srun --distribution=block`` puts ranks 0,1 (a tp group) on node1, ``cyclic`` puts
ranks 0,2 (a pp pair) there, so each tp group spans the two nodes. Reported per placement: the median
``step_s`` of the trainer's log after the first step, and the bytes that crossed between the nodes per
step (the root-side veth counters over the whole run, start-up included, divided by the steps). The
placements alternate for ``--rounds`` rounds (the machine's speed drifts) and each is summed up by the
median of its rounds, with their range.

Before them the planner is calibrated on the same throttled cluster: ``hpc-tp bench comm`` measures
both links (``p2p_intra``, ``p2p_inter``, and an ``all_reduce`` over the nodes) and ``hpc-tp bench
step`` the block stack's compute rate with every rank of the cluster busy, as in training. From those
two files (``--calibration``) the planner predicts both placements (``hpc_tp.plan.placement``), for the
model the trainer builds (its vocabulary is the byte tokenizer's), and the table puts predicted next
to measured. Each rank runs under ``setsid -w``: the kernel's autogroup otherwise gives every srun
step one session, and ranks sharing a node look slower than ranks alone on theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from slurm.cluster import missing_programs  # noqa: E402
from slurm.nodes import VirtualCluster, unavailable  # noqa: E402

from hpc_tp.models.config import load_config  # noqa: E402
from hpc_tp.plan.calibration import load_calibration  # noqa: E402
from hpc_tp.plan.clusters import get_cluster  # noqa: E402
from hpc_tp.plan.cost import Layout  # noqa: E402
from hpc_tp.plan.placement import compare_placements  # noqa: E402
from hpc_tp.tokenizer import load_tokenizer  # noqa: E402

HPC_TP = str(Path(sys.prefix) / "bin" / "hpc-tp")
PLACEMENT = {"block": "tp inside, pp across", "cyclic": "tp across, pp inside"}


def step_env(cluster) -> dict:
    return {
        **cluster.env,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def srun(cluster, *args, distribution="block", per_node=2, node=None, timeout=1800):
    """One job step over both nodes (``per_node`` tasks each), or over ``node`` alone; waits for it."""
    return finish(start(cluster, *args, distribution=distribution, per_node=per_node, node=node), timeout)


def start(cluster, *args, distribution="block", per_node=2, node=None) -> subprocess.Popen:
    where = ["--nodes=1", f"--nodelist={node}"] if node else ["--nodes=2"]
    cmd = [
        "srun",
        "--mpi=pmix",
        *where,
        f"--ntasks-per-node={per_node}",
        "--cpus-per-task=1",
        f"--distribution={distribution}",
        "setsid",
        "-w",
        *args,
    ]
    return subprocess.Popen(
        cmd,
        env=step_env(cluster),
        cwd=cluster.dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(step: subprocess.Popen, timeout=1800) -> subprocess.CompletedProcess:
    out, err = step.communicate(timeout=timeout)
    if step.returncode != 0:
        raise SystemExit(f"{' '.join(step.args)} failed:\n{out[-2000:]}{err[-3000:]}")
    return subprocess.CompletedProcess(step.args, step.returncode, out, err)


def bytes_between_nodes(cluster) -> int:
    """Bytes the bridge delivered into the nodes (each byte from one node to another is counted once)."""
    return sum(
        int(Path(f"/sys/class/net/{cluster.veth(node)}/statistics/tx_bytes").read_text()) for node in cluster.nodes
    )


def time_layout(cluster, args, distribution: str, log: Path) -> dict:
    before = bytes_between_nodes(cluster)
    run = srun(
        cluster,
        HPC_TP,
        "train",
        "--model",
        args.model,
        "--tp",
        "2",
        "--pp",
        "2",
        "--steps",
        str(args.steps),
        "--micro-batch",
        str(args.micro_batch),
        "--global-batch",
        str(args.global_batch),
        "--seq-len",
        str(args.seq_len),
        "--log",
        str(log),
        "--no-progress",
        "--eval-problems",
        "4",
        "--samples",
        "0",
        distribution=distribution,
    )
    moved = bytes_between_nodes(cluster) - before
    steps = [json.loads(line) for line in log.read_text().splitlines() if '"step_s"' in line]
    return {
        "placement": PLACEMENT[distribution],
        "distribution": distribution,
        "step_s": statistics.median(r["step_s"] for r in steps[1:]),
        "step_s_all": [r["step_s"] for r in steps],
        "bytes_between_nodes_per_step": moved / args.steps,
        "warned": "spans 2 nodes" in run.stderr,
    }


def calibrate(cluster, args, index: int = 0) -> list[Path]:
    """The planner's calibration files, measured on the throttled cluster: ``bench comm``'s ping-pongs
    inside a node and across (2 ranks a node), its all-reduce across the nodes between 2 ranks (one a
    node: a tp group of 2 placed across), and ``bench step`` at tp=2 on each node at once. The virtual
    nodes share the host's cores, so the two run together: every rank busy, as in training (on a real
    cluster one node's ``bench step`` at tp = its ranks is the same measurement)."""
    links, across = cluster.dir / f"links-{index}.json", cluster.dir / f"across-{index}.json"
    comm = (HPC_TP, "bench", "comm", "--sizes", "64K:4M:4", "--iters", "3", "--warmup", "1", "--json")
    srun(cluster, *comm, str(links), "--ops", "p2p_intra,p2p_inter")
    srun(cluster, *comm, str(across), "--ops", "all_reduce", per_node=1)
    steps = [cluster.dir / f"step-{node}-{index}.json" for node in cluster.nodes]
    bench_step = (HPC_TP, "bench", "step", "--model", args.model, "--seq-len", str(args.seq_len))
    bench_step += ("--micro-batch", str(args.micro_batch), "--repeats", "3", "--warmup", "1", "--json")
    running = [start(cluster, *bench_step, str(path), node=node) for node, path in zip(cluster.nodes, steps)]
    for step in running:
        finish(step)
    return [links, across, *steps]


def predict_placements(args, calibration_files) -> dict:
    """The planner's step time and traffic for tp=2 x pp=2 under each placement, from the calibration."""
    cfg = load_config(args.model, vocab_size=load_tokenizer("bytes").vocab_size)  # what hpc-tp train builds
    cluster = get_cluster("cpu-2core").with_overrides(devices_per_node=2)
    layout = Layout(2, 2, 1, args.micro_batch)
    placed = compare_placements(
        cfg, layout, args.global_batch, args.seq_len, cluster, load_calibration(calibration_files)
    )
    return {p.prediction.layout.placement: p for p in placed}


def one_round(cluster, args, index: int) -> dict:
    """Calibrate, predict both placements, then time them (block first in even rounds, cyclic in odd)."""
    files = calibrate(cluster, args, index)
    links, across, *steps = (json.loads(f.read_text()) for f in files)
    predicted = predict_placements(args, files)
    order = list(PLACEMENT) if index % 2 == 0 else list(PLACEMENT)[::-1]
    runs = {d: time_layout(cluster, args, d, cluster.dir / f"{d}-{index}.jsonl") for d in order}
    for d, run in runs.items():
        run["predicted_s"] = predicted[d].prediction.step_s
        run["predicted_bytes_between_nodes_per_step"] = predicted[d].bytes_between_nodes
    return {"links": links + across, "steps": steps, "runs": [runs[d] for d in PLACEMENT]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="200mbit", help="each node's link, tc syntax (default %(default)s)")
    parser.add_argument("--model", default="w1")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds of calibrate, predict, time both placements (default 1)"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    reason = unavailable() or (f"SLURM missing: {', '.join(missing_programs())}" if missing_programs() else None)
    if reason:
        print(f"cannot build the virtual cluster here: {reason}", file=sys.stderr)
        return 1
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="hpctp-layouts-") as scratch:
        cluster = VirtualCluster(scratch, nodes=2)
        try:
            cluster.start()
            cluster.throttle(args.rate)
            rounds = [one_round(cluster, args, i) for i in range(args.rounds)]
        finally:
            cluster.stop()
    print(
        f"{args.model}, tp=2 x pp=2 on 2 virtual nodes x 2 ranks, link {args.rate}, seq {args.seq_len}, "
        f"micro-batch {args.micro_batch}, global batch {args.global_batch}, {args.steps} steps, {args.rounds} "
        f"rounds; load average {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )
    for i, one in enumerate(rounds):
        print(f" round {i + 1}")
        for r in one["links"]:
            if r["bytes"] == max(x["bytes"] for x in one["links"]):
                print(
                    f"  bench comm {r['op']:<10} {r['link']:<5} ({r['ranks']} ranks) {r['bytes'] / 2**20:.0f} MiB: "
                    f"{r['raw_algbw_GBps'] * 1e3:.1f} MB/s"
                )
        for step in one["steps"]:
            print(
                f"  bench step {step['compute_s'] * 1e3:.0f} ms compute, {step['comm_s'] * 1e3:.0f} ms "
                f"communication (tp={step['tp']} on {step['nodes']} node, both nodes at once)"
            )
        for r in one["runs"]:
            print(
                f"  {r['placement']:<22} step {r['step_s']:.2f} s (all: {', '.join(f'{s:.2f}' for s in r['step_s_all'])})"
                f", predicted {r['predicted_s']:.2f} s; {r['bytes_between_nodes_per_step'] / 2**20:.1f} MiB between "
                f"nodes per step, predicted {r['predicted_bytes_between_nodes_per_step'] / 2**20:.1f}"
                f"{'  (warned: tp spans nodes)' if r['warned'] else ''}"
            )
    summary = [summarize(d, [r for one in rounds for r in one["runs"] if r["distribution"] == d]) for d in PLACEMENT]
    print("  placement              measured s (range)     predicted s (range)    error (range)         MiB/step")
    for row in summary:
        print(
            f"  {row['placement']:<22} {row['measured_s']:6.2f} ({row['measured_range']})   "
            f"{row['predicted_s']:6.2f} ({row['predicted_range']})   {row['error'] * 100:+5.1f}% ({row['error_range']})"
            f"   {row['measured_mib']:.1f} measured, {row['predicted_mib']:.1f} predicted"
        )
    if args.json:
        results = {"settings": vars(args), "rounds": rounds, "summary": summary}
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def summarize(distribution: str, runs: list[dict]) -> dict:
    """One placement over the rounds: medians and ranges of measured and predicted step, and of the
    error of each round's prediction against that round's measurement."""
    measured, predicted = [r["step_s"] for r in runs], [r["predicted_s"] for r in runs]
    errors = [p / m - 1 for p, m in zip(predicted, measured)]

    def span(values):
        return f"{min(values):.2f}-{max(values):.2f}"

    return {
        "placement": PLACEMENT[distribution],
        "measured_s": statistics.median(measured),
        "measured_range": span(measured),
        "predicted_s": statistics.median(predicted),
        "predicted_range": span(predicted),
        "error": statistics.median(errors),
        "error_range": f"{min(errors) * 100:+.1f}% to {max(errors) * 100:+.1f}%",
        "measured_mib": statistics.median(r["bytes_between_nodes_per_step"] for r in runs) / 2**20,
        "predicted_mib": statistics.median(r["predicted_bytes_between_nodes_per_step"] for r in runs) / 2**20,
    }


if __name__ == "__main__":
    sys.exit(main())
