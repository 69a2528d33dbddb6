"""A virtual SLURM cluster of N nodes on one machine: one Linux network + hostname namespace per node.

    cluster = VirtualCluster(scratch_dir, nodes=2)
    cluster.start()          # bridge, namespaces, munged, slurmctld (here), one slurmd per node
    job = cluster.sbatch(script, "--nodes=2", "--ntasks-per-node=2")
    cluster.kill_node("node2")   # its slurmd and every process in its namespace: a node lost
    cluster.stop()           # daemons by pid, then every process in the namespaces, then the network

A command line for people (the cluster stays up until `down`):

    python tests/slurm/nodes.py up DIR [NODES]   # then: export SLURM_CONF=DIR/slurm.conf; sinfo; sbatch ...
    python tests/slurm/nodes.py down DIR

Why it is built this way:

- A node is a network namespace (its own addresses, so MPI sees separate hosts and talks TCP between
  them) plus a UTS namespace (its own hostname, which slurmd uses to know which node it is, and which
  MPI reports as the processor name). Daemons enter them with ``nsenter`` + ``unshare --uts``, not
  ``ip netns exec``: that one remounts /sys, and slurmd then finds no cgroup file system.
- Addresses are only ever in 127.0.0.0/8, one /24 per cluster picked unused, so nothing can leave the
  machine: the bridge (in the root namespace) takes .1, node K takes .10+K, and packets travel only
  between the namespaces made here. Loopback-range addresses on real interfaces need ``route_localnet``
  (the bridge's own setting in the root namespace; everything in a node's) and a route in the *local*
  table, more specific than its 127.0.0.0/8 entry.
- SLURM: slurmctld runs in the root namespace on the bridge address; each node's slurmd has its own
  pid, log, spool and ``TmpFS`` (the nodes share /tmp, and PMIx's per-step folder would otherwise
  collide across nodes with "File exists"). One munged serves all: its unix socket crosses network
  namespaces.
- Open MPI leaves 127/8 out of its TCP transports unless told: ``env`` sets the interface variables.
- Teardown happens whatever state the cluster is in, from what ``DIR/network.json`` recorded before
  anything was created: daemons by pid file, then every process in each namespace, then the
  namespaces and the bridge (their veths go with them).
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from slurm.cluster import SlurmCluster, SlurmError, _real_memory_mb, _terminate, _which  # noqa: E402

NODE_CPUS = 4  # per virtual node: more than the host has is fine (config_overrides), ranks share cores


def unavailable() -> str | None:
    """Why this machine cannot build the cluster, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces and slurmd need root"
    for program in ("ip", "nsenter", "unshare"):
        if shutil.which(program, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])) is None:
            return f"{program} is not installed (apt-get install iproute2 util-linux)"
    probe = f"hvprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args, netns: str | None = None, check: bool = True):
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise SlurmError(f"{' '.join(cmd)} exited {result.returncode}: {result.stderr.strip()}")
    return result


def _subnet_in_use() -> set[ipaddress.IPv4Network]:
    text = _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    used = set()
    for word in text.split():
        try:
            used.add(ipaddress.ip_network(word.split("/")[0] + "/24", strict=False))
        except ValueError:
            pass
    return used


def _pick_subnet() -> ipaddress.IPv4Network:
    """A /24 in 127.0.0.0/8 that no interface or route of this machine mentions (127.0.0.0/24 excluded)."""
    used = _subnet_in_use()
    for _ in range(200):
        net = ipaddress.ip_network(f"127.{random.randint(100, 250)}.{random.randint(0, 255)}.0/24")
        if net not in used:
            return net
    raise SlurmError("no free /24 found in 127.0.0.0/8")


