"""SSH topologies (bastions, aliases): the job they train and the JSON run document's check
that every node ended clean."""

from __future__ import annotations

from pathlib import Path

DDP_DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "ddp_demo.py")
ALLREDUCE_DEMO = str(Path(__file__).resolve().parents[1] / "cluster" / "jobs" / "allreduce_demo.py")
"""The demo's training without DDP and torch.optim (tests/cluster/jobs/allreduce_demo.py: the
same lines and losses, 1.2-1.8 s less CPU a rank): where the test's subject is how the job is
reached, not DDP."""


def assert_clean(document: dict[str, object], nodes: list[str]) -> None:
    checks = document["checks"]
    assert isinstance(checks, list)
    failed = [entry["summary"] for entry in checks if entry["status"] == "fail"]
    assert failed == [] and document["ok"] is True
    ssh = {entry["node"]: entry for entry in checks if entry["check"] == "ssh"}
    assert sorted(ssh) == sorted(nodes)
    for entry in ssh.values():  # a warning may only say the 2-core machine was slow to start a shell
        assert entry["status"] == "pass" or "round trip" in entry["summary"] or "took" in entry["summary"], entry
        assert "host key verified" in entry["summary"], entry
    warned = [entry["summary"] for entry in checks if entry["status"] == "warn" and entry["check"] != "ssh"]
    print("\n".join(["warnings:"] + warned) if warned else "no warnings")
