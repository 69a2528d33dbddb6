"""Stop cleanly when the batch system asks: USR1 (``#SBATCH --signal=B:USR1@120``, forwarded by
jobs/train.sbatch) or TERM (``scancel``, preemption, the time limit).

A handler only records the signal; the trainer asks ``agreed(comm)`` once per step, an
all-reduce, so every rank stops after the same step even when the signal reached only some
of them, then checkpoints and exits.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = ("SIGUSR1", "SIGTERM")


class StopRequest:
    def __init__(self, signals=STOP_SIGNALS):
        self.received: str | None = None
        self._previous = {}
        for name in signals:
            number = getattr(signal, name, None)
            if number is not None:
                self._previous[number] = signal.signal(number, self._record)

    def _record(self, number, frame):
        self.received = signal.Signals(number).name

    def agreed(self, comm) -> bool:
        """True on every rank when any rank of ``comm`` received a stop signal (collective)."""
        return comm.all_reduce_scalar(1.0 if self.received else 0.0, op="max") > 0

    def restore(self):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}
