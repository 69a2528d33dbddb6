"""Reading a checkpoint: load it into any (tp, pp, dp) layout, verify it, describe it.

Loading has one code path for every layout: each rank reads the hyperslab of the logical tensor
its partition names, checks the crc32 of every index it read, and copies it into its local
data (padding past the logical end left zero), or, for a ``StreamedTensor``, hands it over as a
local array of its own: one tensor at a time, whatever holds it after. After each tensor (each few
beyond ``MAX_AGREEMENTS`` tensors) the ranks agree whether any failed (one scalar all-reduce), so a
failure on one rank ends the load on every rank soon after, not after the others have read the rest
of the checkpoint.
"""

from __future__ import annotations

import json
import zlib
from contextlib import closing
from pathlib import Path

import h5py
import numpy

from .. import backend
from ..errors import ConfigError
from .collective import agreed, run_everywhere
from .format import FORMAT, FORMAT_VERSION, MASTER, SourceCheck, region, resolve_checkpoint, unit_checksums
from .streamed import StreamedTensor

_VERIFY_BLOCK_BYTES = 64 << 20  # verify reads a tensor in blocks of about this size


def load_checkpoint(path_or_root, tensors: dict, grid) -> dict:
    """Fill each tensor's local data in place from a checkpoint saved at any layout; returns meta.

    Collective over the grid: a missing tensor, a shape mismatch, a missing shard file, a checksum
    mismatch or a failed ``StreamedTensor.store`` on any rank raises on every rank (ConfigError for
    a bad file or tensor set, else CheckpointError), and no rank reads past the tensor where the
    first failure happened.
    """
    comm = grid.world
    meta = run_everywhere(comm, lambda: _load(path_or_root, tensors, comm))
    if tensors:
        backend.release_free_memory()  # the whole tensors read (and a new model's first draws) are no longer needed
    return meta


# Agreements a load makes at most, after opening the file: with more tensors than this the ranks
# agree after every few (``_load``). Each one holds the ranks in step, and on a loaded machine a rank
# then waits for a descheduled peer at every one (+17-83% for 100 tensors agreed one by one under
# load, benchmarks/load_agreement.py); 64 keep a failure's reach within 1/64 of the load.
MAX_AGREEMENTS = 64


