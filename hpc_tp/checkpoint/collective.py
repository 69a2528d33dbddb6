"""Every rank learns whether a step of a checkpoint operation failed anywhere, so all ranks raise
together instead of the healthy ones waiting forever in the next collective."""

from __future__ import annotations

from ..errors import ConfigError


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous checkpoint is untouched."""


class PeerFailure(CheckpointError):
    """This rank stopped because another failed (``first_failed``): left out of ``run_everywhere``'s
    report, which names the failing rank and its own error instead."""


def first_failed(comm, failed: bool) -> int | None:
    """The lowest rank of ``comm`` that says it ``failed``, or None where none does: one all-reduce of
    a scalar, the agreement a group makes before a collective one of its ranks may never join."""
    lowest = int(comm.all_reduce_scalar(comm.rank if failed else comm.size, "min"))
    return lowest if lowest < comm.size else None


def agreed(comm, work, failed: bool = False, stopped: str = "this rank stopped there"):
    """``work()``'s result, once every rank of ``comm`` has run its own and agreed that none failed
    (``first_failed``). Where one did, every rank raises there: a rank whose ``work`` raised, its
    own error; the others ``PeerFailure`` (``stopped``: what this rank gives up). ``failed``: this
    rank failed before and does not run ``work``, only agrees. Every rank makes the one all-reduce
    whatever its ``work`` did, and all get the same answer: all go on, or all raise."""
    result, error = None, None
    if not failed:
        try:
            result = work()
        except Exception as e:  # told to the others first: they are about to wait in the all-reduce
            error = e
    lowest = first_failed(comm, failed or error is not None)
    if error is not None:
        raise error
    if lowest is not None:
        group = getattr(comm, "group", f"its group of {comm.size}")
        raise PeerFailure(f"rank {lowest} of {group} failed: {stopped}")
    return result


def run_everywhere(comm, work):
    """Run ``work()`` on this rank; if it raised on any rank, raise on every rank.

    The error is a ConfigError when every failing rank's was (a bad file or tensor set), else a
    CheckpointError. Identical messages from several ranks are reported once, and a rank's
    ``PeerFailure`` only where no rank reports an error of its own.
    """
    try:
        result, failure = work(), None
    except ConfigError as e:
        result, failure = None, (True, str(e), False)
    except Exception as e:  # any failure must reach the other ranks, whatever its kind
        result, failure = None, (False, f"{type(e).__name__}: {e}", isinstance(e, PeerFailure))
    failures = [(rank, f) for rank, f in enumerate(comm.allgather_object(failure)) if f is not None]
    if failures:
        failures = [(rank, f) for rank, f in failures if not f[2]] or failures
        first_rank = {}
        for rank, (_, message, _) in failures:
            first_rank.setdefault(message, rank)
        text = "; ".join(f"rank {rank}: {message}" for message, rank in first_rank.items())
        raise (ConfigError if all(is_config for _, (is_config, _, _) in failures) else CheckpointError)(text)
    return result
