"""`hpc-tp serve` on more ranks than the model's tp: world = tp x replicas behind one endpoint. Under
mpiexec -n 2 at --tp 1 and -n 4 at --tp 2, concurrent requests (some streamed) are each answered once, with what the
request alone gives, the replicas share them, one /metrics page counts them all, and SIGTERM stops
every rank with exit 0."""

import json
import os
import queue
import re
import signal
import subprocess
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_generate import _model, write_checkpoint
from test_serve import BIN, MPIEXEC, ROOT, _post, _start_line, _text_of

from hpc_tp.comm.mpi import self_comm
from hpc_tp.grid import ProcessGrid
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.tokenizer import ByteTokenizer

N_REQUESTS = 24


@pytest.mark.parametrize("ranks,tp", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_two_replicas_answer_every_request_once_as_alone(tmp_path, ranks, tp):
    ckpt = write_checkpoint(tmp_path / "ckpt", "llama-gqa", ProcessGrid(tp=1, world=self_comm()), ByteTokenizer())
    proc = subprocess.Popen(
        [
            MPIEXEC,
            "-n",
            str(ranks),
            str(BIN / "hpc-tp"),
            "serve",
            "--ckpt",
            str(ckpt),
            "--port",
            "0",
            "--tp",
            str(tp),
            "--dtype",
            "float64",
            "--max-batch",
            "4",
            "--max-model-len",
            "31",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        port, pids = _start_line(proc, lines)
        prompts = [f"replica {i}: " + "ab" * (i % 5) for i in range(N_REQUESTS)]
        bodies = [
            json.dumps(
                {
                    "prompt": p,
                    "max_tokens": 4 + i % 5,
                    "temperature": 0,
                    "stream": i % 3 == 0,
                    **({"stream_options": {"include_usage": True}} if i % 3 == 0 else {}),
                }
            ).encode()
            for i, p in enumerate(prompts)
        ]
        with ThreadPoolExecutor(max_workers=N_REQUESTS) as pool:
            answers = list(pool.map(lambda body: _post(port, body), bodies))
        engine = Engine(_model("llama-gqa", self_comm()), ByteTokenizer())
        want, _ = engine.generate(
            [list(p.encode()) for p in prompts], [SamplingParams(max_new_tokens=4 + i % 5) for i in range(N_REQUESTS)]
        )
        for i, ((status, content_type, body), expected) in enumerate(zip(answers, want)):
            assert status == 200, body
            text, finish, usage = _text_of(content_type, body)
            assert (text, finish) == (expected.text, expected.finish_reason), f"request {i}"
            assert usage["completion_tokens"] == len(expected.ids)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
            counted = dict(
                line.rsplit(" ", 1) for line in response.read().decode().splitlines() if not line.startswith("#")
            )
        assert sum(float(v) for k, v in counted.items() if k.startswith("hpc_tp_requests_total{")) == N_REQUESTS
        assert counted["hpc_tp_requests_running"] == counted["hpc_tp_requests_waiting"] == "0"
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        reader.join(timeout=10)
        output = "".join(lines.get_nowait() for _ in range(lines.qsize()))
        spread = re.search(rf"{N_REQUESTS} requests answered \(by replica: (\d+) (\d+)\)", output)
        assert spread, output
        assert all(int(n) > 0 for n in spread.groups()), output  # 24 requests at once, 4 rows a replica
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
