"""One hop's host key check: the keys on record (known_hosts, RevokedHostKeys) loaded into
paramiko, and the policy for a key it does not know; a changed or revoked key is always refused."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from torchherd.errors import TransportError
from torchherd.transport import knownhosts
from torchherd.transport.sshtarget import SshTarget

if TYPE_CHECKING:  # paramiko is imported lazily: `torchherd --help` must stay fast.
    import paramiko

class HostKeyCheck:
    """One hop's host key verification: the keys on record are loaded into paramiko (so it
    prefers their type, and compares), and this is its missing-key policy."""

    def __init__(self, target: SshTarget, accept_new: bool, home: str) -> None:
        self.target = target
        self.accept_new = accept_new
        self.home = home
        self.keys = self.on_record()
        self.revoked, self.revoked_error = self.revoked_files()
        self.off = (f"StrictHostKeyChecking no ({target.strict_where or 'your ssh config'}): a new host key "
                    "would be accepted unchecked" if target.strict == "no" else "")
        self.note: str | None = self.off or None
        """What ``check`` says when the key was not verified against one on record."""

    def on_record(self) -> knownhosts.HostKeys:
        entries = knownhosts.load(self.target.known_hosts + self.target.global_known_hosts)
        return knownhosts.for_name(entries, self.target.host_key_name or self.target.hostname)

    def revoked_files(self) -> tuple[tuple[knownhosts.RevokedKeys, ...], TransportError | None]:
        """The ``RevokedHostKeys`` files, or why one cannot be read (OpenSSH then refuses)."""
        found = []
        for path in self.target.revoked_host_keys:
            try:
                found.append(knownhosts.load_revoked(path))
            except knownhosts.RevokedKeysError as error:
                target = self.target
                return (), TransportError(
                    target.node, "host-key-revoked",
                    f"{target.node}: cannot check the host key of {target.hostname} against RevokedHostKeys "
                    f"({error}); refusing to connect, as ssh does",
                    "fix or remove that file, or the RevokedHostKeys line in your ssh config")
        return tuple(found), None

    def verdict(self, blob: bytes) -> knownhosts.Verdict:
        """What the presented key is: a RevokedHostKeys file first (as OpenSSH checks it
        before known_hosts), then known_hosts."""
        for revoked in self.revoked:
            if revoked.revokes(blob):
                return knownhosts.Verdict("revoked-file", revoked_by=revoked.path)
        return self.keys.verdict(blob)

    def install(self, client: paramiko.SSHClient) -> None:
        """Loads the keys on record and this policy into ``client``, before it connects.
        A key a RevokedHostKeys file lists is left out, so paramiko asks the policy."""
        import paramiko

        if self.revoked_error is not None:
            raise self.revoked_error
        name = self.target.hostname if self.target.port == 22 else f"[{self.target.hostname}]:{self.target.port}"
        for entry in self.keys.keys:
            if any(revoked.revokes(entry.blob) for revoked in self.revoked):
                continue
            try:
                key = paramiko.PKey.from_type_string(entry.key_type, entry.blob)
            except Exception:  # a key type paramiko cannot use (sk-*) is one it will never be shown
                continue
            client.get_host_keys().add(name, entry.key_type, key)
        client.set_missing_host_key_policy(self)

    def accepts_new(self) -> bool:
        return self.accept_new or self.target.strict in ("accept-new", "no")

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        verdict = self.verdict(key.asbytes())
        if verdict.kind != "unknown":
            raise self.refusal(verdict, key)
        if not self.accepts_new():
            target = self.target
            port = f" -p {target.port}" if target.port != 22 else ""
            raise TransportError(
                target.node, "host-key-unknown",
                f"{target.node}: unknown SSH host key for {hostname} ({key.get_name()} {key.fingerprint})",
                f"check the fingerprint, then trust it with `ssh{port} {target.user}@{target.hostname}` "
                f"once, or rerun with --accept-new-host-keys",
            )
        self.record(client, hostname, key)

    def record(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        target = self.target
        if not target.known_hosts:
            raise TransportError(target.node, "host-key-unknown",
                                 f"{target.node}: unknown SSH host key for {hostname}, and no known_hosts file to "
                                 f"record it in (UserKnownHostsFile none)",
                                 "name a UserKnownHostsFile in your ssh config, or record the key yourself")
        path = target.known_hosts[0]
        line = knownhosts.entry_line(target.host_key_name or hostname, key.asbytes(), target.hash_known_hosts)
        try:
            knownhosts.append(path, line, self.home)
        except OSError as error:
            raise TransportError(target.node, "host-key-unknown",
                                 f"{target.node}: cannot record the new host key of {hostname} in {path}: "
                                 f"{error.strerror or error}") from None
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.keys = self.on_record()  # a retry of this connection must find the key, not record it twice
        why = (f"StrictHostKeyChecking {target.strict} ({target.strict_where})" if target.strict in ("accept-new", "no")
               else "--accept-new-host-keys")
        self.note = f"new host key {key.get_name()} {key.fingerprint} accepted ({why}) and recorded in {path}"

    def refusal(self, verdict: knownhosts.Verdict, key: paramiko.PKey) -> TransportError:
        """Why a key that is not simply new is refused, whatever the flags say."""
        target, entry = self.target, verdict.entry
        node, name, now = target.node, target.host_key_name or target.hostname, f"{key.get_name()} {key.fingerprint}"
        where = f" ({entry.where})" if entry is not None else ""
        if verdict.kind == "revoked-file":
            return TransportError(
                node, "host-key-revoked",
                f"{node}: SSH host key of {target.hostname} ({now}) is revoked by file {verdict.revoked_by} "
                "(RevokedHostKeys); refusing to connect",
                "a revoked key means the node's key was compromised or retired: do not connect until "
                "the node has a new key you have checked")
        if verdict.kind == "revoked":
            return TransportError(
                node, "host-key-revoked",
                f"{node}: SSH host key of {target.hostname} is REVOKED{where} ({now}); refusing to connect",
                "a revoked key means the node's key was compromised or retired: do not connect until "
                "the node has a new key you have checked")
        if verdict.kind == "cert-authority":
            return TransportError(
                node, "host-key-cert",
                f"{node}: known_hosts trusts a certificate authority for {name}{where}, but torchherd cannot "
                f"verify SSH host certificates; refusing the host's plain key ({now})",
                f"add the host's own key to known_hosts after checking its fingerprint (`ssh-keyscan "
                f"{'-p ' + str(target.port) + ' ' if target.port != 22 else ''}{target.hostname}`)")
        recorded = f"; known_hosts has {entry.key_type} {entry.fingerprint}{where}" if entry is not None else ""
        file_hint = f" -f {shlex.quote(entry.path)}" if entry is not None else ""
        return TransportError(
            node, "host-key-changed",
            f"{node}: SSH host key of {target.hostname} CHANGED (now {now}{recorded}); refusing to connect",
            f"if the node was reinstalled, remove the old key with `ssh-keygen -R {shlex.quote(name)}{file_hint}` "
            "and connect once to check the new one; otherwise investigate",
        )
