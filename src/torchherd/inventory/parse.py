"""``hosts.toml`` in, an ``Inventory`` out: the file is read and validated once, here;
nothing downstream sees raw dicts. Also the inventory's changes for one run (spares,
the container flags)."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from torchherd.errors import InventoryError
from torchherd.imagearchive import holds
from torchherd.inventory.model import (
    ChecksSettings,
    Cluster,
    ContainerSettings,
    Host,
    Inventory,
    Recovery,
    SyncSettings,
    UvSettings,
)
from torchherd.inventory.nodeset import NodesetError, expand
from torchherd.inventory.options import (
    FINAL_EXIT_CODES,
    HANG_TIMEOUT,
    HEARTBEAT,
    HEARTBEAT_MISSES,
    MIN_NODES,
    NPROC_PER_NODE,
    REPLICATE,
    RESUME_ARGS,
    RETRIES,
    SSH_TIMEOUT,
    recovery_problem,
)
from torchherd.inventory.reader import FlagReader, Reader, did_you_mean
from torchherd.inventory.rules import (
    HEARTBEAT_HINT,
    HOST_NAME_PATTERN,
    MAX_INVENTORY_BYTES,
    RDZV_BACKENDS,
    heartbeat_problem,
    show,
)
from torchherd.inventory.tables import SSH_ONLY, Schedulers, TableSettings
from torchherd.remote import container as containers

CLUSTER_KEYS = (
    "master", "port", "nproc_per_node", "rdzv_backend", "master_addr",
    "ssh_config", "ssh_timeout", "scheduler",
)
CLUSTER_ONLY = MappingProxyType({key: "[cluster]" for key in ("master", "port", "rdzv_backend", "master_addr",
                                                                "ssh_config", "ssh_timeout", "scheduler")})
"""The ``[cluster]`` keys a host's table or ``[defaults]`` cannot take: said where one is written there."""
NODE_KEYS = ("user", "ssh_port", "identity_file", "python", "workdir", "env", "setup", "uv", "venv_dir")
HOST_KEYS = ("name", "address", "local_addr", "nproc_per_node", "spare", "container", "transport") + NODE_KEYS
TRANSPORTS = ("auto", "ssh", "local")
"""A host's ``transport``: "auto" is this machine without SSH for localhost, 127.0.0.1 or
::1 (and for this machine's own hostname as the only host), where no user, port or key
asks for SSH; "ssh" always SSH (to test one's own sshd); "local" this machine, no SSH."""
LOOPBACK_ADDRESSES = ("localhost", "127.0.0.1", "::1")
CONTAINER_KEYS = ("image", "runtime", "mounts", "options", "pull", "archive")
STEP_KEYS = ("address", "local_addr")
"""Host keys that may be nodesets too, expanding in step with the name."""
SYNC_KEYS = ("dir", "exclude", "include", "dest")
TOP_KEYS = ("cluster", "defaults", "hosts", "sync", "recovery", "checks", "container", "uv")
"""The tables every inventory may have; a scheduler's own (``inventory.tables``) come beside them."""
UV_KEYS = ("wheels", "offline")
RECOVERY_KEYS = ("retries", "final_exit_codes", "spares", "min_nodes", "hang_timeout", "checkpoint", "heartbeat",
                 "heartbeat_misses", "replicate", "replicate_bandwidth", "resume_args", "warm")
CHECKS_KEYS = ("min_bandwidth", "slow_ratio")


def load(path: Path, schedulers: Schedulers = SSH_ONLY) -> Inventory:
    """Reads and validates the inventory at ``path``; raises InventoryError naming file and key."""
    return loads(read(path), path, schedulers)


def read(path: Path) -> bytes:
    """The file's bytes, at most MAX_INVENTORY_BYTES (``-i /dev/zero`` must not eat the memory)."""
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_INVENTORY_BYTES + 1)
    except FileNotFoundError:
        raise InventoryError(f"{path}: inventory file not found",
                             "pass one with -i FILE or set TORCHHERD_INVENTORY; write one with `torchherd init "
                             "-H HOSTS` (or `torchherd init --example`: every key, explained); or give the "
                             "hosts with -H instead") from None
    except OSError as error:
        raise InventoryError(f"{path}: cannot read the inventory: {error.strerror}") from None
    if len(raw) > MAX_INVENTORY_BYTES:
        raise InventoryError(f"{path}: larger than {MAX_INVENTORY_BYTES >> 20} MiB: not an inventory",
                             "pass the TOML inventory file with -i")
    return raw


