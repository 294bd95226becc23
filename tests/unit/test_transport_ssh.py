"""transport.ssh without sshds: jump chains resolved as ``ssh -J`` does, one shared
connection per chain (opened once, closed with its last session), the handshake gate,
and which failures are retried. The connections are fakes in place of fabric's."""

from __future__ import annotations

import getpass
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import paramiko
import pytest

from torchherd.errors import TransportError
from torchherd.inventory import Host
from torchherd.transport import connect_all, ssh, sshfailures
from torchherd.transport.ssh import SshConnector, SshTarget, jump_chain, resolve_target
from torchherd.transport.sshconfig import Local


def host(name: str, address: str | None = None) -> Host:
    return Host(name=name, address=address or name, user=None, ssh_port=None, identity_file=None, python="python3",
                workdir="~", env={}, setup="", local_addr=None)


def local(tmp_path: Path) -> Local:
    return Local(user="me", home=str(tmp_path), uid=1000, hostname="laptop")


def config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ssh_config"
    path.write_text(text)
    return path


def chain_of(tmp_path: Path, text: str, alias: str) -> list[str]:
    path = config(tmp_path, text)
    target = resolve_target(host("n", alias), path, local(tmp_path))
    return [f"{hop.user}@{hop.hostname}:{hop.port}" for hop in jump_chain(target, path, local(tmp_path))]


def test_every_hop_is_resolved_with_its_own_config_the_first_with_its_own_jumps(tmp_path: Path) -> None:
    text = ("Host node\n  ProxyJump ops@a,b:2200\nHost a\n  HostName a.example\n  ProxyJump z\n"
            "Host b\n  HostName b.example\n  User bee\n  ProxyJump ignored-for-b\nHost *\n  User default\n")
    assert chain_of(tmp_path, text, "node") == ["default@z:22", "ops@a.example:22", "bee@b.example:2200"]


def test_a_bastion_matched_by_its_own_wildcard_jump_is_reached_directly(tmp_path: Path) -> None:
    text = "Host bastion\n  HostName 10.0.0.1\nHost *\n  ProxyJump bastion\n"
    assert chain_of(tmp_path, text, "gpu1") == ["me@10.0.0.1:22"]
    assert chain_of(tmp_path, text, "bastion") == []


def test_a_jump_loop_is_an_error_saying_how_to_end_it(tmp_path: Path) -> None:
    with pytest.raises(TransportError) as caught:
        chain_of(tmp_path, "Host a\n  ProxyJump b\nHost b\n  ProxyJump a\nHost n\n  ProxyJump a\n", "n")
    assert caught.value.kind == "ssh-config" and "ProxyJump none" in caught.value.hint


def test_a_config_error_is_a_transport_error_naming_file_and_line(tmp_path: Path) -> None:
    path = config(tmp_path, "Host *\n  Port 0\n")
    with pytest.raises(TransportError) as caught:
        resolve_target(host("n"), path, local(tmp_path))
    assert caught.value.kind == "ssh-config" and f"{path} line 2: bad port '0'" in str(caught.value)


def test_the_inventory_wins_over_the_config(tmp_path: Path) -> None:
    key = tmp_path / "key"
    path = config(tmp_path, "Host n\n  User cfg\n  Port 2200\n  IdentityFile ~/cfg_key\n")
    plain = resolve_target(host("n"), path, local(tmp_path))
    assert (plain.user, plain.port, plain.key_files) == ("cfg", 2200, (f"{tmp_path}/cfg_key",))
    given = Host(name="n", address="n", user="inv", ssh_port=22, identity_file=str(key), python="p", workdir="~",
                 env={}, setup="", local_addr=None)
    target = resolve_target(given, path, local(tmp_path))
    assert (target.user, target.port, target.key_files) == ("inv", 22, (str(key),))


class FakeConnection:
    """Stands in for a fabric Connection: opens by the script it is given."""

    def __init__(self, target: SshTarget, gateway: Any, log: Log) -> None:
        self.target, self.gateway, self.log = target, gateway, log
        self.client = paramiko.SSHClient()
        self.is_connected = False

    def open(self) -> None:
        self.log.opening(self.target.hostname)
        try:
            failure = self.log.failures.get(self.target.hostname, [])
            if failure:
                raise failure.pop(0)
            self.is_connected = True
        finally:
            self.log.opened(self.target.hostname)

    def close(self) -> None:
        self.is_connected = False
        self.log.closed.append(self.target.hostname)


