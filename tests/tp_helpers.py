"""Helpers that compare a tensor-parallel run with the one-process reference run on every rank."""

import types

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


def same_loss_then_backward(par, one, ids, targets):
    """Forward ``par`` (split over tp) and the one-process ``one`` on a batch, assert the same token
    count and loss (1e-10), and add both backwards' gradients to what they hold."""
    loss_ref, n_ref, ctx_ref = one.forward(ids, targets)
    loss_par, n_par, ctx_par = par.forward(ids, targets)
    assert n_par == n_ref and abs(loss_par - loss_ref) <= 1e-10 * abs(loss_ref)
    one.backward(ctx_ref, 1.0 / n_ref)
    par.backward(ctx_par, 1.0 / n_par)


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


class CaptureProbe:
    """``inner`` as a CUDA graph capture sees it, on the CPU: while ``capturing``, the collectives
    NCCL queues on the stream for device arrays go through and are named in ``calls``, and any call
    that would run on the host (an object, a scalar, a barrier, a split, point to point) raises, as
    ``NCCLCommunicator``'s ``HostCallInCapture`` does on a device. Outside a capture every call goes
    through, and the groups split from it are probes sharing its state, so a whole grid (a trainer's
    tp, dp, pp) is watched at once. (On the CPU every array is a host one, so an array collective on
    a value read back to the host still passes: the device tests hold those.)"""

    STREAM_ORDERED = frozenset(("all_reduce", "iall_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"))

    def __init__(self, inner, state=None):
        self.inner = inner
        self.state = state or types.SimpleNamespace(capturing=False, calls=[])

    capturing = property(lambda self: self.state.capturing, lambda self, on: setattr(self.state, "capturing", on))
    calls = property(lambda self: self.state.calls)

    def __getattr__(self, name):
        attribute = getattr(self.inner, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            if self.state.capturing:
                assert name in self.STREAM_ORDERED, f"{name} on the host inside a captured step"
                self.state.calls.append(name)
            result = attribute(*args, **kwargs)
            return CaptureProbe(result, self.state) if name in ("split", "split_node") else result

        return call
