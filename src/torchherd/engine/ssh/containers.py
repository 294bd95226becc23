"""A run's containers, seen from the controller (`torchherd docs containers`).

A node's supervisor removes its container whatever ends the job, but a node that died
(powered off, kernel panic, every process killed) took its supervisor with it: the
runtime keeps the container's record (podman's storage, docker's daemon) and lists it
again once the machine is back. At the end of a run with retries, ``remove_lost`` asks
every node lost in an attempt, and not in the last one, to remove the run's container by
its run-scoped name (no other run's or user's container is ever named), and says which
nodes it could not reach, with the command to run there once they are back.
"""

from __future__ import annotations

import shlex
from typing import Sequence

from torchherd.engine.events import LostContainers
from torchherd.errors import TransportError
from torchherd.inventory import Host
from torchherd.remote import container as containers
from torchherd.transport import Connector, Session, fan_out

REMOVE_SECONDS = 60.0
"""``rm -f`` of a container whose processes are gone: well under a second, more on a loaded node."""


def runtimes_of(host: Host) -> tuple[str, ...]:
    """The runtimes whose containers outlive their client that ``host``'s job may have used."""
    if host.container is None:
        return ()
    if host.container.runtime == "auto":
        return containers.OCI_RUNTIMES
    return (host.container.runtime,) if host.container.runtime in containers.OCI_RUNTIMES else ()


def remove_command(runtimes: Sequence[str], name: str) -> str:
    """Removes the container ``name`` with whichever of ``runtimes`` is installed; prints
    ``removed`` when there was one. "No such container" is no error: the supervisor may
    have removed it before the node was lost."""
    quoted = shlex.quote(name)
    return "\n".join([
        "removed=",
        f"for rt in {' '.join(shlex.quote(runtime) for runtime in runtimes)}; do",
        '  command -v "$rt" >/dev/null 2>&1 || continue',
        f'  if out=$("$rt" rm -f {quoted} 2>&1); then removed=1',
        '  else case "$out" in *"o such container"*) ;; *) printf "%s\\n" "$out" >&2; exit 1 ;; esac; fi',
        "done",
        'if [ -n "$removed" ]; then echo removed; fi',
    ])


def remove_lost(connector: Connector, hosts: Sequence[Host], run_id: str) -> LostContainers | None:
    """Removes the run's container on each of ``hosts`` (nodes lost in an attempt); None when
    none of them ran in a container that outlives its client."""
    wanted = [host for host in hosts if runtimes_of(host)]
    if not wanted:
        return None

    def one(host: Host) -> tuple[str, bool, str]:
        name = containers.container_name(run_id, host.name)
        session: Session | None = None
        try:
            session = connector.connect(host)
            done = session.run(remove_command(runtimes_of(host), name), timeout=REMOVE_SECONDS)
        except TransportError as error:
            return host.name, False, f"not reached: {error}"
        finally:
            if session is not None:
                session.close()
        if done.exit_code != 0:
            lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
            return host.name, False, lines[-1] if lines else f"exit status {done.exit_code}"
        return host.name, done.stdout.strip() == b"removed", ""

    results = fan_out(wanted, one)
    by_name = {host.name: host for host in wanted}
    removed = tuple(node for node, gone, why in results if gone)
    left = tuple((node, containers.container_name(run_id, node), " or ".join(runtimes_of(by_name[node])), why)
                 for node, gone, why in results if why)
    return LostContainers(removed, left)
