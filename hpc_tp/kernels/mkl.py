"""Intel MKL's runtime library (libmkl_rt), found and opened once at import.

Two callers bind it: ``blas`` calls its GEMMs through ctypes from Python, ``mkl_jit`` by symbol name
from numba kernels. Both need the library and the CBLAS enums, and neither needs the other to get
them, so they live here. ``HPC_TP_BLAS=numpy`` leaves the library closed (``LIBRARY`` None,
``GEMMS`` empty): every product then goes to numpy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

import numpy

from ..errors import ConfigError

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # CBLAS enums (also the numba kernels')
_LP64 = 0  # MKL's 32-bit integer interface
LIBRARY_NAMES = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")


def _open(candidates) -> ctypes.CDLL | None:
    for candidate in candidates:
        try:
            return ctypes.CDLL(candidate)
        except OSError:
            continue
    return None


def _find_mkl() -> ctypes.CDLL | None:
    """libmkl_rt from this environment's lib/ (the mkl wheel puts it there) or the loader's path (a
    site MKL module); ``find_library`` runs ldconfig and gcc, so it is asked last."""
    local = [str(Path(sys.prefix) / "lib" / name) for name in LIBRARY_NAMES]
    library = _open(local + list(LIBRARY_NAMES))
    if library is None and (found := ctypes.util.find_library("mkl_rt")):
        library = _open([found])
    return library


def _load():
    choice = os.environ.get("HPC_TP_BLAS", "mkl")
    if choice not in ("mkl", "numpy"):
        raise ConfigError(f"HPC_TP_BLAS={choice!r}: expected 'mkl' (where installed, the default) or 'numpy'")
    if choice == "numpy":
        return None, {}
    library = _find_mkl()
    # 32-bit integers (LP64), as the ctypes signatures below say, whatever MKL_INTERFACE_LAYER asks for
    # (ILP64 would read each int as 64 bits: a crash).
    if library is None or library.MKL_Set_Interface_Layer(_LP64) != _LP64:
        return None, {}
    pointer, index = ctypes.c_void_p, ctypes.c_int
    gemms = {}
    for dtype, name, scalar in (
        ("float32", "cblas_sgemm", ctypes.c_float),
        ("float64", "cblas_dgemm", ctypes.c_double),
    ):
        function = getattr(library, name)
        function.argtypes = [
            index,
            index,
            index,
            index,
            index,
            index,
            scalar,
            pointer,
            index,
            pointer,
            index,
            scalar,
            pointer,
            index,
        ]
        function.restype = None
        gemms[numpy.dtype(dtype)] = function
    return library, gemms


_library, GEMMS = _load()  # GEMMS: the ctypes cblas_?gemm of each dtype MKL multiplies
LIBRARY = None if _library is None else _library._name  # the path or soname it was opened by