def loads(raw: bytes, path: Path, schedulers: Schedulers = SSH_ONLY) -> Inventory:
    """The inventory in ``raw`` (the bytes of ``path``, which errors name)."""
    try:
        document = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise InventoryError(f"{path}: not UTF-8 text", "save the inventory as UTF-8") from None
    except RecursionError:  # tomllib recurses once per level of nesting
        raise InventoryError(f"{path}: TOML nested too deeply", "an inventory is a few flat tables") from None
    except tomllib.TOMLDecodeError as error:
        raise InventoryError(f"{path}: TOML syntax error: {error}",
                             "fix the line named; `torchherd init --example -i example.toml` writes an example "
                             "of every key") from None
    return parse(document, path, schedulers)


def parse(document: Mapping[str, Any], path: Path, schedulers: Schedulers = SSH_ONLY) -> Inventory:
    """The inventory ``document`` holds (``path`` names it in errors); ``schedulers``: the
    names ``[cluster].scheduler`` may take and the tables they bring (``engine.schedulers.known``)."""
    Reader(path, "", document, TOP_KEYS + tuple(table.name for table in schedulers.tables))
    defaults, cluster_table = _defaults_nproc(_table(document, "defaults", path), _table(document, "cluster", path),
                                              path)
    tables = tuple((table.name, table.parse(_table(document, table.name, path), path, f"[{table.name}]."))
                   for table in schedulers.tables)
    recovery, spare_names = _parse_recovery(_table(document, "recovery", path), path)
    container = _container_table(Reader(path, "[container].", _table(document, "container", path), CONTAINER_KEYS))
    template = _template_host(document, cluster_table, schedulers, dict(tables), path)
    if template is not None:
        hosts: tuple[Host, ...] = (replace(_template(template, defaults, path, container), transport="ssh"),)
    else:
        hosts = _spares_marked(_parse_hosts(document, defaults, path, container), spare_names, path)
    hosts = reached(hosts)
    spares = tuple(host for host in hosts if host.spare)
    hosts = tuple(host for host in hosts if not host.spare)
    if not hosts:
        raise InventoryError(f"{path}: hosts: every host is a spare", "a run needs at least one host that is not")
    cluster = _parse_cluster(cluster_table, hosts, path, tuple(host.name for host in spares), schedulers.names)
    master = next(host for host in hosts if host.name == cluster.master)
    ranked = (master,) + tuple(host for host in hosts if host is not master)
    sync = _parse_sync(_table(document, "sync", path), path) if "sync" in document else None
    checks = _parse_checks(_table(document, "checks", path), path)
    uv = _parse_uv(_table(document, "uv", path), path)
    return Inventory(path=path, cluster=cluster, hosts=ranked, sync=sync, tables=tables, spares=spares,
                     recovery=recovery, checks=checks, uv=uv)


def _parse_uv(table: Mapping[str, Any], path: Path) -> UvSettings:
    read = Reader(path, "[uv].", table, UV_KEYS)
    wheels = read.get("wheels", None, read.text)
    if wheels is not None and not Path(wheels).expanduser().is_dir():
        read.fail("wheels", f"{wheels} is not a directory on this machine",
                  f"mkdir -p {wheels} && pip download uv --no-deps --only-binary=:all: --platform "
                  f"manylinux_2_17_x86_64 -d {wheels} (the nodes' platform)")
    return UvSettings(wheels=wheels, offline=read.get("offline", False, read.flag))


