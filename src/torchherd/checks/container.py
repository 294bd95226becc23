"""The ``container`` check's facts: on every node whose job runs in an image, which runtime
is installed, whether it answers this user, the image's id there, and the Python, torch,
CUDA and NCCL versions read inside the image (one throwaway container per node).

One shell command per node, every value in it quoted; it prints ``KEY VALUE`` lines that
``parse`` reads into a plain dict (the analysis in checks/analysis/container.py)."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any, Mapping

from torchherd.errors import TransportError
from torchherd.inventory import ContainerSettings, Host
from torchherd.remote import DROP_START_DIRECTORY
from torchherd.remote import container as containers
from torchherd.shell import quote_path
from torchherd.transport import Session, fan_out

CHECK_SECONDS = 120.0
"""A container's start plus torch's import, on a loaded node."""
USER_WORD = "UID:GID"
CHECK_WORKDIR = "/"
"""The check's container starts in the image's root, with no directory of the node mounted for it."""

# The first line drops the start directory ("" first in sys.path under ``python -c``) before
# anything is imported, so no json.py or torch/ in the directory the image starts in is run;
# -I would do it too, but would also drop the image's own PYTHONPATH, which may be how it finds torch.
VERSIONS = DROP_START_DIRECTORY + """\
import json
found = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import torch
    found["torch"] = torch.__version__
    found["cuda"] = torch.version.cuda
    try:
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        found["nccl"] = None
except Exception as exc:
    found["torch_error"] = "%s: %s" % (type(exc).__name__, exc)
print("versions " + json.dumps(found))
"""


def _versions_command(settings: ContainerSettings, runtime: str, python: str, rootless: bool) -> str:
    spec = containers.ContainerSpec(image=settings.image, runtime=runtime, name="", run_id="check",
                                    mounts=settings.mounts, options=settings.options, gpus=False)
    # In "/", nothing of the node's mounted: never the node's /tmp, where another user can
    # leave a module for the check's Python to import (security review 4, H1).
    argv = containers.run_argv(spec, runtime, [python, "-c", VERSIONS], [], CHECK_WORKDIR,
                               containers.Identity(USER_WORD, rootless, False), mount_workdir=False, named=False)
    words = " ".join(shlex.quote(word) for word in argv)
    return words.replace(shlex.quote(USER_WORD), '"$(id -u):$(id -g)"')


def node_command(host: Host) -> str:
    """The shell command that gathers ``host``'s container facts."""
    settings = host.container
    assert settings is not None
    candidates = containers.RUNTIMES if settings.runtime == "auto" else (settings.runtime,)
    image = shlex.quote(settings.image)
    lines = [
        # what passing the GPUs through needs (the analysis asks only where the ranks use them)
        'if [ -e /dev/nvidiactl ]; then echo "gpus yes"; else echo "gpus no"; fi',
        'if command -v nvidia-ctk >/dev/null 2>&1; then echo "nvidia-ctk $(command -v nvidia-ctk)"; '
        'nvidia-ctk cdi list 2>/dev/null | sed "s/^/cdi-device /"; fi',
        "for f in /etc/cdi/*.yaml /etc/cdi/*.yml /etc/cdi/*.json /var/run/cdi/*.yaml /var/run/cdi/*.yml "
        "/var/run/cdi/*.json; do",
        '  [ -r "$f" ] && grep -E -o \'^kind:[[:space:]]*["]?[A-Za-z0-9._/-]+|"kind"[[:space:]]*:[[:space:]]*"[A-Za-z0-9._/-]+\' '
        '"$f" | head -n 1 | sed "s|^|cdi-spec $f |"',
        "done",
        'if command -v nvidia-container-runtime-hook >/dev/null 2>&1; then echo "nvidia-hook yes"; fi',
        "rt=",
        f"for r in {' '.join(candidates)}; do if command -v \"$r\" >/dev/null 2>&1; then rt=$r; break; fi; done",
        'if [ -z "$rt" ]; then echo runtime-missing; exit 0; fi',
        'echo "runtime $rt"',
        'case "$rt" in',
        f"  podman|docker) out=$(\"$rt\" image inspect --format '{{{{.Id}}}}' {image} 2>&1) ;;",
        f"  *) out=$(sha256sum -- {image} 2>&1) && out=sha256:${{out%% *}} ;;",
        "esac",
        'if [ $? -ne 0 ]; then echo "image-error $(printf %s "$out" | tr "\\n" " ")"; exit 0; fi',
        # the id is the last line: a wrapper may say something first (podman-docker's "Emulate Docker CLI...")
        'echo "id $(printf "%s\\n" "$out" | tail -n 1)"',
        'if [ "$rt" = docker ]; then echo "docker-runtimes $(docker info --format \'{{json .Runtimes}}\' 2>/dev/null | '
        'tail -n 1)"; fi',
        'case "$rt:$(id -u)" in',
    ]
    python = quote_path(host.python) if host.python.startswith("~") else host.python
    for runtime in containers.RUNTIMES:
        for pattern, rootless in ((f"{runtime}:0", False), (f"{runtime}:*", True)):
            command = _versions_command(settings, runtime, python, rootless and containers.RUNTIME[runtime].keep_id)
            lines.append(f"  {pattern}) out=$({command} 2>&1) ;;")
    lines += [
        "esac",
        'code=$?',
        'printf "%s\\n" "$out" | grep "^versions " || echo "versions-error $code $(printf %s "$out" | tail -n 3 | '
        'tr "\\n" " ")"',
    ]
    return "\n".join(lines)


def parse(text: str) -> dict[str, Any]:
    """The command's ``KEY VALUE`` lines as a dict (``versions``: the JSON it carries)."""
    found: dict[str, Any] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "versions":
            try:
                found["versions"] = json.loads(value)
            except ValueError:
                found["versions-error"] = "unreadable: " + value[:200]
        elif key in ("runtime-missing", "runtime", "id", "image-error", "versions-error", "gpus", "nvidia-ctk",
                     "nvidia-hook"):
            found[key] = value.strip()
        elif key == "cdi-device":
            found.setdefault("cdi-devices", []).append(value.strip())
        elif key == "cdi-spec":
            path, _, kind = value.strip().partition(" ")
            found.setdefault("cdi-specs", []).append((path, re.sub(r'^("kind"|kind)\s*:\s*"?', "", kind)))
        elif key == "docker-runtimes":
            try:
                runtimes = json.loads(value)
            except ValueError:
                continue
            if isinstance(runtimes, dict):
                found["docker-runtimes"] = sorted(runtimes)
    return found


def gather(hosts: tuple[Host, ...], connections: Mapping[str, Session]) -> dict[str, dict[str, Any]]:
    """Every reachable node's container facts (an ``error`` key where the command failed)."""
    wanted = [host for host in hosts if host.container is not None and host.name in connections]

    def one(host: Host) -> tuple[str, dict[str, Any]]:
        try:
            result = connections[host.name].run(node_command(host), timeout=CHECK_SECONDS)
        except TransportError as error:
            return host.name, {"error": str(error)}
        found = parse(result.stdout.decode("utf-8", "replace"))
        if not found:
            found["error"] = (result.stderr.decode("utf-8", "replace").strip().splitlines() or
                              [f"exit status {result.exit_code}"])[-1]
        return host.name, found

    return dict(fan_out(wanted, one, 24))
