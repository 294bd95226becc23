"""The SSH transport against real sshds: ssh_config honoured, host keys verified,
every way a connection fails named, commands and streams byte-exact."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest
from localcluster import LocalCluster

from torchherd.errors import TransportError
from torchherd.inventory import Inventory, load
from torchherd.transport import connect_all
from torchherd.transport.ssh import SshConnector, resolve_target

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> LocalCluster:
    from support.cluster_build import start_cluster

    cluster = start_cluster(2, tmp_path_factory.mktemp("transport"))
    yield cluster  # type: ignore[misc]
    cluster.down()


def inventory_of(cluster: LocalCluster) -> Inventory:
    return load(cluster.inventory)


def test_ssh_config_alias_resolves_to_the_node(two: LocalCluster) -> None:
    inventory = inventory_of(two)
    target = resolve_target(inventory.hosts[1], inventory.cluster.ssh_config)
    assert (target.hostname, target.port, target.user) == (two.node("node1").ip, 22, "root")
    assert target.known_hosts == (str(two.known_hosts),)


def test_run_returns_exit_code_and_exact_bytes(two: LocalCluster) -> None:
    inventory = inventory_of(two)
    with SshConnector(inventory.cluster.ssh_config, 10).connect(inventory.hosts[1]) as connection:
        result = connection.run("hostname; cat; printf 'err\\xff' >&2; exit 7", stdin=b"in\x00put\n")
    assert not connection.is_alive()
    assert result.exit_code == 7
    assert result.stdout == b"node1\nin\x00put\n"
    assert result.stderr == b"err\xff"


def test_connect_all_reports_each_node_separately(two: LocalCluster) -> None:
    inventory = inventory_of(two)
    two.stop_sshd("node1")
    try:
        results = connect_all(SshConnector(inventory.cluster.ssh_config, 5), inventory.hosts)
        assert list(results.succeeded) == ["node0"] and list(results.failed) == ["node1"]
        error = results.failed["node1"]
        assert error.kind == "refused"
        assert str(error) == f"node1: connection refused by root@{two.node('node1').ip}:22"
        results.close()
        assert not results.succeeded["node0"].is_alive()
    finally:
        two.start_sshd("node1")


def _with_known_hosts(cluster: LocalCluster, tmp_path: Path, edit: Callable[[str], str]) -> Inventory:
    config = tmp_path / "ssh_config"
    known = tmp_path / "known_hosts"
    known.write_text(edit(cluster.known_hosts.read_text()))
    config.write_text(cluster.ssh_config.read_text().replace(str(cluster.known_hosts), str(known)))
    text = cluster.inventory.read_text().replace('ssh_config = "ssh_config"', f'ssh_config = "{config}"')
    path = tmp_path / "hosts.toml"
    path.write_text(text)
    return load(path)


def test_unknown_host_key_is_refused_with_how_to_accept(two: LocalCluster, tmp_path: Path) -> None:
    ip = two.node("node1").ip
    inventory = _with_known_hosts(two, tmp_path, lambda text: "".join(
        line + "\n" for line in text.splitlines() if "node1" not in line and ip not in line))
    with pytest.raises(TransportError) as caught:
        SshConnector(inventory.cluster.ssh_config, 5).connect(inventory.host("node1"))
    assert caught.value.kind == "host-key-unknown"
    assert str(caught.value).startswith(f"node1: unknown SSH host key for {ip} (ssh-ed25519 SHA256:")
    assert "--accept-new-host-keys" in caught.value.hint
    accepted = SshConnector(inventory.cluster.ssh_config, 5, True).connect(inventory.host("node1"))
    accepted.close()
    assert ip in (tmp_path / "known_hosts").read_text()
    SshConnector(inventory.cluster.ssh_config, 5).connect(inventory.host("node1")).close()


def test_changed_host_key_is_always_refused(two: LocalCluster, tmp_path: Path) -> None:
    node0_key = two.known_hosts.read_text().splitlines()[0].split()[1:]
    ip = two.node("node1").ip

    def swap(text: str) -> str:
        lines = [line for line in text.splitlines() if "node1" not in line and ip not in line]
        return "\n".join(lines + [f"{ip} {' '.join(node0_key)}"]) + "\n"

    inventory = _with_known_hosts(two, tmp_path, swap)
    for accept_new in (False, True):
        with pytest.raises(TransportError) as caught:
            SshConnector(inventory.cluster.ssh_config, 5, accept_new).connect(inventory.host("node1"))
        assert caught.value.kind == "host-key-changed"
        assert "CHANGED" in str(caught.value) and f"ssh-keygen -R {ip}" in caught.value.hint


def test_wrong_key_is_an_authentication_failure(two: LocalCluster, tmp_path: Path) -> None:
    inventory = inventory_of(two)
    other_key = tmp_path / "other"
    shutil.copy(two.identity_file, other_key)
    import subprocess

    other_key.unlink()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True)
    host = inventory.host("node1")
    from dataclasses import replace

    with pytest.raises(TransportError) as caught:
        SshConnector(inventory.cluster.ssh_config, 5).connect(replace(host, identity_file=str(other_key)))
    assert caught.value.kind == "auth"
    assert str(caught.value).startswith(f"node1: authentication failed for root@{two.node('node1').ip}")


def test_unreachable_address_times_out_quickly(two: LocalCluster) -> None:
    inventory = inventory_of(two)
    import time
    from dataclasses import replace

    nobody = str(two.subnet.network_address + 250)  # on the bridge's subnet, but no host has it
    host = replace(inventory.host("node1"), address=nobody)
    started = time.monotonic()
    with pytest.raises(TransportError) as caught:
        SshConnector(None, 2).connect(host)
    assert caught.value.kind in ("timeout", "unreachable")
    assert time.monotonic() - started < 6


def test_aes_gcm_is_offered_first_and_a_server_without_it_gets_ctr(two: LocalCluster) -> None:
    """One OpenSSL call per packet instead of a MAC apart (``_transport_class``); an sshd that
    allows CTR only still answers, as it did before GCM was offered first."""
    inventory = inventory_of(two)
    connector = SshConnector(inventory.cluster.ssh_config, 10)
    with connector.connect(inventory.hosts[1]) as connection:
        assert connection.run("true").exit_code == 0
        transport = connection.client.get_transport()
        assert (transport.local_cipher, transport.remote_cipher) == ("aes128-gcm@openssh.com",) * 2
    config = two._node_dir("node1") / "sshd_config"
    original = config.read_text()
    two.stop_sshd("node1")
    try:
        config.write_text(original + "Ciphers aes128-ctr,aes256-ctr\n")
        two.start_sshd("node1")
        with connector.connect(inventory.hosts[1]) as connection:
            assert connection.run("echo ok").stdout == b"ok\n"
            transport = connection.client.get_transport()
            assert (transport.local_cipher, transport.remote_cipher) == ("aes128-ctr",) * 2
    finally:
        two.stop_sshd("node1")
        config.write_text(original)
        two.start_sshd("node1")