def _parse_recovery(table: Mapping[str, Any], path: Path) -> tuple[Recovery, frozenset[str]]:
    """The ``[recovery]`` table, and the host names its ``spares`` nodeset stands for."""
    read = Reader(path, "[recovery].", table, RECOVERY_KEYS)
    spares = read.get("spares", None, read.nodeset)
    recovery = Recovery(retries=read.get("retries", 0, read.option(RETRIES)),
                        final_exit_codes=read.get("final_exit_codes", (), read.option(FINAL_EXIT_CODES)),
                        min_nodes=read.get("min_nodes", None, read.option(MIN_NODES)),
                        hang_timeout=read.get("hang_timeout", None, read.option(HANG_TIMEOUT)),
                        checkpoint=read.get("checkpoint", None, read.checkpoint),
                        heartbeat=read.get("heartbeat", 0.5, read.option(HEARTBEAT)),
                        heartbeat_misses=read.get("heartbeat_misses", 5, read.option(HEARTBEAT_MISSES)),
                        replicate=read.get("replicate", None, read.option(REPLICATE)),
                        resume_args=read.get("resume_args", (), read.option(RESUME_ARGS)),
                        warm=read.get("warm", True, read.flag))
    problem = heartbeat_problem(recovery)
    if problem is not None:
        read.fail("heartbeat_misses" if "heartbeat_misses" in table else "heartbeat", problem, HEARTBEAT_HINT)
    if "replicate_bandwidth" in table:
        recovery = replace(recovery, replicate_bandwidth=read.bandwidth("replicate_bandwidth",
                                                                         table["replicate_bandwidth"]))
    needs = recovery_problem(recovery, tuple(table), "file")
    if needs is not None:
        read.fail(needs.option.name, needs.problem, needs.hint)
    return recovery, frozenset(expand(spares) if spares else ())


def _spares_marked(hosts: tuple[Host, ...], names: frozenset[str], path: Path) -> tuple[Host, ...]:
    unknown = sorted(names - {host.name for host in hosts})
    if unknown:
        raise InventoryError(f"{path}: [recovery].spares: {unknown[0]!r} is not one of the hosts",
                             "list the spare under [[hosts]] too, or mark it there with spare = true")
    return tuple(replace(host, spare=True) if host.name in names else host for host in hosts)


def with_spares(inventory: Inventory, names: frozenset[str], where: str = "--spares") -> Inventory:
    """The inventory with the hosts ``names`` set aside as spares (after those it has);
    the master gives way to the first host left when it is one of them."""
    known = {host.name for host in inventory.hosts} | {host.name for host in inventory.spares}
    unknown = sorted(names - known)
    if unknown:
        raise InventoryError(f"{where}: {unknown[0]!r} is not one of the hosts",
                             f"the hosts are {', '.join(sorted(known))}")
    hosts = tuple(host for host in inventory.hosts if host.name not in names)
    if not hosts:
        raise InventoryError(f"{where}: every host would be a spare", "a run needs at least one host that is not")
    spares = inventory.spares + tuple(replace(host, spare=True) for host in inventory.hosts if host.name in names)
    cluster = inventory.cluster
    if cluster.master in names:
        cluster = replace(cluster, master=hosts[0].name)
    return replace(inventory, hosts=hosts, spares=spares, cluster=cluster)


def _container_table(read: Reader) -> dict[str, Any]:
    """The container keys of ``read``'s table, read and validated."""
    values: dict[str, Any] = {}
    for key, convert in (("image", read.image), ("runtime", read.choice(containers.RUNTIME_CHOICES)),
                         ("mounts", read.mounts), ("options", read.runtime_options),
                         ("pull", read.choice(containers.PULL_CHOICES)), ("archive", read.archive)):
        if key in read.table:
            values[key] = convert(key, read.table[key])
    return values


def _host_container(read: Reader, base: Mapping[str, Any]) -> ContainerSettings | None:
    """``[container]`` with the host's own ``container`` table over it, key by key."""
    own: dict[str, Any] = {}
    if "container" in read.table:
        table = read.table["container"]
        if not isinstance(table, dict):
            read.fail("container", f"expected a table of container keys, got {show(table)}",
                      'write container = { image = "..." }')
        own = _container_table(Reader(read.path, f"{read.where}container.", table, CONTAINER_KEYS))
    merged = {**base, **own}
    if not merged:
        return None
    if "image" not in merged:
        read.fail("container", "no image: [container] has none, nor this host's container table",
                  'set image = "..." in [container]')
    # The archive's key is named where it was written: the host's table, else [container].
    named = Reader(read.path, f"{read.where}container." if "archive" in own else "[container].", {}, CONTAINER_KEYS)
    return _with_archive(named, ContainerSettings(**merged))


def _with_archive(read: Reader, settings: ContainerSettings) -> ContainerSettings:
    """``settings``, once its archive (if any) is known to hold its image and to be loadable
    by its runtime (docker or podman: Apptainer and enroot take no ``docker save`` tar)."""
    archive = settings.archive
    if archive is None:
        return settings
    if settings.runtime not in ("auto", *containers.OCI_RUNTIMES):
        read.fail("archive", f"{archive.path}: runtime {settings.runtime} does not load docker save archives",
                  "use runtime = \"podman\" or \"docker\" (or \"auto\") with an archive")
    if not holds(archive, settings.image):
        saved = ", ".join(archive.tags) or "no name"
        read.fail("archive", f"{archive.path} holds {saved}, not {settings.image}",
                  f"run with --image {archive.tags[0]}" if archive.tags else
                  f"save it by name: podman save -o FILE {settings.image}")
    return settings


