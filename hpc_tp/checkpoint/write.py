"""save_checkpoint: every rank writes its own pieces; rank 0 publishes the folder only when all did.

    1. agree on a plan: who writes which piece of which tensor (each piece once, pieces tile
       every tensor exactly);
    2. rank 0 starts ROOT/.tmp-step-N (extra files included);
    3. writers write their pieces (serial HDF5: one shard file each; parallel HDF5: one file),
       tensor by tensor in the order of ``tensors``; every rank fetches each ``StreamedTensor`` on
       the way, writer or not (``streamed.py``: a fetch may be a collective of its group);
    4. rank 0 builds the master file of virtual datasets, renames the folder into place, moves
       the ``latest`` pointer, prunes old steps.
A failure anywhere makes every rank raise and removes the temp folder; earlier steps are untouched.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy

from .. import backend
from ..errors import ConfigError
from ..paths import nearest_existing
from .collective import CheckpointError, run_everywhere
from .format import (
    FORMAT,
    FORMAT_VERSION,
    MASTER,
    POINTER,
    RESERVED,
    SET_ASIDE_PREFIX,
    SHARDS,
    TEMP_PREFIX,
    checksum_axis,
    fsync,
    region,
    shard_name,
    step_folder_name,
    step_folders,
    unit_checksums,
)
from .streamed import StreamedTensor

# Parallel HDF5 lets every rank write straight into one file; serial HDF5 needs a shard file per
# rank, joined by virtual datasets.
COLLECTIVE_IO = h5py.get_config().mpi


@dataclass(frozen=True)
class Piece:
    rank: int
    start: int  # [start, stop) along the tensor's checksum axis
    stop: int


@dataclass
class TensorPlan:
    name: str
    shape: tuple
    split_axis: int | None
    dtype: str
    pieces: list[Piece] = field(default_factory=list)

    @property
    def axis(self) -> int:
        """The axis pieces are cut along and checksums are kept along."""
        return checksum_axis(self.split_axis)

    def region(self, piece: Piece) -> tuple:
        return region(self.shape, self.axis, piece.start, piece.stop)

    def piece_shape(self, piece: Piece) -> tuple:
        return tuple(piece.stop - piece.start if d == self.axis else n for d, n in enumerate(self.shape))


def save_checkpoint(
    root_dir, step: int, tensors: dict, meta: dict, grid, keep: int = 3, files: dict[str, bytes] | None = None
) -> Path:
    """Save ``tensors`` (name -> object with ``.data`` and ``.partition``, or a ``StreamedTensor``) and
    ``meta`` as step ``step``.

    Collective over the whole grid. ``meta`` (JSON) is taken from world rank 0, as are ``files``
    (name -> bytes, stored next to master.h5). The ``keep`` highest steps stay (``keep`` < 1: all);
    the step just written always stays. Returns the step folder. If any rank fails, every rank
    raises (CheckpointError, or ConfigError for a bad tensor set) and the previous checkpoints,
    including one of the same step, are left as they were.
    """
    comm = grid.world
    root = Path(root_dir)
    final = root / step_folder_name(step)
    temp = root / f"{TEMP_PREFIX}{final.name}"
    claims = run_everywhere(comm, lambda: _claims(tensors, grid))
    plans = _plan(comm.allgather_object(claims))
    mine = _pieces_by_rank(plans).get(comm.rank, [])
    try:
        attrs = run_everywhere(
            comm, lambda: _prepare(temp, step, meta, files or {}, grid, _bytes(plans)) if comm.rank == 0 else None
        )
        if COLLECTIVE_IO:
            run_everywhere(comm, lambda: _write_one_file(temp, plans, mine, tensors, attrs, comm))
        else:
            run_everywhere(comm, lambda: _write_shard(temp / shard_name(comm.rank), mine, tensors))
        run_everywhere(comm, lambda: _finish(temp, final, plans, attrs, keep) if comm.rank == 0 else None)
    except (CheckpointError, ConfigError):
        if comm.rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        comm.barrier()  # no rank returns before the temp folder is gone
        raise
    return final


def _claims(tensors: dict, grid) -> list[tuple]:
    """The pieces this rank holds and should write. Data-parallel replicas hold identical tensors
    and the replicas of a piece are neighbouring tp ranks, so the first of each writes. Under
    expert parallelism the first ep group of dp ranks writes: between them they hold every expert
    (the identical non-expert pieces they all claim are planned once)."""
    if grid.coords.dp >= grid.ep_size:
        return []
    claims = []
    for name, tensor in tensors.items():
        part = tensor.partition
        if not name or "/" in name:
            raise ConfigError(f"tensor name {name!r}: names must be non-empty and contain no '/'")
        if not part.full_shape:
            raise ConfigError(f"tensor {name!r} is a scalar: keep scalars in meta")
        if grid.coords.tp % part.replicas == 0:
            start, stop = part.local_range() if part.axis is not None else (0, part.full_shape[0])
            dtype = tensor.dtype if isinstance(tensor, StreamedTensor) else tensor.data.dtype
            claims.append((name, tuple(part.full_shape), part.axis, str(numpy.dtype(dtype)), start, stop))
    return claims


def _plan(claims_by_rank: list[list[tuple]]) -> dict[str, TensorPlan]:
    """Every rank computes the same plan from the same claims, so its errors are raised everywhere."""
    plans, described_by = {}, {}
    for rank, claims in enumerate(claims_by_rank):
        for name, shape, split_axis, dtype, start, stop in claims:
            plan = plans.setdefault(name, TensorPlan(name, shape, split_axis, dtype))
            first = described_by.setdefault(name, rank)
            if (plan.shape, plan.split_axis, plan.dtype) != (shape, split_axis, dtype):
                raise ConfigError(
                    f"tensor {name!r} is shape {plan.shape}, split axis {plan.split_axis}, {plan.dtype} "
                    f"on rank {first} but shape {shape}, split axis {split_axis}, {dtype} on rank {rank}"
                )
            # Tied copies of one piece (on two pipeline stages) are written once; padding-only parts not at all.
            if stop > start and all((p.start, p.stop) != (start, stop) for p in plan.pieces):
                plan.pieces.append(Piece(rank, start, stop))
    for plan in plans.values():
        _check_tiling(plan)
    return dict(sorted(plans.items()))


def _check_tiling(plan: TensorPlan):
    """The pieces must tile the checksum axis exactly: a gap would read back as fill value."""
    plan.pieces.sort(key=lambda p: p.start)
    edges = [0] + [p.stop for p in plan.pieces]
    if [p.start for p in plan.pieces] != edges[:-1] or edges[-1] != plan.shape[plan.axis]:
        spans = ", ".join(f"[{p.start}, {p.stop}) on rank {p.rank}" for p in plan.pieces) or "nothing"
        raise ConfigError(
            f"tensor {plan.name!r}: the writing ranks hold {spans} of its {plan.shape[plan.axis]} "
            f"indices along axis {plan.axis}; pieces must tile it exactly (replicas of a piece "
            "must be neighbouring tp ranks: tp_rank % replicas == 0 writes)"
        )


def _pieces_by_rank(plans: dict[str, TensorPlan]) -> dict[int, list[tuple[TensorPlan, Piece]]]:
    by_rank = {}
    for plan in plans.values():
        for piece in plan.pieces:
            by_rank.setdefault(piece.rank, []).append((plan, piece))
    return by_rank


def _piece_values(data, partition) -> numpy.ndarray:
    """This rank's piece of the logical tensor (``data``: its local array) as a contiguous host
    array, padding left out."""
    return numpy.ascontiguousarray(backend.to_numpy(data[partition.valid_local()]))


class _InOrder:
    """This rank's pieces with their values, tensor by tensor in the order of ``tensors``. Every
    streamed tensor is fetched on the way, written here or not, and leaving the ``with`` block,
    even on a failed write, fetches the rest: a fetch may be a collective, and no peer may be left
    waiting in it. Once this rank failed (a write, a fetch), or learned from a fetch that a peer
    did, nothing more is written and the rest are fetched as failed: each collective fetch then
    only tells its group (no data moves), and the first error is raised when the walk is done
    (``streamed.py``). The fetched data goes before the next fetch, so one is held at a time (a
    fetch that gathers may hand it only to the writer: None elsewhere)."""

    def __init__(self, tensors: dict, mine: list):
        self._tensors, self._names = tensors, iter(tensors)
        self._mine = {plan.name: (plan, piece) for plan, piece in mine}
        self._failure: BaseException | None = None  # the first error this rank raised or learned of

    def __enter__(self):
        return self

    def __iter__(self):
        return self._walk(self._mine)

    def __exit__(self, kind, error, traceback):
        if self._failure is None:
            self._failure = error
        for _ in self._walk({}):
            pass
        if error is None and self._failure is not None:
            raise self._failure

    def _walk(self, mine: dict):
        for name in self._names:
            tensor = self._tensors[name]
            streamed = isinstance(tensor, StreamedTensor)
            data = self._fetch(tensor) if streamed else tensor.data
            if name in mine and self._failure is None:
                yield *mine[name], _piece_values(_fetched(name, data) if streamed else data, tensor.partition)

    def _fetch(self, tensor: StreamedTensor):
        """The fetch's data, or None where it failed (its error kept, if the first)."""
        failed = self._failure is not None
        try:
            return tensor.fetch(failed)
        except Exception as e:  # raised when the walk is done: the peers still wait in the fetches to come
            if not failed:
                self._failure = e
            return None


