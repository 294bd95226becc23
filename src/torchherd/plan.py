"""The launch plan: pure functions from the inventory and the options to, per node,
the exact torchrun command, its environment and its working directory.

Nothing here touches the network or the clock; ``--dry-run`` prints what this builds.
"""

from __future__ import annotations

import hashlib
import ipaddress
import posixpath
import re
import shlex
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping, Sequence

from torchherd.errors import UsageError
from torchherd.inventory import CONTROL, Host, Inventory
from torchherd.inventory.options import (
    MAX_RESTARTS_OPTION,
    MONITOR_INTERVAL,
    NNODES,
    NPROC_PER_NODE,
    RDZV_CONF,
    OptionError,
    env_problem,
)
from torchherd.remote import container as containers
from torchherd.remote import uvlock, wire
from torchherd.remote.wire import RANK_PREFIX_TEMPLATE
from torchherd.shell import quote_path
from torchherd.words import count


@dataclass(frozen=True)
class NodeNetwork:
    """How a node takes part in the job's network, and why it was chosen."""

    address: str
    """The address the other nodes reach this node at (torchrun's --local-addr)."""
    interface: str | None = None
    """The interface that routes to the master, for GLOO/NCCL_SOCKET_IFNAME."""
    reason: str = ""


@dataclass(frozen=True)
class SyncOptions:
    """``--sync``: the local project, made identical on every node before the launch."""

    source: str
    """The local project directory, absolute."""
    dest: str | None = None
    """Where it goes on each node: relative to the node's workdir, or a path inside it.
    None: the workdir itself (``~/<project name>`` when the workdir is the home directory)."""
    exclude: tuple[str, ...] = ()
    """Patterns left out, as .gitignore writes them (the project's .gitignore files count too)."""
    include: tuple[str, ...] = ()
    """Patterns taken back from the private defaults (``tree.PRIVATE``) and ``exclude``."""


@dataclass(frozen=True)
class UvOptions:
    """A uv-locked project (``--uv``; on by itself when the synced project has
    ``pyproject.toml`` and ``uv.lock``): every node runs the job in a venv that
    ``uv sync --frozen`` built from the lock, kept under the lock's hash."""

    lock_hash: str
    """SHA-256 of the project's pyproject.toml and uv.lock, as the controller has them (``tree.uv_lock_hash``)."""
    system_site_packages: bool = False
    """The venv also sees the node python's own packages (a torch installed there)."""
    offline: bool = False
    """``--uv-offline``, ``[uv] offline``: a node that must build its venv gets the lock's
    wheels from the controller (downloaded once per node platform, relayed node to node)
    and builds with no network (``engine.prepare.offline``)."""


@dataclass(frozen=True)
class NodeVenv:
    """One node's venv for a uv-locked project: where it is, and how it is built."""

    path: str
    """``<project>/.torchherd-venvs/<key>``, or ``<venv_dir>/<project name>-<key>``: one
    venv per lock, python and kind."""
    key: str
    """What the marker in the venv holds once it is built; the same key: nothing to do."""
    project: str
    """The synced project on the node, where uv reads pyproject.toml and uv.lock."""
    python: str
    """The configured python: the venv's base interpreter, and what runs the sync's receiver and the build."""
    uv: tuple[str, ...]
    """Where uv is looked for on the node, in order (a bare name: on PATH)."""
    lock_hash: str
    system_site_packages: bool = False

    @property
    def python_path(self) -> str:
        """The venv's python: the job's interpreter."""
        return posixpath.join(self.path, "bin", "python")

    @property
    def marker(self) -> str:
        return posixpath.join(self.path, uvlock.MARKER)


VENVS_IN_PROJECT = ".torchherd-venvs"
"""Where the venvs are kept in the synced project on a node, unless ``venv_dir`` says."""


def uv_candidates(host: Host) -> tuple[str, ...]:
    """Where a node's uv is looked for: the inventory's ``uv`` alone when set; else beside
    the configured python (``pip install uv`` into its venv or pyenv: the uv that belongs
    to it, and no shim to go through), on PATH, and where uv's own installer and ``pip
    install --user uv`` put it."""
    if host.uv is not None:
        return (host.uv,)
    beside = [posixpath.join(posixpath.dirname(host.python), "uv")] if "/" in host.python else []
    return (*beside, "uv", "~/.local/bin/uv", "~/.cargo/bin/uv")


