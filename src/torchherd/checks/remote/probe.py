"""torchherd probe: real TCP listeners and connects between nodes.

Standard library only, Python >= 3.8. Run as ``PYTHON -c SOURCE CONFIG``, CONFIG a
JSON object with "mode":
  listen:  {"mode": "listen", "ports": {"LABEL": PORT (0 = any free port)}, "seconds": S}
           binds every port on all addresses, prints {"bound": {LABEL: PORT},
           "errors": {LABEL: MESSAGE}} on one line, accepts and closes connections
           until stdin reaches EOF or S seconds pass.
  connect: {"mode": "connect", "targets": [[LABEL, HOST, PORT], ...], "timeout": T,
           "ping": HOST or null, "resolve": [NAME, ...]}
           connects to every target at once and prints {LABEL: {"result": R,
           "source": LOCAL_ADDRESS}} where R is ok, refused, timeout, unreachable,
           unresolved or the error's text; with "ping", one ICMP echo to that host;
           "resolve" maps each NAME to {"addresses": [...]} or {"error": ...}.
"""

import errno
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List


def listen(config: Dict[str, Any]) -> None:
    sockets: List[socket.socket] = []
    bound: Dict[str, int] = {}
    errors: Dict[str, str] = {}
    for label, port in config["ports"].items():
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # As torch's TCPStore does: a port with only TIME_WAIT leftovers counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
            sock.listen(64)
        except OSError as error:
            errors[label] = os.strerror(error.errno) if error.errno else str(error)
            sock.close()
            continue
        bound[label] = sock.getsockname()[1]
        sockets.append(sock)
    sys.stdout.write(json.dumps({"bound": bound, "errors": errors}) + "\n")
    sys.stdout.flush()
    # Accepted connections stay open until the end: the connecting side closes
    # first, so no TIME_WAIT is left on the master port to block the next bind.
    accepted: List[socket.socket] = []
    deadline = time.time() + config["seconds"]
    while time.time() < deadline:
        ready: List[Any] = select.select(sockets + [sys.stdin], [], [], 0.2)[0]
        for sock in ready:
            if sock is sys.stdin:
                if not os.read(sys.stdin.fileno(), 4096):
                    return
                continue
            accepted.append(sock.accept()[0])


def connect_one(host: str, port: int, timeout: float) -> Dict[str, Any]:
    try:
        infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except socket.gaierror as error:
        return {"result": "unresolved", "detail": error.strerror or str(error)}
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.settimeout(timeout)
    try:
        sock.connect(sockaddr)
        return {"result": "ok", "source": sock.getsockname()[0], "address": sockaddr[0]}
    except socket.timeout:
        return {"result": "timeout", "address": sockaddr[0]}
    except OSError as error:
        names = {errno.ECONNREFUSED: "refused", errno.EHOSTUNREACH: "unreachable",
                 errno.ENETUNREACH: "unreachable", errno.ETIMEDOUT: "timeout"}
        return {"result": names.get(error.errno or 0, os.strerror(error.errno or 0) or str(error)),
                "address": sockaddr[0]}
    finally:
        sock.close()


def resolve(name: str) -> Dict[str, Any]:
    try:
        infos = socket.getaddrinfo(name, None, 0, socket.SOCK_STREAM)
    except socket.gaierror as error:
        return {"error": error.strerror or str(error)}
    return {"addresses": sorted(set(info[4][0] for info in infos))}


def ping(host: str) -> Dict[str, Any]:
    if not shutil.which("ping"):
        return {"result": "no-ping"}
    try:
        done = subprocess.run(["ping", "-c1", "-W1", host], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=3)
    except (OSError, subprocess.SubprocessError) as error:
        return {"result": "error", "detail": str(error)}
    last = done.stdout.decode("utf-8", "replace").strip().splitlines()[-1:]
    return {"result": "ok" if done.returncode == 0 else "no-reply", "detail": " ".join(last)}


def connect(config: Dict[str, Any]) -> None:
    results: Dict[str, Any] = {}

    def attempt(label: str, host: str, port: int) -> None:
        results[label] = dict(connect_one(host, port, config["timeout"]), port=port)

    threads = [threading.Thread(target=attempt, args=tuple(target)) for target in config["targets"]]
    if config.get("ping"):
        threads.append(threading.Thread(target=lambda: results.__setitem__("ping", ping(config["ping"]))))
    results["resolve"] = {name: resolve(name) for name in config.get("resolve", [])}
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sys.stdout.write(json.dumps(results) + "\n")


def main() -> None:
    config = json.loads(sys.argv[1])
    if config["mode"] == "listen":
        listen(config)
    else:
        connect(config)


main()
