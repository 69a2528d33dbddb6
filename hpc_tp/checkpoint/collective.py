"""Every rank learns whether a step of a checkpoint operation failed anywhere, so all ranks raise
together instead of the healthy ones waiting forever in the next collective."""
from __future__ import annotations

from ..errors import ConfigError


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous checkpoint is untouched."""


def run_everywhere(comm, work):
    """Run ``work()`` on this rank; if it raised on any rank, raise on every rank.

    The error is a ConfigError when every failing rank's was (a bad file or tensor set), else a
    CheckpointError. Identical messages from several ranks are reported once.
    """
    try:
        result, failure = work(), None
    except ConfigError as e:
        result, failure = None, (True, str(e))
    except Exception as e:  # any failure must reach the other ranks, whatever its kind
        result, failure = None, (False, f"{type(e).__name__}: {e}")
    failures = [(rank, f) for rank, f in enumerate(comm.allgather_object(failure)) if f is not None]
    if failures:
        first_rank = {}
        for rank, (_, message) in failures:
            first_rank.setdefault(message, rank)
        text = "; ".join(f"rank {rank}: {message}" for message, rank in first_rank.items())
        raise (ConfigError if all(is_config for _, (is_config, _) in failures) else CheckpointError)(text)
    return result