class VirtualCluster(SlurmCluster):
    def __init__(self, scratch, nodes: int = 2, cpus: int = NODE_CPUS):
        super().__init__(scratch, cpus=cpus)
        self.network_file = self.dir / "network.json"
        if self.network_file.exists():  # `down` on a cluster started earlier (or by another process)
            saved = json.loads(self.network_file.read_text())
            self.prefix, self.subnet, self.node_count = (
                saved["prefix"],
                ipaddress.ip_network(saved["subnet"]),
                saved["nodes"],
            )
        else:
            self.prefix, self.subnet, self.node_count = f"hv{secrets.token_hex(2)}", None, nodes
        self.controller_address = self.address() if self.subnet else None
        self.nodes = [f"node{k}" for k in range(1, self.node_count + 1)]
        self.env.update(self.mpi_env())

    # ---------------------------------------------------------------- names and addresses
    def address(self, node: str | None = None) -> str:
        """The bridge's address (node None) or node's."""
        offset = 1 if node is None else 10 + self.nodes.index(node) + 1
        return str(self.subnet.network_address + offset)

    def netns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def veth(self, node: str) -> str:
        return f"{self.prefix}-{node[4:]}"  # the root-side end; interface names stop at 15 characters

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    def mpi_env(self) -> dict:
        """Open MPI leaves loopback addresses out of its TCP transports by default: name this cluster's."""
        if self.subnet is None:
            return {}
        return {
            "OMPI_MCA_btl_tcp_if_include": str(self.subnet),
            "PRTE_MCA_oob_tcp_if_include": str(self.subnet),
            "OMPI_MCA_oob_tcp_if_include": str(self.subnet),
        }

    # ---------------------------------------------------------------- network
    def _build_network(self):
        self.subnet = _pick_subnet()
        self.controller_address = self.address()
        self.env.update(self.mpi_env())
        # Written before anything exists, so that a teardown after any failure knows what to remove.
        self.network_file.write_text(
            json.dumps({"prefix": self.prefix, "subnet": str(self.subnet), "nodes": self.node_count})
        )
        bits = self.subnet.prefixlen
        _ip("link", "add", self.bridge, "type", "bridge")
        _sysctl(f"net.ipv4.conf.{self.bridge}.route_localnet=1")
        _ip("addr", "add", f"{self.address()}/{bits}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        _ip("route", "add", str(self.subnet), "dev", self.bridge, "src", self.address(), "table", "local")
        for node in self.nodes:
            ns, veth, addr = self.netns(node), self.veth(node), self.address(node)
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            for key in ("all", "eth0"):
                _sysctl(f"net.ipv4.conf.{key}.route_localnet=1", netns=ns)
            _ip("addr", "add", f"{addr}/{bits}", "dev", "eth0", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _ip("route", "add", str(self.subnet), "dev", "eth0", "src", addr, "table", "local", netns=ns)

    def _remove_network(self):
        if not self.network_file.exists():
            return
        for node in self.nodes:
            if _ip("netns", "pids", self.netns(node), check=False).returncode == 0:
                _ip("netns", "delete", self.netns(node), check=False)
        _ip("link", "delete", self.bridge, check=False)
        self.network_file.unlink()

    def namespace_pids(self, node: str) -> list[int]:
        result = _ip("netns", "pids", self.netns(node), check=False)
        return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []

    def throttle(self, rate: str | None):
        """Limit each node's link (both directions: its veth's two ends) to ``rate`` (tc syntax, "200mbit"),
        or lift the limit (None). A token bucket: netem is not in every kernel."""
        for node in self.nodes:
            for dev, ns in ((self.veth(node), None), ("eth0", self.netns(node))):
                prefix = ["tc", *(["-n", ns] if ns else [])]
                subprocess.run([*prefix, "qdisc", "del", "dev", dev, "root"], capture_output=True)
                if rate:
                    subprocess.run(
                        [
                            *prefix,
                            "qdisc",
                            "add",
                            "dev",
                            dev,
                            "root",
                            "tbf",
                            "rate",
                            rate,
                            "burst",
                            "256kb",
                            "latency",
                            "50ms",
                        ],
                        check=True,
                        capture_output=True,
                        text=True,
                    )

    # ---------------------------------------------------------------- SLURM
    def write_config(self):
        for node in self.nodes:
            (self.dir / "spool" / node).mkdir(parents=True, exist_ok=True)
            (self.dir / "tmp" / node).mkdir(parents=True, exist_ok=True)
        return super().write_config()

    def slurmd_files(self) -> str:
        d = self.dir
        return (
            f"SlurmdSpoolDir={d}/spool/%n\nSlurmdPidFile={d}/slurmd-%n.pid\nSlurmdLogFile={d}/slurmd-%n.log\n"
            # The nodes share /tmp: PMIx's per-step folder would collide across them ("File exists").
            f"TmpFS={d}/tmp/%n"
        )

    def nodes_section(self) -> str:
        memory = _real_memory_mb() // self.node_count
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={self.address(n)} CPUs={self.cpus} RealMemory={memory} State=UNKNOWN"
            for n in self.nodes
        )
        return f"""# Virtual nodes (tests/slurm/nodes.py): their CPUs are the host's, shared; slurmd takes the configured count.
SlurmdParameters=config_overrides
# A lost node is declared DOWN after this long without an answer (the default, 300 s, is for real clusters).
SlurmdTimeout=10
{nodes}
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"""

    def _start_slurmd(self, node: str):
        """slurmd in the node's namespaces, named by its hostname there."""
        enter = [
            "nsenter",
            f"--net=/run/netns/{self.netns(node)}",
            "unshare",
            "--uts",
            "sh",
            "-c",
            f'hostname {node} && exec "$0" "$@"',
            _which("slurmd"),
            "-f",
            str(self.conf),
        ]
        self._daemon(*enter)

    def start(self, timeout: float = 60.0):
        try:
            self._build_network()
        except BaseException:
            self.stop()
            raise
        return super().start(timeout)

    def _start_compute_daemons(self):
        for node in self.nodes:
            self._start_slurmd(node)

    def node_states(self) -> dict[str, str]:
        result = self._run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return {name: state.rstrip("*~#") for name, state in (line.split() for line in result.stdout.splitlines())}

    def node_state(self) -> str:
        states = set(self.node_states().values())
        return states.pop() if len(states) == 1 and len(self.node_states()) == self.node_count else ""

    def pid_files(self) -> dict[str, Path]:
        files = super().pid_files()
        del files["slurmd"]
        return {**{f"slurmd-{n}": self.dir / f"slurmd-{n}.pid" for n in self.nodes}, **files}

    def kill_node(self, node: str):
        """The node is lost: its slurmd and every process in its namespace get SIGKILL, all at once."""
        pids = self.namespace_pids(node)
        pid = self.pids().get(f"slurmd-{node}")
        _terminate_now(([pid] if pid else []) + pids)

    def revive_node(self, node: str, timeout: float = 30.0):
        """A lost node back in service: its slurmd again, and slurmctld told to use it (State=RESUME)."""
        self._start_slurmd(node)
        self._wait_for(lambda: self.node_states().get(node) in ("idle", "down"), timeout, f"{node} to register")
        self._run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        self._wait_for(lambda: self.node_states().get(node) == "idle", timeout, f"{node} to be idle")

    def stop(self, timeout: float = 15.0):
        """Jobs cancelled, daemons by pid (the slurmds in parallel), then whatever is left in the
        namespaces, then the network. Idempotent; works from DIR alone (the command line's `down`)."""
        super().stop(timeout)
        for node in self.nodes:
            _terminate(self.namespace_pids(node), timeout)
        self._remove_network()


def _terminate_now(pids):
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _sysctl(setting: str, netns: str | None = None):
    cmd = (["ip", "netns", "exec", netns] if netns else []) + ["sysctl", "-q", "-w", setting]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=20)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3) or argv[0] not in ("up", "down", "status"):
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        return 2
    cluster = VirtualCluster(argv[1], nodes=int(argv[2]) if len(argv) == 3 else 2)
    if argv[0] == "up":
        reason = unavailable()
        if reason:
            print(f"cannot build a virtual cluster here: {reason}", file=sys.stderr)
            return 1
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf} " + " ".join(f"{k}={v}" for k, v in cluster.mpi_env().items()))
    elif argv[0] == "down":
        cluster.stop()
    else:
        print(json.dumps({"pids": cluster.pids(), "nodes": cluster.node_states(), "leftovers": cluster.leftovers()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