class Log:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.opens: dict[str, int] = {}
        self.closed: list[str] = []
        self.at_once = 0
        self.most_at_once = 0
        self.failures: dict[str, list[BaseException]] = {}

    def opening(self, name: str) -> None:
        with self.lock:
            self.opens[name] = self.opens.get(name, 0) + 1
            self.at_once += 1
            self.most_at_once = max(self.most_at_once, self.at_once)
        time.sleep(0.02)

    def opened(self, name: str) -> None:
        with self.lock:
            self.at_once -= 1


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Log:
    made = Log()
    monkeypatch.setattr(SshConnector, "_fabric_connection",
                        lambda self, target, gateway: FakeConnection(target, gateway, made))
    monkeypatch.setattr(ssh, "BACKOFF_SECONDS", 0.001)
    return made


BASTION = "Host bastion\n  HostName 10.0.0.1\nHost gpu*\n  ProxyJump bastion\n  HostName %h.internal\n"


def test_nodes_behind_one_bastion_share_one_connection_closed_with_the_last_session(tmp_path: Path, log: Log) -> None:
    connector = SshConnector(config(tmp_path, BASTION), 5.0)
    results = connect_all(connector, [host(f"gpu{index}") for index in range(24)])
    sessions = [result for result in results.values() if not isinstance(result, TransportError)]
    assert len(sessions) == 24 and log.opens["10.0.0.1"] == 1
    assert {session.fabric.gateway.target.hostname for session in sessions} == {"10.0.0.1"}  # type: ignore[attr-defined]
    for session in sessions[:-1]:
        session.close()
    assert "10.0.0.1" not in log.closed
    sessions[-1].close()
    sessions[-1].close()  # twice: released once
    assert log.closed.count("10.0.0.1") == 1 and connector._shared.chains == {}


def test_no_more_than_the_gate_s_handshakes_at_once_to_one_sshd(tmp_path: Path, log: Log) -> None:
    connector = SshConnector(config(tmp_path, "Host *\n  HostName 10.0.0.9\n"), 5.0, handshakes=3)
    results = connect_all(connector, [host(f"alias{index}") for index in range(20)])
    assert all(not isinstance(result, TransportError) for result in results.values())
    assert log.most_at_once == 3


def test_a_dropped_banner_is_retried_and_an_auth_failure_is_not(tmp_path: Path, log: Log) -> None:
    connector = SshConnector(config(tmp_path, "Host a\n  HostName 10.0.0.2\nHost b\n  HostName 10.0.0.3\n"), 5.0)
    log.failures["10.0.0.2"] = [paramiko.SSHException("Error reading SSH protocol banner"), ConnectionResetError()]
    assert connector.connect(host("a")).fabric.is_connected
    assert log.opens["10.0.0.2"] == 3
    log.failures["10.0.0.3"] = [paramiko.AuthenticationException("no"), paramiko.AuthenticationException("no")]
    with pytest.raises(TransportError) as caught:
        connector.connect(host("b"))
    assert caught.value.kind == "auth" and log.opens["10.0.0.3"] == 1


def test_a_banner_dropped_every_time_is_reported_after_the_last_try(tmp_path: Path, log: Log) -> None:
    connector = SshConnector(config(tmp_path, "Host a\n  HostName 10.0.0.2\n"), 5.0)
    log.failures["10.0.0.2"] = [EOFError() for _ in range(ssh.ATTEMPTS)]
    with pytest.raises(TransportError) as caught:
        connector.connect(host("a"))
    assert caught.value.kind == "dropped" and "MaxStartups" in caught.value.hint
    assert log.opens["10.0.0.2"] == ssh.ATTEMPTS


def test_a_dead_bastion_fails_every_node_behind_it_at_once_naming_the_hop(tmp_path: Path, log: Log) -> None:
    connector = SshConnector(config(tmp_path, BASTION), 5.0)
    log.failures["10.0.0.1"] = [ConnectionRefusedError(111, "refused")]
    results = connect_all(connector, [host(f"gpu{index}") for index in range(8)])
    assert log.opens["10.0.0.1"] == 1
    for name, result in results.items():
        assert isinstance(result, TransportError) and result.kind == "refused"
        assert str(result) == f"{name}: jump host bastion: connection refused by {getpass.getuser()}@10.0.0.1:22"
    assert connector._shared.chains == {}