def node_venv(host: Host, uv: UvOptions, source: str, project: str) -> NodeVenv:
    """The venv ``host`` runs a uv-locked project in. Its key covers the lock, the
    configured python and the kind of venv: a node whose python differs gets a venv of
    its own, even in a home shared with other nodes."""
    kind = "system-site-packages" if uv.system_site_packages else "isolated"
    key = hashlib.sha256(f"{uv.lock_hash}\n{host.python}\n{kind}".encode()).hexdigest()[:16]
    # By default in the project itself: uv's venv refers to the project's files (a path
    # dependency, the project installed as a package) by their path and their ctime, so a
    # venv shared by nodes that each have their own copy of the project is, for uv, out of
    # date on all but one of them.
    path = (posixpath.join(host.venv_dir, f"{_project_name(source)}-{key}") if host.venv_dir is not None
            else posixpath.join(project, VENVS_IN_PROJECT, key))
    return NodeVenv(path=path, key=key, project=project, python=host.python, uv=uv_candidates(host),
                    lock_hash=uv.lock_hash, system_site_packages=uv.system_site_packages)


@dataclass(frozen=True)
class RunOptions:
    script: str
    script_args: tuple[str, ...] = ()
    run_id: str = "dry-run"
    nproc_per_node: int | str | None = None
    nnodes: str | None = None
    """torchrun's --nnodes; "MIN:MAX" makes the job elastic (c10d only)."""
    module: bool = False
    extra_env: Mapping[str, str] = field(default_factory=dict)
    """--env K=V and --env-pass NAME, already resolved by the CLI."""
    master_addr: str | None = None
    max_restarts: int = 0
    monitor_interval: float | None = None
    rdzv_conf: str | None = None
    rdzv_backend: str | None = None
    sync: SyncOptions | None = None
    uv: UvOptions | None = None


@dataclass(frozen=True)
class Torchrun:
    """A node's torchrun settings, decided once by the plan: each backend renders its own
    command from them (``argv`` for a node torchherd starts itself; SLURM's batch script
    puts its own variables where each node differs), and nothing reads them back out of
    a command line."""

    python: str
    nnodes: str
    nproc_per_node: int | str
    node_rank: int
    master_addr: str
    port: int
    rdzv_backend: str
    """"static" (``--node-rank``, ``--master-addr``) or "c10d" (a rendezvous endpoint)."""
    run_id: str
    rdzv_conf: str | None
    local_addr: str | None
    """The address the other nodes reach this one at (``--local-addr``); None: torch's own guess."""
    max_restarts: int
    monitor_interval: float | None
    log_dir: str
    module: bool
    script: str
    script_args: tuple[str, ...]

    @property
    def endpoint(self) -> str:
        """The c10d rendezvous endpoint: the master's address (an IPv6 one bracketed) and port."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"{host}:{self.port}"

    @property
    def conf(self) -> tuple[str, ...]:
        """The c10d rendezvous's settings: the user's, and ``is_host=1`` on the master."""
        conf = [self.rdzv_conf] if self.rdzv_conf else []
        if self.node_rank == 0:
            # The master hosts the store even when its address is on a secondary NIC,
            # where torch's own hostname match gives a false negative.
            conf.append("is_host=1")
        return tuple(conf)

    @property
    def rank_base(self) -> int | None:
        """The node's first global rank where torchrun's options fix it (static rendezvous:
        the node rank x a numeric process count); None for c10d, where the rendezvous hands
        out node ranks, and for ``gpu``/``auto`` process counts."""
        if self.rdzv_backend != "static" or not isinstance(self.nproc_per_node, int):
            return None
        return self.node_rank * self.nproc_per_node

    def options(self, output: str = "--tee") -> list[tuple[str, str]]:
        """torchrun's own options and their values, in the order its command has them.
        ``output``: how the ranks' output reaches their files (``--tee 3``: and torchrun's
        own stdout; ``--redirects 3``: only the files)."""
        pairs = [("--nnodes", self.nnodes), ("--nproc-per-node", str(self.nproc_per_node))]
        if self.rdzv_backend == "static":
            pairs += [("--node-rank", str(self.node_rank)), ("--master-addr", self.master_addr),
                      ("--master-port", str(self.port))]
        else:
            pairs += [("--rdzv-backend", "c10d"), ("--rdzv-endpoint", self.endpoint), ("--rdzv-id", self.run_id)]
            if self.conf:
                pairs.append(("--rdzv-conf", ",".join(self.conf)))
        if self.local_addr:
            pairs.append(("--local-addr", self.local_addr))
        pairs.append(("--max-restarts", str(self.max_restarts)))
        if self.monitor_interval is not None:
            pairs.append(("--monitor-interval", str(self.monitor_interval)))
        return pairs + [(output, "3"), ("--log-dir", self.log_dir)]

    def target(self) -> list[str]:
        """What torchrun runs: ``-m`` for a module, ``--`` (a script named "-x" is not an
        option of torchrun), the script or module, its arguments."""
        return (["-m"] if self.module else []) + ["--", self.script, *self.script_args]

    def argv(self, output: str = "--tee") -> tuple[str, ...]:
        """torchrun's command (``output``: as in ``options``)."""
        words = [self.python, "-m", "torch.distributed.run"]
        for option, value in self.options(output):
            words += [option, value]
        return tuple(words + self.target())


