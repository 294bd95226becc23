"""Host keys on real sshds, every hop checked: a node behind a bastion (``jump0``).

Each test writes its own known_hosts and an ssh_config whose first ``Host *`` block
says what the test needs (first value wins over the cluster's own blocks).
"""

from __future__ import annotations

import base64
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from localcluster import LocalCluster

from torchherd.cli import main
from torchherd.errors import TransportError
from torchherd.inventory import Inventory, load
from torchherd.transport import knownhosts
from torchherd.transport.ssh import SshConnector

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def behind(tmp_path_factory: pytest.TempPathFactory) -> LocalCluster:
    from support.cluster_build import start_cluster

    cluster = start_cluster(1, tmp_path_factory.mktemp("hostkeys"), jump_hosts=1)
    yield cluster  # type: ignore[misc]
    cluster.down()


@dataclass(frozen=True)
class Keys:
    """The cluster's host keys, as known_hosts lines would hold them."""

    cluster: LocalCluster

    def blob(self, name: str) -> bytes:
        text = (self.cluster.state_dir / name / "ssh_host_ed25519_key.pub").read_text()
        return base64.b64decode(text.split()[1])

    def line(self, hosts: str, name: str, marker: str = "") -> str:
        return (f"{marker} " if marker else "") + knownhosts.entry_line(hosts, self.blob(name), hashed=False)

    def ip(self, name: str) -> str:
        return self.cluster.node(name).ip


def variant(cluster: LocalCluster, tmp_path: Path, known: str, options: str = "") -> Inventory:
    """The cluster's inventory with a known_hosts of the test's own and ``options`` first."""
    path = tmp_path / "known_hosts"
    path.write_text(known)
    config = tmp_path / "ssh_config"
    text = cluster.ssh_config.read_text().replace(str(cluster.known_hosts), str(path))
    config.write_text(f"Host *\n{options}\n" + text)
    inventory = tmp_path / "hosts.toml"
    inventory.write_text(cluster.inventory.read_text().replace('ssh_config = "ssh_config"',
                                                               f'ssh_config = "{config}"'))
    return load(inventory)


def connect(inventory: Inventory, accept_new: bool = False) -> TransportError | None:
    connector = SshConnector(inventory.cluster.ssh_config, 10.0, accept_new)
    try:
        session = connector.connect(inventory.hosts[0])
    except TransportError as error:
        return error
    assert session.run("hostname").stdout == b"node0\n"
    session.close()
    assert connector._shared.chains == {}, "the bastion connection outlived the last session"
    return None


def test_the_cluster_as_built_connects_through_the_bastion(behind: LocalCluster, tmp_path: Path) -> None:
    keys = Keys(behind)
    assert connect(variant(behind, tmp_path, keys.line(keys.ip("jump0"), "jump0") +
                           keys.line(keys.ip("node0"), "node0"))) is None


def test_a_revoked_key_is_refused_loudly_whatever_the_flags(behind: LocalCluster, tmp_path: Path) -> None:
    keys = Keys(behind)
    known = keys.line(keys.ip("jump0"), "jump0") + keys.line(keys.ip("node0"), "node0") + keys.line("*", "node0",
                                                                                                     "@revoked")
    inventory = variant(behind, tmp_path, known, "    StrictHostKeyChecking no")
    for accept_new in (False, True):
        error = connect(inventory, accept_new)
        assert error is not None and error.kind == "host-key-revoked"
        assert str(error).startswith(f"node0: SSH host key of {keys.ip('node0')} is REVOKED ")
        assert "known_hosts:3" in str(error) and "do not connect" in error.hint


def test_a_revoked_bastion_key_stops_every_node_behind_it(behind: LocalCluster, tmp_path: Path) -> None:
    keys = Keys(behind)
    known = keys.line(keys.ip("node0"), "node0") + keys.line(keys.ip("jump0"), "jump0", "@revoked")
    error = connect(variant(behind, tmp_path, known), accept_new=True)
    assert error is not None and error.kind == "host-key-revoked"
    assert str(error).startswith(f"node0: jump host jump0: SSH host key of {keys.ip('jump0')} is REVOKED")


