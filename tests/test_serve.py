"""`hpc-tp serve` as users start it: under mpiexec -n 2 on loopback, 50 concurrent requests (some
streamed) each get their own complete greedy completion, malformed ones get a 400 with the reason
without disturbing the others, and SIGTERM stops every rank with exit 0; with continuous batching
and with static batches (`--batching static`)."""

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_generate import _model, write_checkpoint

from hpc_tp.comm.mpi import self_comm
from hpc_tp.grid import ProcessGrid
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MPIEXEC = os.environ.get("MPIEXEC", str(BIN / "mpiexec"))
N_REQUESTS = 50


def _post(port, body: bytes, path="/v1/completions"):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("Content-Type"), response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read().decode()


def _text_of(content_type, body):
    """(text, finish_reason, usage) of a JSON answer or of a server-sent event stream, from
    /v1/completions (``text``) or /v1/chat/completions (the assistant's ``message``, or ``delta`` chunks)."""

    def text(choice, first=True):
        turn = choice.get("message", choice.get("delta"))
        if turn is None:
            return choice["text"]
        assert turn.get("role") == ("assistant" if first else None)  # a stream names the role once
        return turn.get("content", "")

    if content_type == "text/event-stream":
        events = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        usage = chunks.pop()["usage"] if not chunks[-1]["choices"] else None  # only where include_usage asked it
        assert all(c.get("usage") is None for c in chunks)
        return (
            "".join(text(c["choices"][0], i == 0) for i, c in enumerate(chunks)),
            chunks[-1]["choices"][0]["finish_reason"],
            usage,
        )
    answer = json.loads(body)
    return text(answer["choices"][0]), answer["choices"][0]["finish_reason"], answer["usage"]


def _start_line(proc, lines: queue.Queue, timeout=60):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert proc.poll() is None, "".join(seen)
            continue
        seen.append(line)
        match = re.search(
            r"listening on http://127\.0\.0\.1:(\d+) \(tp=\d+, pp=\d+, replicas=\d+, rank pids ([\d ]+)\)", line
        )
        if match:
            return int(match.group(1)), [int(p) for p in match.group(2).split()]
    raise AssertionError("no start-up line in time:\n" + "".join(seen))