@dataclass(frozen=True)
class NodePlan:
    host: Host
    node_rank: int
    argv: tuple[str, ...]
    """The command the node runs: ``torchrun.argv()`` (a check's own program in its place)."""
    torchrun: Torchrun
    """The settings ``argv`` was rendered from, for a backend that renders its own command."""
    env: Mapping[str, str]
    workdir: str
    setup: str
    network: NodeNetwork | None
    notes: tuple[str, ...]
    """Why each derived choice (address, interface, env) was made, for --dry-run."""
    remote_log_dir: str
    nproc_per_node: int | str = 1
    """This node's own ``--nproc-per-node`` (nodes may differ: uneven GPU counts)."""
    sync_within: str | None = None
    """With ``--sync``: the workdir the inventory gave, which the destination (this
    plan's ``workdir``) must lie in."""
    container: containers.ContainerSpec | None = None
    """The image ``argv`` runs in (the supervisor stays outside it); None: on the node itself."""

    def job_argv(self) -> tuple[str, ...]:
        """``argv`` as the node runs it: inside the container when there is one (the user's
        uid:gid and the runtime "auto" picks are the node's: shown as the shell finds them)."""
        if self.container is None:
            return self.argv
        runtime = self.container.runtime if self.container.runtime != "auto" else containers.RUNTIMES[0]
        names = [*self.env, wire.RUN_ID_ENV, wire.SUPERVISOR_ENV]
        identity = containers.Identity(DRY_USER, False, bool(self.container.gpus))
        return tuple(containers.run_argv(self.container, runtime, self.argv, names, DRY_WORKDIR, identity,
                                         (self.remote_log_dir,)))

    venv: NodeVenv | None = None
    """A uv-locked project's venv: ``host.python`` (the job's, the checks', the
    supervisor's) is its python; it is built after the sync, before the preflight."""

    @property
    def base_python(self) -> str:
        """The configured python: what runs before the venv exists (the sync's receiver, the build)."""
        return self.venv.python if self.venv is not None else self.host.python

    def shell_prefix(self) -> list[str]:
        """What the node's shell does before the job, as the launch sends it: change into
        the workdir, then the setup snippet, on lines of its own (a ``# comment`` in it ends
        there), its output on stderr (never in the supervisor's record stream)."""
        parts = [f"cd {shell_dir(self.workdir)}"]
        if self.setup.strip():
            parts.append("{ " + self.setup.strip() + "\n} >&2")
        return parts

    def shell_line(self, hide_secrets: bool = False) -> str:
        """The command a user could paste into a shell on the node to do the same by hand;
        with ``hide_secrets``, values that look like secrets (by name or by shape) are ***."""
        assignments = " ".join(f"{name}={shown_value(name, value) if hide_secrets else shlex.quote(value)}"
                               for name, value in self.env.items())
        argv = self.job_argv()
        command = " ".join([quote_path(argv[0]), *map(shlex.quote, argv[1:])])
        command = command.replace(shlex.quote(DRY_USER), '"$(id -u):$(id -g)"').replace(DRY_WORKDIR, '"$PWD"')
        return " && ".join([*self.shell_prefix(), f"env {assignments} {command}" if assignments else command])


