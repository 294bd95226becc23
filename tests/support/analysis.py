"""Hand-made node facts for the pure analyses: ``facts(name, **overrides)`` one node's,
``observed(**facts)`` two nodes' as the checks see them (no sockets, no SSH)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchherd.checks.analysis.network import compute_networks
from torchherd.checks.model import NodeFacts, Observed
from torchherd.inventory import parse

ADDRESSES = {"node0": "10.0.0.1", "node1": "10.0.0.2"}


HOSTS = "10.0.0.1 node0\n10.0.0.2 node1\n"


def facts(name: str, **overrides: Any) -> NodeFacts:
    address = ADDRESSES[name]
    raw: dict[str, Any] = {
        "time": 1000.0, "hostname": name, "fqdn": name, "gloo": {"address": address}, "etc_hosts": HOSTS,
        "resolve": {"node0": {"addresses": ["10.0.0.1"]}},
        "interfaces": [{"name": "lo", "addresses": ["127.0.0.1"], "mtu": 65536},
                       {"name": "eth0", "addresses": [address], "mtu": 1500}],
        "route": {"target": "node0", "address": "10.0.0.1", "source": address},
        "port_range": "32768\t60999\n", "listeners": [], "free_port": 29501,
        "firewall": {"euid": 0, "tools": {"iptables": {"code": 0, "out": "-P INPUT ACCEPT\n"}}},
        "env": {}, "shm": {"bytes": 8 << 30}, "container": [],
        "python": {"executable": "/usr/bin/python3", "version": "3.11.7"},
        "torch": {"version": "2.13.0", "cuda": None, "nccl": None, "gpus": 0}, "script": None, "gpu": {},
    }
    raw.update(overrides)
    return NodeFacts(raw=raw, sent=999.0, received=1001.0)


def observed(**node_facts: NodeFacts) -> Observed:
    inventory = parse({"cluster": {"port": 29500}, "hosts": [{"name": "node0"}, {"name": "node1"}]},
                      Path("hosts.toml"))
    seen = Observed(inventory=inventory, master_target="node0")
    seen.facts = {"node0": facts("node0"), "node1": facts("node1"), **node_facts}
    seen.ssh_addresses = dict(ADDRESSES)
    seen.networks = compute_networks(seen)
    return seen
