"""Communicators: one interface (``base.Communicator``), an MPI implementation, NCCL on GPUs."""
from .base import Communicator, Request

__all__ = ["Communicator", "Request"]