def with_container(inventory: Inventory, table: Mapping[str, Any], where: str = "") -> Inventory:
    """The inventory with ``table``'s container keys over every host's: ``where`` "" for the
    command line's flags (``--image``, ``--container-runtime``, ``--pull``, named so in
    errors), else what names the keys (``Cluster.with_container``)."""
    read = Reader(Path(where), "", table, CONTAINER_KEYS) if where else FlagReader(Path("-"), "", table, CONTAINER_KEYS)
    values = _container_table(read)

    def merged(host: Host) -> Host:
        own = host.container
        keys = {**({field.name: getattr(own, field.name) for field in fields(own)} if own is not None else {}),
                **values}
        if "image" not in keys:
            read.fail(next(iter(values), "runtime"), "no image to run it with",
                      "give the image too (--image IMAGE), or image in [container]")
        return replace(host, container=_with_archive(read, ContainerSettings(**keys)))

    return replace(inventory, hosts=tuple(map(merged, inventory.hosts)), spares=tuple(map(merged, inventory.spares)))


def _parse_checks(table: Mapping[str, Any], path: Path) -> ChecksSettings:
    read = Reader(path, "[checks].", table, CHECKS_KEYS)
    return ChecksSettings(min_bandwidth=read.get("min_bandwidth", None, read.rate),
                          slow_ratio=read.get("slow_ratio", 0.5, read.ratio))


def _template_host(document: Mapping[str, Any], cluster: Mapping[str, Any], schedulers: Schedulers,
                   tables: Mapping[str, TableSettings], path: Path) -> str | None:
    """The one host's name of an inventory without [[hosts]] whose scheduler picks the nodes."""
    table = schedulers.table(str(cluster.get("scheduler")))
    if table is None or document.get("hosts") not in (None, []):
        return None
    return table.template_host(tables[table.name], cluster, path)


def _template(name: str, defaults: Mapping[str, Any], path: Path, container: Mapping[str, Any]) -> Host:
    base = _read_node_keys(Reader(path, "[defaults].", defaults, NODE_KEYS, CLUSTER_ONLY), {})
    return _parse_host(Reader(path, "", {"name": name}, HOST_KEYS), base, container)


def _table(document: Mapping[str, Any], key: str, path: Path) -> Mapping[str, Any]:
    value = document.get(key, {})
    if not isinstance(value, dict):
        raise InventoryError(f"{path}: {key}: expected a table [{key}], got {show(value)}")
    return value


def _defaults_nproc(defaults: Mapping[str, Any], cluster: Mapping[str, Any],
                    path: Path) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """``[defaults].nproc_per_node`` (where the other per-host keys stand) is
    ``[cluster].nproc_per_node``: every host's count unless its table sets its own."""
    if "nproc_per_node" not in defaults:
        return defaults, cluster
    read = Reader(path, "[defaults].", defaults, NODE_KEYS + ("nproc_per_node",), CLUSTER_ONLY)
    if "nproc_per_node" in cluster:
        read.fail("nproc_per_node", "[cluster].nproc_per_node is set too",
                  "keep one of them: both are every host's process count")
    value = read.option(NPROC_PER_NODE)("nproc_per_node", defaults["nproc_per_node"])
    return ({key: item for key, item in defaults.items() if key != "nproc_per_node"},
            {**cluster, "nproc_per_node": value})


def master_port_problem(port: int, hosts: Sequence[Host], master: str) -> str | None:
    """Why the master port cannot be ``port``: sshd's port 22, or the SSH port of a host at
    the master's address (one machine at two ports), where torchrun's bind would fail."""
    if port == 22:
        return "22 is SSH's port"
    at = {host.address for host in hosts if host.name == master}
    for host in hosts:
        if host.address in at and host.transport == "ssh" and port == (host.ssh_port or 22):
            return f"{port} is the SSH port of {host.name}, at the master's address"
    return None


