"""The ``gpudiag`` check's facts: ``dcgmi diag -r 1 -j`` on every reached node, run by the
node's own Python (so its timeout and output cap hold on the node, and the job's PATH
finds the DCGM the job would see), and a second time on a node whose first run failed a
test: the analysis (checks/analysis/gpudiag.py) fails a node only on a failure that came
back."""

from __future__ import annotations

import json
import shlex
from typing import Any, Mapping

from torchherd.checks.analysis.gpudiag import parse
from torchherd.errors import TransportError
from torchherd.inventory import Host
from torchherd.shell import quote_path
from torchherd.transport import Session, fan_out

DIAG_SECONDS = 300.0
"""DCGM's level 1 takes seconds to a minute; a stuck host engine must not hold the check."""
OUTPUT_LIMIT = 1 << 20
NODES_AT_ONCE = 32

RUN_DIAG = f"""\
import json, shutil, subprocess
path = shutil.which("dcgmi")
if path is None:
    print(json.dumps({{"missing": True}}))
else:
    try:
        done = subprocess.run([path, "diag", "-r", "1", "-j"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout={DIAG_SECONDS - 10:.0f})
        print(json.dumps({{"code": done.returncode, "out": done.stdout[:{OUTPUT_LIMIT}].decode("utf-8", "replace"),
                          "err": done.stderr[-2000:].decode("utf-8", "replace")}}))
    except subprocess.TimeoutExpired:
        print(json.dumps({{"error": "no answer in {DIAG_SECONDS - 10:.0f} s"}}))
    except OSError as exc:
        print(json.dumps({{"error": str(exc)}}))
"""


def node_command(host: Host) -> str:
    python = quote_path(host.python) if host.python.startswith("~") else shlex.quote(host.python)
    # -I -S as for every standard-library node program: the home directory the session
    # starts in, and PYTHON* variables, stay out of its imports.
    return f"{python} -I -S -c {shlex.quote(RUN_DIAG)}"


def run_once(connection: Session, host: Host) -> dict[str, Any]:
    try:
        result = connection.run(node_command(host), timeout=DIAG_SECONDS)
    except TransportError as error:
        return {"error": str(error)}
    text = result.stdout.decode("utf-8", "replace").strip()
    try:
        answer = json.loads(text.splitlines()[-1]) if text else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        said = result.stderr.decode("utf-8", "replace").strip().splitlines()
        return {"error": (said or [f"{host.python} exited with status {result.exit_code}"])[-1][:300]}
    if "out" in answer and not str(answer["out"]).strip():
        answer = {"error": " ".join(str(answer.get("err", "")).split())[:300] or f"exit status {answer.get('code')}"}
    return answer


def _failed(answer: Mapping[str, Any]) -> bool:
    try:
        return bool(parse(str(answer["out"])).failed()) if "out" in answer else False
    except ValueError:
        return False


def gather(hosts: tuple[Host, ...], connections: Mapping[str, Session]) -> dict[str, dict[str, Any]]:
    """Every reached node's diagnostic; ``again``: the second run's output where the first
    failed a test (or its error, which the analysis cannot take as a confirmation)."""
    wanted = [host for host in hosts if host.name in connections]

    def one(host: Host) -> tuple[str, dict[str, Any]]:
        answer = run_once(connections[host.name], host)
        if _failed(answer):
            second = run_once(connections[host.name], host)
            answer = dict(answer, again=second["out"] if "out" in second else None)
        return host.name, answer

    return dict(fan_out(wanted, one, NODES_AT_ONCE))
