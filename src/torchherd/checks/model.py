"""What the checks observed, in one value the pure analysis functions read.

The runner fills it over SSH; the analysis modules turn it into CheckResults without
touching the network, so unit tests build an ``Observed`` by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from torchherd.errors import TransportError
from torchherd.inventory import Host, Inventory
from torchherd.plan import NodeNetwork, NodeVenv

CHECK_IDS = ("ssh", "ping", "hostname", "port", "firewall", "network", "env", "python", "gpu", "xid", "ib",
             "gpudiag", "script", "venv", "clock", "bandwidth", "mtu", "smoke", "container")
"""Every check id, in report column order; ``smoke`` only runs with --smoke, ``bandwidth``
with --bandwidth or --smoke, ``gpudiag`` with --gpu-diag (or when --only names them).
``mtu`` runs in every preflight: one datagram of the interface MTU each way per pair (each
worker and the master, ring neighbours); with --bandwidth, on the measured links' pairs."""
OPT_IN = frozenset({"bandwidth", "smoke", "gpudiag"})
"""The checks a plain ``check`` leaves out: they send real traffic for seconds, run a job,
or load the GPUs for a while (DCGM's diagnostic)."""
WHERE_THEY_APPLY = frozenset({"venv"})
"""Checks that report nothing where they do not apply (``venv``: only for a uv-locked
project), so a run without one sees the report it always saw."""

Json = Mapping[str, Any]


@dataclass(frozen=True)
class NodeFacts:
    """One node's facts document (remote/facts.py), and how it was obtained."""

    raw: Json
    sent: float
    """Controller time.time() just before the command was sent, and just after the answer came."""
    received: float
    python_error: str = ""
    """Why the configured python did not run, when the facts came from a fallback ``python3``."""

    def get(self, key: str) -> Any:
        return self.raw.get(key)

    def own_addresses(self) -> set[str]:
        found: set[str] = set()
        for interface in self.raw.get("interfaces") or []:
            if isinstance(interface, dict):
                found.update(interface.get("addresses", []))
        return found

    def interface_of(self, address: str) -> Json | None:
        for interface in self.raw.get("interfaces") or []:
            if isinstance(interface, dict) and address in interface.get("addresses", []):
                return interface
        return None


Mesh = Literal["auto", "full"]
"""How many peers each node probes: ``full`` every other node, ``auto`` the full mesh up
to a threshold and a bounded, covering sample beyond it (see probes.plan_probes)."""


@dataclass(frozen=True)
class ProbePlan:
    """Whose ephemeral ports each node connects to (every worker probes the master port besides)."""

    mode: Literal["full", "sampled"]
    peers: Mapping[str, tuple[str, ...]]
    """Per node, in the order it probes them."""
    subnets: int
    """How many distinct subnets the nodes' addresses lie in."""

    def probers(self) -> dict[str, list[str]]:
        """Per node, the nodes that probe it."""
        found: dict[str, list[str]] = {node: [] for node in self.peers}
        for node, peers in self.peers.items():
            for peer in peers:
                found.setdefault(peer, []).append(node)
        return found

    def describe(self) -> str:
        others = max(0, len(self.peers) - 1)
        if self.mode == "full":
            return f"full mesh: every node probed all {others} others"
        degrees = sorted(len(peers) for peers in self.peers.values())
        fewest = min((len(probers) for probers in self.probers().values()), default=0)
        spread = f"{degrees[0]}" if degrees[0] == degrees[-1] else f"{degrees[0]} to {degrees[-1]}"
        subnets = f", both ways between each pair of the {self.subnets} subnets" if self.subnets > 1 else ""
        return (f"sampled: each node probed {spread} of the {others} others, each was probed by at least "
                f"{fewest}{subnets} (--mesh full probes every pair)")


