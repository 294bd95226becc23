"""The GPU tests' shared builders: node facts from nvidia-smi's XML, an Observed around
them, stand-in nvidia-smi and dmesg commands for a real facts round trip."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from torchherd.checks.analysis import xid
from torchherd.checks.gather import finish_facts, start_facts
from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult
from torchherd.inventory import Host, parse
from torchherd.transport.local import LocalSession

DATA = Path(__file__).resolve().parents[1] / "unit" / "data" / "gpu"


def smi(name: str) -> str:
    return (DATA / "nvidia-smi" / name).read_text(encoding="utf-8")


def node_facts(xml: str | None = None, gpus: int | None = None, **extra: Any) -> NodeFacts:
    raw: dict[str, Any] = {"gpu": {}, "env": {}}
    if xml is not None:
        raw["gpu"] = {"query": {"code": 0, "out": xml, "err": ""}}
    if gpus is not None:
        raw["torch"] = {"gpus": gpus, "nccl": None}
    raw.update(extra)
    return NodeFacts(raw=raw, sent=0.0, received=0.0)


def observed(nproc: int | str = 1, **facts: NodeFacts) -> Observed:
    inventory = parse({"cluster": {"nproc_per_node": nproc}, "hosts": [{"name": name} for name in facts]},
                      Path("hosts.toml"))
    seen = Observed(inventory=inventory, master_target=next(iter(facts)))
    seen.facts = dict(facts)
    return seen


def by_node(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {result.node: result for result in results}


def xid_result(lines: list[str], xml: str | None = None) -> CheckResult:
    facts = node_facts(xml, 1, kernel_xids={"source": "dmesg", "lines": lines})
    return by_node(xid.analyse(observed(node0=facts)))["node0"]


def tool(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body, encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def stand_ins(tmp_path: Path, xml: str, dmesg: str) -> Path:
    """A bin directory: nvidia-smi answering each query the facts make, and dmesg."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "query.xml").write_text(xml, encoding="utf-8")
    (tmp_path / "dmesg.txt").write_text(dmesg, encoding="utf-8")
    tool(bin_dir, "nvidia-smi", f"""case "$*" in
  "-q -x") cat {tmp_path}/query.xml ;;
  --query-gpu*) echo "0, NVIDIA RTX A5000, 1, 590.44.01"; echo "1, NVIDIA RTX A5000, 1, 590.44.01" ;;
  --query-compute-apps*) ;;
  "nvlink -s") echo "GPU 0: NVIDIA RTX A5000 (UUID: GPU-x)" ;;
  *) exit 2 ;;
esac
""")
    tool(bin_dir, "dmesg", f"cat {tmp_path}/dmesg.txt\n")
    return bin_dir


def gather(bin_dir: Path, root: Path, **extra: object) -> NodeFacts:
    host = Host(name="node0", address="127.0.0.1", user=None, ssh_port=None, identity_file=None,
                python="python3", workdir="~", env={}, setup="", local_addr=None)
    session = LocalSession("node0", env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    config = {"port": 29500, "resolve": [], "route_to": ["127.0.0.1"], "script": None, "workdir": "~",
              "torch": False, "listen": None, "root": str(root), **extra}
    try:
        return finish_facts(start_facts(session, config, 30.0, "python3"), host).facts
    finally:
        session.close()


def gathered_observed(facts: NodeFacts) -> Observed:
    inventory = parse({"cluster": {"nproc_per_node": 2}, "hosts": [{"name": "node0"}]}, Path("hosts.toml"))
    seen = Observed(inventory=inventory, master_target="node0", with_torch=False)
    seen.facts = {"node0": facts}
    return seen
