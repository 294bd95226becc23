"""Where and how to reach a node (or a jump host) over SSH: its ssh_config entry and the
inventory merged (the inventory wins), and the jump chain in front of it."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from torchherd.errors import TransportError
from torchherd.inventory import Host
from torchherd.transport import sshconfig

if TYPE_CHECKING:  # paramiko is imported lazily: `torchherd --help` must stay fast.
    pass

MAX_JUMP_DEPTH = 8


@dataclass(frozen=True)
class SshTarget:
    """Where and how to connect to one node (or jump host), ssh_config and inventory merged."""

    node: str
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...]
    known_hosts: tuple[str, ...]
    """The user's known_hosts files (``UserKnownHostsFile``): new keys go to the first."""
    proxy_jump: str | None
    proxy_command: str | None
    """Tokens expanded; run with the user's shell."""
    identities_only: bool
    global_known_hosts: tuple[str, ...] = ()
    host_key_name: str = ""
    """The name its key is recorded under: HostKeyAlias, ``host`` or ``[host]:port``."""
    strict: str = "ask"
    strict_where: str = ""
    hash_known_hosts: bool = False
    connect_timeout: float | None = None
    jumps: tuple[sshconfig.Jump, ...] = ()
    alias: str = ""
    revoked_host_keys: tuple[str, ...] = ()
    """``RevokedHostKeys`` files: a key they list is refused; one that cannot be read refuses the host."""

    def describe(self, port_always: bool = False) -> str:
        """``user@host[:port][ via jump]``; ``port_always``: :22 too (where the port is the news)."""
        port = f":{self.port}" if self.port != 22 or port_always else ""
        via = f" via {self.proxy_jump}" if self.proxy_jump else ""
        return f"{self.user}@{self.hostname}{port}{via}"

    @property
    def chain_key(self) -> tuple[str, str, int, str]:
        return (self.user, self.hostname, self.port, self.proxy_command or "")


def target_of(node: str, found: sshconfig.HostConfig) -> SshTarget:
    strict = found.settings.get("stricthostkeychecking")
    return SshTarget(
        node=node,
        hostname=found.hostname,
        port=found.port,
        user=found.user,
        key_files=found.identity_files,
        known_hosts=found.user_known_hosts_files,
        proxy_jump=",".join(str(hop) for hop in found.proxy_jump) or None,
        proxy_command=found.proxy_command,
        identities_only=found.identities_only,
        global_known_hosts=found.global_known_hosts_files,
        host_key_name=found.host_key_name,
        strict=found.strict_host_key_checking,
        strict_where=strict.where if strict is not None else "",
        hash_known_hosts=found.hash_known_hosts,
        connect_timeout=found.connect_timeout,
        jumps=found.proxy_jump,
        alias=found.original_host,
        revoked_host_keys=found.revoked_host_keys,
    )


def lookup_host(node: str, alias: str, ssh_config: Path | None, local: sshconfig.Local, *, user: str | None = None,
            port: int | None = None, jump: str | None = None) -> sshconfig.HostConfig:
    try:
        return sshconfig.lookup(alias, ssh_config, local, user=user, port=port, jump=jump)
    except sshconfig.SshConfigError as error:
        raise TransportError(node, "ssh-config", f"{node}: cannot read the ssh configuration: {error}",
                             "fix the line named (`ssh -G " + shlex.quote(alias) + "` shows how ssh reads it)") \
            from None


def resolve_target(host: Host, ssh_config: Path | None, local: sshconfig.Local | None = None) -> SshTarget:
    """The node's ssh_config entry merged with the inventory (the inventory wins; its
    ``identity_file`` replaces the config's IdentityFiles). Without ``ssh_config``:
    ``~/.ssh/config``, then ``/etc/ssh/ssh_config``, as ``ssh`` reads them."""
    local = local or sshconfig.Local.of_this_machine()
    target = target_of(host.name, lookup_host(host.name, host.address, ssh_config, local, user=host.user,
                                        port=host.ssh_port))
    if host.identity_file:
        target = replace(target, key_files=(os.path.expanduser(host.identity_file),))
    return target


def ssh_hostnames(hosts: Iterable[Host], ssh_config: Path | None,
                  local: sshconfig.Local | None = None) -> dict[str, str]:
    """Per host whose address the ssh_config resolves to another HostName (an alias), that
    HostName, as ``ssh -G`` prints it. A host whose config cannot be read is left out: its
    connection says why."""
    local = local or sshconfig.Local.of_this_machine()
    found: dict[str, str] = {}
    for host in hosts:
        try:
            hostname = resolve_target(host, ssh_config, local).hostname
        except TransportError:
            continue
        if hostname != host.address.lower():
            found[host.name] = hostname
    return found


def jump_chain(target: SshTarget, ssh_config: Path | None, local: sshconfig.Local,
               depth: int = 0) -> list[SshTarget]:
    """The jump hosts in front of ``target``, first to last, each resolved as ``ssh -J`` does:
    the first with its own ssh_config entry (its own ProxyJump or ProxyCommand included),
    every later one reached through the hops before it."""
    hops = target.jumps
    if not hops or _is_itself(hops[0], target):
        return []
    if depth >= MAX_JUMP_DEPTH:
        raise TransportError(target.node, "ssh-config", f"{target.node}: ProxyJump goes {MAX_JUMP_DEPTH} hops deep "
                             f"(a loop through {hops[0]}?)",
                             "give the jump host `ProxyJump none` in its own Host block")
    chain: list[SshTarget] = []
    for index, hop in enumerate(hops):
        name = f"jump host {hop.host}"
        before = ",".join(str(earlier) for earlier in hops[:index]) or None
        found = target_of(name, lookup_host(name, hop.host, ssh_config, local, user=hop.user, port=hop.port, jump=before))
        if index == 0:
            chain += jump_chain(found, ssh_config, local, depth + 1)
        chain.append(found)
    return chain


def _is_itself(hop: sshconfig.Jump, target: SshTarget) -> bool:
    # `Host * ProxyJump bastion` also matches the bastion itself; as fabric does, a host
    # whose first hop is itself is reached directly rather than through an endless loop.
    return hop.host in (target.alias, target.hostname) and (hop.port is None or hop.port == target.port)