def _fetched(name: str, data):
    if data is None:  # gathered to another rank of its group (``streamed.py``): nothing here to write
        raise CheckpointError(
            f"streamed tensor {name!r}: this rank writes it, but its fetch delivered it to another rank"
        )
    return data


def _bytes(plans: dict) -> int:
    """What the save writes: every tensor once, and its checksums."""
    return sum(math.prod(p.shape) * numpy.dtype(p.dtype).itemsize + 4 * p.shape[p.axis] for p in plans.values())


def _prepare(temp: Path, step: int, meta: dict, files: dict[str, bytes], grid, tensor_bytes: int) -> dict:
    """Start an empty temp folder holding the extra files; return the master's root attributes.
    A file system without room for the checkpoint is refused first: HDF5 does not fail cleanly on a
    full disk (a write error at close crashes it), and the half-written folder would fill it."""
    needed = tensor_bytes + sum(len(content) for content in files.values()) + 2**20  # + HDF5's own bytes
    free = shutil.disk_usage(nearest_existing(temp)).free
    if free < needed:
        raise ConfigError(
            f"checkpoint step {step}: {needed / 2**20:.1f} MiB to write, {free / 2**20:.1f} MiB free in {temp.parent}"
        )
    attrs = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "meta": json.dumps(meta),
        "saved_layout": json.dumps({"tp": grid.tp_size, "pp": grid.pp_size, "dp": grid.dp_size}),
    }
    for name in files:
        if name in RESERVED or name.startswith(".") or Path(name).name != name:
            raise ConfigError(f"extra file name {name!r}: use a plain file name other than {sorted(RESERVED)}")
    shutil.rmtree(temp, ignore_errors=True)  # left by a save of this step that crashed
    temp.mkdir(parents=True)
    if not COLLECTIVE_IO:
        (temp / SHARDS).mkdir()
    for name, content in files.items():
        (temp / name).write_bytes(content)
        fsync(temp / name)
    attrs["files"] = json.dumps({name: zlib.crc32(content) for name, content in files.items()})
    return attrs


