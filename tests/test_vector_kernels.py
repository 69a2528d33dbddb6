"""The vector kernels (kernels.f32_dot, kernels.bf16_dot): an environment variable switches each off
at import (an A/B against the path it replaces), and ``warm_up`` compiles a kernel module's products
for a model of its dtype only, before a server's first request would wait for them."""

import os
import subprocess
import sys

import pytest

from hpc_tp.kernels import bf16_dot, f32_dot

pytest.importorskip("ml_dtypes")
# module, its switch, its model dtype and another (as code for a fresh process), its kernels
KERNELS = [
    (f32_dot, "HPC_TP_F32_DOT", "'float32'", "'float64'", ("_rows_by_matrix", "_rows_by_transposed")),
    (
        bf16_dot,
        "HPC_TP_BF16_DOT",
        "ml_dtypes.bfloat16",
        "'float32'",
        ("_rows_by_matrix", "_rows_by_transposed", "_rows_by_panels"),
    ),
]


@pytest.mark.parametrize("module, switch", [kernel[:2] for kernel in KERNELS])
def test_environment_switches_it_off(module, switch):
    name = module.__name__.rsplit(".", 1)[1]
    code = f"from hpc_tp.kernels import {name}; print({name}.AVAILABLE)"
    env = dict(os.environ, **{switch: "0"})
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("module, dtype, other, names", [(m, d, o, k) for m, _, d, o, k in KERNELS])
def test_warm_up_prepares_every_kernel_for_its_dtype_only(module, dtype, other, names):
    """In a fresh process, ``warm_up`` for a model of the module's dtype leaves every kernel (the
    row-major, the transposed and, for bfloat16, the panels' one) compiled or loaded, and for another
    dtype touches none."""
    if not module.AVAILABLE:
        pytest.skip(f"{module.__name__} needs numba and its instructions on this CPU")
    name = module.__name__.rsplit(".", 1)[1]
    count = " + ".join(f"len({name}.{kernel}.signatures)" for kernel in names)
    for model_dtype, kernels in ((dtype, len(names)), (other, 0)):
        code = f"import ml_dtypes; from hpc_tp.kernels import {name}; {name}.warm_up({model_dtype}); print({count})"
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert int(result.stdout) == kernels, model_dtype
