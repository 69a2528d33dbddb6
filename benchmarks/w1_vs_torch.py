"""W1 side by side: this engine (`hpc-tp bench step`) and the PyTorch DTensor peer, in one run.

    python benchmarks/w1_vs_torch.py [--np 1,2] [--rounds 3] [--peer PATH]

W1 is 4 GPT blocks of hidden 768, 12 heads, FFN 3072, sequence 256, micro-batch 4, float32,
causal: the `w1` preset here, the peer's defaults there. Both run one BLAS/intra-op thread per
rank, on the same rank counts, and their rounds alternate (engine, peer, peer, engine, ...) so the
load of a shared machine falls on both alike. Each round reports its median step; the summary is
the median over rounds, and the ratio peer/engine is > 1 when this engine is faster. Each round
also sets the peer against the engine's floor (`bench step`'s `floor_s`: the step's needed matrix
products at the highest GEMM peak sample of that round, nothing else): peer/floor is the most any
engine could be faster than the peer on this machine at that moment, the ceiling for peer/engine.

The peer (a PyTorch script kept outside this project) is found by --peer, else the environment
variable HPC_TP_TORCH_PEER, else ../shared/peers/torch_tp_step.py next to the repository. It needs
PyTorch (the optional extra: pip install torch==2.13.0); without it this script says so and still
reports the engine. With several --np values it also prints strong scaling: the step at the lowest
rank count over the step at each other one.

The MPI launcher is the mpiexec next to this Python (the venv's) unless --mpiexec names another;
environment variables the launcher needs (e.g. running as root, oversubscription) are passed through.
Both sides run with glibc's heap on transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, as
the Makefile and jobs/ set for the engine), the same environment for both; --no-huge-pages leaves the
tunable out for both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PEER = REPO.parent / "shared" / "peers" / "torch_tp_step.py"
W1_PEER_ARGS = ["--hidden", "768", "--heads", "12", "--seq", "256", "--batch", "4", "--layers", "4"]
PEER_LINE = re.compile(r"peer_torch tp=(\d+) step_ms=([0-9.]+)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", default="2", help="comma-separated rank counts (= tp), e.g. 1,2 (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per rank count (default %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per round, each engine (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="BLAS / torch threads per rank (default %(default)s)")
    p.add_argument(
        "--peer",
        default=os.environ.get("HPC_TP_TORCH_PEER", str(DEFAULT_PEER)),
        help="the PyTorch peer script (default: $HPC_TP_TORCH_PEER or ../shared/peers/torch_tp_step.py)",
    )
    p.add_argument("--mpiexec", default=None, help="MPI launcher (default: the one next to this Python, else on PATH)")
    p.add_argument(
        "--no-huge-pages",
        action="store_true",
        help="run both without GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (default: both with it)",
    )
    p.add_argument("--json", metavar="FILE", help="write every round and the summary as JSON")
    args = p.parse_args(argv)
    args.np = [int(n) for n in args.np.split(",")]
    if args.rounds < 1 or args.repeats < 1 or args.threads < 1 or min(args.np) < 1:
        p.error("--rounds, --repeats, --threads and every --np must be positive")
    return args


def launcher(name: str | None) -> str:
    if name:
        return name
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")


def torch_missing() -> str | None:
    """Why the peer cannot run here, or None when it can."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torch, torch.distributed; print(torch.__version__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode:
        return probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else "import torch failed"
    return None


def run_env(args) -> dict:
    """The environment of both sides: ``args.threads`` per rank, and the heap on huge pages unless
    ``--no-huge-pages`` (either way the same for the engine and the peer)."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads)
    )
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb=")]
    if not args.no_huge_pages:
        tunables.append("glibc.malloc.hugetlb=1")
    env["GLIBC_TUNABLES"] = ":".join(tunables)
    return env


def run_engine(mpiexec: str, ranks: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        cmd = [
            mpiexec,
            "-n",
            str(ranks),
            sys.executable,
            "-m",
            "hpc_tp.cli",
            "bench",
            "step",
            "--model",
            "w1",
            "--threads",
            str(args.threads),
            "--repeats",
            str(args.repeats),
            "--json",
            str(out),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, env=run_env(args), cwd=REPO)
        if done.returncode:
            raise SystemExit(f"engine failed ({' '.join(cmd)}):\n{done.stdout}{done.stderr}")
        return json.loads(out.read_text())


def run_peer(ranks: int, args) -> float:
    """The peer's median step in seconds."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        args.peer,
        *W1_PEER_ARGS,
        "--iters",
        str(args.repeats),
        "--threads",
        str(args.threads),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=run_env(args))
    found = PEER_LINE.search(done.stdout)
    if done.returncode or not found:
        raise SystemExit(f"peer failed ({' '.join(cmd)}):\n{done.stdout}{done.stderr}")
    return float(found.group(2)) / 1e3


