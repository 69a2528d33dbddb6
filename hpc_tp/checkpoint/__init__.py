"""Topology-free checkpoints: each tensor stored once at its full logical shape in HDF5, loadable
into any (tp, pp, dp) layout. The format is specified in io/CHECKPOINT_FORMAT.md.

    save_checkpoint(root, step, tensors, meta, grid, keep=3, files=None) -> step folder   (collective)
    load_checkpoint(folder_or_root, tensors, grid) -> meta                                 (collective)
    latest_checkpoint(root) -> folder | None
    verify_checkpoint(folder_or_root) -> list of problems (empty: good)

A tensor is any object with ``.data`` (this rank's local array, padding included) and
``.partition`` (``module.Partition``), or a ``StreamedTensor`` (``.streamed``): data made on
demand while it is saved and handed over as it is loaded, for states a distributed optimizer
holds only in pieces (saving and loading then hold one such tensor's data at a time).

Names are imported on first use, so ``hpc-tp --help`` (which imports ``checkpoint.inspect``)
does not pay for h5py.
"""

from importlib import import_module

_HOMES = {
    "save_checkpoint": ".write",
    "load_checkpoint": ".read",
    "verify_checkpoint": ".read",
    "describe_checkpoint": ".read",
    "latest_checkpoint": ".format",
    "CheckpointError": ".collective",
    "StreamedTensor": ".streamed",
}

__all__ = sorted(_HOMES)


def __getattr__(name):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_HOMES[name], __name__), name)
