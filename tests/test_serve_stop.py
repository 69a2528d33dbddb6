"""Ctrl-C on `mpiexec hpc-tp serve`: Open MPI's mpiexec does not pass SIGINT on but kills the ranks
(SIGCONT, SIGTERM 0.25 s later, SIGKILL 0.25 s after that), so the server stops in a hurry: every open
stream ends with a final chunk and [DONE] (finished ones whole, the others cut where they were),
and new connections are refused (``serve.shutdown``)."""

import json
import os
import signal
import socket
import time
import urllib.request

import pytest
from test_generate import _model, write_checkpoint
from test_serve import serving

from hpc_tp.comm.mpi import self_comm
from hpc_tp.grid import ProcessGrid
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.serve.shutdown import KILL_SEQUENCE_S, Shutdown
from hpc_tp.tokenizer import ByteTokenizer

N_STREAMS = 96  # enough waiting streams that Open MPI's 0.25 s before SIGTERM cannot serve them all


def test_ctrl_c_on_mpiexec_ends_every_open_stream_and_refuses_new_connections(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "llama-gqa", ProcessGrid(tp=1, world=self_comm()), ByteTokenizer())
    with serving("--ckpt", str(ckpt), "--dtype", "float64", "--max-batch", "1", "--max-model-len", "31") as served:
        port, proc = served.port, served.proc
        prompts = [f"stream {i}: " for i in range(N_STREAMS)]
        bodies = [
            json.dumps({"prompt": p, "max_tokens": 20, "temperature": 0, "stream": True}).encode() for p in prompts
        ]
        # urlopen returns once the headers came: each stream open, the first decoding, the others waiting
        opened = [
            urllib.request.urlopen(
                urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=b), timeout=60
            )
            for b in bodies
        ]
        answers = [opened[0].read().decode()]  # the first finished: it had the one row
        proc.send_signal(signal.SIGINT)
        answers += [response.read().decode() for response in opened[1:]]
        proc.wait(timeout=30)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10)
    engine = Engine(_model("llama-gqa", self_comm()), ByteTokenizer())
    want, _ = engine.generate([list(p.encode()) for p in prompts], [SamplingParams(max_new_tokens=20)] * N_STREAMS)
    finishes = []
    for body, expected in zip(answers, want):
        events = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", body[-200:]
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        text, finish = "".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]
        finishes.append(finish)
        if finish == "abort":
            assert expected.text.startswith(text)
        else:
            assert (text, finish) == (expected.text, expected.finish_reason)
    assert finishes[0] != "abort" and "abort" in finishes, finishes


@pytest.mark.parametrize(
    "sequence, received, hurried",
    [
        ([(signal.SIGTERM, 0.0)], "SIGTERM", False),  # kill, scancel --signal=TERM
        ([(signal.SIGCONT, 0.0), (signal.SIGTERM, 0.25)], "SIGTERM", True),  # Open MPI's mpiexec on Ctrl-C
        ([(signal.SIGCONT, 0.0), (signal.SIGTERM, KILL_SEQUENCE_S + 1)], "SIGTERM", False),  # fg long before
        ([(signal.SIGINT, 0.0), (signal.SIGTERM, 0.1)], "SIGINT", True),  # Ctrl-C passed on (srun)
    ],
)
def test_which_signals_ask_for_a_hurried_stop(sequence, received, hurried):
    calls = []
    stop = Shutdown(on_hurry=lambda: calls.append(True))
    try:
        for number, at in sequence:
            stop.note(number, at)
    finally:
        stop.restore()
    assert (stop.received, stop.hurried, calls) == (received, hurried, [True] * hurried)


def test_a_signal_reaches_the_watcher_while_the_main_thread_is_in_a_long_computation():
    """A Python-level handler runs only once the main thread is back in Python; the watcher thread acts
    while it is inside numpy (which lets other threads run), as during a forward pass."""
    import threading

    import numpy as np

    calls = []
    stop = Shutdown(on_hurry=lambda: calls.append(time.monotonic()))
    matrix = np.random.default_rng(0).standard_normal((2000, 2000))
    try:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        entered = time.monotonic()
        matrix @ matrix  # about 1 s on one core; the signal comes 0.05 s in
        done = time.monotonic()
    finally:
        stop.restore()
    assert stop.received == "SIGINT" and len(calls) == 1
    assert calls[0] - entered < (done - entered) / 2, (calls[0] - entered, done - entered)  # not once it returned
