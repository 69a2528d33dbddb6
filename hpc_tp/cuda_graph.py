"""Device work captured once as a CUDA graph and replayed: one launch instead of hundreds.

A step of this engine on a GPU is hundreds of small kernels and cuBLAS calls, each tens of
microseconds of Python on the host; at small batches the card waits for the host (a W1 decode
step: 3.6 ms launched from Python, 0.4 ms replayed). ``Replayed(work)`` runs ``work()`` eagerly at
its first call, captures the same call into a CUDA graph right after, and at every later call
replays the graph. What ``work`` must be for that (``serve.decoding.FixedStep``, each bucket of
``serve.decoding.PagedSteps`` and ``bench step --cuda-graph`` are built so):

- the same shapes and addresses at every call: it reads and writes arrays that outlive it (inputs
  copied into them beforehand), and Python values it bakes into launches (shapes, offsets,
  scalars) do not change between calls;
- no host work on device data: no sync, no value read back (a cupy boolean mask's hit count is
  one), no collective the graph cannot hold: NCCL's are queued on the stream and captured with the
  kernels (``comm.nccl``), MPI's run on the host (``capturable`` says which groups a work may use);
- its temporaries come from a memory pool of its own, which nothing else uses while the graph
  lives, so no other array can take an address the graph writes between replays (PyTorch's
  private graph pool); the eager first call fills that pool on the capture stream, so the kernels
  are compiled, cuBLAS has its workspace, and the capture reuses the pool's blocks.

A replay returns the captured call's outputs, the same arrays every time, overwritten in place.
A capture that fails warns and leaves ``work`` running eagerly. ``HPC_TP_CUDA_GRAPHS=0`` turns
graphs off where callers ask ``enabled()``.
"""

from __future__ import annotations

import contextlib
import os
import warnings

from . import backend


def enabled() -> bool:
    return os.environ.get("HPC_TP_CUDA_GRAPHS", "1") != "0"


def capturable(*groups) -> bool:
    """Whether work whose collectives go over ``groups`` can be captured here: on a GPU, where each
    group is one rank (its collectives call nothing) or queues its device collectives on the stream
    with no host work (``stream_ordered``: NCCL). MPI's collectives run on the host, once, at the
    capture: a group on MPI or host staging keeps the work eager."""
    return backend.device == "cuda" and all(g.size == 1 or getattr(g, "stream_ordered", False) for g in groups)


class Replayed:
    """``work()`` (cupy arrays only) eager once, then replayed from a CUDA graph; ``what`` names it
    in the warning of a failed capture."""

    def __init__(self, work, what: str):
        self.work, self.what = work, what
        self.failed = False
        self._graph = self._outputs = self._pool = None

    def __call__(self):
        if self._graph is not None:
            self._graph.launch()
            return self._outputs
        if self.failed:
            return self.work()
        return self._run_and_capture()

    def _run_and_capture(self):
        import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

        self._pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream()
        with cupy.cuda.using_allocator(self._pool.malloc), stream:
            outputs = self.work()
            stream.begin_capture()
            try:
                self._outputs = self.work()  # recorded, not run: what it moves on stays for the next call
                self._graph = stream.end_capture()
            except Exception as error:  # nothing recorded ran
                with contextlib.suppress(Exception):
                    stream.end_capture()
                self.failed, self._outputs = True, None
                warnings.warn(
                    f"{self.what} runs without a CUDA graph: its capture failed ({type(error).__name__}: {error})",
                    stacklevel=2,
                )
        return outputs

    def close(self):
        """Give the graph's memory back (its pool is this object's alone)."""
        self._graph = self._outputs = None
        if self._pool is not None:
            self._pool.free_all_blocks()