@dataclass(frozen=True)
class LinkPlan:
    """Which directed links (sender, receiver) ``check --bandwidth`` measures, in rounds of
    links that share no node (see links.plan_links)."""

    mode: Literal["full", "sampled"]
    links: tuple[tuple[str, str], ...]
    rounds: tuple[tuple[tuple[str, str], ...], ...]
    subnets: int

    def describe(self) -> str:
        nodes = {node for link in self.links for node in link}
        if self.mode == "full":
            return f"full mesh: {len(self.links)} links both ways between {len(nodes)} nodes"
        subnets = f", every two of the {self.subnets} subnets both ways" if self.subnets > 1 else ""
        return (f"sampled: {len(self.links)} links, each node to and from at least two others{subnets} "
                f"(--mesh full measures every pair)")


BUSY_SHARE = 0.5
"""A transfer whose sender or receiver spent this share of its time on a CPU or waiting for
one was limited by the CPU, not (only) by the link: its figure is a floor on the link's."""


@dataclass(frozen=True)
class Transfer:
    """One measured transfer from ``sender`` to ``receiver`` (remote/bandwidth.py)."""

    sender: str
    receiver: str
    bits_per_second: float | None
    """None when it failed (``error`` says why)."""
    seconds: float = 0.0
    cpu: Mapping[str, float | None] = field(default_factory=dict)
    """Shares of the transfer's time: sender_cpu, sender_wait, receiver_cpu, receiver_wait."""
    alone: bool = False
    """Measured again after the burst, with no other transfer at the same time."""
    error: str = ""

    @property
    def link(self) -> tuple[str, str]:
        return self.sender, self.receiver

    @property
    def cpu_bound(self) -> bool:
        for side in ("sender", "receiver"):
            used = (self.cpu.get(f"{side}_cpu") or 0.0) + (self.cpu.get(f"{side}_wait") or 0.0)
            if used >= BUSY_SHARE:
                return True
        return False

    @property
    def gbit(self) -> float | None:
        return None if self.bits_per_second is None else self.bits_per_second / 1e9


MtuOutcome = bool | str
"""True: passed; False: no answer; else the error's text (EMSGSIZE: a router said smaller)."""


@dataclass(frozen=True)
class MtuProbe:
    """Datagrams of ``size`` bytes with don't-fragment between ``first`` and ``second``,
    both ways (one round trip), and a small one to show that the path itself works."""

    first: str
    second: str
    size: int
    small: MtuOutcome
    full: MtuOutcome
    out: MtuOutcome | None = None
    """``size`` bytes from first to second, small back (asked only when the full size failed)."""
    back: MtuOutcome | None = None
    largest: int | None = None
    """The largest size that passed both ways, when the full size did not."""
    confirmed: bool = False
    """Probed again after the burst, with longer waits."""
    error: str = ""

    @property
    def black_hole(self) -> bool:
        return self.small is True and self.full is not True and not self.error