def test_a_host_vouched_for_only_by_a_ca_is_refused_with_a_reason(behind: LocalCluster, tmp_path: Path) -> None:
    keys = Keys(behind)
    known = keys.line(keys.ip("jump0"), "jump0") + keys.line("10.*", "jump0", "@cert-authority")
    error = connect(variant(behind, tmp_path, known), accept_new=True)
    assert error is not None and error.kind == "host-key-cert"
    assert "cannot verify SSH host certificates" in str(error) and "ssh-keyscan" in error.hint


def test_a_key_of_another_type_on_record_is_refused_as_changed(behind: LocalCluster, tmp_path: Path) -> None:
    keys = Keys(behind)
    subprocess.run(["ssh-keygen", "-q", "-t", "rsa", "-b", "2048", "-N", "", "-f", str(tmp_path / "rsa")], check=True)
    rsa = (tmp_path / "rsa.pub").read_text().split()[1]
    known = keys.line(keys.ip("jump0"), "jump0") + f"{keys.ip('node0')} ssh-rsa {rsa}\n"
    error = connect(variant(behind, tmp_path, known), accept_new=True)
    assert error is not None and error.kind == "host-key-changed"
    assert "CHANGED" in str(error) and "known_hosts has ssh-rsa" in str(error)
    assert f"ssh-keygen -R {keys.ip('node0')} -f " in error.hint


def test_accept_new_records_hashed_in_the_first_user_file_then_verifies(behind: LocalCluster, tmp_path: Path) -> None:
    keys = Keys(behind)
    first, second = tmp_path / "first", tmp_path / "second"
    second.write_text(keys.line(keys.ip("jump0"), "jump0"))
    inventory = variant(behind, tmp_path, "", f"    UserKnownHostsFile {first} {second}\n    HashKnownHosts yes")
    error = connect(inventory)
    assert error is not None and error.kind == "host-key-unknown" and "--accept-new-host-keys" in error.hint
    assert connect(inventory, accept_new=True) is None
    recorded = first.read_text()
    assert recorded.startswith("|1|") and keys.ip("node0") not in recorded
    assert knownhosts.for_name(knownhosts.load([str(first)]), keys.ip("node0")).verdict(
        keys.blob("node0")).kind == "known"
    assert connect(inventory) is None


def test_host_key_alias_and_global_files_are_honoured(behind: LocalCluster, tmp_path: Path) -> None:
    keys = Keys(behind)
    system = tmp_path / "ssh_known_hosts"
    system.write_text(keys.line("the-bastion", "jump0") + keys.line(f"[{keys.ip('node0')}]:22,{keys.ip('node0')}",
                                                                      "node0"))
    config = f"    GlobalKnownHostsFile {tmp_path}/missing {system}\nHost jump0\n    HostKeyAlias the-bastion"
    assert connect(variant(behind, tmp_path, "", config)) is None


