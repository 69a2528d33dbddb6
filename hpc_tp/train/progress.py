"""Progress of a long job on rank 0: a tqdm bar on a terminal, plain lines in a log file.

SLURM writes stdout to a file, where a bar's carriage returns turn into one endless line; there
``Progress`` prints a whole line every ``every`` steps or ``interval_s`` seconds, whichever comes
first, e.g. ``step 40/200 loss 1.2345 tok/s 12345 eta 1m20s``.

A rank's stdout is a terminal only when no launcher stands in between: ``mpiexec`` (and ``srun
--pty``) hand every rank a pseudo-terminal even when their own output goes to a file, so under a
launcher the bar is off unless ``HPC_TP_PROGRESS=bar`` asks for it (``lines`` forces lines).
"""

from __future__ import annotations

import os
import sys
import time

from ..launch import detect_launcher


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class Progress:
    """``update(step, ...)`` takes the number of steps done so far; ``start_step`` is where a resumed
    run began, so the rate and the ETA count only this run's steps. Disabled (other ranks, or
    --no-progress), it prints no step lines; ``write`` still prints."""

    def __init__(
        self,
        total_steps: int,
        enabled: bool = True,
        *,
        start_step: int = 0,
        every: int | None = None,
        interval_s: float = 10.0,
        stream=None,
    ):
        self.total_steps, self.enabled, self.start_step = total_steps, enabled, start_step
        self.every = every or max(1, total_steps // 20)
        self.interval_s = interval_s
        self.stream = sys.stdout if stream is None else stream
        self._started = self._printed = time.monotonic()
        self._bar = None
        if enabled and _wants_bar(self.stream):
            from tqdm import tqdm  # only for a terminal's bar

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", file=self.stream, dynamic_ncols=True)

    def update(self, step: int, loss: float, tokens_per_s: float):
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f} tok/s {tokens_per_s:,.0f}", refresh=False)
            self._bar.update(step - self._bar.n)
            return
        now = time.monotonic()
        if step % self.every == 0 or step >= self.total_steps or now - self._printed >= self.interval_s:
            self._printed = now
            self.write(
                f"step {step}/{self.total_steps} loss {loss:.4f} tok/s {tokens_per_s:.0f} eta {self._eta(step, now)}"
            )

    def _eta(self, step: int, now: float) -> str:
        done = step - self.start_step
        if done <= 0:
            return "?"
        return format_duration((now - self._started) / done * max(self.total_steps - step, 0))

    def write(self, message: str):
        """A message on its own line, also where the step lines are off (its caller decides who
        speaks); on a terminal the bar is redrawn below it."""
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _wants_bar(stream) -> bool:
    choice = os.environ.get("HPC_TP_PROGRESS", "")
    if choice in ("bar", "lines"):
        return choice == "bar"
    return stream.isatty() and detect_launcher() == "none"
