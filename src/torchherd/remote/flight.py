"""torch's flight recorder, read from every rank of a hung job (the hang watch's runs only).

torch keeps, in each rank, the last collectives it issued (``TORCH_FR_BUFFER_SIZE``
entries: for NCCL and, since torch 2.10, for gloo), but hands them out only to code in
that rank (``torch._C._distributed_c10d._dump_fr_trace_json``). So the supervisor puts
a ``sitecustomize`` module first on the ranks' ``PYTHONPATH``, in a private directory of
its own (inside torchrun's log directory, which a container mounts too): in each rank it
starts a thread that sleeps until the hang probe asks (a file named ``dump`` appears), then
writes the rank's record beside it, and it runs the ``sitecustomize`` it hid, if any. A
rank blocked in a collective has released Python's lock, so the thread runs then.

The buffer's variable depends on the rank's torch: ``TORCH_FR_BUFFER_SIZE`` since torch
2.8, which warns in every rank when it finds the old ``TORCH_NCCL_TRACE_BUFFER_SIZE``; older
torch knows only the old name. The supervisor cannot tell which torch the ranks import (a
venv, a container), so it hands the size over as ``TORCHHERD_FR_BUFFER`` and the hook, in
the rank itself, reads its torch's version from ``torch/version.py`` (without importing
torch) and sets the one name that torch reads.

``install`` (the supervisor) and ``collect`` (the hang probe) run on the node's Python
(>= 3.8), standard library only.
"""

import json
import os
import stat
import time
from typing import Any, Dict, List, Mapping, Optional

