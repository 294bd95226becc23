"""The local cluster's links held to a rate with tc's token bucket (tbf): on each node's
controller-side veth (traffic to the node) and on the node's own eth0 (traffic from it)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from localcluster import LocalCluster, veth_name


@contextmanager
def rate_limited(cluster: LocalCluster, names: Sequence[str], rate: str = "50mbit", burst: str = "32kbit",
                 latency: str = "400ms") -> Iterator[None]:
    """Every node of ``names`` at ``rate`` both ways (tc's units: ``50mbit``, ``2gbit``);
    ``burst`` at least the rate's bytes per kernel tick."""
    tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
    shaped: list[str] = []
    try:
        for name in names:
            shaped.append(name)
            port = veth_name(cluster.prefix, cluster.names.index(name))
            subprocess.run(["tc", "qdisc", "add", "dev", port, *tbf], check=True, capture_output=True)
            cluster.netns_exec(name, ["tc", "qdisc", "add", "dev", "eth0", *tbf])
        yield
    finally:
        for name in shaped:
            port = veth_name(cluster.prefix, cluster.names.index(name))
            subprocess.run(["tc", "qdisc", "del", "dev", port, "root"], capture_output=True)
            cluster.netns_exec(name, ["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