@dataclass(frozen=True)
class Plan:
    """The job, decided once: the preflight verifies this object, the launch executes it."""

    run_id: str
    master: str
    master_addr: str
    port: int
    rdzv_backend: str
    nodes: tuple[NodePlan, ...]
    inventory: Inventory
    options: RunOptions
    nproc_per_node: int | str
    """The processes per node asked for the whole run (``--nproc-per-node``, else
    ``[cluster]``); each node's own count is ``NodePlan.nproc_per_node``."""
    base_inventory: Inventory | None = field(default=None, repr=False, compare=False)
    """The inventory as given, when ``--sync`` moved the workdirs to the destination."""
    ssh_hostnames: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    """Per host, the HostName its SSH address resolves to in the ssh_config (what
    ``ssh -G`` prints), where it differs from the address: an alias is the controller's
    name for a node, and the other nodes cannot resolve it."""

    @property
    def sync(self) -> SyncOptions | None:
        return self.options.sync

    @property
    def world_size(self) -> int | None:
        """Every rank of the job, or None when a node's count is found there ("gpu", "auto")."""
        counts = [node.nproc_per_node for node in self.nodes]
        if all(isinstance(count, int) for count in counts):
            return sum(int(count) for count in counts)
        return None

    @property
    def script(self) -> str | None:
        """The training script's path, as each node must find it (None for a module)."""
        return None if self.options.module or not self.options.script else self.options.script

    def with_networks(self, networks: Mapping[str, NodeNetwork]) -> Plan:
        """The same plan with the addresses and interfaces the preflight found on the nodes
        (a master address given by the user or the inventory is kept as it is)."""
        if not networks:
            return self
        return build_plan(self.base_inventory or self.inventory, self.options, networks, self.ssh_hostnames)

    def as_json(self) -> dict[str, object]:
        """``run --dry-run --json`` (``engine.backend.Description``): every node's exact command,
        its environment's names (never their values: a token may be among them)."""
        return {"run_id": self.run_id, "scheduler": "ssh", "master": self.master,
                "master_addr": self.master_addr, "port": self.port, "rdzv_backend": self.rdzv_backend,
                "world_size": self.world_size, "sync": None if self.sync is None else self.sync.source,
                "nodes": [{"name": node.host.name, "node_rank": node.node_rank, "address": node.host.address,
                           "local_addr": None if node.network is None else node.network.address,
                           "nproc_per_node": node.nproc_per_node, "workdir": node.workdir, "argv": list(node.argv),
                           "command": node.shell_line(hide_secrets=True), "env": sorted(node.env),
                           "notes": list(node.notes)} for node in self.nodes]}

    def text(self) -> tuple[tuple[str, str], ...]:
        """What ``run --dry-run`` prints (``engine.backend.Description``): every node's command
        as a user could paste it, and why each choice was made."""
        lines = [("", f"run {self.run_id}: {count(len(self.nodes), 'node')}, master {self.master} at {self.master_addr}:{self.port}, "
                      f"rendezvous {self.rdzv_backend}")]
        for index, node in enumerate(self.nodes):
            lines.append((f"node:{index}", f"{node.host.name} (node_rank {node.node_rank})"))
            # every line of the command as it is sent (a setup snippet spans lines)
            lines.append(("", "  $ " + node.shell_line(hide_secrets=True)))
            lines.extend(("note", f"  - {note}") for note in node.notes)
        lines.append(("", "dry run: nothing was started"))
        return tuple(lines)


DRY_USER = "UID:GID"
"""Where ``--dry-run`` shows the node's ``$(id -u):$(id -g)``."""
DRY_WORKDIR = "@WORKDIR@"
"""Where ``--dry-run`` shows the workdir's real path, ``"$PWD"`` once the line's ``cd`` ran
(the supervisor expands a ``~`` there; the runtime takes none)."""

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)
URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/:@\s]*:)[^@\s]*(?P<at>@)")
"""scheme://user:PASSWORD@host: a DATABASE_URL names no secret, yet holds one."""
TOKEN_SHAPE = re.compile(r"\b(?:hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}"
                         r"|sk-[A-Za-z0-9_-]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})")
"""Well-known token formats (Hugging Face, GitHub, OpenAI-style, Slack, AWS keys)."""


def looks_secret(name: str) -> bool:
    """A variable whose value must never be printed (WANDB_API_KEY, HF_TOKEN, ...)."""
    return SECRET_NAME.search(name) is not None


def shown_value(name: str, value: str) -> str:
    """The value as ``--dry-run`` may show it, shell-quoted: *** for a variable named like a
    secret or a value shaped like a token, a URL's password as ***."""
    if looks_secret(name) or TOKEN_SHAPE.search(value):
        return "***"
    return shlex.quote(URL_PASSWORD.sub(r"\g<head>***\g<at>", value))


