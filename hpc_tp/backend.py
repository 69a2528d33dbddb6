"""Array module selection: numpy on the CPU, cupy on a GPU (one device per node-local rank).

Layers ask ``xp_of(array)`` for the module that owns their inputs, so the same code runs on
both; parameters are allocated with ``backend.xp`` chosen once at start-up by ``use``.
"""
from __future__ import annotations

import numpy

xp = numpy
device = "cpu"


def use(name: str, local_rank: int = 0):
    """Select the array backend for this process: 'cpu' (numpy) or 'cuda' (cupy, device = local rank)."""
    global xp, device
    if name == "cpu":
        xp, device = numpy, "cpu"
        return xp
    if name != "cuda":
        from .errors import ConfigError
        raise ConfigError(f"device {name!r} is not one of 'cpu', 'cuda'")
    import cupy  # only needed on GPU nodes

    ndev = cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(local_rank % ndev).use()
    xp, device = cupy, "cuda"
    return xp


def xp_of(array):
    """numpy or cupy, whichever owns ``array``."""
    if isinstance(array, numpy.ndarray) or xp is numpy:
        return numpy
    return xp.get_array_module(array)


def to_numpy(array):
    """A host copy (or the array itself on the CPU), for checkpoints and logs."""
    return array if isinstance(array, numpy.ndarray) else array.get()