def _load(path_or_root, tensors: dict, comm) -> dict:
    """Open the checkpoint, then fill the tensors in turn, agreeing with every rank after each step
    (``agreed``): a failure anywhere stops every rank there, not at the end of its own reads. A step
    is the opening (a rank that cannot open the file stops the others before their first tensor),
    then ``every`` tensors: one while the dicts are at most ``MAX_AGREEMENTS`` long.

    The ranks' dicts differ (each pipeline stage holds its own layers, an expert group its own
    experts, in numbers of their own), so the agreements go by position, not by name: the ranks
    first agree on the longest dict's length, which fixes the steps, then every rank agrees once
    per step (a rank past its own tensors only agrees). So every rank makes the same all-reduces in
    the same order whatever it holds, and each hands every rank the same answer: all stop at the
    same step, and none is left waiting in an agreement the others skipped.
    """
    positions = int(comm.all_reduce_scalar(len(tensors), "max"))
    every = max(1, -(-positions // MAX_AGREEMENTS))
    stopped = "this rank's load stopped before its next tensor"
    with closing(_reads(path_or_root, tensors)) as reads:
        meta = agreed(comm, lambda: next(reads), stopped=stopped)
        for _ in range(0, positions, every):
            agreed(comm, lambda: [next(reads, None) for _ in range(every)], stopped=stopped)
    return meta


def _reads(path_or_root, tensors: dict):
    """Opens the checkpoint and yields its meta; then fills one tensor of ``tensors`` per step."""
    folder = resolve_checkpoint(path_or_root)
    try:
        with h5py.File(folder / MASTER, "r") as f:
            yield _header(f)
            sources = SourceCheck(folder)
            for name, tensor in tensors.items():
                _fill(f, name, tensor, sources)
                yield
    except (ConfigError, OSError) as e:
        raise ConfigError(f"checkpoint {folder}: {e}") from e


def _fill(f, name: str, tensor, sources: SourceCheck):
    part = tensor.partition
    ds = f["tensors"].get(name)
    if ds is None:
        raise ConfigError(f"tensor {name!r} (shape {tuple(part.full_shape)}) is not in the checkpoint")
    if ds.shape != tuple(part.full_shape):
        raise ConfigError(
            f"tensor {name!r} has shape {ds.shape} in the checkpoint but {tuple(part.full_shape)} in the model"
        )
    problems = sources.problems(name, ds)
    if problems:
        raise ConfigError("; ".join(problems))
    # Checksums cover whole indices along the checksum axis: a rank split along that axis reads
    # and checks exactly its slice; any other partition reads the whole tensor to check it.
    axis = int(ds.attrs["checksum_axis"])
    aligned = part.axis == axis
    start, stop = part.local_range() if aligned else (0, ds.shape[axis])
    values = read_verified(f, name, start, stop)
    mine = values if aligned else values[part.local_slice()]
    if isinstance(tensor, StreamedTensor):
        local = numpy.zeros(part.local_shape, tensor.dtype)
        local[part.valid_local()] = mine
        tensor.store(local)
    else:
        tensor.data[...] = 0
        tensor.data[part.valid_local()] = backend.xp_of(tensor.data).asarray(mine)


def read_verified(f, name: str, start: int, stop: int) -> numpy.ndarray:
    """Indices [start, stop) of a tensor along its checksum axis, each checked against its crc32."""
    ds = f[f"tensors/{name}"]
    axis = int(ds.attrs["checksum_axis"])
    expected = f["checksums"].get(name)
    if expected is None or expected.shape != (ds.shape[axis],):
        raise ConfigError(f"tensor {name!r}: no checksums for its {ds.shape[axis]} indices along axis {axis}")
    values = ds[region(ds.shape, axis, start, stop)]
    bad = numpy.flatnonzero(unit_checksums(values, axis) != expected[start:stop])
    if bad.size:
        first = start + int(bad[0])
        raise ConfigError(
            f"tensor {name!r}: checksum mismatch at {bad.size} of {stop - start} indices along axis {axis} "
            f"(first: {first}{_stored_in(ds, axis, first)}); the file is corrupted"
        )
    return _as_saved(ds, values)


def _as_saved(ds, values: numpy.ndarray) -> numpy.ndarray:
    """``values`` in the dtype the tensor was saved in: HDF5 has no bfloat16, so h5py stores one as
    opaque 2-byte elements, read back as raw ``V2`` that no dtype casts from; the ``dtype`` attribute
    names what those bits are."""
    saved = ds.attrs.get("dtype")
    if values.dtype.kind != "V" or saved is None:
        return values
    dtype = backend.resolve_dtype(str(saved))
    if dtype.itemsize != values.dtype.itemsize:
        raise ConfigError(f"tensor {ds.name!r}: stored as {values.dtype.itemsize}-byte opaque elements, not {saved}")
    return values.view(dtype)


def _stored_in(ds, axis: int, index: int) -> str:
    for source in ds.virtual_sources() if ds.is_virtual else ():
        low, high = source.vspace.get_select_bounds()
        if low[axis] <= index <= high[axis]:
            return f", stored in {source.file_name}"
    return ""


def _header(f) -> dict:
    """Check the format; return meta."""
    if f.attrs.get("format") != FORMAT:
        raise ConfigError(f"{f.filename} is not an hpc_tp checkpoint (no format attribute {FORMAT!r})")
    if int(f.attrs["format_version"]) > FORMAT_VERSION:
        raise ConfigError(
            f"{f.filename} has format version {f.attrs['format_version']}; "
            f"this hpc_tp reads up to version {FORMAT_VERSION}"
        )
    return json.loads(f.attrs["meta"])


def verify_checkpoint(path) -> list[str]:
    """Everything wrong with a checkpoint folder (or the latest under a root); empty means good.

    One process, no MPI: the format, the extra files, every shard file a tensor maps, and the
    checksum of every index of every tensor.
    """
    try:
        folder = resolve_checkpoint(path)
        with h5py.File(folder / MASTER, "r") as f:
            _header(f)
            problems = _file_problems(f, folder)
            sources = SourceCheck(folder)
            for name, ds in f["tensors"].items():
                # Checksums of a tensor whose shards are missing would only repeat the problem.
                problems += sources.problems(name, ds) or _checksum_problems(f, name)
            return problems
    except (ConfigError, OSError) as e:
        return [str(e)]


def _file_problems(f, folder: Path) -> list[str]:
    problems = []
    for name, crc in json.loads(f.attrs["files"]).items():
        path = folder / name
        if not path.is_file():
            problems.append(f"extra file {name} is missing")
        elif zlib.crc32(path.read_bytes()) != crc:
            problems.append(f"extra file {name}: checksum mismatch")
    return problems


def _checksum_problems(f, name: str) -> list[str]:
    ds = f[f"tensors/{name}"]
    axis = int(ds.attrs["checksum_axis"])
    length = ds.shape[axis]
    unit_bytes = ds.dtype.itemsize * ds.size // max(length, 1)
    block = max(1, _VERIFY_BLOCK_BYTES // max(unit_bytes, 1))
    try:
        for start in range(0, length, block):
            read_verified(f, name, start, min(start + block, length))
    except ConfigError as e:
        return [str(e)]
    return []


def describe_checkpoint(path) -> dict:
    """Step, saved layout, meta, extra files and the tensors (logical shape, split axis, dtype, bytes)."""
    folder = resolve_checkpoint(path)
    if not h5py.is_hdf5(folder / MASTER):  # else h5py's OSError and a traceback
        raise ConfigError(f"checkpoint {folder}: {MASTER} is not an HDF5 file (corrupted, or not a checkpoint)")
    try:
        with h5py.File(folder / MASTER, "r") as f:
            meta = _header(f)
            tensors = [
                {
                    "name": name,
                    "shape": list(ds.shape),
                    "split_axis": None if int(ds.attrs["split_axis"]) < 0 else int(ds.attrs["split_axis"]),
                    "dtype": str(ds.attrs["dtype"]),
                    "bytes": int(ds.size * ds.dtype.itemsize),
                    "pieces": len(ds.virtual_sources()) if ds.is_virtual else 1,
                }
                for name, ds in f["tensors"].items()
            ]
            return {
                "path": str(folder),
                "step": int(f.attrs["step"]),
                "format_version": int(f.attrs["format_version"]),
                "saved_layout": json.loads(f.attrs["saved_layout"]),
                "files": sorted(json.loads(f.attrs["files"])),
                "meta": meta,
                "tensors": tensors,
            }
    except OSError as e:  # a truncated or damaged file can still pass is_hdf5
        raise ConfigError(f"checkpoint {folder}: {MASTER}: {e}") from None
