"""Communicators: one interface (``base.Communicator``), an MPI implementation, NCCL on GPUs
(``nccl``: cupy loads only when a device group is built)."""

from .. import backend
from .base import Communicator, Request
from .nccl import use_device_communicators

__all__ = ["Communicator", "Request", "select_device"]


def select_device(name: str, world: Communicator | None = None):
    """``backend.use(name)`` with this rank's node-local rank picking its GPU: the rank in ``world``'s
    shared-memory split (collective over ``world``), or the launcher's variable without a world."""
    local_rank = world.split_node().rank if world is not None and name == "cuda" else None
    return backend.use(name, local_rank)


def use_device(name: str, grid) -> dict[str, str]:
    """The whole set-up of ``--device``: the backend with this rank's GPU (``grid``'s node rank),
    and on cuda each of ``grid``'s groups its transport (``nccl.use_device_communicators``).
    Returns {group: transport} ({} on the CPU)."""
    backend.use(name, grid.local_rank if name == "cuda" else None)
    if name != "cuda":
        return {}
    return use_device_communicators(grid)
