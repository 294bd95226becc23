"""The local test cluster behaves like several real hosts.

Everything here goes through the plain OpenSSH client (``ssh -F ssh_config``), as
a user would, so these tests also prove that the generated ssh_config,
known_hosts and keys work.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import localcluster
import pytest
from localcluster import (
    ClusterError,
    ClusterUnavailable,
    LocalCluster,
    NodeInfo,
    choose_subnet,
    leftovers,
    subnet_prefixlen,
    unavailable_reason,
)

from support.processes import wait_until

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
PORT = 29500

LISTENER = textwrap.dedent(
    """
    import os, socket, sys, threading
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[1])))
    s.listen(16)
    print("listening", flush=True)
    # Exit when the controller closes stdin (the ssh client ends).
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    while True:
        s.accept()[0].close()
    """
)

PROBE = textwrap.dedent(
    """
    import socket, sys
    port = int(sys.argv[1])
    for host in sys.argv[2:]:
        try:
            socket.create_connection((host, port), timeout=2).close()
            print(host, "ok")
        except socket.timeout:
            print(host, "timeout")
        except OSError as exc:
            print(host, "error", exc.errno)
    """
)

ALL_REDUCE = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(f"rank {rank} of {dist.get_world_size()} sum {int(value.item())}", flush=True)
    dist.destroy_process_group()
    """
)


def py(script: str, *args: str) -> str:
    """A shell command that runs ``script`` with the cluster's python."""
    return shlex.join([PY, "-c", script, *args])