def main(argv=None) -> int:
    args = parse_args(argv)
    mpiexec = launcher(args.mpiexec)
    missing = None if Path(args.peer).is_file() else f"peer script not found at {args.peer} (use --peer)"
    missing = missing or torch_missing()
    if missing:
        print(
            f"PyTorch peer NOT run: {missing}. Install the optional extra (pip install torch==2.13.0) "
            "for the comparison; reporting this engine only."
        )
    rounds, summary = [], {}
    for ranks in args.np:
        for i in range(args.rounds):
            # Alternate who goes first, so neither always runs on the machine the other just warmed or loaded.
            order = ("engine", "peer") if i % 2 == 0 else ("peer", "engine")
            row = {"ranks": ranks, "round": i}
            for who in order:
                if who == "engine":
                    record = run_engine(mpiexec, ranks, args)
                    row.update(
                        engine_step_s=record["step_s"],
                        engine_mfu=record["mfu"],
                        engine_comm_s=record["comm_s"],
                        gemm_peak_per_rank=record["gemm_peak_flops_per_rank"],
                        floor_s=record["floor_s"],
                    )
                elif not missing:
                    row["peer_step_s"] = run_peer(ranks, args)
            if "peer_step_s" in row:
                row["peer_over_engine"] = row["peer_step_s"] / row["engine_step_s"]
                row["peer_over_floor"] = row["peer_step_s"] / row["floor_s"]
            rounds.append(row)
            print(
                f"tp={ranks} round {i}: engine {row['engine_step_s'] * 1e3:.1f} ms (MFU {row['engine_mfu'] * 100:.1f}%, "
                f"floor {row['floor_s'] * 1e3:.1f} ms)"
                + (
                    f", peer {row['peer_step_s'] * 1e3:.1f} ms, peer/engine {row['peer_over_engine']:.2f}x "
                    f"(ceiling {row['peer_over_floor']:.2f}x)"
                    if "peer_step_s" in row
                    else ""
                ),
                flush=True,
            )
        mine = [r for r in rounds if r["ranks"] == ranks]
        summary[ranks] = {
            key: statistics.median(r[key] for r in mine)
            for key in (
                "engine_step_s",
                "engine_mfu",
                "engine_comm_s",
                "gemm_peak_per_rank",
                "floor_s",
                "peer_step_s",
                "peer_over_engine",
                "peer_over_floor",
            )
            if key in mine[0]
        }
    print(
        f"\nW1 summary (median of {args.rounds} rounds, {args.threads} thread(s) per rank, "
        f"{'without' if args.no_huge_pages else 'with'} huge pages for both; machine may be shared):"
    )
    for ranks, s in summary.items():
        line = (
            f"  tp={ranks}: engine {s['engine_step_s'] * 1e3:.1f} ms, MFU {s['engine_mfu'] * 100:.1f}% "
            f"(GEMM peak {s['gemm_peak_per_rank'] / 1e9:.1f} GFLOP/s per rank)"
        )
        if "peer_step_s" in s:
            line += (
                f"; PyTorch peer {s['peer_step_s'] * 1e3:.1f} ms; peer/engine {s['peer_over_engine']:.2f}x "
                f"(ceiling peer/floor {s['peer_over_floor']:.2f}x, floor {s['floor_s'] * 1e3:.1f} ms)"
            )
        print(line)
    base = min(summary)
    for ranks in sorted(summary):
        if ranks != base:
            print(
                f"  strong scaling tp={base} -> tp={ranks}: engine "
                f"{summary[base]['engine_step_s'] / summary[ranks]['engine_step_s']:.2f}x"
                + (
                    f", peer {summary[base]['peer_step_s'] / summary[ranks]['peer_step_s']:.2f}x"
                    if "peer_step_s" in summary[ranks]
                    else ""
                )
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rounds": rounds, "summary": summary, "peer_missing": missing}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
