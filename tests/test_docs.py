"""The documentation describes the code that runs.

- Every shell block marked runnable (a ```bash fence right after a ``<!-- runnable -->`` line) in
  README.md, CONTRIBUTING.md and docs/*.md runs as written, in order, in a fresh folder per file,
  with this checkout's ``hpc-tp`` and ``mpiexec`` first on PATH.
- Every relative link in those files, jobs/*.md and io/*.md points to a file that exists.
- Every ``hpc-tp`` subcommand the README's command table names answers ``--help``, and every flag
  a page shows with an ``hpc-tp`` command is one that command takes.

These start their own processes (some under mpiexec), so they run in the one-rank launch only.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from hpc_tp.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
# Every page whose links a reader follows (NOTES.md, a log, aside).
LINKED = [*DOCS, *sorted((ROOT / "jobs").glob("*.md")), *sorted((ROOT / "io").glob("*.md"))]
RUNNABLE = re.compile(r"^<!-- runnable -->\n```bash\n(.*?)^```$", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMAND_ROW = re.compile(r"^\| `hpc-tp ([a-z]+)` \|", re.M)
# What the tour must show beyond exit statuses: training evaluated, and the server's answer (curl
# exits 0 on an HTTP error too).
EXPECTED_OUTPUT = {"README.md": ["held-out accuracy", '"object": "text_completion"']}
# A shell block that has not finished by then is stuck (a server that never answered, say).
BLOCK_TIMEOUT_S = 240

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="documentation tests run in the 1-rank launch")


def runnable_blocks(path: Path) -> list[str]:
    return RUNNABLE.findall(path.read_text())


def relative_links(path: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(path.read_text())
        if not re.match(r"[a-z]+:", target) and not target.startswith("#")
    ]


def doc_env() -> dict:
    """The environment a reader has after `make install`: this checkout's venv first on PATH, and
    the Makefile's settings for ranks that share cores and may run as root."""
    env = dict(
        os.environ,
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        OMP_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        HPC_TP_PROGRESS="lines",
    )
    return env


def test_the_runnable_marker_is_found():
    """The README's tour is runnable: a marker this test no longer recognised would make the
    block test below pass on nothing."""
    assert len(runnable_blocks(ROOT / "README.md")) >= 4


def run_block(block: str, folder: Path) -> tuple[int, str]:
    """Run one shell block in its own process group, so that a block stuck past its time limit is
    ended with everything it started (a server in the background, the ranks under mpiexec)."""
    with subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=folder,
        env=doc_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        process_group=0,
    ) as shell:
        try:
            output, _ = shell.communicate(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(shell.pid, signal.SIGKILL)
            output, _ = shell.communicate()
            return -1, f"still running after {BLOCK_TIMEOUT_S} s\n{output}"
    return shell.returncode, output


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", [p for p in DOCS if p.exists() and runnable_blocks(p)], ids=lambda p: p.name)
def test_runnable_blocks_run_as_written(path, tmp_path):
    outputs = []
    for number, block in enumerate(runnable_blocks(path), 1):
        status, output = run_block(block, tmp_path)
        assert status == 0, f"{path.name} block {number} failed ({status}):\n{block}\n{output}"
        outputs.append(output)
    missing = [text for text in EXPECTED_OUTPUT.get(path.name, []) if text not in "".join(outputs)]
    assert not missing, f"{path.name}: the blocks ran but never printed {missing}:\n{''.join(outputs)}"


@pytest.mark.parametrize("path", [p for p in LINKED if p.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_that_exist(path):
    missing = [target for target in relative_links(path) if not (path.parent / target.split("#")[0]).exists()]
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


def test_every_page_under_docs_is_linked_from_the_readme():
    linked = {(ROOT / target.split("#")[0]).resolve() for target in relative_links(ROOT / "README.md")}
    unlinked = [p.name for p in DOCS[2:] if p.resolve() not in linked]
    assert not unlinked, f"pages under docs/ the README does not link: {unlinked}"


def test_every_command_in_the_readme_table_answers_help(capsys):
    """The installed entry point starts; each subcommand's --help (the parser it runs) answers."""
    run = subprocess.run([str(BIN / "hpc-tp"), "--help"], env=doc_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "usage: hpc-tp" in run.stdout, run.stderr
    readme = (ROOT / "README.md").read_text()
    commands = COMMAND_ROW.findall(readme)
    assert "train" in commands and "serve" in commands, commands
    benchmarks = re.findall(r"`([a-z]+)`", re.search(r"^\| `hpc-tp bench` \|(.*)$", readme, re.M).group(1))
    assert "step" in benchmarks, benchmarks
    for command in [*commands, *(f"bench {name}" for name in benchmarks)]:
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args([*command.split(), "--help"])
        assert done.value.code == 0 and f"usage: hpc-tp {command}" in capsys.readouterr().out, command


def documented_invocations(path: Path):
    """(subcommand words, flags) of every `hpc-tp ...` command line in a page's code blocks and
    inline code."""
    text = path.read_text()
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```$", text, re.M | re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"`([^`\n]*hpc-tp [^`\n]*)`", re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S))
    for line in lines:
        for command in re.split(r"[|;&]", line.split(" #")[0]):
            words = command.split()
            if "hpc-tp" not in words:
                continue
            words = words[words.index("hpc-tp") + 1 :]
            if not words or not re.fullmatch(r"[a-z]+", words[0]):
                continue  # `hpc-tp --help`, or an elided `hpc-tp ...`
            sub = words[:2] if words[0] == "bench" and len(words) > 1 and words[1].isalpha() else words[:1]
            yield sub, [w.split("=")[0] for w in words if w.startswith("--")]


def subcommand_parser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    """The parser of `hpc-tp WORDS...` (argparse keeps its subparsers in the action that holds them)."""
    for word in words:
        choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        assert word in choices, f"hpc-tp has no subcommand {word!r} (it has {', '.join(choices)})"
        parser = choices[word]
    return parser


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


@pytest.mark.parametrize("path", [p for p in LINKED if p.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_flag_is_one_the_command_takes(path):
    unknown = []
    for sub, flags in documented_invocations(path):
        known = options_of(subcommand_parser(build_parser(), sub))
        unknown += [f"hpc-tp {' '.join(sub)} {flag}" for flag in flags if flag not in known]
    assert not unknown, f"{path.relative_to(ROOT)} documents flags the code does not take: {unknown}"