def _write_shard(path: Path, mine: list, tensors: dict):
    """Serial HDF5: this rank's pieces into a shard file of its own (none where it writes nothing)."""
    with _InOrder(tensors, mine) as pieces:
        if mine:
            with h5py.File(path, "w") as f:
                for plan, _, values in pieces:
                    f.create_dataset(f"tensors/{plan.name}", data=values)
                    f.create_dataset(f"checksums/{plan.name}", data=unit_checksums(values, plan.axis))
            fsync(path)


def _write_one_file(temp: Path, plans: dict, mine: list, tensors: dict, attrs: dict | None, comm):
    """Parallel HDF5: creating datasets and attributes is collective (every rank, same order and
    values); each rank then writes its own pieces into them (independent writes). A rank whose
    write fails still takes part in the fetches and the collective flush and close, and raises
    after them: leaving early would leave the other ranks waiting there."""
    attrs = comm.bcast_object(attrs)
    failure = None
    with h5py.File(temp / MASTER, "w", driver="mpio", comm=comm.comm) as f:
        _start_master(f, attrs)
        for plan in plans.values():
            _describe(f.create_dataset(f"tensors/{plan.name}", plan.shape, plan.dtype), plan)
            f.create_dataset(f"checksums/{plan.name}", (plan.shape[plan.axis],), numpy.uint32)
        try:
            with _InOrder(tensors, mine) as pieces:
                for plan, piece, values in pieces:
                    f[f"tensors/{plan.name}"][plan.region(piece)] = values
                    f[f"checksums/{plan.name}"][piece.start : piece.stop] = unit_checksums(values, plan.axis)
        except Exception as e:  # reported once the collective calls below are done
            failure = e
        f.flush()  # MPI_File_sync: the collective fsync
    if failure is not None:
        raise failure


