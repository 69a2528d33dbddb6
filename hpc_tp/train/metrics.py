"""Metrics of a run as JSON lines (``--log``): one object per logged step, written by rank 0.

Each line holds what the trainer measured (step, loss, lr, grad_norm, tokens_per_s, step_s,
compute_s, comm_s, ...) plus ``peak_mem_bytes``, a list with every rank's peak memory in world
rank order, and ``time``, the wall clock (Unix seconds). ``read_metrics`` reads a log back.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

from ..errors import ConfigError
from ..jsonl import read_json_lines


def peak_memory_bytes() -> int:
    """This process's peak resident memory, in bytes.

    Host memory only: a GPU backend adds its device's peak allocation here.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def _plain(value):
    """numpy scalars and arrays as Python numbers and lists, so ``json`` can write them."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"metric value {value!r} of type {type(value).__name__} is not JSON-serialisable")


class MetricsLogger:
    """``log`` is collective: every rank of ``comm`` calls it (it gathers their memory peaks).

    Only rank 0 opens ``path`` (append mode, parents created); ``path=None`` logs nothing to disk.
    The file is line-buffered, so ``tail -f`` and a job killed mid-run see every finished line.
    """

    def __init__(self, path, comm):
        self.comm = comm
        self._file = None
        if path is not None and comm.rank == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1, encoding="utf-8")

    def log(self, record: dict) -> dict:
        """Write rank 0's ``record`` with the memory peaks and the time added; returns the full record."""
        full = dict(record, peak_mem_bytes=self.comm.allgather_object(peak_memory_bytes()), time=time.time())
        if self._file is not None:
            self._file.write(json.dumps(full, default=_plain) + "\n")
        return full

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(path) -> list[dict]:
    """The records of a log; ConfigError naming the file (and line) if it is missing, empty or not JSON lines."""
    records = [record for _, record in read_json_lines(path, "metrics log")]
    if not records:
        raise ConfigError(f"metrics log {path}: the metrics log is empty")
    return records
