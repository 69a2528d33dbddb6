"""Helpers that compare a tensor-parallel run with the one-process reference run on every rank."""

import numpy as np

from hpc_tp.comm.mpi import self_comm, world
from hpc_tp.verify import gradient_errors


def max_rel_err(a, b):
    """max |a - b| / max |b|."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(float(np.abs(b).max(initial=0.0)), 1e-300)
    return float(np.abs(a - b).max(initial=0.0)) / scale


def assert_grads_match(par, ref, comm, tol=1e-10):
    assert sorted(n for n, _ in par.named_parameters()) == sorted(n for n, _ in ref.named_parameters())
    for name, err in gradient_errors(par, ref, comm).items():
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"


def same_random(seed, *shape):
    """The same array on every rank."""
    return np.random.default_rng(seed).standard_normal(shape)


def tp_and_reference():
    return world(), self_comm()


def lm_batch(seed=0, b=3, t=7, v=37):
    """Random token ids [b, t] and their next-token targets (the last position ignored)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, v, (b, t))
    targets = np.roll(ids, -1, axis=1)
    targets[:, -1] = -100
    return ids, targets
