"""Checkpoint staging on this machine: the node program run as on a node
(``node_program``, ``find``), a relay chain through several workdirs (``relay_chain``)
and the node plans of a run (``nodes_in``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from torchherd.plan import NodePlan
from torchherd.remote import argv


def nodes_in(tmp_path: Path, count: int) -> dict[str, NodePlan]:
    """``count`` "nodes" (the in-process transport), each with a workdir of its own."""
    from torchherd.api import Cluster
    from torchherd.transport.local import LocalConnector

    hosts = [{"name": f"n{index}", "address": "127.0.0.1", "workdir": str(tmp_path / f"n{index}")}
             for index in range(count)]
    for host in hosts:
        Path(host["workdir"]).mkdir()
    plan = Cluster(hosts, python=sys.executable, nproc_per_node=1, connector=LocalConnector()).plan("train.py")
    return {node.host.name: node for node in plan.nodes}


def node_program(mode: str, workdir: Path, path: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, *argv("checkpoint.py"), mode, str(workdir), path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/")


def find(workdir: Path, path: str, code: int = 0) -> dict[str, object]:
    process = node_program("find", workdir, path)
    out, err = process.communicate(timeout=30)
    assert process.returncode == code, err
    answer = json.loads(out)
    assert isinstance(answer, dict)
    return answer


def relay_chain(workdirs: list[Path], expect: dict[str, object], token: str = "t0ken",
                stranger: bool = False, extra: dict[str, object] | None = None) -> list[dict[str, object]]:
    """The source (workdirs[0]) and a receiver per other workdir, chained on 127.0.0.1, as the
    controller chains them (``extra``: replication's keys); each program's last answer."""
    processes = [node_program("relay", workdir, str(expect["path"])) for workdir in workdirs]
    ports = []
    for index, process in enumerate(processes):
        assert process.stdin is not None and process.stdout is not None
        config = {"token": token, "expect": expect, "source": index == 0, "bind": "127.0.0.1",
                  "downstream": index < len(processes) - 1, **(extra or {})}
        process.stdin.write((json.dumps(config) + "\n").encode())
        process.stdin.flush()
        ports.append(json.loads(process.stdout.readline())["port"])
    if stranger:  # connects first to the source, answers its nonce with a guess: refused, the chain goes on
        import socket

        with socket.create_connection(("127.0.0.1", ports[0])) as sock:
            sock.sendall(b"guess\n")
            heard = b""
            while block := sock.recv(100):
                heard += block
            assert heard.startswith(b"torchherd-relay 1 ") and heard.count(b"\n") == 1, heard  # the greeting only
    for index, process in enumerate(processes[1:], 1):
        assert process.stdin is not None
        process.stdin.write((json.dumps({"upstream": ["127.0.0.1", ports[index - 1]]}) + "\n").encode())
        process.stdin.flush()
    answers = []
    for process in processes:
        assert process.stdout is not None and process.stdin is not None
        answers.append(json.loads(process.stdout.readline()))
        process.stdin.close()
        process.wait(timeout=30)
    return answers
