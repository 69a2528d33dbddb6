"""Helpers that compare a tensor-parallel run with the one-process reference run on every rank."""
import numpy as np

from hpc_tp.comm.mpi import self_comm, world
from hpc_tp.module import gather_full


def gather_grads(module, comm):
    return {name: gather_full(p.grad, p.partition, comm) for name, p in module.named_parameters()}


def max_rel_err(a, b, floor=1e-300):
    """max |a - b| / max |b|; ``floor`` bounds the scale from below for tensors that are zero in exact math."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(float(np.abs(b).max(initial=0.0)), floor)
    return float(np.abs(a - b).max(initial=0.0)) / scale


def assert_grads_match(par, ref, comm, tol=1e-10):
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    par_grads = gather_grads(par, comm)
    assert sorted(par_grads) == sorted(ref_grads)
    # The K bias gradient is zero in exact math (softmax ignores a per-query constant): its round-off
    # is measured against the largest gradient of the module, not against its own noise.
    floor = max(float(np.abs(g).max(initial=0.0)) for g in ref_grads.values())
    for name in ref_grads:
        err = max_rel_err(par_grads[name], ref_grads[name], floor if name.endswith("k.bias") else 1e-300)
        assert err <= tol, f"gradient of {name}: relative error {err:.2e} > {tol}"


def same_random(seed, *shape):
    """The same array on every rank."""
    return np.random.default_rng(seed).standard_normal(shape)


def tp_and_reference():
    return world(), self_comm()