@dataclass
class Observed:
    """Everything gathered for one preflight run."""

    inventory: Inventory
    master_target: str
    """The address the workers are told to reach the master at (a name or an IP)."""
    master_given: str | None = None
    """Where the master address came from when the user chose it (``--master-addr``,
    ``[cluster].master_addr``); None when torchherd finds it on the master. A chosen
    address is what the workers' probes connect to: the job will use exactly it."""
    script: str | None = None
    with_torch: bool = True
    """Whether the facts import torch: seconds of CPU per node, only for the checks that read it."""
    torch_known: Mapping[str, str] = field(default_factory=dict)
    """Per node whose torch ran moments ago, what ran it ("attempt 1's ranks"): its facts
    read torch's versions from its files, without the import (``CheckOptions.torch_known``)."""
    torch_imported: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Per node, the installs of torch (their fingerprints) an earlier check imported there,
    each with what did ("a check 3 min ago"): where the node's torch is one of them, its facts read its versions from its
    files (``CheckOptions.torch_imported``)."""
    ssh_errors: dict[str, TransportError] = field(default_factory=dict)
    ssh_addresses: dict[str, str] = field(default_factory=dict)
    """The IP the controller's SSH connection reached each node at."""
    host_key_notes: dict[str, str] = field(default_factory=dict)
    """Per node, when its host key was not verified against one on record: a new key
    accepted and recorded, or StrictHostKeyChecking no in the user's ssh config."""
    facts: dict[str, NodeFacts] = field(default_factory=dict)
    facts_errors: dict[str, str] = field(default_factory=dict)
    networks: dict[str, NodeNetwork] = field(default_factory=dict)
    ssh_hostnames: Mapping[str, str] = field(default_factory=dict)
    """Per host reached by an ssh_config alias, the alias's HostName (``Plan.ssh_hostnames``)."""
    listened: dict[str, Json] = field(default_factory=dict)
    connected: dict[str, Json] = field(default_factory=dict)
    probe_errors: dict[str, str] = field(default_factory=dict)
    probe_plan: ProbePlan | None = None
    """Which peers the probes covered; None when no probe ran."""
    controller_ping: dict[str, str] = field(default_factory=dict)
    """Per node: "ok", "no-reply", or "unavailable: why" (ICMP from the controller)."""
    shell_seconds: dict[str, float] = field(default_factory=dict)
    """Per node: the SSH round trip of a trivial command (session, login shell, exit)."""
    shell_alone: dict[str, float] = field(default_factory=dict)
    """Per node whose shell was slow among every node's logins: a trivial command's round
    trip timed again, after the burst, with few others at once (a slow verdict confirmed)."""
    nproc_per_node: int | str | None = None
    """The job's processes per node (``--nproc-per-node`` included); None: the inventory's."""
    job_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Per node, the environment the job's ranks get (inventory env and ``--env``)."""
    containers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per node whose job runs in an image: what checks/container.py found there."""
    gpu_diag: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per reached node, DCGM's diagnostic as checks/gpudiag.py ran it (``--gpu-diag``)."""

    node_nproc: Mapping[str, int | str] = field(default_factory=dict)
    """Per node, its own ``--nproc-per-node`` as the plan gives it (nodes may differ)."""
    link_plan: LinkPlan | None = None
    """Which links the bandwidth check measured; None when it did not run."""
    transfers: list[Transfer] = field(default_factory=list)
    """Every transfer measured, the burst's first and then the ones measured again alone."""
    mtu_probes: dict[tuple[str, str], MtuProbe] = field(default_factory=dict)
    mtu_pairs: tuple[tuple[str, str], ...] | None = None
    """The pairs the preflight's path-MTU probe chose (``links.preflight_pairs``); None
    when it did not run (``--bandwidth`` probes its ``link_plan``'s pairs instead)."""
    """Per pair (in the plan's order), the last probe of the path MTU."""
    bandwidth_errors: dict[str, str] = field(default_factory=dict)
    """Per node, why it could not take part in the measurements."""
    min_bandwidth: float | None = None
    """Bits per second: a link or node below fails (--min-bandwidth, [checks] min_bandwidth)."""
    slow_ratio: float = 0.5
    """A link or node below this share of the cluster's median warns."""
    venvs: Mapping[str, NodeVenv] = field(default_factory=dict)
    """Per node, a uv-locked project's venv (``check`` verifies it against the lock)."""

    @property
    def nproc(self) -> int | str:
        return self.inventory.cluster.nproc_per_node if self.nproc_per_node is None else self.nproc_per_node

    def nproc_of(self, host: Host) -> int | str:
        """The processes ``host`` runs: its own count in the plan, else the job's."""
        return self.node_nproc.get(host.name, self.nproc)

    def env_of(self, host: Host) -> Mapping[str, str]:
        return self.job_env.get(host.name, host.env)

    @property
    def master(self) -> Host:
        return self.inventory.hosts[0]

    @property
    def port(self) -> int:
        return self.inventory.cluster.port

    def missing(self, node: str) -> str | None:
        """Why ``node`` has no facts (for a skip), or None when it has them."""
        if node in self.ssh_errors:
            return "no SSH connection (see ssh)"
        if node in self.facts_errors:
            return f"facts not gathered: {self.facts_errors[node]}"
        if node not in self.facts:
            return "facts not gathered"
        return None