@contextmanager
def serving(*flags, ranks: int = 2):
    """``mpiexec -n RANKS hpc-tp serve --port 0 FLAGS`` for the block: yields its process, port, rank pids,
    a queue of its output lines and the thread reading them; a server still up after it is stopped."""
    proc = subprocess.Popen(
        [MPIEXEC, "-n", str(ranks), str(BIN / "hpc-tp"), "serve", "--port", "0", *flags],
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
        yield SimpleNamespace(proc=proc, port=port, pids=pids, lines=lines, reader=reader)
    finally:
        if proc.poll() is None:  # a failed check, or done: mpiexec passes TERM on and takes its ranks down with it
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# one block of 4 tokens of llama-gqa's K/V at tp = 2 in float64: 2 layers, K and V, 1 kv head of 8
KV_BLOCK_BYTES = 2 * 2 * 1 * 4 * 8 * 8


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_server_under_load_malformed_requests_and_sigterm(tmp_path, batching):
    ckpt = write_checkpoint(tmp_path / "ckpt", "llama-gqa", ProcessGrid(tp=1, world=self_comm()), ByteTokenizer())
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}a:")
    with serving(
        "--ckpt",
        str(ckpt),
        "--dtype",
        "float64",
        "--max-batch",
        "8",
        "--batching",
        batching,
        "--max-model-len",
        "31",
        "--chat-template",
        str(template),
        # continuous: 16 blocks of 4 tokens a rank besides the scratch one (64 tokens for 8 rows of up to 30):
        # the load preempts
        *(
            ["--kv-block-size", "4", "--kv-cache-memory", str(17 * KV_BLOCK_BYTES / 2**30)]
            if batching == "continuous"
            else []
        ),
    ) as served:
        port, pids, proc, lines = served.port, served.pids, served.proc, served.lines
        prompts = [f"request {i}: " + "xy" * (i % 7) for i in range(N_REQUESTS)]
        bodies = [
            json.dumps(
                {
                    "prompt": p,
                    "max_tokens": 3 + i % 6,
                    "temperature": 0,
                    "stream": i % 5 == 0,
                    "stream_options": {"include_usage": True} if i % 5 == 0 else None,
                }
            ).encode()
            for i, p in enumerate(prompts)
        ]
        malformed = {
            b"{not json": "body is not JSON",
            b'{"prompt": "hi", "max_tokens": 0}': "max_tokens=0: expected an integer >= 1",
            b'{"prompt": {"a": "b"}}': "prompt must be a string, a list of strings",
            b'{"prompt": "hi", "temprature": 0.5}': "unknown fields temprature",
            b'{"prompt": "\\ud800"}': "text is not valid Unicode",  # a lone surrogate
            b'{"prompt": "' + b"z" * 30 + b'", "max_tokens": 3}': "this server takes 31 (--max-model-len)",
            b"[" * 100000 + b"]" * 100000: "nested too deeply",
        }
        with ThreadPoolExecutor(max_workers=N_REQUESTS + len(malformed)) as pool:
            bad = [pool.submit(_post, port, body) for body in malformed]
            good = [pool.submit(_post, port, body) for body in bodies]
            answers, refusals = [f.result() for f in good], [f.result() for f in bad]
        for (status, _, body), reason in zip(refusals, malformed.values()):
            assert status == 400 and reason in json.loads(body)["error"]["message"], body
        engine = Engine(_model("llama-gqa", self_comm()), ByteTokenizer())
        want, _ = engine.generate(
            [list(p.encode()) for p in prompts], [SamplingParams(max_new_tokens=3 + i % 6) for i in range(N_REQUESTS)]
        )
        for i, ((status, content_type, body), expected) in enumerate(zip(answers, want)):
            assert status == 200, body
            assert content_type == ("text/event-stream" if i % 5 == 0 else "application/json")
            text, finish, usage = _text_of(content_type, body)
            assert (text, finish) == (expected.text, expected.finish_reason), f"request {i}"
            assert usage["completion_tokens"] == len(expected.ids) and len(usage["kv_cache_bytes_per_rank"]) == 2
        # the same prompt twice in a row: the second finds all of it but its last token in a row's cache
        repeat = json.dumps({"prompt": prompts[1], "max_tokens": 2, "temperature": 0}).encode()
        cached = [_text_of(*_post(port, repeat)[1:])[2]["prompt_tokens_details"]["cached_tokens"] for _ in range(2)]
        assert cached[1] == (len(prompts[1].encode()) - 1 if batching == "continuous" else 0)
        # a chat, then its next turn: each the completion of its rendered prompt, the next turn finding at
        # least the first one's prompt cached
        turns, chats = [{"role": "user", "content": "hi"}], []
        for stream in (False, True):
            body = json.dumps(
                {
                    "messages": turns,
                    "max_tokens": 4,
                    "temperature": 0,
                    "stream": stream,
                    "stream_options": {"include_usage": stream},
                }
            ).encode()
            status, content_type, answer = _post(port, body, path="/v1/chat/completions")
            assert status == 200, answer
            chats.append(_text_of(content_type, answer))
            rendered = "".join(f"{m['role'][0]}:{m['content']}\n" for m in turns) + "a:"
            want_chat, _ = engine.generate([list(rendered.encode())], [SamplingParams(max_new_tokens=4)])
            assert chats[-1][:2] == (want_chat[0].text, want_chat[0].finish_reason)
            turns += [{"role": "assistant", "content": chats[-1][0]}, {"role": "user", "content": "ok"}]
        assert chats[1][2]["prompt_tokens_details"]["cached_tokens"] >= (
            len("u:hi\na:") if batching == "continuous" else 0
        )
        # the model is served by its checkpoint folder's name: listed, answered under it, others refused
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as response:
            assert [m["id"] for m in json.loads(response.read())["data"]] == ["ckpt"]
        named = _post(port, json.dumps({"prompt": "hi", "max_tokens": 1, "model": "ckpt"}).encode())
        assert named[0] == 200 and json.loads(named[2])["model"] == "ckpt"
        other = _post(port, json.dumps({"prompt": "hi", "model": "gpt-4"}).encode())
        assert other[0] == 404 and "model 'gpt-4' is not served here" in json.loads(other[2])["error"]["message"]
        refused = _post(port, json.dumps({"messages": "hi"}).encode(), path="/v1/chat/completions")
        assert json.loads(refused[2])["error"]["message"].startswith("messages must be a non-empty list")
        # what the server counted so far: every answer, the refusals, nothing running or waiting
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
            counted = dict(
                line.rsplit(" ", 1) for line in response.read().decode().splitlines() if not line.startswith("#")
            )
        answered = N_REQUESTS + len(cached) + len(chats) + 1
        assert sum(float(v) for k, v in counted.items() if k.startswith("hpc_tp_requests_total{")) == answered
        assert float(counted["hpc_tp_time_to_first_token_seconds_count"]) == answered
        assert counted["hpc_tp_requests_running"] == counted["hpc_tp_requests_waiting"] == "0"
        assert counted['hpc_tp_requests_refused_total{code="400"}'] == str(len(malformed) + 1)
        assert counted['hpc_tp_requests_refused_total{code="404"}'] == "1"
        assert (float(counted["hpc_tp_prompt_tokens_cached_total"]) > 0) == (batching == "continuous")
        assert int(counted["hpc_tp_preemptions_total"]) >= 0 and (
            batching == "continuous" or counted["hpc_tp_preemptions_total"] == "0"
        )
        assert _post(port, b"{}", path="/v1/other")[0] == 404
        with socket.create_connection(("127.0.0.1", port), timeout=60) as raw:
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n")
            assert raw.recv(4096).startswith(b"HTTP/1.0 413")
        assert _post(port, b" " * (16 * 2**20 + 1))[0] == 413  # a client sending the body still reads the answer
        idle = socket.create_connection(("127.0.0.1", port), timeout=60)  # sends nothing: must not stall the stop
        # SIGTERM while streamed requests are open: they are answered in full, then every rank exits 0
        late = [
            json.dumps({"prompt": p, "max_tokens": 12, "temperature": 0, "stream": True}).encode() for p in prompts[:3]
        ]
        opened = [
            urllib.request.urlopen(
                urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=b), timeout=60
            )
            for b in late
        ]  # returns once the headers came: accepted
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        want_late, _ = engine.generate([list(p.encode()) for p in prompts[:3]], [SamplingParams(max_new_tokens=12)] * 3)
        for response, expected in zip(opened, want_late):
            assert _text_of("text/event-stream", response.read().decode())[:2] == (
                expected.text,
                expected.finish_reason,
            )
        assert proc.wait(timeout=30) == 0
        idle.close()
        served.reader.join(timeout=10)
        output = "".join(lines.get_nowait() for _ in range(lines.qsize()))
        assert f"{N_REQUESTS + len(cached) + len(chats) + 1 + len(late)} requests answered" in output
