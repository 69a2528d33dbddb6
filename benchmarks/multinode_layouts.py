"""The seed's rule, measured: tp inside a node and pp across, against tp across and pp inside, over a
throttled link between two virtual nodes (tests/slurm/nodes.py: root, network namespaces, SLURM).

    python benchmarks/multinode_layouts.py [--rate 200mbit] [--model w1] [--steps 4] [--seq-len 256]

Both runs train the same model at the same layout, tp=2 x pp=2 on 2 nodes x 2 ranks; only the rank
placement differs: ``srun --distribution=block`` puts ranks 0,1 (a tp group) on node1, ``cyclic`` puts
ranks 0,2 (a pp pair) there, so each tp group spans the two nodes. Reported per placement: the median
``step_s`` of the trainer's log after the first step, and the bytes that crossed between the nodes per
step (the root-side veth counters over the whole run, start-up included, divided by the steps). Before
them, ``hpc-tp bench comm`` measures the two links (``p2p_intra``, ``p2p_inter``) on the same throttled
cluster. Each rank runs under ``setsid -w``: the kernel's autogroup otherwise gives every srun step one
session, and ranks sharing a node look slower than ranks alone on theirs.
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

HPC_TP = str(Path(sys.prefix) / "bin" / "hpc-tp")


def step_env(cluster) -> dict:
    return {
        **cluster.env,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def srun(cluster, *args, distribution="block", timeout=1800):
    cmd = [
        "srun",
        "--mpi=pmix",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        f"--distribution={distribution}",
        "setsid",
        "-w",
        *args,
    ]
    result = subprocess.run(
        cmd, env=step_env(cluster), cwd=cluster.dir, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
    return result


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
        "placement": "tp inside, pp across" if distribution == "block" else "tp across, pp inside",
        "distribution": distribution,
        "step_s": statistics.median(r["step_s"] for r in steps[1:]),
        "step_s_all": [r["step_s"] for r in steps],
        "bytes_between_nodes_per_step": moved / args.steps,
        "warned": "spans 2 nodes" in run.stderr,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="200mbit", help="each node's link, tc syntax (default %(default)s)")
    parser.add_argument("--model", default="w1")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    reason = unavailable() or (f"SLURM missing: {', '.join(missing_programs())}" if missing_programs() else None)
    if reason:
        print(f"cannot build the virtual cluster here: {reason}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="hpctp-layouts-") as scratch:
        cluster = VirtualCluster(scratch, nodes=2)
        try:
            cluster.start()
            cluster.throttle(args.rate)
            srun(
                cluster,
                HPC_TP,
                "bench",
                "comm",
                "--ops",
                "p2p_intra,p2p_inter,all_reduce",
                "--sizes",
                "64K:4M:4",
                "--iters",
                "3",
                "--warmup",
                "1",
                "--json",
                str(cluster.dir / "links.json"),
            )
            links = json.loads((cluster.dir / "links.json").read_text())
            runs = [time_layout(cluster, args, d, cluster.dir / f"{d}.jsonl") for d in ("block", "cyclic")]
        finally:
            cluster.stop()
    print(
        f"{args.model}, tp=2 x pp=2 on 2 virtual nodes x 2 ranks, link {args.rate}, seq {args.seq_len}, "
        f"micro-batch {args.micro_batch}, global batch {args.global_batch}, {args.steps} steps; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    for r in links:
        if r["bytes"] == max(x["bytes"] for x in links):
            print(
                f"  bench comm {r['op']:<10} {r['link']:<5} {r['bytes'] / 2**20:.0f} MiB: "
                f"{r['raw_algbw_GBps'] * 1e3:.1f} MB/s"
            )
    for r in runs:
        print(
            f"  {r['placement']:<22} step {r['step_s']:.2f} s (all: {', '.join(f'{s:.2f}' for s in r['step_s_all'])})"
            f"  {r['bytes_between_nodes_per_step'] / 2**20:.1f} MiB between nodes per step"
            f"{'  (warned: tp spans nodes)' if r['warned'] else ''}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "links": links, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