def test_strict_checking_off_in_the_users_config_is_said_in_check(behind: LocalCluster, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    keys = Keys(behind)
    inventory = variant(behind, tmp_path, keys.line(keys.ip("jump0"), "jump0"), "    StrictHostKeyChecking no")
    code = main(["check", "-i", str(inventory.path), "--json", "--only", "ssh"])
    (entry,) = json.loads(capsys.readouterr().out)["checks"]
    assert code == 0 and entry["status"] == "warn", entry
    assert "new host key ssh-ed25519" in entry["summary"] and "StrictHostKeyChecking no" in entry["summary"]
    assert "accept-new" in entry["fix"]
    code = main(["check", "-i", str(inventory.path), "--json", "--only", "ssh"])
    (entry,) = json.loads(capsys.readouterr().out)["checks"]
    assert entry["status"] == "warn" and "would be accepted unchecked" in entry["summary"]


def test_accept_new_in_the_users_config_records_and_says_so(behind: LocalCluster, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    keys = Keys(behind)
    inventory = variant(behind, tmp_path, keys.line(keys.ip("jump0"), "jump0"),
                        "    StrictHostKeyChecking accept-new")
    assert main(["check", "-i", str(inventory.path), "--json", "--only", "ssh"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["checks"]
    assert entry["status"] == "pass" and "accepted (StrictHostKeyChecking accept-new" in entry["summary"]
    assert main(["check", "-i", str(inventory.path), "--json", "--only", "ssh"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["checks"]
    assert "host key verified" in entry["summary"]


def real_ssh(inventory: Inventory) -> subprocess.CompletedProcess[str]:
    """OpenSSH itself with the same config: the oracle for what it refuses."""
    config = str(inventory.cluster.ssh_config)
    return subprocess.run(["ssh", "-F", config, inventory.hosts[0].address, "true"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=60, check=False)


@pytest.mark.parametrize("form", ["key-list", "krl"])
def test_a_key_listed_in_revoked_host_keys_is_refused_as_ssh_refuses_it(behind: LocalCluster, tmp_path: Path,
                                                                        form: str) -> None:
    keys = Keys(behind)
    public = behind.state_dir / "node0" / "ssh_host_ed25519_key.pub"
    revoked = tmp_path / "revoked"
    if form == "krl":
        subprocess.run(["ssh-keygen", "-q", "-k", "-f", str(revoked), str(public)], check=True, capture_output=True)
    else:
        revoked.write_text("# retired keys\n" + public.read_text())
    known = keys.line(keys.ip("jump0"), "jump0") + keys.line(keys.ip("node0"), "node0")  # on record, and good
    inventory = variant(behind, tmp_path, known, f"    RevokedHostKeys {revoked}")
    openssh = real_ssh(inventory)
    assert openssh.returncode == 255 and "revoked by file" in openssh.stderr, openssh.stderr
    for accept_new in (False, True):
        error = connect(inventory, accept_new)
        assert error is not None and error.kind == "host-key-revoked"
        assert str(error).startswith(f"node0: SSH host key of {keys.ip('node0')} (ssh-ed25519 SHA256:")
        assert f"is revoked by file {revoked} (RevokedHostKeys)" in str(error)


def test_a_bastion_key_in_revoked_host_keys_stops_the_node_behind_it(behind: LocalCluster, tmp_path: Path) -> None:
    keys = Keys(behind)
    revoked = tmp_path / "revoked"
    revoked.write_text((behind.state_dir / "jump0" / "ssh_host_ed25519_key.pub").read_text())
    known = keys.line(keys.ip("jump0"), "jump0") + keys.line(keys.ip("node0"), "node0")
    inventory = variant(behind, tmp_path, known, f"    RevokedHostKeys {revoked}")
    assert "revoked by file" in real_ssh(inventory).stderr
    error = connect(inventory)
    assert error is not None and error.kind == "host-key-revoked"
    assert str(error).startswith(f"node0: jump host jump0: SSH host key of {keys.ip('jump0')} (")
    assert "revoked by file" in str(error)


def test_a_revoked_host_keys_file_that_cannot_be_read_refuses_the_connection(behind: LocalCluster,
                                                                            tmp_path: Path) -> None:
    keys = Keys(behind)
    known = keys.line(keys.ip("jump0"), "jump0") + keys.line(keys.ip("node0"), "node0")
    inventory = variant(behind, tmp_path, known, f"    RevokedHostKeys {tmp_path / 'no-such-krl'}")
    openssh = real_ssh(inventory)
    assert openssh.returncode == 255 and "revoked keys file" in openssh.stderr, openssh.stderr
    error = connect(inventory)
    assert error is not None and error.kind == "host-key-revoked"
    assert "cannot check the host key" in str(error) and "no-such-krl" in str(error)
    assert "refusing to connect" in str(error)