ENABLE_ENV = "TORCHHERD_FLIGHT_RECORDER"
"""In the job's environment (``1``): the hang watch wants the flight recorder read."""
DIR_ENV = "TORCHHERD_FR_DIR"
BUFFER = "2000"
"""Entries each rank keeps, unless the job set its own size."""
BUFFER_ENV = "TORCHHERD_FR_BUFFER"
"""The size the hook gives the rank's torch under the name that torch reads."""
NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""The buffer's variable: torch >= 2.8's (the hook's ``_torchherd_buffer_name``), then the
older torch's, deprecated since."""
DIR_NAME = "torchherd-fr"
TRIGGER = "dump"
RECORD_LIMIT = 4 << 20
"""Bytes of one rank's record read; a bigger one is refused."""
KEPT = 6
"""Entries per process group sent back to the controller: the last ones say where it stands."""

HOOK = '''\
"""torchherd's flight recorder hook (only in runs with a hang watch): see torchherd.remote.flight."""
import json, os, sys, threading, time


def _torchherd_dump(directory):
    trigger = os.path.join(directory, "dump")
    while not os.path.exists(trigger):
        time.sleep(0.25)
    dist = sys.modules.get("torch.distributed")
    c10d = sys.modules.get("torch._C._distributed_c10d")
    try:
        if dist is None or not dist.is_initialized():
            return  # a helper process of a rank: no process group, no record
        dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
        text = dump() if dump is not None else b'{"error": "this torch has no flight recorder"}'
    except Exception as exc:
        text = json.dumps({"error": str(exc)[:200]}).encode()
    name = "fr-%s-%d" % (os.environ.get("RANK", "-1"), os.getpid())
    partial = os.path.join(directory, "." + name)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(text if isinstance(text, bytes) else str(text).encode())
    os.rename(partial, os.path.join(directory, name + ".json"))


def _torchherd_next_sitecustomize(here):
    import importlib.machinery, importlib.util
    sys.path[:] = [path for path in sys.path if os.path.abspath(path or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is not None and spec.loader is not None:  # it replaces this one in sys.modules
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


def _torchherd_buffer_name():
    """The flight recorder's variable this process's torch reads, from torch/version.py
    (``__version__ = '2.13.0+cu130'``); the new name where that cannot be read."""
    import importlib.util
    version = None
    try:
        spec = importlib.util.find_spec("torch")
        with open(os.path.join(spec.submodule_search_locations[0], "version.py")) as file:
            for line in file:
                if line.startswith("__version__"):
                    major, minor = line.split("=", 1)[1].strip()[1:].split(".")[:2]
                    version = (int(major), int(minor))
    except Exception:
        version = None
    return "TORCH_NCCL_TRACE_BUFFER_SIZE" if version is not None and version < (2, 8) else "TORCH_FR_BUFFER_SIZE"


_here = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("TORCHHERD_FR_DIR") == _here and os.environ.get("TORCHHERD_FR_BUFFER") and not (
        os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")):
    os.environ[_torchherd_buffer_name()] = os.environ["TORCHHERD_FR_BUFFER"]
if os.environ.get("LOCAL_RANK") is not None and os.environ.get("TORCHHERD_FR_DIR") == _here:
    threading.Thread(target=_torchherd_dump, args=(_here,), name="torchherd-fr", daemon=True).start()
_torchherd_next_sitecustomize(_here)
'''


def install(base: str, env: Mapping[str, str]) -> Dict[str, str]:
    """Writes the hook into ``base`` (torchrun's private log directory of this attempt);
    the variables to add to the job's ``env`` (the job's own, then the supervisor's)."""
    directory = os.path.join(base, DIR_NAME)
    os.mkdir(directory, 0o700)
    fd = os.open(os.path.join(directory, "sitecustomize.py"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(HOOK)
    before = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    added = {"PYTHONPATH": directory + (os.pathsep + before if before else ""), DIR_ENV: directory}
    if not any(env.get(name) or os.environ.get(name) for name in NAMES):
        added[BUFFER_ENV] = BUFFER  # the job's own size, under either name, is kept as it is
    return added


def _own_private_dir(path: str) -> bool:
    """The hook's directory as the supervisor made it: ours, a directory (not a link), private."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077
            and os.path.basename(path) == DIR_NAME)


def _summary(document: Any) -> Dict[str, Any]:
    """The last entries of each process group, with what says where the rank stands."""
    if not isinstance(document, dict):
        return {"error": "not a JSON object"}
    if "error" in document and "entries" not in document:
        return {"error": str(document["error"])[:200]}
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for entry in document.get("entries") or []:
        if not isinstance(entry, dict):
            continue
        group = entry.get("process_group")
        key = str(group[1] if isinstance(group, list) and len(group) > 1 else entry.get("pg_id", "?"))[:64]
        groups.setdefault(key, []).append({
            "seq": entry.get("collective_seq_id"), "p2p_seq": entry.get("p2p_seq_id"),
            "p2p": bool(entry.get("is_p2p")), "name": str(entry.get("profiling_name", "?"))[:64],
            "state": str(entry.get("state", "?"))[:16], "retired": bool(entry.get("retired")),
            "sizes": str(entry.get("input_sizes", ""))[:80]})
    return {"groups": {key: entries[-KEPT:] for key, entries in groups.items()}}


def collect(directories: Mapping[int, str], ranks: Mapping[int, int], wait: float) -> Dict[str, Any]:
    """Asks every rank (pid -> its hook directory; pid -> its global rank) for its record
    and waits up to ``wait`` seconds for them; per rank, the summary of its record (the
    process with the most entries where a rank has helpers with the same RANK)."""
    wanted = {}
    for pid, directory in directories.items():
        if _own_private_dir(directory):
            wanted[pid] = directory
    for directory in set(wanted.values()):
        try:
            os.close(os.open(os.path.join(directory, TRIGGER), os.O_WRONLY | os.O_CREAT, 0o600))
        except OSError:
            continue
    deadline = time.monotonic() + wait
    found: Dict[int, Dict[str, Any]] = {}
    while True:
        for pid, directory in wanted.items():
            path = os.path.join(directory, "fr-%d-%d.json" % (ranks.get(pid, -1), pid))
            if pid in found or not os.path.exists(path):
                continue
            try:
                with open(path, "rb") as file:
                    text = file.read(RECORD_LIMIT + 1)
                found[pid] = (_summary(json.loads(text.decode("utf-8", "replace"))) if len(text) <= RECORD_LIMIT
                              else {"error": "a record of more than %d bytes" % RECORD_LIMIT})
            except (OSError, ValueError) as exc:
                found[pid] = {"error": str(exc)[:200]}
        if len(found) == len(wanted) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    by_rank: Dict[str, Dict[str, Any]] = {}
    for pid, summary in found.items():
        key = str(ranks.get(pid, -1))
        entries = sum(len(group) for group in summary.get("groups", {}).values())
        if key not in by_rank or entries > sum(len(group) for group in by_rank[key].get("groups", {}).values()):
            by_rank[key] = summary
    return by_rank


def directory_of(variables: Mapping[bytes, bytes]) -> Optional[str]:
    """A rank's hook directory, from its environment."""
    value = variables.get(DIR_ENV.encode())
    return value.decode("utf-8", "replace") if value else None
