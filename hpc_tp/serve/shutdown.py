"""How ``hpc-tp serve`` stops on a signal: drained, or in a hurry.

    drain   SIGTERM alone (``kill`` to the ranks, ``scancel --signal=TERM``): new connections are
            refused, every request already accepted is finished in full, then every rank stops.
    hurry   SIGINT (Ctrl-C; ``srun`` passes it on to every task), or a SIGTERM shortly after a
            SIGCONT: new connections are refused, each open stream ends at once with a final chunk
            (finish reason "abort") and ``[DONE]``, a waiting non-streamed request is answered 503,
            and every rank stops.

Why the second kind: Open MPI's ``mpiexec`` does not pass a Ctrl-C on. It kills the job, sending
each rank SIGCONT, SIGTERM 0.25 s later and SIGKILL 0.25 s after that (measured with Open MPI 5.0;
PRRTE's ``odls`` kill sequence), so a drain would be cut off mid-stream, clients left without an
end. That SIGTERM follows a SIGCONT, which tells it from a drain's.

Signals reach a watcher thread through ``signal.set_wakeup_fd``: the interpreter's C-level handler
writes the signal's number to a socket at once, even while the main thread is inside a long forward
pass (numpy releases the interpreter lock), where a Python-level handler would wait for it to end.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

KILL_SEQUENCE_S = 2.0  # a SIGTERM this soon after a SIGCONT: a kill sequence (Open MPI waits 0.25 s)
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGCONT)


class Shutdown:
    """Rank-local record of stop signals. ``received``: the first stop signal's name (None until
    one); ``hurried``: whether it asks for a hurried stop, when ``on_hurry`` (rank 0: the server's
    ``hurry``) was called, from the watcher thread. Built on the main thread."""

    def __init__(self, on_hurry=None):
        self.received: str | None = None
        self.hurried = False
        self.on_hurry = on_hurry
        self._continued_at: float | None = None
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._sockets = reader, writer
        self._previous = {number: signal.signal(number, _ignore) for number in _SIGNALS}
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="signals", daemon=True).start()

    def note(self, number: int, now: float):
        """Signal ``number`` arrived at ``now`` (``time.monotonic``)."""
        if number == signal.SIGCONT:
            self._continued_at = now
            return
        self.received = self.received or signal.Signals(number).name
        killing = self._continued_at is not None and now - self._continued_at < KILL_SEQUENCE_S
        if (number == signal.SIGINT or killing) and not self.hurried:
            self.hurried = True
            if self.on_hurry is not None:
                self.on_hurry()

    def restore(self):
        """The handlers and wakeup fd of before (main thread); the watcher ends."""
        signal.set_wakeup_fd(self._previous_fd)
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        for sock in self._sockets:
            sock.close()

    def _watch(self):
        while True:
            try:
                data = self._sockets[0].recv(64)
            except OSError:  # closed by restore
                return
            if not data:
                return
            for number in data:
                self.note(number, time.monotonic())


def _ignore(number, frame):
    """The Python-level handler: the watcher acts on the signal (a handler must be set for the
    wakeup fd to be written, and it keeps SIGINT from raising KeyboardInterrupt)."""
