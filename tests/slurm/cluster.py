"""A real one-node SLURM for the tests: munged + slurmctld + slurmd in a scratch folder.

    cluster = SlurmCluster(scratch_dir)      # writes slurm.conf (hostname -s, nproc CPUs)
    cluster.start()                          # munged, slurmctld, slurmd; waits until the node is idle
    job = cluster.sbatch(script_path, "-n", "2")
    state = cluster.wait(job, timeout=60)    # scancel on timeout
    cluster.stop()                           # by pid files, plus anything left that carries our marker

Also a command line, for poking at it by hand:

    python tests/slurm/cluster.py up DIR     # then: export SLURM_CONF=DIR/slurm.conf; sinfo; sbatch ...
    python tests/slurm/cluster.py down DIR

Everything lives in the scratch folder: its own munge key and socket, state, spool, logs, pid
files, and ports picked free at start, so it neither needs nor disturbs a system SLURM or munge.
Clients find it through ``SLURM_CONF`` (``cluster.env``). It must run as root (slurmd and
``SlurmUser=root``); munged runs with ``--force`` because pytest's scratch folders are not
world-executable, which munged otherwise insists on for its socket.

Every daemon is started with ``HPC_TP_SLURM_CLUSTER=<dir>`` in its environment; job steps and the
processes they start inherit it (sbatch exports the submitter's environment, which has it too), so
``stop`` can find and end whatever a cancelled job left behind, by pid, and only those processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

MARKER = "HPC_TP_SLURM_CLUSTER"
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def missing_programs() -> list[str]:
    """The programs the harness needs that are not installed (empty: it can run)."""
    need = ["munged", "mungekey", "slurmctld", "slurmd", "sinfo", "sbatch", "srun", "squeue", "scontrol", "scancel"]
    sbin = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [p for p in need if shutil.which(p, path=sbin) is None]


def _which(program: str) -> str:
    path = shutil.which(program, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if path is None:
        raise FileNotFoundError(f"{program} is not installed (apt-get install slurmctld slurmd slurm-client munge)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_memory_mb() -> int:
    """What slurmd will find, less a margin (a node configured above its real memory is drained)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return max(256, int(int(line.split()[1]) / 1024 * 0.9))
    return 1024


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    def __init__(self, scratch, cpus: int | None = None):
        self.dir = Path(scratch).resolve()
        self.host = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
        self.cpus = cpus or os.cpu_count() or 1
        self.controller_address = "127.0.0.1"
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf), **{MARKER: str(self.dir)})
        # Daemons, not the tests, own these variables; a test run inside an allocation must not leak them in.
        for var in [v for v in self.env if v.startswith("SLURM_") and v != "SLURM_CONF"]:
            del self.env[var]

    # ---------------------------------------------------------------- configuration
    def write_config(self):
        for sub in ("state", "spool", "munge", "jobs"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        (self.dir / "munge").chmod(0o700)
        d, host = self.dir, self.host
        text = f"""# written by tests/slurm/cluster.py: a one-node cluster for the tests
ClusterName=hpctptest
SlurmctldHost={host}({self.controller_address})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmctldPidFile={d}/slurmctld.pid
SlurmctldLogFile={d}/slurmctld.log
{self.slurmd_files()}
SlurmctldDebug=info
SlurmdDebug=info
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
# Finished jobs stay visible to scontrol for the tests; steps get 5 s between SIGTERM and SIGKILL.
JobRequeue=1
KillWait=5
MinJobAge=300
{self.nodes_section()}
"""
        self.conf.write_text(text)
        # slurmd 22.05 reads cgroup.conf next to slurm.conf when it exists; none of our plugins need cgroups.
        return self.conf

    def slurmd_files(self) -> str:
        d = self.dir
        return f"SlurmdSpoolDir={d}/spool\nSlurmdPidFile={d}/slurmd.pid\nSlurmdLogFile={d}/slurmd.log"

    def nodes_section(self) -> str:
        return (
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={_real_memory_mb()} State=UNKNOWN\n"
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
        )

    # ---------------------------------------------------------------- start / stop
    def _run(self, *cmd, timeout=20, check=True):
        result = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise SlurmError(f"{' '.join(map(str, cmd))} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def _daemon(self, *cmd):
        """Start a daemon that forks into the background; its first words go to daemons.out (not a pipe,
        which a daemon's child could hold open)."""
        with open(self.dir / "daemons.out", "a") as out:
            rc = subprocess.run(
                cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=20
            ).returncode
        if rc != 0:
            raise SlurmError(f"{Path(cmd[0]).name} exited {rc}\n{self.logs()}")

    def start(self, timeout: float = 60.0):
        """Start munged, slurmctld and slurmd (in that order) and wait until the node is idle."""
        self.write_config()
        try:
            key = self.dir / "munge" / "munge.key"
            if not key.exists():
                self._run(_which("mungekey"), "--create", "--keyfile", str(key))
            m = self.dir / "munge"
            self._daemon(
                _which("munged"),
                "--force",
                f"--socket={self.munge_socket}",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
                f"--key-file={key}",
            )
            self._wait_for(lambda: self.munge_socket.exists(), 10, "munged to create its socket")
            self._daemon(_which("slurmctld"), "-f", str(self.conf))
            self._wait_for(
                lambda: "UP" in self._run("scontrol", "ping", check=False).stdout,
                timeout,
                "slurmctld to answer scontrol ping",
            )
            self._start_compute_daemons()
            self._wait_for(lambda: self.node_state() == "idle", timeout, "the node to be idle in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_compute_daemons(self):
        self._daemon(_which("slurmd"), "-f", str(self.conf))

    def node_state(self) -> str:
        result = self._run("sinfo", "-h", "-N", "-o", "%T", check=False)
        return result.stdout.strip().rstrip("*~#") if result.returncode == 0 else ""

    def _wait_for(self, condition, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.25)
        raise SlurmError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.logs()}")

    def logs(self, lines: int = 15) -> str:
        out = []
        slurmd_logs = sorted(p.name for p in self.dir.glob("slurmd*.log"))
        for name in ("daemons.out", "slurmctld.log", *slurmd_logs, "munge/munged.log"):
            path = self.dir / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {name} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(out)

    def pid_files(self) -> dict[str, Path]:
        """Each daemon's pid file, in the order they stop: slurmd before slurmctld before munged (each
        still needs the next one while it shuts down)."""
        return {
            "slurmd": self.dir / "slurmd.pid",
            "slurmctld": self.dir / "slurmctld.pid",
            "munged": self.dir / "munge" / "munged.pid",
        }

    def pids(self) -> dict[str, int]:
        found = {}
        for name, path in self.pid_files().items():
            try:
                found[name] = int(path.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        return found

    def leftovers(self) -> list[int]:
        """Pids of live processes (other than ours) whose environment carries this cluster's marker."""
        marker = f"{MARKER}={self.dir}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
        return found

    def stop(self, timeout: float = 15.0):
        """Cancel every job, stop slurmd, slurmctld and munged by their pid files, then end any
        process left with this cluster's marker (job steps of a cancelled job). Idempotent."""
        if self.conf.exists() and "slurmctld" in self.pids():
            try:
                self._run("scancel", "--full", "--user=root", check=False, timeout=10)
            except (subprocess.TimeoutExpired, OSError):
                pass
        pids = self.pids()
        compute = [pid for name, pid in pids.items() if name.startswith("slurmd")]
        _terminate(compute, timeout)  # all nodes' slurmd at once, then the controller, then munge
        for name in ("slurmctld", "munged"):
            if name in pids:
                _terminate([pids[name]], timeout)
        _terminate(self.leftovers(), timeout)

    # ---------------------------------------------------------------- jobs
    def sbatch(self, script, *options, cwd=None, env=None) -> str:
        """Submit ``script`` (a path) and return the job id."""
        result = subprocess.run(
            ["sbatch", "--parsable", *options, str(script)],
            env={**self.env, **(env or {})},
            cwd=cwd or self.dir / "jobs",
            capture_output=True,
            text=True,
            timeout=20,
        )
        if result.returncode != 0:
            raise SlurmError(f"sbatch {script} failed: {result.stderr.strip()}")
        return result.stdout.strip().split(";")[0]

    def queue(self) -> list[str]:
        """``squeue``: "JOBID STATE" of every job still known to the controller."""
        return self._run("squeue", "-h", "-o", "%i %T", check=False).stdout.splitlines()

    def job_info(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (JobState, ExitCode, StdOut, Restarts, ...); empty once purged."""
        result = self._run("scontrol", "-o", "show", "job", job_id, check=False)
        info = {}
        for field in result.stdout.split():
            key, _, value = field.partition("=")
            info[key] = value
        return info

    def wait(self, job_id: str, timeout: float = 60.0) -> dict:
        """Poll until the job reaches a final state; on timeout scancel it and raise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") in TERMINAL_STATES:
                return info
            time.sleep(0.5)
        self._run("scancel", job_id, check=False)
        raise SlurmError(
            f"job {job_id} still {self.job_info(job_id).get('JobState')} after {timeout:.0f}s: cancelled\n{self.logs()}"
        )

    def signal(self, job_id: str, signame: str = "USR1", batch: bool = True):
        """``scancel --signal``: what SLURM does at ``--signal=B:USR1@T`` ahead of the time limit."""
        self._run("scancel", f"--signal={signame}", *(["--batch"] if batch else []), job_id)

    def preempt(self, job_id: str, output: Path, timeout: float = 120.0) -> int:
        """USR1 to a running train.sbatch job, as ahead of its time limit; wait for its requeue, release it
        at once, and return the step its ranks checkpointed after (from the job's ``output``)."""
        import re

        self.signal(job_id, "USR1")
        deadline = time.monotonic() + timeout
        while self.job_info(job_id).get("Restarts") != "1":
            if time.monotonic() > deadline:
                raise SlurmError(
                    f"job {job_id} not requeued {timeout:.0f}s after USR1:\n" + output.read_text(errors="replace")
                )
            time.sleep(0.5)
        stopped = int(re.search(r"stopped by SIGUSR1 after step (\d+)", output.read_text()).group(1))
        # slurmd refuses a launch whose credential is from the same second as the requeue's revocation
        # ("Job credential revoked"): let a few seconds pass before releasing the held job.
        time.sleep(3)
        self.start_now(job_id)
        return stopped

    def start_now(self, job_id: str):
        """Make a pending job eligible at once: SLURM holds a requeued job for a while (Reason=BeginTime)."""
        self._run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def srun(self, *args, timeout: float = 60.0, env=None) -> subprocess.CompletedProcess:
        """A job step in a fresh allocation, bounded: ``srun`` is killed (and the job cancelled) on timeout."""
        name = f"hpctp-srun-{os.getpid()}-{time.monotonic_ns()}"
        try:
            return subprocess.run(
                ["srun", f"--job-name={name}", *args],
                env={**self.env, **(env or {})},
                cwd=self.dir / "jobs",
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            self._run("scancel", f"--name={name}", check=False)
            raise


def _send(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _terminate(pids, timeout):
    live = [p for p in pids if _alive(p)]
    _send(live, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while live and time.monotonic() < deadline:
        time.sleep(0.1)
        live = [p for p in live if _alive(p)]
    _send(live, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (a child of ours not yet reaped) is not running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("up", "down", "status"):
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        return 2
    cluster = SlurmCluster(argv[1])
    if argv[0] == "up":
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}")
    elif argv[0] == "down":
        cluster.stop()
    else:
        print(json.dumps({"pids": cluster.pids(), "node": cluster.node_state(), "leftovers": cluster.leftovers()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