def shell_dir(path: str) -> str:
    """``quote_path`` for ``cd``: a relative path starting with "-" would be read as an option."""
    return quote_path("./" + path if path.startswith("-") else path)




def is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def build_plan(inventory: Inventory, options: RunOptions, networks: Mapping[str, NodeNetwork] | None = None,
               ssh_hostnames: Mapping[str, str] | None = None) -> Plan:
    """Every node's command, in node-rank order (the master is rank 0). ``networks``: what
    the preflight found on the nodes; ``ssh_hostnames``: per host, the HostName its SSH
    address resolves to in the ssh_config (the transport reads it; the plan reads no file)."""
    _check_options(options)
    _check_hosts(inventory)
    networks = networks or {}
    ssh_hostnames = {name: hostname for name, hostname in (ssh_hostnames or {}).items()
                     if hostname and not CONTROL.search(hostname)}
    given = inventory
    if options.sync is not None:
        inventory = _synced(inventory, options.sync)
    venvs = _venvs(inventory, options)
    if venvs:
        inventory = replace(inventory, hosts=tuple(replace(host, python=venvs[host.name].python_path)
                                                   for host in inventory.hosts))
    cluster = inventory.cluster
    backend, backend_note = _rendezvous(inventory, options)
    if options.nnodes and ":" in options.nnodes and backend != "c10d":
        raise OptionError(NNODES, options.nnodes, "an elastic range needs the c10d rendezvous",
                          'pass rdzv_backend="c10d" too, or set rdzv_backend = "c10d" in [cluster]',
                          flag_hint='add --rdzv-backend c10d, or set rdzv_backend = "c10d" in [cluster]')
    if options.rdzv_conf and backend != "c10d":  # torchrun's static rendezvous reads no --rdzv-conf
        raise OptionError(RDZV_CONF, options.rdzv_conf, f"only the c10d rendezvous takes it, and this run's is "
                          f"{backend}", 'pass rdzv_backend="c10d" too, or leave rdzv_conf out',
                          flag_hint="add --rdzv-backend c10d, or leave --rdzv-conf out")
    master = inventory.hosts[0]
    master_addr, master_note = _master_address(inventory, options, networks, ssh_hostnames)
    nodes = tuple(
        _node_plan(inventory, options, host, rank, master_addr, networks.get(host.name), backend,
                   ssh_hostnames.get(host.name))
        for rank, host in enumerate(inventory.hosts)
    )
    head = (master_note,) + ((backend_note,) if backend_note else ())
    nodes = (replace(nodes[0], notes=head + nodes[0].notes),) + nodes[1:]
    if options.sync is not None:
        nodes = tuple(_sync_node(node, given.hosts[index], options.sync) for index, node in enumerate(nodes))
    if venvs:
        offline = options.uv is not None and options.uv.offline
        nodes = tuple(_venv_node(node, venvs[node.host.name], offline) for node in nodes)
    nproc = options.nproc_per_node if options.nproc_per_node is not None else cluster.nproc_per_node
    return Plan(run_id=options.run_id, master=master.name, master_addr=master_addr,
                port=cluster.port, rdzv_backend=backend, nodes=nodes, inventory=inventory, options=options,
                nproc_per_node=nproc, base_inventory=given if given is not inventory else None,
                ssh_hostnames=MappingProxyType(ssh_hostnames))


def _synced(inventory: Inventory, sync: SyncOptions) -> Inventory:
    """The inventory with every host's workdir moved to the sync destination, so the
    checks (the ``script`` check) and the launch see the project where it was sent."""
    hosts = tuple(replace(host, workdir=sync_dest(host.workdir, sync)[0]) for host in inventory.hosts)
    return replace(inventory, hosts=hosts)


def _venvs(inventory: Inventory, options: RunOptions) -> dict[str, NodeVenv]:
    """Per host, the venv of a uv-locked project (none without ``options.uv``)."""
    if options.uv is None:
        return {}
    if options.sync is None:
        raise UsageError("--uv: the locked environment is built from the synced project's uv.lock",
                         "add --sync (or a [sync] table) to send the project with its lock")
    return {host.name: node_venv(host, options.uv, options.sync.source, host.workdir) for host in inventory.hosts}