def _parse_cluster(table: Mapping[str, Any], hosts: tuple[Host, ...], path: Path,
                   spares: tuple[str, ...] = (), schedulers: tuple[str, ...] = SSH_ONLY.names) -> Cluster:
    read = Reader(path, "[cluster].", table, CLUSTER_KEYS)
    names = [host.name for host in hosts]
    master = read.get("master", names[0], read.text)
    if master in spares:
        read.fail("master", f"{master!r} is a spare: a spare is not launched until a node is excluded",
                  "choose another master, or drop spare = true from that host")
    if master not in names:
        read.fail("master", f"{master!r} is not one of the hosts ({', '.join(names)})",
                  did_you_mean(master, tuple(names), "hosts"))
    ssh_config = read.get("ssh_config", None, read.text)
    if ssh_config and not _relative_to(path, ssh_config).is_file():
        read.fail("ssh_config", f"{str(_relative_to(path, ssh_config))!r}: no such file",
                  "fix the path (relative to the inventory), or leave the key out to use ~/.ssh/config")
    default_nproc: int | str = 1
    port = read.get("port", 29500, read.port)
    clash = master_port_problem(port, hosts, master)
    if clash:
        read.fail("port", clash, "choose a free port for the rendezvous (torchrun's default is 29500)")
    return Cluster(
        master=master,
        port=port,
        nproc_per_node=read.get("nproc_per_node", default_nproc, read.option(NPROC_PER_NODE)),
        rdzv_backend=read.get("rdzv_backend", "static", read.choice(RDZV_BACKENDS)),
        master_addr=read.get("master_addr", None, read.text),
        ssh_config=_relative_to(path, ssh_config) if ssh_config else None,
        ssh_timeout=read.get("ssh_timeout", 10.0, read.option(SSH_TIMEOUT)),
        rdzv_backend_set="rdzv_backend" in table,
        scheduler=read.get("scheduler", "ssh", read.choice(schedulers)),
        nproc_per_node_set="nproc_per_node" in table,
    )


def _parse_sync(table: Mapping[str, Any], path: Path) -> SyncSettings:
    read = Reader(path, "[sync].", table, SYNC_KEYS)
    directory = read.get("dir", None, read.text)
    no_patterns: list[str] = []
    exclude = read.get("exclude", no_patterns, _patterns(read))
    include = read.get("include", no_patterns, _patterns(read))
    return SyncSettings(dir=_relative_to(path, directory) if directory else None, exclude=tuple(exclude),
                        include=tuple(include), dest=read.get("dest", None, read.text))


def _patterns(read: Reader) -> Callable[[str, Any], list[str]]:
    def convert(key: str, value: Any) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(item, str) and item.strip() for item in value):
            example = '[".env"]' if key == "include" else '["data/", "*.ckpt"]'
            read.fail(key, f"expected a list of patterns, got {show(value)}", f"write {key} = {example}")
        return [str(item) for item in value]
    return convert


def _relative_to(inventory_path: Path, value: str) -> Path:
    candidate = Path(value).expanduser()
    if candidate.is_absolute():
        return candidate
    return inventory_path.parent / candidate


def _parse_hosts(document: Mapping[str, Any], defaults: Mapping[str, Any], path: Path,
                 container: Mapping[str, Any]) -> tuple[Host, ...]:
    entries = document.get("hosts")
    if entries is None or entries == []:
        raise InventoryError(f"{path}: hosts: no hosts listed",
                             'add at least one [[hosts]] table with name = "..."')
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise InventoryError(f"{path}: hosts: expected [[hosts]] tables, got {show(entries)}")
    base = _read_node_keys(Reader(path, "[defaults].", defaults, NODE_KEYS, CLUSTER_ONLY), {})
    hosts: list[Host] = []
    seen: set[str] = set()  # a set, not a scan of the hosts so far: 50,000 hosts parse in linear time
    for index, entry in enumerate(entries):
        read = Reader(path, f"hosts[{index}].", entry, HOST_KEYS, CLUSTER_ONLY)
        for expanded in _expand_entry(read):
            host = _parse_host(Reader(path, f"hosts[{index}].", expanded, HOST_KEYS), base, container)
            if host.name in seen:
                raise InventoryError(f"{path}: hosts[{index}].name: duplicate host name {host.name!r}",
                                     "give every host a unique name")
            seen.add(host.name)
            hosts.append(host)
    return tuple(hosts)


