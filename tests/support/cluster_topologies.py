"""SSH topologies (bastions, aliases): the DDP demo and the JSON run document's check
that every node ended clean."""

from __future__ import annotations

from pathlib import Path

DDP_DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "ddp_demo.py")


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
