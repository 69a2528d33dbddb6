"""Output paths, checked before the work that fills them: a run that trained or generated for an
hour must not end in a traceback about where its result goes, with the result lost.

Every rank of a command under MPI runs the same check, so a bad path fails them all alike. Nothing
is created: a path that is missing is fine when its nearest existing ancestor is a folder that
takes new files (the writer creates the rest).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import ConfigError


def check_output_file(path, flag: str):
    """``path`` can be written as a file: it is no folder, and its folder exists or can be created."""
    path = Path(path)
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a folder: expected a file")
    _check_writable(path.parent, path, flag)


def check_output_folder(path, flag: str):
    """``path`` is a folder, or can be created as one, that takes new files."""
    path = Path(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file: expected a folder")
    _check_writable(path, path, flag)


def nearest_existing(path) -> Path:
    """``path`` itself if it exists, else its nearest ancestor that does (what a writer creating
    ``path`` would write into, and whose file system it would fill)."""
    path = Path(path)
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _check_writable(folder: Path, path: Path, flag: str):
    existing = nearest_existing(folder)
    if not os.path.isdir(existing):
        raise ConfigError(f"{flag} {path}: {existing} is not a folder")
    # A probe file, not os.access: for root, os.access says yes to folders such as /proc that take no file.
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".hpc-tp-probe-")
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot create files in {existing} ({e.strerror})") from None
    os.close(handle)
    os.unlink(probe)
