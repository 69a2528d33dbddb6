"""Imports run one way, downward (the layers are listed in ``hpc_tp/__init__.py``'s docstring).

Every import of every module under hpc_tp/, at module level and inside functions alike, is read
with ``ast`` and mapped to its layer; an import of a higher layer fails, naming the file, the line
and both layers. Modules import each other without cycles, and mpi4py is imported only where
``MPI_ALLOWED`` says.
"""

import ast
from pathlib import Path

import pytest

from hpc_tp.cli import COMMANDS

PACKAGE = Path(__file__).resolve().parents[1] / "hpc_tp"

# Lowest first. A module belongs to the layer of the longest prefix that names it; imports within a
# layer go any way that keeps the modules free of cycles.
LAYERS = {
    "errors": ["hpc_tp.errors"],
    "foundation": ["hpc_tp.backend", "hpc_tp.paths", "hpc_tp.jsonl", "hpc_tp.recompute", "hpc_tp.cuda_graph"],
    "comm": ["hpc_tp.comm"],
    "launch": ["hpc_tp.launch", "hpc_tp.grid", "hpc_tp.preemption"],
    "module": ["hpc_tp.module"],
    "kernels": ["hpc_tp.kernels"],
    "tensor_parallel": ["hpc_tp.tensor_parallel"],
    "nn": ["hpc_tp.nn"],
    "models": ["hpc_tp.models"],
    "pipeline/checkpoint/tokenizer": ["hpc_tp.pipeline", "hpc_tp.checkpoint", "hpc_tp.tokenizer"],
    "serve": ["hpc_tp.serve"],
    "plan": ["hpc_tp.plan"],
    "train": ["hpc_tp.train"],
    "bench": ["hpc_tp.bench"],
    # The command line: each subcommand's module; plan.validate, which `hpc-tp plan --validate` runs
    # (the benchmarks and the trainer on the planned layouts); bench.gpu_check, a program of its own.
    "cli": [
        "hpc_tp.cli",
        *(module for module, _ in COMMANDS.values()),
        "hpc_tp.plan.validate",
        "hpc_tp.bench.gpu_check",
    ],
}
RANK = {layer: n for n, layer in enumerate(LAYERS)}
# Importing mpi4py starts MPI: the communicators and the launch checks do, and the benchmark that
# times MPI's own calls beside the Communicator's; everything else reaches MPI through hpc_tp.comm.
MPI_ALLOWED = ("hpc_tp.comm", "hpc_tp.launch", "hpc_tp.bench.comm")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str:
    if module == "hpc_tp":  # the package itself: a docstring and the version, no imports
        return "errors"
    best, layer = -1, None
    for name, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), name
    return layer


def imports(module: str):
    """(line, imported module) for every import in ``module``, function level included; ``from X
    import name`` counts as an import of X.name where that is a module, of X otherwise."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base


def project_imports(module: str):
    return [(line, target) for line, target in imports(module) if target.split(".")[0] == "hpc_tp"]


def test_every_module_has_a_layer():
    assert [m for m in MODULES if layer_of(m) is None] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_downward(module):
    mine = layer_of(module)
    upward = [
        f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {target}: layer {mine} "
        f"imports layer {layer_of(target)} above it"
        for line, target in project_imports(module)
        if RANK.get(layer_of(target), len(RANK)) > RANK[mine]
    ]
    assert upward == []


def test_no_module_imports_itself_through_others():
    graph = {module: {target for _, target in project_imports(module) if target != module} for module in MODULES}
    done, path, cycles = set(), [], []

    def visit(module):
        if module in path:
            cycles.append(" -> ".join(path[path.index(module) :] + [module]))
            return
        if module in done:
            return
        path.append(module)
        for target in sorted(graph.get(module, ())):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert cycles == []


def test_only_comm_and_launch_import_mpi4py():
    users = [
        f"{MODULES[m].relative_to(PACKAGE.parent)}:{line}"
        for m in MODULES
        for line, target in imports(m)
        if target.split(".")[0] == "mpi4py" and not any(m == a or m.startswith(a + ".") for a in MPI_ALLOWED)
    ]
    assert users == []


def test_the_layering_reads_as_the_package_docstring_says():
    import hpc_tp

    assert " < ".join(LAYERS) in " ".join(hpc_tp.__doc__.split())
