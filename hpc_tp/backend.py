"""Array module selection: numpy on the CPU, cupy on a GPU (one device per node-local rank).

Layers ask ``xp_of(array)`` for the module that owns their inputs, so the same code runs on
both; parameters are allocated with ``backend.xp`` chosen once at start-up by ``use``.
"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy

from .errors import ConfigError

xp = numpy
device = "cpu"
DEVICES = ("cpu", "cuda")
# Launchers that export the node-local rank: Open MPI, SLURM, MPICH/Hydra, MVAPICH.
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")


def use(name: str, local_rank: int | None = None):
    """Select the array backend for this process: 'cpu' (numpy) or 'cuda' (cupy on device
    ``local_rank`` modulo the node's devices; None: the launcher's local rank, else 0)."""
    global xp, device
    if name == "cpu":
        retain_freed_memory()
        xp, device = numpy, "cpu"
        return xp
    if name != "cuda":
        raise ConfigError(f"--device {name!r}: expected one of {', '.join(DEVICES)}")
    cupy = import_cupy()
    ndev = cupy.cuda.runtime.getDeviceCount()
    rank = launcher_local_rank() if local_rank is None else local_rank
    cupy.cuda.Device(device_index(rank or 0, ndev)).use()
    xp, device = cupy, "cuda"
    return xp


def import_cupy():
    """cupy, with at least one visible CUDA device; a ConfigError that says which is missing otherwise."""
    try:
        import cupy  # an optional dependency (hpc_tp[gpu]): imported when a GPU is asked for
    except ImportError as error:
        raise ConfigError(f"--device cuda needs cupy (pip install 'hpc_tp[gpu]'): {error}") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as error:
        raise ConfigError(f"--device cuda: no CUDA device is usable ({error})") from None
    if count < 1:
        raise ConfigError("--device cuda: cupy sees no CUDA device")
    return cupy


def cuda_available() -> bool:
    """True where cupy imports and sees a device (what GPU tests and gpu-check ask first)."""
    try:
        import_cupy()
    except ConfigError:
        return False
    return True


def device_index(local_rank: int, n_devices: int) -> int:
    """The GPU a rank uses: its node-local rank modulo the devices it can see.

    When SLURM binds one GPU per task (``--gpus-per-task=1`` or ``--gpu-bind``), each process sees one
    device and every rank gets index 0; when all of a node's GPUs are visible, rank ``r`` gets ``r % n``.
    Do not set ``CUDA_VISIBLE_DEVICES`` per rank by hand on top of that. More ranks than GPUs on a node
    means ranks share a device, which NCCL refuses within one communicator.
    """
    if n_devices < 1:
        raise ConfigError(
            f"no GPU visible to local rank {local_rank} (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): request GPUs for the job "
            "(#SBATCH --gpus-per-node=N) or run with the cpu device"
        )
    if local_rank < 0:
        raise ConfigError(f"local rank {local_rank}: expected a rank >= 0")
    return local_rank % n_devices


def launcher_local_rank(environ=os.environ) -> int | None:
    """This process's rank among those of its node, as the launcher exported it (None: not told)."""
    for variable in LOCAL_RANK_VARIABLES:
        value = environ.get(variable, "")
        if value.isdigit():
            return int(value)
    return None


def _glibc():
    """glibc's C library on Linux; None elsewhere (macOS, musl), where the allocator is left alone."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def retain_freed_memory() -> bool:
    """Keep freed memory in this process's heap (glibc only; elsewhere nothing changes). A step
    frees and reallocates the same activations every time; by default glibc hands the heap top
    back to the OS and maps big arrays fresh, so every step page-faults them in again (W1 at tp=2:
    ~10% of the step). Every array comes from the heap, the large ones too (glibc would map anything
    over its largest threshold, 32 MiB, fresh each time: a 103 MB logits buffer was page-faulted in
    every step), and the heap gives memory back only when 1 GiB is free at its
    top: in training the resident size stays at the peak every step reaches anyway. Start-up's
    one-off buffers (the model's first draws, a checkpoint's whole tensors) are handed back by
    ``release_free_memory``. True if applied."""
    libc = _glibc()
    if libc is None:
        return False
    m_trim_threshold, m_mmap_threshold, m_mmap_max = -1, -3, -4  # malloc.h
    applied = [
        libc.mallopt(m_mmap_threshold, 32 << 20),
        libc.mallopt(m_trim_threshold, 1 << 30),
        libc.mallopt(m_mmap_max, 0),
    ]
    return all(applied)


def release_free_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``), wherever they sit. Called
    once start-up's large temporaries are gone (after building a model, after loading a checkpoint):
    the retained heap would otherwise keep them resident for the life of the process, e.g. a server
    holding its model's float64 first draw (a 611 MB model: 1501 -> 734 MiB resident). True if
    memory was released."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


# glibc backs its heap with transparent huge pages (madvise) under this tunable; it is read at process
# start, so launchers export it (the Makefile, jobs/*.sbatch). W1 at tp=2: ~2.5% faster, from fewer TLB misses.
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"


def huge_page_bytes() -> tuple[int, int] | None:
    """(bytes of this process's anonymous memory on transparent huge pages, resident bytes) now;
    None where the kernel does not say (not Linux, or no smaps_rollup)."""
    fields = {}
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                name, _, rest = line.partition(":")
                if name in ("Rss", "AnonHugePages"):
                    fields[name] = int(rest.split()[0]) * 1024
    except OSError:
        return None
    return (fields["AnonHugePages"], fields["Rss"]) if len(fields) == 2 else None


def heap_huge_pages_requested(environ=os.environ) -> bool:
    """True when this process was started with ``HUGE_PAGE_TUNABLE`` as GLIBC_TUNABLES' last word on
    ``glibc.malloc.hugetlb`` (glibc takes the last; glibc before 2.35 ignores it)."""
    setting = HUGE_PAGE_TUNABLE.split("=")[0] + "="
    said = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith(setting)]
    return bool(said) and said[-1] == HUGE_PAGE_TUNABLE


def xp_of(array):
    """numpy or cupy, whichever owns ``array``."""
    if isinstance(array, numpy.ndarray) or xp is numpy:
        return numpy
    return xp.get_array_module(array)


def synchronize():
    """Wait for this device's queued work (nothing to wait for on the CPU): timers call it."""
    if xp is not numpy:
        xp.cuda.get_current_stream().synchronize()


def to_numpy(array):
    """A host copy (or the array itself on the CPU), for checkpoints and logs."""
    return array if isinstance(array, numpy.ndarray) else array.get()


def resolve_dtype(name: str):
    """The numpy dtype called ``name`` (bfloat16 needs ml_dtypes; a ConfigError says so)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ConfigError(
                "--dtype bfloat16 needs the ml_dtypes package (numpy has no bfloat16): "
                "pip install ml_dtypes, or use --dtype float16"
            ) from None
        return numpy.dtype(ml_dtypes.bfloat16)
    try:
        return numpy.dtype(name)
    except TypeError:
        raise ConfigError(f"--dtype {name!r} is not a numpy dtype") from None
