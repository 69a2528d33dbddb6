"""`hpc-tp serve` under a stream of requests: time to first token and latency, server variants side by side.

    python benchmarks/serve_load.py [--np 2] [--model llama-tiny] [--requests 24] [--rate 8]
                                    [--variant NAME=SERVE_ARGS ...] [--rounds 2] [--json FILE]

A random-weight checkpoint of ``--model`` (a preset, the byte tokenizer's vocabulary) goes to a
temporary folder. Each variant is a server started as ``mpiexec -n NP hpc-tp serve --ckpt ... --port 0
SERVE_ARGS``; rounds alternate the variants' order, so a shared machine's load falls on all alike.
Against each, the same requests arrive at the same offsets (a seeded Poisson process of ``--rate``
requests a second): their prompts are ``--prompt-tokens`` bytes after ``--shared-prefix`` bytes the
same for every request (a chat service's system prompt), and every ``--long-every``-th has a prompt of
``--long-prompt-tokens`` bytes (default ``--prompt-tokens``) and asks
for ``--long-tokens`` new tokens, the others for ``--short-tokens`` (greedy, streamed). Each server
first answers one request untimed (start-up work such as loading compiled kernels stays out of the
figures). Per variant and round it reports time to first token (the server's
``time_to_first_token_s``, from the request's arrival: a random model's bytes are often not yet
valid text, so the client's first text can come later than the first token) and end-to-end latency
at the client (median and 90th percentile), the same for the
short requests alone (the ones a static batch makes wait behind a long one), the completion
tokens a second over the round, and the prompt tokens the server found cached (``cached_tokens``). The last lines are the medians over rounds. No time is asserted
anywhere: the machine is shared and noisy, and only variants of one run compare.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy

REPO = Path(__file__).resolve().parent.parent
START_LINE = re.compile(r"listening on http://[^:]+:(\d+) ")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="ranks (= tp) of every server (default %(default)s)")
    p.add_argument("--model", default="llama-tiny", help="preset of the random-weight model (default %(default)s)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=8.0, help="mean arrivals a second (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="BYTES",
        help="bytes every prompt begins with, before its own (default %(default)s)",
    )
    p.add_argument("--short-tokens", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=48)
    p.add_argument("--long-every", type=int, default=6, help="every k-th request is long (default %(default)s)")
    p.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=None,
        metavar="BYTES",
        help="the long requests' own prompt bytes (default: --prompt-tokens)",
    )
    p.add_argument(
        "--variant",
        action="append",
        metavar="NAME=SERVE_ARGS",
        help="a server to compare, e.g. 'batch8=--max-batch 8' (repeat; default: one, 'default=')",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mpiexec", default=None, help="MPI launcher (default: the one next to this Python)")
    p.add_argument("--json", metavar="FILE", help="every round's figures and the medians as JSON")
    args = p.parse_args(argv)
    numbers = (
        args.np,
        args.requests,
        args.prompt_tokens,
        args.short_tokens,
        args.long_tokens,
        args.long_every,
        args.rounds,
    )
    if min(numbers) < 1 or not args.rate > 0 or args.shared_prefix < 0 or (args.long_prompt_tokens or 1) < 1:
        p.error(
            "--np, --requests, --prompt-tokens, --short-tokens, --long-tokens, --long-every and --rounds "
            "must be >= 1, --long-prompt-tokens too if given, --shared-prefix >= 0 and --rate > 0"
        )
    variants = {}
    for spec in args.variant or ["default="]:
        name, sep, serve_args = spec.partition("=")
        if not sep or not name or name in variants:
            p.error(f"--variant {spec!r}: expected a new NAME=SERVE_ARGS")
        variants[name] = serve_args.split()
    args.variants = variants
    return args


def write_checkpoint(folder: Path, preset: str, max_len: int) -> Path:
    """A random-weight ``preset`` model over the byte tokenizer, saved at tp = 1 (any tp loads it)."""
    from hpc_tp.checkpoint import save_checkpoint
    from hpc_tp.comm.mpi import self_comm
    from hpc_tp.grid import ProcessGrid
    from hpc_tp.models.config import load_config
    from hpc_tp.models.gpt import GPTModel
    from hpc_tp.tokenizer import ByteTokenizer, saved_files

    tokenizer = ByteTokenizer()
    cfg = load_config(preset, vocab_size=tokenizer.vocab_size, max_seq_len=max_len)
    grid = ProcessGrid(tp=1, world=self_comm())
    model = GPTModel(cfg, grid.tp, seed=0)
    return save_checkpoint(
        folder, 1, model.state(), {"step": 1, "config": cfg.to_dict()}, grid, files=saved_files(tokenizer)
    )


def workload(args) -> list[dict]:
    """The requests, the same for every variant: arrival offset, body, whether long."""
    rng = numpy.random.default_rng(args.seed)
    shared = "".join(chr(c) for c in rng.integers(ord("A"), ord("Z") + 1, args.shared_prefix))
    offsets = numpy.cumsum(rng.exponential(1.0 / args.rate, args.requests)) - 1.0 / args.rate
    requests = []
    for i, offset in enumerate(offsets):
        long = i % args.long_every == 0
        own = (args.long_prompt_tokens or args.prompt_tokens) if long else args.prompt_tokens
        prompt = shared + "".join(chr(c) for c in rng.integers(ord("a"), ord("z") + 1, own))
        body = {
            "prompt": prompt,
            "max_tokens": args.long_tokens if long else args.short_tokens,
            "temperature": 0,
            "stream": True,
        }
        requests.append({"offset": float(max(offset, 0.0)), "body": json.dumps(body).encode(), "long": long})
    return requests


class Server:
    """``hpc-tp serve`` under mpiexec on loopback, port from its start-up line; stopped with SIGTERM."""

    def __init__(self, mpiexec: str, ranks: int, ckpt: Path, dtype: str, extra: list[str]):
        cmd = [
            mpiexec,
            "-n",
            str(ranks),
            sys.executable,
            "-m",
            "hpc_tp.cli",
            "serve",
            "--ckpt",
            str(ckpt),
            "--port",
            "0",
            "--dtype",
            dtype,
            *extra,
        ]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self.port = self._port(" ".join(cmd))

    def _port(self, cmd: str, timeout: float = 120) -> int:
        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            seen.append(line)
            if found := START_LINE.search(line):
                return int(found.group(1))
        self.stop()
        raise SystemExit(f"server did not start ({cmd}):\n{''.join(seen)}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()  # mpiexec passes TERM to the ranks: they finish and exit 0
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def one_request(port: int, request: dict, start: float) -> dict:
    """Send at the request's offset and read its stream to the end; the usage comes in the last chunk."""
    time.sleep(max(0.0, start + request["offset"] - time.perf_counter()))
    sent = time.perf_counter()
    http = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=request["body"], headers={"Content-Type": "application/json"}
    )
    usage = None
    with urllib.request.urlopen(http, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                usage = json.loads(line[len("data: ") :]).get("usage") or usage
    if usage is None:
        raise SystemExit(f"no usage in the answer to {request['body'][:80]!r}")
    return {
        "long": request["long"],
        "ttft_s": usage["time_to_first_token_s"],
        "latency_s": time.perf_counter() - sent,
        "tokens": usage["completion_tokens"],
        "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        "decode_tokens_per_s": usage["decode_tokens_per_s"],
    }


def run_round(server: Server, requests: list[dict]) -> dict:
    one_request(server.port, {**requests[0], "offset": 0.0}, time.perf_counter())  # warm-up, untimed
    start = time.perf_counter() + 0.2
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        results = list(pool.map(lambda r: one_request(server.port, r, start), requests))
    wall = max(r["latency_s"] + req["offset"] for r, req in zip(results, requests))
    short = [r for r in results if not r["long"]] or results

    def quantiles(values):
        return float(numpy.median(values)), float(numpy.percentile(values, 90))

    decoding = [r["decode_tokens_per_s"] for r in short if r["tokens"] > 1]
    figures = {
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "wall_s": wall,
        "cached_tokens": sum(r["cached"] for r in results),
        # the slowest short decodes: a long prefill run whole stalls the rows decoding beside it
        "short_decode_tokens_per_s_p10": float(numpy.percentile(decoding, 10)) if decoding else 0.0,
    }
    for label, rows in (("", results), ("short_", short)):
        figures[f"{label}ttft_p50_s"], figures[f"{label}ttft_p90_s"] = quantiles([r["ttft_s"] for r in rows])
        figures[f"{label}latency_p50_s"], figures[f"{label}latency_p90_s"] = quantiles([r["latency_s"] for r in rows])
    return figures


def describe(name: str, f: dict) -> str:
    ms = {k: v * 1e3 for k, v in f.items() if k.endswith("_s")}
    return (
        f"{name:>12}: TTFT p50/p90 {ms['ttft_p50_s']:7.1f} / {ms['ttft_p90_s']:7.1f} ms, latency "
        f"{ms['latency_p50_s']:7.1f} / {ms['latency_p90_s']:7.1f} ms; short requests TTFT "
        f"{ms['short_ttft_p50_s']:7.1f} / {ms['short_ttft_p90_s']:7.1f} ms, latency "
        f"{ms['short_latency_p50_s']:7.1f} / {ms['short_latency_p90_s']:7.1f} ms; {f['tokens_per_s']:.1f} tokens/s; "
        f"{f['cached_tokens']:.0f} prompt tokens cached; short decode p10 {f['short_decode_tokens_per_s_p10']:.1f} tokens/s"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    mpiexec = args.mpiexec or str(Path(sys.executable).with_name("mpiexec"))
    if not Path(mpiexec).exists():
        mpiexec = shutil.which("mpiexec") or "mpiexec"
    requests = workload(args)
    folder = Path(tempfile.mkdtemp(prefix="serve_load_"))
    rounds = []
    try:
        longest = max(args.prompt_tokens, args.long_prompt_tokens or 0)
        ckpt = write_checkpoint(folder / "ckpt", args.model, args.shared_prefix + longest + args.long_tokens)
        names = list(args.variants)
        for i in range(args.rounds):
            for name in names if i % 2 == 0 else names[::-1]:
                server = Server(mpiexec, args.np, ckpt, args.dtype, args.variants[name])
                try:
                    figures = run_round(server, requests)
                finally:
                    server.stop()
                rounds.append({"variant": name, "round": i, **figures})
                print(f"round {i} " + describe(name, figures), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    summary = {
        name: {
            key: statistics.median(r[key] for r in rounds if r["variant"] == name)
            for key in rounds[0]
            if key not in ("variant", "round")
        }
        for name in args.variants
    }
    print(
        f"\nmedians over {args.rounds} round(s), {args.requests} requests at {args.rate}/s, tp={args.np}, "
        f"{args.model} (random weights), machine may be shared:"
    )
    for name, figures in summary.items():
        print(describe(name, figures))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": {k: v for k, v in vars(args).items()}, "rounds": rounds, "summary": summary},
                indent=1,
                default=str,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
