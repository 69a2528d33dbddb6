"""`hpc-tp serve` on more ranks than the model's tp: world = tp x replicas behind one endpoint. Under
mpiexec -n 2 at --tp 1 and -n 4 at --tp 2, concurrent requests (some streamed) are each answered once, with what the
request alone gives, the replicas share them, one /metrics page counts them all, and SIGTERM stops
every rank with exit 0."""

import json
import os
import re
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_generate import _model, write_checkpoint
from test_serve import _post, _text_of, serving

from hpc_tp.comm.mpi import self_comm
from hpc_tp.errors import ConfigError
from hpc_tp.grid import ProcessGrid
from hpc_tp.models import ModelConfig
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.loading import check_layout
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.tokenizer import ByteTokenizer

N_REQUESTS = 24


@pytest.mark.parametrize("ranks,tp", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_two_replicas_answer_every_request_once_as_alone(tmp_path, ranks, tp):
    ckpt = write_checkpoint(tmp_path / "ckpt", "llama-gqa", ProcessGrid(tp=1, world=self_comm()), ByteTokenizer())
    flags = ("--ckpt", str(ckpt), "--tp", str(tp), "--dtype", "float64", "--max-batch", "4", "--max-model-len", "31")
    with serving(*flags, ranks=ranks) as server:
        port = server.port
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
        for pid in server.pids:
            os.kill(pid, signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        server.reader.join(timeout=10)
        output = "".join(server.lines.get_nowait() for _ in range(server.lines.qsize()))
        spread = re.search(rf"{N_REQUESTS} requests answered \(by replica: (\d+) (\d+)\)", output)
        assert spread, output
        assert all(int(n) > 0 for n in spread.groups()), output  # 24 requests at once, 4 rows a replica


def test_heads_that_do_not_split_over_tp_name_the_layouts_of_the_world_replicas_included():
    cfg = ModelConfig(hidden=72, n_heads=9, n_kv_heads=3)
    check_layout(cfg, 3, 1, 6)  # fits: nothing said
    with pytest.raises(ConfigError) as bad:
        check_layout(cfg, 2, 1, 2)
    assert (
        str(bad.value)
        == "9 attention heads with 3 kv heads cannot be split over --tp 2; on 2 ranks: --tp 1 (2 replicas)"
    )
    with pytest.raises(ConfigError, match=r"on 6 ranks: --tp 1 \(6 replicas\), --tp 3 \(2 replicas\)$"):
        check_layout(cfg, 2, 1, 6)
