"""A real SLURM on a local test cluster (see DESIGN.md, "SLURM on the local test cluster").

On the controller side (this machine's own network namespace, at the cluster's bridge
address): ``munged`` with a key of its own and ``slurmctld``; inside every node
(entered with ``nsenter``, as that node's sshd sees the world): the cgroup mounts that
``slurmd`` insists on, the config bind-mounted over ``/etc/slurm`` (so anything run on
the node, over SSH too, finds it), and one ``slurmd``. Everything lives in
``<cluster state dir>/slurm/`` and every daemon's command line names that directory,
so the cluster's own teardown would still find them; ``down()`` stops them by pid,
nodes first, and says what it could not.

Installs nothing: it needs Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and
``munge`` (``scripts/install-deps``). Client commands find this SLURM through
``SLURM_CONF`` (``env()``); the machine's own ``/etc/slurm`` is never touched.
Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from localcluster import ClusterError, LocalCluster, _alive, _cmdline

__all__ = ["SlurmCluster", "slurm_unavailable_reason"]

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
CGROUP_CONTROLLERS = ("freezer", "cpuset", "memory", "devices")


def _find(tool: str) -> str | None:
    for directory in ("/usr/sbin", "/usr/bin", "/sbin"):
        if os.access(f"{directory}/{tool}", os.X_OK):
            return f"{directory}/{tool}"
    return shutil.which(tool)


def slurm_unavailable_reason() -> str | None:
    """Why no SLURM can run on the local cluster here, or None."""
    missing = [tool for tool in DAEMONS if _find(tool) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): "
                "apt-get install slurmctld slurmd slurm-client munge (scripts/install-deps)")
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        return int(probe.getsockname()[1])


class SlurmCluster:
    """SLURM over the nodes of ``cluster``: one partition ``main`` holding them all."""

    def __init__(self, cluster: LocalCluster, cpus: int = 2, partition: str = "main") -> None:
        self.cluster = cluster
        self.cpus = cpus
        self.partition = partition
        self.dir = cluster.state_dir / "slurm"
        self.etc = self.dir / "etc"
        self.conf = self.etc / "slurm.conf"
        self.socket = self.dir / "munge.socket"
        self.port = 0
        # A node with podman (LocalCluster(containers=True)) has a cgroup2 hierarchy at
        # /sys/fs/cgroup that its crun needs: slurmd's cgroup v1 mounts go elsewhere.
        self.cgroups = "/run/slurm-cgroup" if getattr(cluster, "containers", False) else "/sys/fs/cgroup"
        self._munged: subprocess.Popen[bytes] | None = None
        self._slurmctld: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"SlurmCluster({self.cluster.prefix!r}, {self.dir})"

    # ------------------------------------------------------------------ up

    def up(self) -> SlurmCluster:
        reason = slurm_unavailable_reason()
        if reason is not None:
            raise ClusterError(reason)
        try:
            self.dir.mkdir(mode=0o700)
            self.etc.mkdir()
            self._start_munged()
            self._write_config()
            self._start_slurmctld()
            for name in self.cluster.names:
                self._start_slurmd(name)
            self.wait_idle()
        except BaseException:
            with contextlib.suppress(ClusterError):
                self.down()
            raise
        return self

    def _daemon(self, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.dir / log, "ab") as out:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True)

    def _start_munged(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        # As root, with a socket, pid and seed of its own: the machine's munge stays untouched.
        self._munged = self._daemon([_find("munged") or "munged", "--foreground", "--force",
                                     f"--socket={self.socket}", f"--key-file={key}",
                                     f"--pid-file={self.dir / 'munged.pid'}", f"--seed-file={self.dir / 'munge.seed'}",
                                     f"--log-file={self.dir / 'munged.log'}"], "munged.out")
        self._wait(lambda: self.socket.exists(), 10, "munged did not create its socket", "munged.out")

    def _write_config(self) -> None:
        self.port = _free_port()
        controller = socket.gethostname().split(".")[0]
        lines = [
            f"ClusterName=th{self.cluster.prefix.replace('-', '')[-8:]}",
            f"SlurmctldHost={controller}({self.cluster.bridge_ip})",
            f"SlurmctldPort={self.port}",
            "SlurmdPort=6818",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SlurmUser=root",
            "SlurmdUser=root",
            "ReturnToService=2",
            # Tests end jobs on purpose: SIGKILL 5 s after SIGTERM, not SLURM's 30.
            "KillWait=5",
            f"StateSaveLocation={self.dir / 'state'}",
            f"SlurmdSpoolDir={self.dir / 'spool'}/%n",
            f"SlurmctldPidFile={self.dir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.dir / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.dir / 'spool'}/slurmd-%n.log",
        ]
        lines += [f"NodeName={host.name} NodeAddr={host.ip} CPUs={self.cpus} State=UNKNOWN"
                  for host in self.cluster.hosts]
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        # slurmd insists on a cgroup filesystem even with proctrack/linuxproc.
        (self.etc / "cgroup.conf").write_text(f"CgroupPlugin=cgroup/v1\nCgroupAutomount=yes\n"
                                              f"CgroupMountpoint={self.cgroups}\n")
        (self.etc / "plugstack.conf").write_text("")
        for directory in ("state", "spool"):
            (self.dir / directory).mkdir()

    def _start_slurmctld(self) -> None:
        self._slurmctld = self._daemon([_find("slurmctld") or "slurmctld", "-D", "-i", "-f", str(self.conf)],
                                       "slurmctld.out")
        self._wait(lambda: self.client("scontrol", "ping", check=False).returncode == 0, 20,
                   "slurmctld does not answer scontrol ping", "slurmctld.log")

    def _start_slurmd(self, name: str) -> None:
        """Inside the node: cgroups (``ip netns exec`` hid the host's), the config at
        /etc/slurm, then slurmd, which daemonizes into the node's process table."""
        root = self.cgroups
        mounts = [f"mkdir -p {root} && mount -t tmpfs cg {root}"] + [
            f"mkdir -p {root}/{c} && mount -t cgroup -o {c} cgroup {root}/{c}"
            for c in CGROUP_CONTROLLERS]
        script = " && ".join(mounts + [
            f"mount --bind {shlex.quote(str(self.etc))} /etc/slurm",
            f"mkdir -p {shlex.quote(str(self.dir / 'spool' / name))}",
            f"exec {_find('slurmd') or 'slurmd'} -f {shlex.quote(str(self.conf))} -N {shlex.quote(name)}",
        ])
        self.cluster.node_exec(name, ["sh", "-c", script], timeout=30)

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str, log: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise ClusterError(f"{what} after {timeout:.0f} s:\n{self._tail(log)}")
            time.sleep(0.2)

    def _tail(self, log: str, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.dir / log).read_text(errors="replace").splitlines()[-lines:])
        return ""

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until every node is idle (after start, or after a job was cancelled)."""
        def idle() -> bool:
            states = self.node_states()
            return len(states) == len(self.cluster.names) and all(state == "idle" for state in states.values())

        self._wait(idle, timeout, f"nodes not idle ({self.node_states()})", "slurmctld.log")

    # ------------------------------------------------------------------ use

    def env(self) -> dict[str, str]:
        """The cluster's env (its inventory) plus ``SLURM_CONF``: what a SLURM client needs."""
        return {**self.cluster.env(), "SLURM_CONF": str(self.conf)}

    def client(self, *argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                              env={**os.environ, "SLURM_CONF": str(self.conf)})
        if check and done.returncode != 0:
            raise ClusterError(f"`{shlex.join(argv)}` failed: {(done.stderr or done.stdout).strip()}")
        return done

    def node_states(self) -> dict[str, str]:
        out = self.client("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        return dict(line.split(None, 1) for line in out.splitlines() if len(line.split(None, 1)) == 2)

    def queue(self) -> list[str]:
        """The ids of the jobs SLURM still runs or holds (pending, running, completing)."""
        return self.client("squeue", "-h", "-o", "%i").stdout.split()

    def drain(self, node: str, reason: str) -> None:
        self.client("scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}")

    def resume(self, node: str) -> None:
        self.client("scontrol", "update", f"nodename={node}", "state=resume")

    def inventory(self, path: Path, **slurm: object) -> Path:
        """The cluster's own inventory with ``scheduler = "slurm"`` and a ``[slurm]`` table."""
        text = self.cluster.inventory.read_text().replace("[cluster]\n", '[cluster]\nscheduler = "slurm"\n', 1)
        table = {"partition": self.partition, **slurm}
        text += "\n[slurm]\n" + "".join(f"{key} = {_toml(value)}\n" for key, value in table.items())
        # ssh_config stays relative to the cluster's own directory.
        text = text.replace('ssh_config = "ssh_config"', f'ssh_config = "{self.cluster.ssh_config}"')
        path.write_text(text)
        return path

    # ------------------------------------------------------------------ down

    def down(self) -> None:
        """Every slurmd, slurmctld, munged stopped by pid (nodes first); the directory
        removed. Raises ClusterError naming what survived."""
        with contextlib.suppress(ClusterError, OSError, subprocess.SubprocessError):
            if self._slurmctld is not None and self._slurmctld.poll() is None:
                self.client("scancel", "--full", "--signal=KILL", "--partition", self.partition, check=False,
                            timeout=10)
        mine = f"{self.dir}/"
        for name in self.cluster.names:
            with contextlib.suppress(ClusterError):
                for pid in self.cluster.node_pids(name):
                    if mine in (_cmdline(pid) or ""):
                        _stop(pid)
        for daemon in (self._slurmctld, self._munged):
            if daemon is not None and daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait(timeout=5)
        left = [pid for pid in _pids() if mine in (_cmdline(pid) or "") and _alive(pid)]
        for pid in left:
            _stop(pid)
        left = [f"{pid} {_cmdline(pid)}" for pid in left if _alive(pid)]
        shutil.rmtree(self.dir, ignore_errors=True)
        if left:
            raise ClusterError(f"{self!r} left behind: " + "; ".join(left))


def _stop(pid: int) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 3.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _alive(pid):
            return


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
