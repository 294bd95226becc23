"""A run's preflight reads torch's versions from its files where a check imported that
very install on the node (``engine.ssh.imports``): the real facts program on the
in-process transport, what is kept on this machine, and the python check's words."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from support.analysis import facts, observed
from torchherd.checks.analysis import python
from torchherd.checks.gather import finish_facts, start_facts
from torchherd.checks.model import NodeFacts
from torchherd.engine.ssh.imports import KEPT_SECONDS, PER_NODE, imported_on, imports_file, keep_imports
from torchherd.inventory import Host
from torchherd.transport.local import LocalSession

NODE = Host(name="node0", address="10.0.0.1", user="ml", ssh_port=None, identity_file=None, python=sys.executable,
            workdir="~", env={}, setup="", local_addr=None)


def node_torch(imported: list[str], **env: str) -> dict[str, object]:
    session = LocalSession("node0", env={"PATH": os.environ["PATH"], **env})
    config = {"port": 29500, "resolve": [], "route_to": ["127.0.0.1"], "script": None, "workdir": "~",
              "torch": True, "imported": imported, "listen": None}
    try:
        gathered = finish_facts(start_facts(session, config, 60.0, sys.executable), NODE).facts
    finally:
        session.close()
    torch = gathered.get("torch")
    assert isinstance(torch, dict)
    return torch


@pytest.mark.timeout(120)
def test_an_install_imported_before_is_read_from_its_files_and_another_is_imported() -> None:
    imported = node_torch([])
    fingerprint = imported["fingerprint"]
    assert isinstance(fingerprint, str) and len(fingerprint) == 32
    assert "files" not in imported and imported["version"] == __import__("torch").__version__
    again = node_torch([fingerprint])
    assert again == {"version": imported["version"], "cuda": None, "nccl": None, "gpus": 0, "files": True,
                     "fingerprint": fingerprint}
    # Another LD_LIBRARY_PATH may load other libraries: another install, imported again.
    other = node_torch([fingerprint], LD_LIBRARY_PATH="/nonexistent")
    assert "files" not in other and other["fingerprint"] != fingerprint


def facts_with(torch: dict[str, object]) -> dict[str, NodeFacts]:
    return {"node0": NodeFacts({"torch": torch}, 0.0, 0.0)}


def test_only_an_import_that_succeeded_is_kept_private_and_newest_first(tmp_path: Path) -> None:
    keep_imports([NODE], facts_with({"version": "2.13.0", "fingerprint": "a" * 32}), now=1000.0, directory=tmp_path)
    keep_imports([NODE], facts_with({"error": "ImportError: x", "fingerprint": "b" * 32}), now=1001.0,
                 directory=tmp_path)
    keep_imports([NODE], facts_with({"version": "2.13.0", "files": True, "fingerprint": "c" * 32}), now=1002.0,
                 directory=tmp_path)
    assert imported_on([NODE], now=1100.0, directory=tmp_path) == (("node0", (("a" * 32, "a check 1 min ago"),)),)
    assert imports_file(tmp_path).stat().st_mode & 0o777 == 0o600
    for number in range(PER_NODE + 1):
        keep_imports([NODE], facts_with({"version": "2.13.0", "fingerprint": str(number) * 32}), now=2000.0 + number,
                     directory=tmp_path)
    ((_, kept),) = imported_on([NODE], now=2010.0, directory=tmp_path)
    assert [fingerprint[0] for fingerprint, _ in kept] == [str(number) for number in range(PER_NODE, 0, -1)]


def test_an_old_import_another_address_or_python_and_a_damaged_file_keep_nothing(tmp_path: Path) -> None:
    keep_imports([NODE], facts_with({"version": "2.13.0", "fingerprint": "a" * 32}), now=1000.0, directory=tmp_path)
    assert imported_on([NODE], now=1000.0 + KEPT_SECONDS + 1, directory=tmp_path) == ()
    for other in (Host(**{**NODE.__dict__, "address": "10.0.0.2"}), Host(**{**NODE.__dict__, "python": "python3"})):
        assert imported_on([other], now=1000.0, directory=tmp_path) == ()
    imports_file(tmp_path).write_text('{"ssh ml@10.0.0.1:": [["a", "yesterday"]', encoding="utf-8")
    assert imported_on([NODE], now=1000.0, directory=tmp_path) == ()


def test_the_python_check_says_which_check_imported_the_install_it_read() -> None:
    files = {"version": "2.13.0", "cuda": None, "nccl": None, "gpus": 0, "files": True, "fingerprint": "a" * 32}
    seen = observed(node0=facts("node0", torch=files))
    seen.torch_imported = {"node0": {"a" * 32: "a check 3 min ago"}}
    assert python.analyse(seen)[0].summary == ("python 3.11.7, torch 2.13.0, CUDA - (read from its files: a check "
                                               "3 min ago imported it)")