def plain_ssh(
    cluster: LocalCluster, name: str, command: str, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ssh", "-F", str(cluster.ssh_config), name, command],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def listeners(cluster: LocalCluster) -> Iterator[Callable[[str, int], None]]:
    """``listen(node, port)``: a TCP listener on that node for the test's duration."""
    started: list[tuple[str, subprocess.Popen[str]]] = []

    def listen(name: str, port: int) -> None:
        proc = subprocess.Popen(
            cluster.ssh_argv(name, py(LISTENER, str(port))),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append((name, proc))
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "listening", proc.stderr.read() if proc.stderr else line

    yield listen
    for name, proc in started:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
        assert cluster.wait_no_processes(name) == []


@pytest.mark.timeout(60)
def test_each_host_answers_plain_ssh_with_its_own_hostname(
    cluster: LocalCluster,
) -> None:
    assert cluster.names == ["node0", "node1", "node2"]
    for host in cluster.hosts:
        result = plain_ssh(cluster, host.name, "hostname; ip -4 -o addr show dev eth0")
        assert result.returncode == 0, result.stderr
        hostname, addr = result.stdout.splitlines()
        assert hostname == host.name
        assert f"inet {host.ip}/24" in addr
        assert host.namespace == f"{cluster.prefix}-{host.name}"
        assert ipaddress.IPv4Address(host.ip) in cluster.subnet


@pytest.mark.timeout(60)
def test_host_keys_are_verified(cluster: LocalCluster, tmp_path: Path) -> None:
    # The same node with a known_hosts that does not know it: refused.
    other = tmp_path / "known_hosts"
    other.write_text("")
    result = subprocess.run(
        [
            "ssh",
            "-F",
            str(cluster.ssh_config),
            "-o",
            f"UserKnownHostsFile={other}",
            "node0",
            "true",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 255
    assert "Host key verification failed" in result.stderr
    # known_hosts names every node both by name and by address.
    lines = cluster.known_hosts.read_text().splitlines()
    for host in cluster.hosts:
        assert any(
            line.startswith(f"{host.name},{host.ip} ssh-ed25519 ") for line in lines
        )


@pytest.mark.timeout(60)
def test_every_node_resolves_every_node_name(cluster: LocalCluster) -> None:
    names = " ".join(cluster.names)
    expected = {host.name: host.ip for host in cluster.hosts}
    for host in cluster.hosts:
        result = plain_ssh(cluster, host.name, f"getent hosts {names}")
        assert result.returncode == 0, result.stderr
        # getent hosts asks for IPv6 first: each node's IPv4-mapped line answers it
        resolved = {
            line.split()[1]: line.split()[0] for line in result.stdout.splitlines()
        }
        assert resolved == {name: f"::ffff:{ip}" for name, ip in expected.items()}
        # The node's own hostname resolves to its real, non-loopback address.
        own = plain_ssh(
            cluster,
            host.name,
            py("import socket; print(socket.gethostbyname(socket.gethostname()))"),
        )
        assert own.stdout.strip() == host.ip
    assert (
        plain_ssh(cluster, "node0", "getent ahostsv4 node1").stdout.split()[0]
        == cluster.node("node1").ip
    )
    # Reverse lookups of a peer's IPv4-mapped address (what c10d's store does) name it.
    peer = cluster.node("node1").ip
    reverse = plain_ssh(cluster, "node0", py(
        f"import socket; print(socket.getnameinfo(('::ffff:{peer}', 0, 0, 0), socket.NI_NAMEREQD)[0])"))
    assert reverse.stdout.strip() == "node1", reverse.stderr


@pytest.mark.timeout(90)
def test_firewall_rule_blocks_only_its_own_host(
    cluster: LocalCluster, listeners: Callable[[str, int], None]
) -> None:
    listeners("node1", PORT)
    listeners("node2", PORT)
    probe = py(PROBE, str(PORT), "node1", "node2")
    assert plain_ssh(cluster, "node0", probe).stdout.split("\n")[:2] == [
        "node1 ok",
        "node2 ok",
    ]

    rule = ["-p", "tcp", "--dport", str(PORT), "-j", "DROP"]
    cluster.netns_exec("node1", ["iptables", "-A", "INPUT", *rule])
    try:
        listing = plain_ssh(cluster, "node1", "iptables -S INPUT").stdout
        assert f"--dport {PORT} -j DROP" in listing
        assert (
            f"--dport {PORT}"
            not in plain_ssh(cluster, "node2", "iptables -S INPUT").stdout
        )
        result = plain_ssh(cluster, "node0", probe)
        assert result.stdout.splitlines() == ["node1 timeout", "node2 ok"], (
            result.stderr
        )
        # SSH to the firewalled node itself still works: only that port is dropped.
        assert plain_ssh(cluster, "node1", "hostname").stdout.strip() == "node1"
    finally:
        cluster.netns_exec("node1", ["iptables", "-D", "INPUT", *rule])
    assert plain_ssh(cluster, "node0", probe).stdout.splitlines() == [
        "node1 ok",
        "node2 ok",
    ]


@pytest.mark.timeout(60)
def test_private_tmp_is_private_to_each_node(cluster: LocalCluster) -> None:
    path = f"/tmp/private-{uuid.uuid4().hex}"
    cluster.write_file("node0", path, "written on node0\n")
    cluster.write_file("node1", path, "written on node1\n")
    assert cluster.read_file("node0", path) == "written on node0\n"
    assert cluster.read_file("node1", path) == "written on node1\n"
    assert plain_ssh(cluster, "node2", f"test -e {path}").returncode == 1
    assert not os.path.exists(path), "a node's /tmp leaked into the controller's"
    # The rest of the filesystem is shared: the python with torch is there.
    assert plain_ssh(cluster, "node2", f"test -x {shlex.quote(PY)}").returncode == 0
    assert "/tmp" in plain_ssh(cluster, "node0", "findmnt -n -o TARGET /tmp").stdout


@pytest.mark.timeout(60)
def test_ps_on_a_node_shows_only_that_nodes_processes(cluster: LocalCluster) -> None:
    started = plain_ssh(
        cluster, "node1", "sleep 3141 >/dev/null 2>&1 </dev/null & echo $!"
    )
    marker_pid = int(started.stdout.strip())
    try:
        on_node0 = plain_ssh(cluster, "node0", "ps -eo pid=,args=").stdout.splitlines()
        on_node1 = plain_ssh(cluster, "node1", "ps -eo pid=,args=").stdout.splitlines()
        assert on_node0[0].split(None, 1) == ["1", on_node0[0].split(None, 1)[1]]
        assert "sshd" in on_node0[0] and "[listener]" in on_node0[0]
        for line in on_node0:
            args = line.split(None, 1)[1]
            assert args.startswith(("sshd", "bash -c ps", "ps -eo")), (
                f"foreign process on node0: {line}"
            )
        assert not any("sleep 3141" in line for line in on_node0)
        assert any(
            line.split(None, 1) == [str(marker_pid), "sleep 3141"] for line in on_node1
        )
        assert "sleep 3141" in cluster.processes("node1")
        assert cluster.processes("node0") == []
    finally:
        plain_ssh(cluster, "node1", f"kill {marker_pid}")
    assert cluster.wait_no_processes("node1") == []


# slow: CI's product tests prove the same of the cluster on every run: test_run.py's DDP demo
# (3 hosts x 2 ranks, gloo, every rank's loss equal) and its --no-warm run (torchrun started cold
# on each host). This one, plain torchrun over plain ssh, tells the harness from the product
# when those fail (`scripts/test -m "" tests/cluster/test_local_cluster.py`).
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_gloo_all_reduce_across_two_hosts(cluster: LocalCluster) -> None:
    script = "/tmp/all_reduce.py"
    master = cluster.node("node0").ip
    for name in ("node0", "node1"):
        cluster.write_file(name, script, ALL_REDUCE)
    procs = {}
    for rank, name in enumerate(("node0", "node1")):
        command = shlex.join(
            [
                PY,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(rank),
                "--master-addr",
                master,
                "--master-port",
                str(PORT),
                script,
            ]
        )
        procs[name] = subprocess.Popen(
            cluster.ssh_argv(name, f"cd /tmp && {command}"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    outputs = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=200)
            outputs[name] = out
            assert proc.returncode == 0, f"{name}: torchrun failed\n{out}\n{err}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = sorted(
        re.findall(r"rank (\d) of 4 sum (\d+)", outputs["node0"] + outputs["node1"])
    )
    assert lines == [("0", "10"), ("1", "10"), ("2", "10"), ("3", "10")], outputs
    assert sorted(re.findall(r"rank (\d)", outputs["node0"])) == ["0", "1"]
    assert sorted(re.findall(r"rank (\d)", outputs["node1"])) == ["2", "3"]
    for name in ("node0", "node1"):
        assert cluster.wait_no_processes(name) == [], (
            f"torchrun left processes on {name}"
        )


@pytest.mark.timeout(60)
def test_cut_and_restore_network(cluster: LocalCluster) -> None:
    probe = py(PROBE, "22", "node2")
    assert plain_ssh(cluster, "node0", probe).stdout.strip() == "node2 ok"
    cluster.cut_network("node2")
    try:
        assert plain_ssh(cluster, "node0", probe).stdout.strip() == "node2 timeout"
        result = subprocess.run(
            cluster.ssh_argv("node2", "true", "-o", "ConnectTimeout=2"),
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
        assert result.returncode == 255
    finally:
        cluster.restore_network("node2")
    assert plain_ssh(cluster, "node0", probe).stdout.strip() == "node2 ok"
    assert plain_ssh(cluster, "node2", "hostname").stdout.strip() == "node2"


@pytest.mark.timeout(60)
def test_stop_and_start_sshd_ends_everything_on_the_node(cluster: LocalCluster) -> None:
    plain_ssh(cluster, "node2", "sleep 2718 >/dev/null 2>&1 </dev/null &")
    cluster.write_file("node2", "/tmp/before-stop", "x")
    assert wait_until(lambda: "sleep 2718" in cluster.processes("node2"), timeout=20)
    cluster.stop_sshd("node2")
    assert cluster.node_pids("node2") == []
    assert plain_ssh(cluster, "node2", "true").returncode == 255
    cluster.start_sshd("node2")
    assert plain_ssh(cluster, "node2", "hostname").stdout.strip() == "node2"
    assert plain_ssh(cluster, "node2", "test -e /tmp/before-stop").returncode == 1
    assert cluster.processes("node2") == []
    # node_exec sees the node as its sshd does, without SSH.
    assert cluster.node_exec("node2", ["hostname"]).stdout.strip() == "node2"


@pytest.mark.timeout(60)
def test_inventory_and_ssh_config(cluster: LocalCluster) -> None:
    tomllib = pytest.importorskip("tomllib")

    inventory = tomllib.loads(cluster.inventory.read_text())
    assert inventory["cluster"] == {
        "master": "node0",
        "port": 29500,
        "nproc_per_node": 2,
        "ssh_config": "ssh_config",
    }
    assert inventory["defaults"] == {"python": PY, "workdir": "/tmp"}
    assert inventory["hosts"] == [
        {"name": "node0"},
        {"name": "node1"},
        {"name": "node2"},
    ]
    assert (
        cluster.inventory.parent / inventory["cluster"]["ssh_config"]
    ) == cluster.ssh_config
    config = cluster.ssh_config.read_text()
    for host in cluster.hosts:
        assert (
            f"Host {host.name}\n    HostName {host.ip}\n    User root\n    Port 22\n"
            in config
        )
    for option in (
        "StrictHostKeyChecking yes",
        "IdentitiesOnly yes",
        "BatchMode yes",
        f"IdentityFile {cluster.identity_file}",
        f"UserKnownHostsFile {cluster.known_hosts}",
    ):
        assert option in config
    assert cluster.identity_file.stat().st_mode & 0o077 == 0


@pytest.mark.timeout(90)
def test_clusters_with_different_prefixes_coexist(
    cluster: LocalCluster, make_cluster: Callable[..., LocalCluster]
) -> None:
    other = make_cluster(2)
    assert other.prefix != cluster.prefix
    assert not other.subnet.overlaps(cluster.subnet)
    assert other.bridge != cluster.bridge
    assert plain_ssh(other, "node1", "hostname").stdout.strip() == "node1"
    assert plain_ssh(cluster, "node1", "hostname").stdout.strip() == "node1"
    # The two clusters' nodes do not see each other.
    probe = py(PROBE, "22", cluster.node("node1").ip)
    assert "ok" not in plain_ssh(other, "node0", probe).stdout


@pytest.mark.timeout(90)
def test_down_leaves_nothing_behind(make_cluster: Callable[..., LocalCluster]) -> None:
    made = make_cluster(2)
    prefix, inodes = made.prefix, made.netns_inodes
    marker = f"sleep 1618.{os.getpid()}"  # unique on this machine
    assert leftovers(prefix, inodes) != []
    # Something still running on a node, as a failed job would leave it.
    plain_ssh(made, "node1", f"setsid {marker} >/dev/null 2>&1 </dev/null &")
    # ssh returns once bash forked the background job, maybe before it exec'd sleep.
    assert wait_until(lambda: marker in made.processes("node1"), timeout=20)
    sshd_pids = [made.sshd_pid(name) for name in made.names]
    assert all(sshd_pids)

    made.down()

    assert leftovers(prefix, inodes) == []
    netns = subprocess.run(
        ["ip", "netns", "list"], check=False, capture_output=True, text=True
    ).stdout
    links = subprocess.run(
        ["ip", "-o", "link", "show"], check=False, capture_output=True, text=True
    ).stdout
    assert f"{prefix}-" not in netns
    assert f"{prefix}-" not in links
    assert not Path(f"/etc/netns/{prefix}-node0").exists()
    for pid in sshd_pids:
        assert not Path(f"/proc/{pid}").exists()
    ps = subprocess.run(
        ["ps", "-eo", "args"], check=False, capture_output=True, text=True
    ).stdout
    assert marker not in ps
    assert f"/run/torchherd-cluster/{prefix}/" not in ps
    assert not made.ssh_config.exists() and not made.inventory.exists()
    made.down()  # idempotent


@pytest.mark.timeout(90)
def test_up_cleans_leftovers_of_the_same_prefix(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    first = make_cluster(2)
    again = LocalCluster(1, tmp_path / "again", first.prefix)
    try:
        again.up()
        assert leftovers(first.prefix) != []
        assert again.names == ["node0"]
        assert not Path(f"/run/netns/{first.prefix}-node1").exists()
        assert plain_ssh(again, "node0", "hostname").stdout.strip() == "node0"
    finally:
        again.down()
    assert leftovers(first.prefix) == []


@pytest.mark.timeout(60)
def test_up_failing_halfway_leaves_nothing_behind(
    tmp_path: Path,
    cluster_prefix: Callable[[], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    start = LocalCluster._start_sshd

    def start_but_break_node1(self: LocalCluster, host: NodeInfo) -> None:
        if host.name == "node1":
            raise ClusterError("node1 breaks on purpose")
        start(self, host)

    monkeypatch.setattr(LocalCluster, "_start_sshd", start_but_break_node1)
    broken = LocalCluster(3, tmp_path, cluster_prefix())
    with pytest.raises(ClusterError, match="on purpose"):
        broken.up()
    assert leftovers(broken.prefix) == []
    assert not broken.is_up and broken.hosts == []
    broken.down()


def test_a_cluster_past_253_nodes_gets_a_wider_subnet() -> None:
    # A /24 holds the bridge (.1) and 253 nodes (.2-.254); small clusters keep theirs.
    assert [subnet_prefixlen(n) for n in (1, 3, 253, 254, 256, 509, 510)] == [24, 24, 24, 23, 23, 23, 22]
    wide = choose_subnet("tcwide", 23)
    assert wide.prefixlen == 23 and wide.subnet_of(ipaddress.IPv4Network("10.128.0.0/9"))
    assert choose_subnet("tcwide") == choose_subnet("tcwide", 24)


def test_bad_prefixes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="too long"):
        LocalCluster(2, tmp_path, "averyverylongprefix")
    with pytest.raises(ValueError, match="prefix"):
        LocalCluster(2, tmp_path, "bad prefix")
    with pytest.raises(ValueError):
        LocalCluster(0, tmp_path)


def test_without_root_up_raises_cluster_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import localcluster

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(localcluster, "_unavailable_cache", [])
    with pytest.raises(ClusterUnavailable, match="needs root"):
        LocalCluster(2, tmp_path, "tcnoroot").up()


@pytest.mark.timeout(120)
def test_cli_up_status_down(tmp_path: Path, cluster_prefix: Callable[[], str]) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    prefix = cluster_prefix()
    cli = [sys.executable, str(REPO / "scripts" / "local-cluster")]
    workdir = tmp_path / "cli"
    up = subprocess.run(
        [*cli, "up", "2", "--dir", str(workdir), "--prefix", prefix],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        assert up.returncode == 0, up.stderr
        assert str(workdir / "hosts.toml") in up.stdout
        assert "torchherd -i" in up.stdout
        # The sshds outlive the CLI process that started them.
        attached = LocalCluster.attach(workdir)
        assert attached.prefix == prefix
        assert plain_ssh(attached, "node1", "hostname").stdout.strip() == "node1"
        status = subprocess.run(
            [*cli, "status", "--prefix", prefix],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert (
            prefix in status.stdout
            and "node1" in status.stdout
            and "up" in status.stdout
        )
    finally:
        down = subprocess.run(
            [*cli, "down", "--dir", str(workdir)],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert down.returncode == 0, down.stderr
    assert leftovers(prefix) == []
    with pytest.raises(ClusterError):
        LocalCluster.attach(workdir)


@pytest.mark.timeout(60)
def test_a_process_started_after_the_clusters_namespaces_were_deleted_is_none_of_its_leftovers(
        cluster_prefix: Callable[[], str]) -> None:
    """The kernel reuses a network namespace's inode number once the namespace is gone, so a
    recorded number may name a namespace made since (CI run 22: a headless chromium of
    another worker's test was called this worker's leftover). Only a process that had started
    by the time its namespace was deleted can be one of the cluster's leftovers, judged per
    namespace: a cluster brought up again deletes namespaces at two times, and the later one
    must not claim a namespace made between them (CI, stop 53: another worker's
    ``check -H localhost`` in an unnamed namespace, in test_up_cleans_leftovers_of_the_same_prefix)."""
    prefix = cluster_prefix()
    earlier = subprocess.Popen(["unshare", "--net", "sleep", "60"])
    later: subprocess.Popen[bytes] | None = None
    inode, other = -1, -2  # no namespace has a negative inode
    try:
        own = os.readlink("/proc/self/ns/net")
        assert wait_until(lambda: os.readlink(f"/proc/{earlier.pid}/ns/net") != own, timeout=10)
        inode = int(os.readlink(f"/proc/{earlier.pid}/ns/net")[len("net:["):-1])
        time.sleep(0.1)
        localcluster._DELETED_AT[inode] = localcluster._since_boot()  # as teardown records it
        time.sleep(0.1)
        later = subprocess.Popen(["nsenter", f"--net=/proc/{earlier.pid}/ns/net", "sleep", "60"])
        assert wait_until(lambda: os.readlink(f"/proc/{later.pid}/ns/net") == f"net:[{inode}]", timeout=10)
        time.sleep(0.1)
        localcluster._DELETED_AT[other] = localcluster._since_boot()  # the prefix's second teardown
        found = leftovers(prefix, [inode, other])
        assert [line for line in found if line.startswith(f"process {earlier.pid}:")], found
        assert not [line for line in found if line.startswith(f"process {later.pid}:")], found
    finally:
        for process in (earlier, later):
            if process is not None:
                process.kill()
                process.wait(timeout=10)
        localcluster._DELETED_AT.pop(inode, None)
        localcluster._DELETED_AT.pop(other, None)
