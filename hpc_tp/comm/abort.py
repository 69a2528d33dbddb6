"""A rank's last words, then ``MPI_Abort``: how the watchdog, a user error the other ranks do not
share and an unhandled exception end a job.

Under ``mpiexec`` a rank's stderr reaches the job log through the launcher, which reads it some time
after the rank wrote it; ``MPI_Abort`` reaches the launcher by another channel, and on a loaded
machine its banner ("MPI_ABORT was invoked on rank ...") is often printed first. Open MPI's banners
end in a NUL byte, which then sticks to the front of the next line: a rank's message must start on
a line of its own to stay greppable. So ``last_words`` writes its text as one block, one ``write``
call (lines of several ranks never interleave inside it), after a newline.
"""

from __future__ import annotations

import os
import sys
import threading

from mpi4py import MPI

ABORT_FALLBACK_S = 10.0  # if MPI_Abort itself hangs, the process exits and the launcher ends the job


def last_words(text: str):
    """``text`` on the process's stderr (file descriptor 2, what the launcher reads, whatever
    ``sys.stderr`` was replaced by), each line prefixed ``hpc-tp: ``, as one block on lines of its own."""
    sys.stderr.flush()  # whatever Python buffered before goes first
    data = ("\n" + "".join(f"hpc-tp: {line}\n" for line in text.splitlines())).encode(errors="replace")
    while data:
        data = data[os.write(2, data) :]


def abort_job(code: int, comm=None):
    """``MPI_Abort`` on ``comm`` (default: the world), exiting this process anyway if it hangs."""
    timer = threading.Timer(ABORT_FALLBACK_S, os._exit, (code,))
    timer.daemon = True
    timer.start()
    (MPI.COMM_WORLD if comm is None else comm).Abort(code)
