"""Metrics log, progress output and the ``hpc-tp plot`` command."""

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from hpc_tp.cli import build_parser
from hpc_tp.errors import ConfigError
from hpc_tp.train import plot
from hpc_tp.train.metrics import MetricsLogger, peak_memory_bytes, read_metrics
from hpc_tp.train.progress import Progress, format_duration


@pytest.mark.mpi(min_size=1)
def test_log_written_by_rank_0_with_every_ranks_memory(comm_world, tmp_path):
    path = comm_world.bcast_object(str(tmp_path / "run" / "metrics.jsonl"))  # one file for all ranks
    with MetricsLogger(path, comm_world) as logger:
        for step in (1, 2):
            logger.log(
                {
                    "step": np.int64(step),
                    "loss": np.float32(2.5),
                    "grad_norm": np.float64(0.5),
                    "lr": 1e-3,
                    "shape": np.array([2, 3]),
                }
            )
    comm_world.barrier()
    if comm_world.rank == 0:
        records = read_metrics(path)
        assert [r["step"] for r in records] == [1, 2]  # one line per call: no other rank appended
        for r in records:
            assert r["loss"] == 2.5 and r["shape"] == [2, 3]
            assert len(r["peak_mem_bytes"]) == comm_world.size
            assert all(isinstance(m, int) and m > 0 for m in r["peak_mem_bytes"])
            assert r["time"] > 0
    comm_world.barrier()  # rank 0 reads before tmp dirs go


def test_logger_without_path_still_returns_record(comm_self):
    record = MetricsLogger(None, comm_self).log({"step": 3})
    (peak,) = record["peak_mem_bytes"]
    assert record["step"] == 3 and 0 < peak <= peak_memory_bytes()  # a peak only grows (run alone, it did here)


def test_peak_memory_is_plausible():
    assert 10 << 20 < peak_memory_bytes() < 1 << 40  # a Python with numpy holds more than 10 MiB


def test_progress_plain_lines_without_carriage_returns():
    out = io.StringIO()  # not a TTY, like a SLURM output file
    progress = Progress(200, enabled=True, every=40, stream=out)
    for step in range(1, 201):
        progress.update(step, 1.23456, 12345.4)
    progress.write("checkpoint saved")
    progress.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0].startswith("step 40/200 loss 1.2346 tok/s 12345 eta ")
    assert [line.split()[1] for line in lines[:-1]] == ["40/200", "80/200", "120/200", "160/200", "200/200"]
    assert lines[-2].endswith("eta 0s") and lines[-1] == "checkpoint saved"


def test_progress_prints_after_interval_between_multiples():
    out = io.StringIO()
    progress = Progress(1000, enabled=True, every=500, interval_s=0.0, stream=out)
    progress.update(7, 1.0, 1.0)
    assert out.getvalue().startswith("step 7/1000 ")


def test_progress_disabled_prints_no_step_lines_but_still_the_messages():
    """--no-progress: no step lines, but "stopped by ...", "rolled back to ..." still reach the log."""
    out = io.StringIO()
    progress = Progress(10, enabled=False, every=1, stream=out)
    progress.update(1, 1.0, 1.0)
    progress.write("rolled back")
    assert out.getvalue() == "rolled back\n"


def test_progress_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    with Progress(10, enabled=True, stream=out) as progress:
        for step in range(1, 11):
            progress.update(step, 0.5, 100.0)
        progress.write("note")
    assert "10/10" in out.getvalue() and "loss 0.5000" in out.getvalue() and "note" in out.getvalue()


def test_format_duration():
    assert [format_duration(s) for s in (4.4, 80, 3725)] == ["4s", "1m20s", "1h02m"]


def _write_log(path, losses):
    path.write_text("".join(json.dumps({"step": i + 1, "loss": v, "lr": 0.1}) + "\n" for i, v in enumerate(losses)))
    return str(path)


def _plot(*argv):
    return plot.run(build_parser().parse_args(["plot", *argv]))


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    a = _write_log(tmp_path / "a.jsonl", [3.0, 2.0, 1.5])
    b = _write_log(tmp_path / "b.jsonl", [3.1, 2.5])
    out = tmp_path / "figs" / "loss.png"
    assert _plot(a, b, "-o", str(out)) == 0
    assert out.read_bytes().startswith(b"\x89PNG")
    assert _plot(a, "--metric", "lr", "-o", str(tmp_path / "lr.png")) == 0


@pytest.mark.parametrize(
    "content, where",
    [
        (None, "cannot read"),
        ("", "empty"),
        ("\n\n", "empty"),
        ('{"step": 1, "loss": 2}\n{"step": 2, "lo\n', ":2: not a JSON line"),
        ("[1, 2]\n", ":1: expected a JSON object"),
    ],
)
def test_plot_bad_log_names_file_and_line(tmp_path, content, where):
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=where) as caught:
        _plot(str(path), "-o", str(tmp_path / "x.png"))
    assert str(path) in str(caught.value)


def test_plot_missing_metric(tmp_path):
    with pytest.raises(ConfigError, match="'tokens_per_s'"):
        _plot(_write_log(tmp_path / "a.jsonl", [1.0]), "--metric", "tokens_per_s")


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ConfigError, match=r"pip install 'hpc_tp\[plot\]'"):
        _plot(_write_log(tmp_path / "a.jsonl", [1.0]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_retained_heap_gives_start_up_buffers_back():
    """With the heap retained, a freed 300 MB buffer stays resident (pinned below a later small
    allocation) until ``release_free_memory`` hands it back."""
    code = """
import numpy
from hpc_tp import backend
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) >> 10
assert backend.retain_freed_memory()
big = numpy.ones(300 << 18, dtype='float32')
pin = numpy.ones(1000)
del big
kept = rss()
assert backend.release_free_memory()
print(kept, rss())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    kept, released = map(int, done.stdout.split())
    assert kept - released > 200, (kept, released)