def _venv_node(node: NodePlan, venv: NodeVenv, offline: bool = False) -> NodePlan:
    kind = ", with the node python's own packages" if venv.system_site_packages else ""
    how = ("uv pip sync builds offline from the lock's wheels, sent from this machine (a package project then "
           "installed editable, as uv sync does, its build backend sent too)," if offline
           else "uv sync --frozen builds")
    note = (f"python {venv.python_path}: the venv {how} from uv.lock (sha256 "
            f"{venv.lock_hash[:12]}) with {venv.python}{kind}; kept while the lock is unchanged")
    return replace(node, venv=venv, notes=node.notes + (note,))


def _project_name(source: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", posixpath.basename(source.rstrip("/"))) or "project"


def _sync_node(node: NodePlan, given: Host, sync: SyncOptions) -> NodePlan:
    dest, why = sync_dest(given.workdir, sync)
    note = f"workdir {dest}: the project synced from {sync.source}" + (f" ({why})" if why else "")
    return replace(node, sync_within=given.workdir, notes=node.notes + (note,))


def _is_home(path: str) -> bool:
    return posixpath.normpath(path) in ("~", "~/.")


def sync_dest(workdir: str, sync: SyncOptions) -> tuple[str, str]:
    """Where the project goes on a node whose workdir is ``workdir``, and why when it
    is not the workdir. Refuses (UsageError) the home directory itself and a path
    plainly outside the workdir; the node checks again with real paths."""
    name = _project_name(sync.source)
    if sync.dest is None:
        if _is_home(workdir):
            return f"~/{name}", "the workdir is the home directory; [sync].dest or --workdir chooses another place"
        return workdir, ""
    dest = sync.dest if sync.dest.startswith(("/", "~")) else posixpath.join(workdir, sync.dest)
    dest = posixpath.normpath(dest)
    if _is_home(dest) or dest == "/":
        raise UsageError(f"[sync].dest {sync.dest!r}: that is the {'home' if dest != '/' else 'root'} directory "
                         "itself; a sync needs a directory of its own", 'for example dest = "~/project"')
    limit = posixpath.normpath(workdir)
    comparable = dest.startswith("~") == limit.startswith("~")
    if comparable and dest != limit and not dest.startswith(limit.rstrip("/") + "/"):
        raise UsageError(f"[sync].dest {sync.dest!r}: {dest} is outside the workdir {workdir}",
                         "give a path inside the workdir (or relative to it), or change the workdir")
    return dest, ""


def node_nproc(inventory: Inventory, options: RunOptions, host: Host) -> int | str:
    """``--nproc-per-node`` for every node, else the host's own count, else ``[cluster]``'s."""
    if options.nproc_per_node is not None:
        return options.nproc_per_node
    return host.nproc_per_node if host.nproc_per_node is not None else inventory.cluster.nproc_per_node


def _rendezvous(inventory: Inventory, options: RunOptions) -> tuple[str, str]:
    """The rendezvous backend, and why when it is not the one asked for. torchrun's
    static rendezvous needs the same process count on every node; c10d takes uneven ones."""
    cluster = inventory.cluster
    backend = options.rdzv_backend or cluster.rdzv_backend
    counts = {host.name: node_nproc(inventory, options, host) for host in inventory.hosts}
    if len(set(map(str, counts.values()))) <= 1 or backend == "c10d":
        return backend, ""
    shown = ", ".join(f"{name} {count}" for name, count in list(counts.items())[:6])
    shown += ", ..." if len(counts) > 6 else ""
    if options.rdzv_backend == "static" or (options.rdzv_backend is None and cluster.rdzv_backend_set):
        where = "--rdzv-backend static" if options.rdzv_backend else "[cluster].rdzv_backend = \"static\""
        raise UsageError(f"{where}: the nodes run different process counts ({shown}), which torchrun's "
                         "static rendezvous cannot start",
                         "use --rdzv-backend c10d (or rdzv_backend = \"c10d\"), or give every node the same "
                         "nproc_per_node")
    return "c10d", (f"rendezvous c10d: the nodes run different process counts ({shown}); torchrun's static "
                    "rendezvous needs the same count everywhere")


def _master_address(inventory: Inventory, options: RunOptions, networks: Mapping[str, NodeNetwork],
                    ssh_hostnames: Mapping[str, str]) -> tuple[str, str]:
    master = inventory.hosts[0]
    if options.master_addr:
        return options.master_addr, "master address from --master-addr"
    if inventory.cluster.master_addr:
        return inventory.cluster.master_addr, "master address from [cluster].master_addr"
    if master.name in networks:
        network = networks[master.name]
        return network.address, f"master address {network.address}: {network.reason or 'found on the master'}"
    if master.local_addr:
        return master.local_addr, "master address from the master's local_addr"
    hostname = ssh_hostnames.get(master.name)
    if hostname is not None and hostname.lower() != master.address.lower():
        note = (f"master address {hostname}: the HostName of the master's ssh_config alias {master.address} "
                f"(as `ssh -G {master.address}` prints it; the other nodes cannot resolve the alias)")
        if is_loopback_name(hostname):
            note += ("; it is loopback (a port forward?): `check` and `run` look for the master's own address, "
                     "`run --no-check` needs master_addr or the master's local_addr")
        return hostname, note
    return master.address, f"master address {master.address}: the master's SSH address"


def is_loopback_name(text: str) -> bool:
    """A loopback address or ``localhost``: an address no other node reaches this one at."""
    if text.lower() in ("localhost", "localhost.localdomain") or text.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def _node_plan(inventory: Inventory, options: RunOptions, host: Host, rank: int, master_addr: str,
               network: NodeNetwork | None, backend: str, ssh_hostname: str | None) -> NodePlan:
    notes: list[str] = []
    local_addr = network.address if network else host.local_addr
    if local_addr is None and is_ip_address(host.address):
        local_addr = host.address
    if local_addr is None and ssh_hostname and is_ip_address(ssh_hostname) and not is_loopback_name(ssh_hostname):
        local_addr = ssh_hostname  # an alias's HostName, as an address written in the inventory is
    if local_addr:
        notes.append(f"--local-addr {local_addr}" + (f": {network.reason}" if network and network.reason else ""))
    # One per node (nodes may share a /tmp); the supervisor creates it, 0700, and refuses
    # one that exists: the name is guessable, and another user could have made it first.
    remote_log_dir = node_log_dir(options.run_id, host.name)
    torchrun = _torchrun(inventory, options, host, rank, master_addr, local_addr, backend, remote_log_dir)
    env = _node_env(host, options, network, notes)
    nproc = node_nproc(inventory, options, host)
    spec = _container(host, options.run_id, nproc, notes)
    return NodePlan(host=host, node_rank=rank, argv=torchrun.argv(), torchrun=torchrun, env=MappingProxyType(env),
                    workdir=host.workdir,
                    setup=host.setup, network=network, notes=tuple(notes), remote_log_dir=remote_log_dir,
                    nproc_per_node=nproc, container=spec)


def _container(host: Host, run_id: str, nproc: int | str, notes: list[str]) -> containers.ContainerSpec | None:
    """The node's container: named after the run and the node, GPUs passed through when the
    ranks are GPUs (nproc "gpu"), never for "cpu", else where the node has them."""
    settings = host.container
    if settings is None:
        return None
    gpus = True if nproc == "gpu" else False if nproc == "cpu" else None
    # The container itself never pulls: with pull "missing"/"always" the run pulls the image
    # on every node before its preflight (engine/prepare/pull.py reads the host's policy).
    spec = containers.ContainerSpec(image=settings.image, runtime=settings.runtime,
                                    name=containers.container_name(run_id, host.name), run_id=run_id,
                                    mounts=settings.mounts, options=settings.options, gpus=gpus, pull="never")
    problem = containers.spec_problem(spec)
    if problem:
        raise UsageError(f"{host.name}: container: {problem}")
    # "auto" is decided on each node: the command shown is the first runtime's, said so
    runtime = (f"runtime auto: each node uses the first of {', '.join(containers.RUNTIMES)} it has; the command "
               f"shows {containers.RUNTIMES[0]}'s" if spec.runtime == "auto" else f"runtime {spec.runtime}")
    notes.append(f"in container {spec.name} of image {spec.image} ({runtime}); "
                 + containers.SHM_NOTE + ("" if gpus is not None else "; GPUs passed through where the node has them")
                 + (f"; the image pulled first (pull = {settings.pull})" if settings.pull != "never" else ""))
    return spec


def node_log_dir(run_id: str, node: str) -> str:
    """torchrun's log directory on a node (made private and atomically where it is used)."""
    return f"/tmp/torchherd-{run_id}-{node}"


def _torchrun(inventory: Inventory, options: RunOptions, host: Host, rank: int, master_addr: str,
              local_addr: str | None, backend: str, log_dir: str) -> Torchrun:
    return Torchrun(python=host.python, nnodes=options.nnodes or str(len(inventory.hosts)),
                    nproc_per_node=node_nproc(inventory, options, host), node_rank=rank, master_addr=master_addr,
                    port=inventory.cluster.port, rdzv_backend="static" if backend == "static" else "c10d",
                    run_id=options.run_id, rdzv_conf=options.rdzv_conf, local_addr=local_addr or None,
                    max_restarts=options.max_restarts, monitor_interval=options.monitor_interval, log_dir=log_dir,
                    module=options.module, script=options.script, script_args=tuple(options.script_args))


def _node_env(host: Host, options: RunOptions, network: NodeNetwork | None, notes: list[str]) -> dict[str, str]:
    env = dict(host.env)
    env.update(options.extra_env)
    if "PYTHONUNBUFFERED" not in env:
        env["PYTHONUNBUFFERED"] = "1"
        notes.append("PYTHONUNBUFFERED=1 so each line reaches the controller as it is printed")
    if network and network.interface:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in env:
                env[name] = network.interface
                notes.append(f"{name}={network.interface}: the interface that routes to the master")
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = RANK_PREFIX_TEMPLATE
    env["TORCHHERD_RUN_ID"] = options.run_id
    return env


def parse_env_assignments(assignments: Sequence[str]) -> dict[str, str]:
    """``--env K=V`` values; the value is kept byte for byte (it may hold '=', quotes, spaces)."""
    env: dict[str, str] = {}
    for assignment in assignments:
        name, sep, value = assignment.partition("=")
        if not sep or env_problem(name, value) is not None:
            raise UsageError(f"--env {assignment!r}: expected NAME=VALUE (NAME: ASCII letters, digits, '_')",
                             "for example --env NCCL_DEBUG=INFO")
        env[name] = value
    return env


# validation: whatever reaches a node (from the inventory, the API or the CLI) is checked here once


def check_nnodes(text: str) -> str:
    """torchrun's ``--nnodes``: N, or MIN:MAX with 1 <= MIN <= MAX; ValueError says why not."""
    parts = text.split(":")
    numbers = [int(part) for part in parts if part.isascii() and part.isdigit()]
    if len(parts) > 2 or len(numbers) != len(parts) or numbers[0] < 1 or numbers != sorted(numbers):
        raise ValueError(f"expected N or MIN:MAX (1 <= MIN <= MAX), got {text!r}")
    return text


def _check_options(options: RunOptions) -> None:
    if not wire.is_run_id(options.run_id):
        raise UsageError(f"run id {options.run_id!r}: only letters, digits and '-' (not first), "
                         f"at most {wire.RUN_ID_MAX} characters", "leave it out: torchherd makes one")
    for value in (options.script, *options.script_args):
        if "\0" in value:
            raise UsageError(f"script {value!r}: holds a NUL character, which no command line can")
    if options.nnodes is not None:
        try:
            check_nnodes(options.nnodes)
        except ValueError as error:
            raise OptionError(NNODES, options.nnodes, str(error)) from None
    MAX_RESTARTS_OPTION.from_argument(options.max_restarts)
    if options.monitor_interval is not None:
        MONITOR_INTERVAL.from_argument(options.monitor_interval)
    if options.nproc_per_node is not None:
        NPROC_PER_NODE.from_argument(options.nproc_per_node)
    for name, value in options.extra_env.items():
        problem = env_problem(name, value)
        if problem is not None:
            raise UsageError(f"plan(env={{{name!r}: ...}}): {problem}")
    for key, text in (("master_addr", options.master_addr), ("rdzv_conf", options.rdzv_conf)):
        if text is not None and CONTROL.search(text):
            raise UsageError(f"{key} {text!r}: holds a control character")


def _check_hosts(inventory: Inventory) -> None:
    """What ``--python``/``--workdir`` or a ``Cluster(...)`` gave, checked as the file's values are."""
    for host in inventory.hosts:
        for key, text in (("python", host.python), ("workdir", host.workdir), ("user", host.user or "")):
            if CONTROL.search(text):
                raise UsageError(f"{host.name}: {key} {text!r}: holds a control character (a newline, a NUL, ...)")
        for name, value in host.env.items():
            problem = env_problem(name, value)
            if problem is not None:
                raise UsageError(f"{host.name}: env {name!r}: {problem}")
