"""Where torch was imported lately, kept on this machine per node, so that a run's
preflight reads torch's versions from its files where a check already imported that very
install: the import proves nothing new there, costs seconds of CPU on every node (more on a
cold page cache or a network filesystem), and the run's torchrun imports it moments later.

``$XDG_STATE_HOME/torchherd/torch-imports.json`` (beside the run records, 0600):
``{"NODE": [[FINGERPRINT, when], ...]}``, each node by how the controller reaches it (its
transport, user, address, port and python: the same in every inventory that names it), each
install by ``checks.remote.facts.torch_fingerprint`` (the interpreter, torch's files and the
variables that change what the import loads: a reinstall, an upgrade or another
``LD_LIBRARY_PATH`` is another install, imported again). ``check`` always imports and
records; only an import that succeeded is kept, for ``KEPT_SECONDS``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from torchherd.checks.model import NodeFacts
from torchherd.inventory import Host
from torchherd.remote.wire import write_text_atomic
from torchherd.statedir import read_kept, state_dir

KEPT_SECONDS = 86400.0
"""How long an import stands for its install: a day (the files' identity is the proof;
the age only bounds what a node could have changed without touching them)."""
PER_NODE = 4
"""The most installs kept per node (the newest): a venv or two beside the system's."""
MAX_NODES = 4096
MAX_FILE_BYTES = 1 << 20


def imports_file(directory: Path | None = None) -> Path:
    return (directory or state_dir()) / "torch-imports.json"


def node_key(host: Host) -> str:
    return f"{host.transport} {host.user or ''}@{host.address}:{host.ssh_port or ''} {host.python}"


def imported_on(hosts: Iterable[Host], now: float | None = None,
                directory: Path | None = None) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """Per host (by name), the installs kept for it, each with what imported it ("a check
    3 min ago"): ``CheckOptions.torch_imported``."""
    when = time.time() if now is None else now
    kept = _read(imports_file(directory))
    found = []
    for host in hosts:
        entries = tuple((fingerprint, f"a check {ago(when - at)}")
                        for fingerprint, at in kept.get(node_key(host), []) if 0 <= when - at <= KEPT_SECONDS)
        if entries and host.container is None:
            found.append((host.name, entries))
    return tuple(found)


def keep_imports(hosts: Iterable[Host], facts: Mapping[str, NodeFacts], now: float | None = None,
                 directory: Path | None = None) -> None:
    """Adds each install of torch that ``facts`` (a check's, by node name) imported without
    an error; one read from its files proves nothing and is not added."""
    when = time.time() if now is None else now
    imported = {}
    for host in hosts:
        torch = facts[host.name].get("torch") if host.name in facts and host.container is None else None
        if (isinstance(torch, dict) and isinstance(torch.get("fingerprint"), str) and "version" in torch
                and not torch.get("files") and "error" not in torch):
            imported[node_key(host)] = str(torch["fingerprint"])
    if not imported:
        return
    path = imports_file(directory)
    kept = _read(path)
    for key, fingerprint in imported.items():
        others = [entry for entry in kept.get(key, []) if entry[0] != fingerprint]
        kept[key] = ([[fingerprint, when]] + others)[:PER_NODE]
    newest = dict(sorted(kept.items(), key=lambda item: max(at for _, at in item[1]))[-MAX_NODES:])
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_text_atomic(str(path), json.dumps(newest, separators=(",", ":")))


def ago(seconds: float) -> str:
    """``12 s ago``, ``3 min ago``, ``5 h ago``."""
    if seconds < 60:
        return f"{max(0.0, seconds):.0f} s ago"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min ago"
    return f"{seconds // 3600:.0f} h ago"


def _read(path: Path) -> dict[str, list[list[Any]]]:
    """The kept imports; a file that is missing, too big or damaged keeps none (the next
    check imports and writes it anew)."""
    raw = read_kept(path, MAX_FILE_BYTES)
    kept: dict[str, list[list[Any]]] = {}
    for key, entries in raw.items():
        if isinstance(key, str) and isinstance(entries, list):
            good = [[entry[0], float(entry[1])] for entry in entries
                    if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                    and isinstance(entry[1], (int, float)) and not isinstance(entry[1], bool)]
            if good:
                kept[key] = good[:PER_NODE]
    return kept
