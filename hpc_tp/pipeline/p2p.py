"""Point-to-point links between neighbouring pipeline stages.

Stage s receives activations from s-1 and sends them to s+1; gradients flow back the other
way. Every message of a step has the shape of one micro-batch's hidden states
``[micro_batch, seq_len, hidden]`` (with sequence parallelism this rank's shard
``[micro_batch, seq_len / tp, hidden]``, ``GPTModel.hidden_shape``) and the model's dtype, both
known on every stage from the config and the batch, so no shape message ever travels: receive
buffers are allocated up front.

Receives are posted early (the next activation while the current one is computed, a
gradient as soon as the activation it answers has gone out) and sends are waited late (an
activation send when its gradient comes back, a gradient send at the next one), so transfers
overlap compute. Tags carry the micro-batch index (modulo a bound every MPI allows); messages
between two ranks with one tag are matched in the order they were posted, so wrapping is safe.
"""
from __future__ import annotations

import time

from .. import backend

ACTIVATION, GRADIENT = 0, 1
_TAG_MICRO_BATCHES = 16384  # 2 * 16384 <= 32767, the smallest tag bound the MPI standard allows


def _tag(kind: int, micro_batch: int) -> int:
    return 2 * (micro_batch % _TAG_MICRO_BATCHES) + kind


class StageLink:
    def __init__(self, pp_comm, shape, dtype):
        self.comm, self.shape, self.dtype = pp_comm, tuple(shape), dtype
        self.stage, self.stages = pp_comm.rank, pp_comm.size
        self._receives = {}  # (kind, micro-batch) -> request
        self._sends = {}     # (kind, micro-batch) -> (request, array kept alive until the send is done)
        self.wait_seconds = 0.0  # time blocked on a neighbour: the pipeline bubble, seen from this stage

    @property
    def has_previous(self) -> bool:
        return self.stage > 0

    @property
    def has_next(self) -> bool:
        return self.stage < self.stages - 1

    def post_activation_receive(self, micro_batch: int):
        self._post(ACTIVATION, micro_batch, self.stage - 1)

    def post_gradient_receive(self, micro_batch: int):
        self._post(GRADIENT, micro_batch, self.stage + 1)

    def activation(self, micro_batch: int):
        """The input of ``micro_batch`` from the previous stage (its receive must be posted)."""
        return self._wait_receive(ACTIVATION, micro_batch)

    def gradient(self, micro_batch: int):
        """The gradient of this stage's output for ``micro_batch`` from the next stage."""
        return self._wait_receive(GRADIENT, micro_batch)

    def send_activation(self, x, micro_batch: int):
        self._send(ACTIVATION, micro_batch, x, self.stage + 1)

    def send_gradient(self, dx, micro_batch: int):
        self._send(GRADIENT, micro_batch, dx, self.stage - 1)

    def wait_send(self, kind: int, micro_batch: int):
        """Wait for one send, if it was made and is still pending, and release its array."""
        pending = self._sends.pop((kind, micro_batch), None)
        if pending is not None:
            self._timed_wait(pending[0])

    def finish(self):
        """Wait for every send still in flight (receives are all consumed by a complete schedule)."""
        if self._receives:
            raise RuntimeError(f"pipeline step ended with receives still posted: {sorted(self._receives)}")
        for key in list(self._sends):
            self.wait_send(*key)

    def _post(self, kind, micro_batch, source):
        buf = backend.xp.empty(self.shape, dtype=self.dtype)
        self._receives[(kind, micro_batch)] = self.comm.irecv(buf, source, _tag(kind, micro_batch))

    def _wait_receive(self, kind, micro_batch):
        return self._timed_wait(self._receives.pop((kind, micro_batch)))

    def _send(self, kind, micro_batch, x, dest):
        if tuple(x.shape) != self.shape or x.dtype != self.dtype:
            raise ValueError(f"pipeline message {tuple(x.shape)} {x.dtype} differs from the agreed "
                             f"{self.shape} {self.dtype}")
        self._sends[(kind, micro_batch)] = (self.comm.isend(x, dest, _tag(kind, micro_batch)), x)

    def _timed_wait(self, request):
        t0 = time.perf_counter()
        try:
            return request.wait()
        finally:
            self.wait_seconds += time.perf_counter() - t0