def test_a_dead_bastion_is_tried_once_for_nodes_that_connect_after_it_failed(tmp_path: Path, log: Log) -> None:
    """The chain of a failed hop is dropped when its last user leaves; a node that connects
    after that (a loaded controller's threads start late: CI, stop 54) fails at once too,
    within the SSH timeout, and tries the hop again after it."""
    connector = SshConnector(config(tmp_path, BASTION), 5.0)
    log.failures["10.0.0.1"] = [ConnectionRefusedError(111, "refused")] * 3
    for index in range(3):
        with pytest.raises(TransportError) as caught:
            connector.connect(host(f"gpu{index}"))
        assert caught.value.kind == "refused" and str(caught.value).startswith(f"gpu{index}: jump host bastion: "), str(caught.value)
    assert log.opens["10.0.0.1"] == 1 and connector._shared.chains == {}
    connector._shared.failures = {key: (when - 5.0, error) for key, (when, error) in connector._shared.failures.items()}
    with pytest.raises(TransportError):
        connector.connect(host("gpu3"))
    assert log.opens["10.0.0.1"] == 2


def test_connector_close_closes_the_shared_chains(tmp_path: Path, log: Log) -> None:
    connector = SshConnector(config(tmp_path, BASTION), 5.0)
    session = connector.connect(host("gpu1"))
    connector.close()
    assert log.closed == ["10.0.0.1"] and connector._shared.chains == {}
    session.close()
    assert log.closed == ["10.0.0.1", "gpu1.internal"]


def test_connections_made_in_many_threads_at_once_each_see_a_whole_config(tmp_path: Path) -> None:
    # fabric's Connection writes into its config, which is empty while it re-merges: with
    # one config shared by the connecting threads, most Connections here raised
    # AttributeError ('forward_agent'), as one did at 256 nodes on a loaded machine.
    connector = SshConnector(config(tmp_path, "Host n1\n  HostName 10.0.0.1\n"), 5.0)
    target = resolve_target(host("n1"), connector.ssh_config, local(tmp_path))
    errors: list[BaseException] = []

    def make() -> None:
        for _ in range(20):
            try:
                connector._fabric_connection(target, False)
            except AttributeError as error:
                errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # a thread switch every few bytecodes, as under load
    try:
        threads = [threading.Thread(target=make) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []


@pytest.mark.parametrize("failure,kind,message", [
    (OSError(113, "No route to host"), "unreachable", "n0: no route to me@10.9.9.9 (No route to host)"),
    (ConnectionRefusedError(111, "Connection refused"), "refused", "n0: connection refused by me@10.9.9.9:22"),
])
def test_paramikos_wrapper_of_every_failed_address_is_explained_by_the_address_s_own_error(
        failure: OSError, kind: str, message: str) -> None:
    """paramiko raises NoValidConnectionsError for any errno: a link just back (no route yet)
    was once reported as 'connection refused'."""
    target = SshTarget(node="n0", hostname="10.9.9.9", port=22, user="me", key_files=(), known_hosts=(),
                       proxy_jump=None, proxy_command=None, identities_only=False)
    error = sshfailures.explain(target, paramiko.ssh_exception.NoValidConnectionsError({("10.9.9.9", 22): failure}))
    assert isinstance(error, TransportError)
    assert (error.kind, str(error)) == (kind, message)


class Listener:
    """A TCP port on 127.0.0.1 that accepts connections and never speaks SSH: it either
    holds them open in silence (a hung sshd) or closes them at once (MaxStartups)."""

    def __init__(self, close_at_once: bool) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.close_at_once = close_at_once
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:  # closed by the test
                return
            self.accepted.append(connection)
            if self.close_at_once:
                connection.close()

    def close(self) -> None:
        self.server.close()
        for connection in self.accepted:
            connection.close()


@pytest.fixture
def silent() -> Iterator[Listener]:
    listener = Listener(close_at_once=False)
    yield listener
    listener.close()


def at(port: int) -> Host:
    return Host(name="n0", address="127.0.0.1", user="me", ssh_port=port, identity_file=None, python="python3",
                workdir="~", env={}, setup="", local_addr=None)


def test_an_sshd_that_accepts_and_never_answers_costs_one_timeout_and_says_so(tmp_path: Path, silent: Listener) -> None:
    """A silent banner was retried as a dropped one: five timeouts (55.9 s at the default),
    blamed on MaxStartups."""
    connector = SshConnector(config(tmp_path, ""), 1.0)
    started = time.monotonic()
    with pytest.raises(TransportError) as caught:
        connector.connect(at(silent.port))
    elapsed = time.monotonic() - started
    assert len(silent.accepted) == 1 and 1.0 <= elapsed < 3.0  # five tries took 5 timeouts and the backoffs
    assert caught.value.kind == "silent" and "MaxStartups" not in caught.value.hint
    assert str(caught.value) == (f"n0: sshd on me@127.0.0.1:{silent.port} accepted the connection but never "
                                 "answered: the node may be overloaded or hung")


def test_a_connect_timeout_shorter_than_ssh_timeout_bounds_the_banner_wait_and_names_it(
        tmp_path: Path, silent: Listener) -> None:
    """ConnectTimeout (as in OpenSSH) also bounds the banner; paramiko's handshake then gives
    up at the same moment as the banner's read, and used to win with "No existing session"."""
    connector = SshConnector(config(tmp_path, "Host *\n  ConnectTimeout 1\n"), 5.0)
    started = time.monotonic()
    with pytest.raises(TransportError) as caught:
        connector.connect(at(silent.port))
    elapsed = time.monotonic() - started
    assert len(silent.accepted) == 1 and 1.0 <= elapsed < 3.0
    assert caught.value.kind == "silent" and "never answered" in str(caught.value)


def test_an_sshd_that_closes_before_its_banner_is_still_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssh, "BACKOFF_SECONDS", 0.001)
    listener = Listener(close_at_once=True)
    try:
        with pytest.raises(TransportError) as caught:
            SshConnector(config(tmp_path, ""), 1.0).connect(at(listener.port))
    finally:
        listener.close()
    assert caught.value.kind == "dropped" and "MaxStartups" in caught.value.hint
    assert len(listener.accepted) == ssh.ATTEMPTS