def _expand_entry(read: Reader) -> list[Mapping[str, Any]]:
    """One ``[[hosts]]`` table per name its nodeset stands for (``name = "gpu[01-16]"``);
    an address or local_addr nodeset expands in step with the name."""
    table = read.table
    # The plain case first, without the nodeset parser: 50,000 hosts must parse in seconds.
    if not any(isinstance(table.get(key), str) and "[" in table[key] for key in ("name",) + STEP_KEYS):
        return [table]
    if "name" not in table:
        read.fail("name", "missing", 'every [[hosts]] table needs name = "..."')
    names = _nodeset(read, "name")
    stepped = {key: _nodeset(read, key) for key in STEP_KEYS if key in read.table}
    for key, values in stepped.items():
        if len(values) != len(names):
            read.fail(key, f"{read.table[key]!r} stands for {len(values)} addresses but name "
                           f"{read.table['name']!r} for {len(names)} hosts",
                      f"write {key} with a range of the same length, e.g. name = \"gpu[01-04]\", "
                      f"{key} = \"10.0.0.[1-4]\"")
    return [{**read.table, "name": name, **{key: values[index] for key, values in stepped.items()}}
            for index, name in enumerate(names)]


def _nodeset(read: Reader, key: str) -> list[str]:
    text = read.text(key, read.table[key])
    try:
        return expand(text)
    except NodesetError as error:
        read.fail(key, f"not a host name or nodeset: {error}", 'write a name, or a range like "gpu[01-16]"')


def _read_node_keys(read: Reader, base: Mapping[str, Any]) -> dict[str, Any]:
    values = dict(base)
    for key, convert in (("user", read.user), ("ssh_port", read.port), ("identity_file", read.existing_file),
                         ("python", read.text), ("workdir", read.text), ("setup", read.script),
                         ("uv", read.text), ("venv_dir", read.text)):
        if key in read.table:
            values[key] = convert(key, read.table[key])
    if "env" in read.table:
        values["env"] = {**values.get("env", {}), **read.env("env", read.table["env"])}
    return values


def _parse_host(read: Reader, base: Mapping[str, Any], container: Mapping[str, Any]) -> Host:
    if "name" not in read.table:
        read.fail("name", "missing", 'every [[hosts]] table needs name = "..."')
    name = read.text("name", read.table["name"])
    if not HOST_NAME_PATTERN.match(name):
        read.fail("name", f"{name!r} is not a usable host name",
                  "use letters, digits, '.', '_' and '-' (it names the log file)")
    values = _read_node_keys(read, base)
    return Host(
        name=name,
        address=read.get("address", name, read.address),
        user=values.get("user"),
        ssh_port=values.get("ssh_port"),
        identity_file=values.get("identity_file"),
        python=values.get("python", "python3"),
        workdir=values.get("workdir", UNSET_WORKDIR),
        env=MappingProxyType(dict(values.get("env", {}))),
        setup=values.get("setup", ""),
        local_addr=read.get("local_addr", None, read.local_addr),
        nproc_per_node=read.get("nproc_per_node", None, read.option(NPROC_PER_NODE)),
        spare=read.get("spare", False, read.flag),
        container=_host_container(read, container),
        uv=values.get("uv"),
        venv_dir=values.get("venv_dir"),
        transport=read.get("transport", "auto", read.choice(TRANSPORTS)),
    )


UNSET_WORKDIR = ""
"""A host's workdir when no table gave one: the home directory over SSH, the current
directory on this machine (where ``torchrun train.py`` would run)."""


def reached(hosts: tuple[Host, ...]) -> tuple[Host, ...]:
    """Every "auto" host decided: this machine ("local") or SSH. An explicit user, port or
    identity file means SSH (someone testing their sshd); this machine's own hostname is
    this machine only when it is the only host (on a cluster, a node may share the name)."""
    own = socket.gethostname().lower()
    decided = [host if host.transport != "auto" else replace(
        host, transport="local" if _this_machine(host, own, len(hosts) == 1) else "ssh") for host in hosts]
    return tuple(host if host.workdir != UNSET_WORKDIR else replace(
        host, workdir=os.getcwd() if host.transport == "local" else "~") for host in decided)


def _this_machine(host: Host, own: str, alone: bool) -> bool:
    if host.user is not None or host.ssh_port is not None or host.identity_file is not None:
        return False
    address = host.address.lower()
    return address in LOOPBACK_ADDRESSES or (alone and address == own)