def _finish(temp: Path, final: Path, plans: dict, attrs: dict, keep: int):
    if not COLLECTIVE_IO:
        _build_master(temp, plans, attrs)
    _publish(temp, final)
    try:
        _prune(final.parent, keep, final)
    except OSError as e:  # the new checkpoint is complete and in place: pruning is housekeeping
        warnings.warn(f"checkpoint {final} saved, but pruning old ones failed: {e}", stacklevel=2)


def _start_master(f, attrs: dict):
    f.attrs.update(attrs)
    f.require_group("tensors")
    f.require_group("checksums")


def _describe(ds, plan: TensorPlan):
    ds.attrs["split_axis"] = -1 if plan.split_axis is None else plan.split_axis
    ds.attrs["dtype"] = plan.dtype
    ds.attrs["checksum"] = "crc32"
    ds.attrs["checksum_axis"] = plan.axis


def _build_master(temp: Path, plans: dict, attrs: dict):
    """Serial HDF5: one virtual dataset per tensor, mapping each piece from its shard file."""
    checksums = _shard_checksums(temp, plans)
    with h5py.File(temp / MASTER, "w") as f:
        _start_master(f, attrs)
        for plan in plans.values():
            layout = h5py.VirtualLayout(plan.shape, plan.dtype)
            for piece in plan.pieces:
                layout[plan.region(piece)] = h5py.VirtualSource(
                    shard_name(piece.rank), f"tensors/{plan.name}", shape=plan.piece_shape(piece)
                )
            _describe(f.create_virtual_dataset(f"tensors/{plan.name}", layout), plan)
            f.create_dataset(f"checksums/{plan.name}", data=checksums[plan.name])
    fsync(temp / MASTER)


def _shard_checksums(temp: Path, plans: dict) -> dict[str, numpy.ndarray]:
    """The checksums the writers computed from memory, copied into the master so that a shard
    file swapped for another (say, an older step's) cannot vouch for itself."""
    checksums = {name: numpy.zeros(plan.shape[plan.axis], numpy.uint32) for name, plan in plans.items()}
    for rank, pieces in _pieces_by_rank(plans).items():
        with h5py.File(temp / shard_name(rank), "r") as f:
            for plan, piece in pieces:
                checksums[plan.name][piece.start : piece.stop] = f[f"checksums/{plan.name}"][...]
    return checksums


def _publish(temp: Path, final: Path):
    """Rename the complete temp folder into place, then move the pointer. A folder of the same
    step is set aside first and deleted only once the new one is in place (a crash in between
    leaves it set aside, where ``step_folders`` still finds it)."""
    for folder in (temp / SHARDS, temp):
        if folder.is_dir():
            fsync(folder)
    set_aside = final.with_name(f"{SET_ASIDE_PREFIX}{final.name}")
    displaced = final.exists()
    if displaced:
        shutil.rmtree(set_aside, ignore_errors=True)
        os.rename(final, set_aside)
    try:
        os.rename(temp, final)
    except OSError:
        if displaced:
            os.rename(set_aside, final)
        raise
    fsync(final.parent)
    _write_pointer(final.parent, final.name)
    shutil.rmtree(set_aside, ignore_errors=True)


def _write_pointer(root: Path, name: str):
    temp = root / f"{TEMP_PREFIX}{POINTER}"
    temp.write_text(name + "\n")
    fsync(temp)
    os.replace(temp, root / POINTER)
    fsync(root)


def _prune(root: Path, keep: int, current: Path):
    """Keep the ``keep`` highest steps and the one just written; drop temp folders of crashed saves."""
    if keep > 0:
        for folder in step_folders(root)[:-keep]:
            if folder != current:
                shutil.rmtree(folder)
    for stale in root.glob(f"{TEMP_PREFIX}step-*"):
        shutil.rmtree(stale, ignore_errors=True)
