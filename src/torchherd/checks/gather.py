"""The SSH side of the checks: run the remote scripts and parse what they print."""

from __future__ import annotations

import json
import shlex
import socket
import time
from importlib import resources
from typing import Any, Mapping

from torchherd.checks.model import Json, NodeFacts
from torchherd.errors import TransportError
from torchherd.inventory import Host
from torchherd.transport import CommandResult, Connection, RemoteProcess

FALLBACK_PYTHON = "python3"
"""Used for the facts when the configured python does not run, so the other checks still report."""


def remote_source(name: str) -> str:
    return resources.files("torchherd.checks.remote").joinpath(name).read_text(encoding="utf-8")


def python_command(python: str, script: str, config: Mapping[str, Any], stdlib_only: bool = True) -> str:
    # The python is written as configured, unquoted: it may start with ~ or be a wrapper command.
    # -S skips site-packages (.pth files can cost 100+ ms of CPU per start), which a
    # standard-library script never needs; it matters with hundreds of nodes per core.
    flags = "-S " if stdlib_only else ""
    return f"{python} {flags}-c {shlex.quote(remote_source(script))} {shlex.quote(json.dumps(config))}"


def _interpreter_missing(result: CommandResult) -> bool:
    return result.exit_code in (126, 127)


def _describe_failure(result: CommandResult) -> str:
    lines = result.stderr.decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else f"exit status {result.exit_code}"


def gather_facts(connection: Connection, host: Host, config: Mapping[str, Any], timeout: float) -> NodeFacts:
    """Runs remote/facts.py with the node's python; raises TransportError when no facts came back."""
    sent = time.time()
    stdlib_only = not config.get("torch", True)
    result = connection.run(python_command(host.python, "facts.py", config, stdlib_only), timeout=timeout)
    python_error = ""
    if _interpreter_missing(result):
        python_error = f"{host.python}: {_describe_failure(result)}"
        sent = time.time()
        result = connection.run(python_command(FALLBACK_PYTHON, "facts.py", config, stdlib_only), timeout=timeout)
    received = time.time()
    try:
        raw = json.loads(result.stdout.decode("utf-8", "replace"))
    except ValueError:
        reason = python_error or _describe_failure(result)
        raise TransportError(host.name, "facts", f"{host.name}: the facts script failed: {reason}") from None
    return NodeFacts(raw=raw, sent=sent, received=received, python_error=python_error)


def start_listener(connection: Connection, python: str, ports: Mapping[str, int], seconds: float,
                   timeout: float) -> tuple[RemoteProcess, Json]:
    """Starts remote/probe.py listening; returns the process (EOF on its stdin ends it) and what it bound."""
    process = connection.start(python_command(python, "probe.py",
                                              {"mode": "listen", "ports": dict(ports), "seconds": seconds}))
    line = read_line(process, time.monotonic() + timeout)
    try:
        return process, json.loads(line)
    except ValueError:
        process.channel.close()
        raise TransportError(connection.node, "probe", f"{connection.node}: the listener did not start") from None


def read_line(process: RemoteProcess, deadline: float) -> str:
    channel = process.channel
    channel.settimeout(0.2)
    data = b""
    while b"\n" not in data and time.monotonic() < deadline:
        try:
            chunk = channel.recv(4096)
        except socket.timeout:
            continue
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace").split("\n")[0]


def stop_listener(process: RemoteProcess) -> None:
    try:
        process.channel.shutdown_write()
        process.exit_code(timeout=2.0)
    finally:
        process.channel.close()


def run_connector(connection: Connection, python: str, targets: list[tuple[str, str, int]],
                  ping: str | None, timeout: float, resolve: list[str]) -> Json:
    config = {"mode": "connect", "targets": [list(target) for target in targets], "timeout": timeout,
              "ping": ping, "resolve": resolve}
    result = connection.run(python_command(python, "probe.py", config), timeout=timeout + 8.0)
    try:
        parsed: Json = json.loads(result.stdout.decode("utf-8", "replace"))
    except ValueError:
        raise TransportError(connection.node, "probe",
                             f"{connection.node}: the probe failed: {_describe_failure(result)}") from None
    return parsed
