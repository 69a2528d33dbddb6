"""The on-disk conventions of a checkpoint folder, shared by saving, loading and ``hpc-tp inspect``.

See io/CHECKPOINT_FORMAT.md for the specification. In short::

    ROOT/latest                  text: the name of the newest complete step folder
    ROOT/step-000120/master.h5   /tensors/<name>    each tensor at its full logical shape
                                 /checksums/<name>  crc32 of every index along the checksum axis
    ROOT/step-000120/shards/     rank-00003.h5: the pieces one rank wrote (serial HDF5 only)
    ROOT/step-000120/<file>      extra files (the tokenizer)
"""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path

import h5py
import numpy

from ..errors import ConfigError

FORMAT = "hpc_tp.checkpoint"
FORMAT_VERSION = 1
MASTER = "master.h5"
SHARDS = "shards"
POINTER = "latest"
TEMP_PREFIX = ".tmp-"
SET_ASIDE_PREFIX = ".old-"  # a step folder while a new save of the same step takes its name
RESERVED = {MASTER, SHARDS}
_STEP_FOLDER = re.compile(r"step-(\d+)")
_SET_ASIDE_FOLDER = re.compile(re.escape(SET_ASIDE_PREFIX) + r"step-(\d+)")


def step_folder_name(step: int) -> str:
    return f"step-{step:06d}"


def is_step_folder(name: str) -> bool:
    return _STEP_FOLDER.fullmatch(name) is not None


def shard_name(rank: int) -> str:
    """A shard's path relative to the step folder: virtual datasets store it as written here,
    and HDF5 resolves it against the master file's folder, so the checkpoint can be moved."""
    return f"{SHARDS}/rank-{rank:05d}.h5"


def checksum_axis(split_axis: int | None) -> int:
    """Checksums are kept per index along the split axis, so a rank that reads its own slice
    can verify exactly what it read; a replicated tensor is checked row by row."""
    return 0 if split_axis is None else split_axis


def region(shape, axis: int, start: int, stop: int) -> tuple:
    """Index of [start, stop) along ``axis`` and everything along the other axes."""
    return tuple(slice(start, stop) if d == axis else slice(None) for d in range(len(shape)))


def unit_checksums(values, axis: int) -> numpy.ndarray:
    """crc32 of the little-endian bytes of each index along ``axis`` (C order within each index)."""
    units = numpy.moveaxis(numpy.asarray(values), axis, 0)
    units = numpy.ascontiguousarray(units, dtype=units.dtype.newbyteorder("<"))
    return numpy.fromiter((zlib.crc32(unit) for unit in units), dtype=numpy.uint32, count=len(units))


def fsync(path):
    """Flush a file or a folder entry to stable storage (a rename is durable only once its folder is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_folders(root) -> list[Path]:
    """Step folders under ``root``, oldest step first. A step whose folder a re-save set aside and
    never replaced (the process died between its two renames) is found under its set-aside name."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = {}
    for pattern in (_STEP_FOLDER, _SET_ASIDE_FOLDER):  # the step's own folder wins
        for p in root.iterdir():
            if (m := pattern.fullmatch(p.name)) and p.is_dir():
                found.setdefault(int(m.group(1)), p)
    return [found[step] for step in sorted(found)]


def latest_checkpoint(root_dir) -> Path | None:
    """The folder the ``latest`` pointer names; if it is missing or dangling (a crash between a
    rename and the pointer update), the highest complete step folder; None when there is none."""
    root = Path(root_dir)
    pointer = root / POINTER
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if (named / MASTER).is_file():
            return named
    complete = [p for p in step_folders(root) if (p / MASTER).is_file()]
    return complete[-1] if complete else None


def resolve_checkpoint(path_or_root) -> Path:
    """A checkpoint folder itself, or the latest checkpoint under a root folder."""
    path = Path(path_or_root)
    if (path / MASTER).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ConfigError(f"{path} is neither a checkpoint folder (no {MASTER}) nor a folder holding checkpoints")
    return latest


class SourceCheck:
    """A virtual dataset whose source file or source dataset is missing reads as the fill value,
    silently: every source is looked at before a tensor is trusted. Shard listings are cached,
    so each shard file is opened once however many tensors it holds."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._listings: dict[str, dict | str] = {}

    def problems(self, name: str, ds) -> list[str]:
        if not ds.is_virtual:
            return []
        problems, covered = [], 0
        for source in ds.virtual_sources():
            listing = self._listing(source.file_name)
            low, high = source.vspace.get_select_bounds()
            shape = tuple(hi - lo + 1 for lo, hi in zip(low, high))  # a piece is a box of the logical tensor
            if isinstance(listing, str):
                problems.append(f"tensor {name!r}: source {source.file_name} {listing}")
            elif listing.get(source.dset_name) != shape:
                problems.append(
                    f"tensor {name!r}: {source.file_name} holds no dataset {source.dset_name} of shape {shape}"
                )
            covered += source.vspace.get_select_npoints()
        if covered != ds.size:
            problems.append(f"tensor {name!r}: its shard pieces cover {covered} of {ds.size} elements")
        return problems

    def _listing(self, file_name: str) -> dict | str:
        """Dataset name -> shape of a shard file, or why it cannot be read."""
        if file_name not in self._listings:
            path = self.folder / file_name
            if not path.is_file():
                self._listings[file_name] = "is missing"
            else:
                try:
                    with h5py.File(path, "r") as f:
                        shapes = {}
                        f.visititems(
                            lambda key, obj: shapes.update({key: obj.shape}) if isinstance(obj, h5py.Dataset) else None
                        )
                    self._listings[file_name] = shapes
                except OSError as e:
                    self._listings[file_name] = f"cannot be read ({e})"
        return self._listings[file_name]
