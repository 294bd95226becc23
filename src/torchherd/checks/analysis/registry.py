"""Which analysis produces each check id."""

from __future__ import annotations

from typing import Callable

from torchherd.checks.analysis import (
    bandwidth,
    clock,
    container,
    env,
    firewall,
    gpu,
    gpudiag,
    hostname,
    ib,
    network,
    ping,
    port,
    python,
    script,
    ssh,
    venv,
    xid,
)
from torchherd.checks.model import Observed
from torchherd.checks.results import CheckResult

Analysis = Callable[[Observed], list[CheckResult]]

ANALYSES: dict[str, Analysis] = {
    "ssh": ssh.analyse, "ping": ping.analyse, "hostname": hostname.analyse, "port": port.analyse,
    "firewall": firewall.analyse, "network": network.analyse, "env": env.analyse,
    "python": python.analyse, "gpu": gpu.analyse, "xid": xid.analyse, "ib": ib.analyse, "gpudiag": gpudiag.analyse, "script": script.analyse,
    "venv": venv.analyse, "clock": clock.analyse,
    "bandwidth": bandwidth.analyse, "mtu": bandwidth.analyse_mtu, "container": container.analyse,
}