def keygen(path: Path, passphrase: str = "") -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-f", str(path)], check=True)
    return paramiko.PKey.from_path(path, passphrase.encode() or None).fingerprint


def test_each_identity_file_is_read_once_per_command_and_tried_first_in_its_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = keygen(tmp_path / "first"), tmp_path / "second"
    keygen(second)
    loads: list[str] = []
    from_path = paramiko.PKey.from_path
    monkeypatch.setattr(paramiko.PKey, "from_path", lambda path, *a: loads.append(str(path)) or from_path(path, *a))
    connector = SshConnector(config(tmp_path, f"Host n*\n  IdentityFile {tmp_path}/first\n"
                                              f"  IdentityFile {second}\n"), 5.0)
    for name in ("n1", "n2", "n3"):
        made = connector._fabric_connection(resolve_target(host(name), connector.ssh_config, local(tmp_path)), False)
        assert made.connect_kwargs["pkey"].fingerprint == first
        assert made.connect_kwargs["key_filename"] == [str(second)]
    assert loads == [f"{tmp_path}/first"]


def test_a_key_that_needs_a_passphrase_is_left_to_paramiko_in_its_place(tmp_path: Path) -> None:
    keygen(tmp_path / "locked", passphrase="secret words")
    connector = SshConnector(config(tmp_path, f"Host n1\n  IdentityFile {tmp_path}/locked\n"), 5.0)
    made = connector._fabric_connection(resolve_target(host("n1"), connector.ssh_config, local(tmp_path)), False)
    assert "pkey" not in made.connect_kwargs
    assert made.connect_kwargs["key_filename"] == [f"{tmp_path}/locked"]


def test_gcm_is_offered_first_and_every_cipher_paramiko_offers_is_still_offered() -> None:
    offered = ssh._transport_class()._preferred_ciphers
    assert offered[:2] == ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
    assert sorted(offered) == sorted(paramiko.Transport._preferred_ciphers)
