"""Point-to-point links between neighbouring virtual pipeline stages.

A rank holds one model chunk per virtual stage (one chunk, its stage, unless the schedule is
interleaved): chunk c of rank r is virtual stage c * pp + r. Virtual stage g receives activations
from g - 1 and sends them to g + 1; gradients flow back the other way. So a rank always hears
from rank r - 1 and speaks to rank r + 1 around the ring: the last rank's chunk c feeds the first
rank's chunk c + 1.

Every message of a step has the shape of one micro-batch's hidden states
``[micro_batch, seq_len, hidden]`` (with sequence parallelism this rank's shard
``[micro_batch, seq_len / tp, hidden]``, ``GPTModel.hidden_shape``) and the model's dtype, both
known on every stage from the config and the batch, so no shape message ever travels: receive
buffers are allocated up front.

Receives are posted early (a chunk's next activation while the current one is computed, a
gradient as soon as the activation it answers has gone out) and sends are waited late (an
activation send when its gradient comes back, a gradient send at the chunk's next one), so
transfers overlap compute. Tags carry the kind, the chunk at the downstream end of the link (two
ranks exchange messages of several chunks, in an order that differs between chunks) and the
micro-batch index modulo a bound every MPI allows; within one chunk's stream messages between
two ranks with one tag are matched in the order they were posted, so wrapping is safe.
"""

from __future__ import annotations

import time

from .. import backend

ACTIVATION, GRADIENT = 0, 1
_TAG_SLOTS = 16384  # 2 * 16384 <= 32767, the smallest tag bound the MPI standard allows


class StageLink:
    def __init__(self, pp_comm, shape, dtype, chunks: int = 1):
        self.comm, self.shape, self.dtype, self.chunks = pp_comm, tuple(shape), dtype, chunks
        self.stage, self.stages = pp_comm.rank, pp_comm.size
        self._receives = {}  # (kind, chunk, micro-batch) -> request
        self._sends = {}  # (kind, chunk, micro-batch) -> (request, array kept alive until the send is done)
        self.wait_seconds = 0.0  # time blocked on a neighbour: the pipeline bubble, seen from this stage

    def _virtual_stage(self, chunk: int) -> int:
        return chunk * self.stages + self.stage

    def has_previous(self, chunk: int = 0) -> bool:
        return self._virtual_stage(chunk) > 0

    def has_next(self, chunk: int = 0) -> bool:
        return self._virtual_stage(chunk) < self.stages * self.chunks - 1

    def _next_chunk(self, chunk: int) -> int:
        """The chunk of the next virtual stage on the next rank: one up from the last rank."""
        return chunk + (self.stage == self.stages - 1)

    def post_activation_receive(self, chunk: int, micro_batch: int):
        self._post(ACTIVATION, chunk, micro_batch, self.stage - 1, chunk)

    def post_gradient_receive(self, chunk: int, micro_batch: int):
        self._post(GRADIENT, chunk, micro_batch, self.stage + 1, self._next_chunk(chunk))

    def activation(self, chunk: int, micro_batch: int):
        """The input of ``chunk`` for ``micro_batch`` from the previous virtual stage (its receive must be posted)."""
        return self._wait_receive(ACTIVATION, chunk, micro_batch)

    def gradient(self, chunk: int, micro_batch: int):
        """The gradient of ``chunk``'s output for ``micro_batch`` from the next virtual stage."""
        return self._wait_receive(GRADIENT, chunk, micro_batch)

    def send_activation(self, x, chunk: int, micro_batch: int):
        self._send(ACTIVATION, chunk, micro_batch, x, self.stage + 1, self._next_chunk(chunk))

    def send_gradient(self, dx, chunk: int, micro_batch: int):
        self._send(GRADIENT, chunk, micro_batch, dx, self.stage - 1, chunk)

    def wait_send(self, kind: int, chunk: int, micro_batch: int):
        """Wait for one send, if it was made and is still pending, and release its array."""
        pending = self._sends.pop((kind, chunk, micro_batch), None)
        if pending is not None:
            self._timed_wait(pending[0])

    def finish(self):
        """Wait for every send still in flight (receives are all consumed by a complete schedule)."""
        if self._receives:
            raise RuntimeError(f"pipeline step ended with receives still posted: {sorted(self._receives)}")
        for key in list(self._sends):
            self.wait_send(*key)

    def _tag(self, kind, downstream_chunk, micro_batch):
        # Each chunk its own range of tags, so wrapping never mixes two chunks' streams.
        per_chunk = _TAG_SLOTS // self.chunks
        return 2 * (downstream_chunk * per_chunk + micro_batch % per_chunk) + kind

    def _post(self, kind, chunk, micro_batch, source, downstream_chunk):
        buf = backend.xp.empty(self.shape, dtype=self.dtype)
        self._receives[(kind, chunk, micro_batch)] = self.comm.irecv(
            buf, source % self.stages, self._tag(kind, downstream_chunk, micro_batch)
        )

    def _wait_receive(self, kind, chunk, micro_batch):
        return self._timed_wait(self._receives.pop((kind, chunk, micro_batch)))

    def _send(self, kind, chunk, micro_batch, x, dest, downstream_chunk):
        if tuple(x.shape) != self.shape or x.dtype != self.dtype:
            raise ValueError(
                f"pipeline message {tuple(x.shape)} {x.dtype} differs from the agreed {self.shape} {self.dtype}"
            )
        request = self.comm.isend(x, dest % self.stages, self._tag(kind, downstream_chunk, micro_batch))
        self._sends[(kind, chunk, micro_batch)] = (request, x)

    def _timed_wait(self, request):
        t0 = time.perf_counter()
        try:
            return request.wait()
        finally:
            self.wait_seconds += time.perf_counter() - t0
