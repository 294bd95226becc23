"""``check --bandwidth``: the plan of links, the verdicts from hand-made transfers, the
floor's syntax, and the node script itself between two processes on loopback."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
import termios
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from torchherd.checks.analysis import bandwidth
from torchherd.checks.gather import node_program
from torchherd.checks.links import pairs, plan_links, rounds
from torchherd.checks.model import MtuProbe, Observed, Transfer
from torchherd.checks.runner import selected_checks
from torchherd.errors import InventoryError
from torchherd.inventory import parse, parse_rate

G = 1e9
IDLE = {"sender_cpu": 0.02, "sender_wait": 0.0, "receiver_cpu": 0.05, "receiver_wait": 0.01}
BUSY = {"sender_cpu": 0.2, "sender_wait": 0.7, "receiver_cpu": 0.2, "receiver_wait": 0.6}


def names(count: int) -> list[str]:
    return [f"node{index}" for index in range(count)]


@pytest.mark.parametrize("count", [2, 3, 4, 5, 16, 64, 257])
def test_every_node_sends_to_and_receives_from_two_others_in_few_rounds(count: int) -> None:
    nodes = names(count)
    plan = plan_links(nodes, dict.fromkeys(nodes, "10.0.0.0/24"))
    for node in nodes:
        assert len({receiver for sender, receiver in plan.links if sender == node}) >= min(2, count - 1)
        assert len({sender for sender, receiver in plan.links if receiver == node}) >= min(2, count - 1)
    assert len(plan.rounds) <= 12, len(plan.rounds)  # as few at 257 nodes as at 5: not growing with n
    for group in plan.rounds:
        ends = [node for link in group for node in link]
        assert len(ends) == len(set(ends)), group
    assert sorted(link for group in plan.rounds for link in group) == sorted(plan.links)


def test_full_mesh_is_every_ordered_pair_and_subnets_are_covered() -> None:
    nodes = names(6)
    full = plan_links(nodes, {}, "full")
    assert sorted(full.links) == sorted((a, b) for a in nodes for b in nodes if a != b)
    subnets = {node: ("a" if index < 5 else "b") for index, node in enumerate(names(10))}
    subnets["node9"] = "c"
    sampled = plan_links(names(10), subnets)
    covered = {(subnets[a], subnets[b]) for a, b in sampled.links}
    assert covered >= {(x, y) for x in "abc" for y in "abc" if x != y}
    assert len(pairs([("a", "b"), ("b", "a"), ("b", "c")])) == 2
    assert rounds([("a", "b"), ("b", "c"), ("c", "d")]) == ((("a", "b"), ("c", "d")), (("b", "c"),))


def observed(count: int, transfers: list[Transfer], floor: float | None = None) -> Observed:
    inventory = parse({"hosts": [{"name": name} for name in names(count)]}, Path("hosts.toml"))
    seen = Observed(inventory=inventory, master_target="node0", min_bandwidth=floor)
    seen.link_plan = plan_links(names(count), {})
    seen.transfers = transfers
    return seen


def ring(count: int, rate: dict[str, float], cpu: dict[str, float], alone: bool = False) -> list[Transfer]:
    """A transfer on every link of the plan: the slower end's rate (``rate``, 10 Gbit/s by default)."""
    plan = plan_links(names(count), {})
    found = []
    for sender, receiver in plan.links:
        bits = min(rate.get(sender, 10 * G), rate.get(receiver, 10 * G))
        found.append(Transfer(sender, receiver, bits, 0.3, IDLE if bits < 10 * G else cpu, alone))
    return found


def verdicts(seen: Observed, check: str = "bandwidth") -> dict[str, str]:
    results = bandwidth.analyse(seen) if check == "bandwidth" else bandwidth.analyse_mtu(seen)
    return {result.node: result.status for result in results if result.status in ("warn", "fail")}


def test_a_slow_node_is_named_once_and_only_after_it_was_measured_alone() -> None:
    burst = ring(8, {"node3": 0.05 * G}, BUSY)
    seen = observed(8, burst)
    assert verdicts(seen) == {}, "a slow burst figure alone is no verdict"
    assert sorted(bandwidth.candidates(seen)) == sorted(link for link in seen.link_plan.links if "node3" in link)  # type: ignore[union-attr]
    seen.transfers = burst + [transfer for transfer in ring(8, {"node3": 0.05 * G}, BUSY, alone=True)
                              if "node3" in transfer.link]
    assert verdicts(seen) == {"node3": "warn"}
    seen.min_bandwidth = 1 * G
    assert verdicts(seen) == {"node3": "fail"}
    named = next(result for result in bandwidth.analyse(seen) if result.node == "node3")
    assert "50 Mbit/s" in named.summary and named.fix


def test_a_busy_cpu_is_not_a_slow_link() -> None:
    # A burst on busy CPUs, and the slow one still busy when measured alone: a lower bound, no verdict.
    burst = ring(6, {}, BUSY)
    slowed = [Transfer(t.sender, t.receiver, 1 * G, 0.3, BUSY, alone) for t in burst[:2] for alone in (False, True)]
    seen = observed(6, burst[2:] + slowed)
    assert verdicts(seen) == {}
    figures = bandwidth.figures(seen)
    assert figures is not None and figures["median_gbit"] == 10.0
    assert all(link["cpu_bound"] for link in figures["links"])


def test_one_slow_link_is_named_as_the_pair() -> None:
    transfers = ring(6, {}, IDLE) + ring(6, {}, IDLE, alone=True)
    transfers = [Transfer(t.sender, t.receiver, 0.5 * G, 0.3, IDLE, t.alone) if t.link == ("node1", "node2") else t
                 for t in transfers]
    results = bandwidth.analyse(observed(6, transfers))
    slow = [result for result in results if result.status != "pass"]
    assert [(result.node, result.status) for result in slow] == [("node1", "warn")]
    assert "node1 -> node2" in slow[0].summary


def test_mtu_black_hole_names_the_common_node() -> None:
    seen = observed(5, ring(5, {}, IDLE))
    seen.mtu_probes = {pair: MtuProbe(pair[0], pair[1], 9000, True, "node2" not in pair, False, False,
                                      1500 if "node2" in pair else None, True)
                       for pair in pairs(seen.link_plan.links)}  # type: ignore[union-attr]
    assert verdicts(seen, "mtu") == {"node2": "fail"}
    hole = next(result for result in bandwidth.analyse_mtu(seen) if result.node == "node2")
    assert "9000-byte packets" in hole.summary and "1500 bytes" in hole.summary
    unconfirmed = {pair: MtuProbe(probe.first, probe.second, 9000, True, probe.full) for pair, probe in
                   seen.mtu_probes.items()}
    seen.mtu_probes = unconfirmed
    assert verdicts(seen, "mtu") == {}


@pytest.mark.parametrize(("text", "bits"), [("10Gbit", 10 * G), ("800 Mbit/s", 8e8), ("25G", 25 * G), ("40", 40 * G),
                                            ("1.5gbps", 1.5 * G), ("fast", None), ("0Gbit", None), ("-1G", None)])
def test_rates(text: str, bits: float | None) -> None:
    assert parse_rate(text) == bits


def test_inventory_checks_table() -> None:
    inventory = parse({"checks": {"min_bandwidth": "10Gbit", "slow_ratio": 0.4}, "hosts": [{"name": "a"}]},
                      Path("hosts.toml"))
    assert inventory.checks.min_bandwidth == 10 * G and inventory.checks.slow_ratio == 0.4
    with pytest.raises(InventoryError, match=r"\[checks\]\.min_bandwidth"):
        parse({"checks": {"min_bandwidth": "fast"}, "hosts": [{"name": "a"}]}, Path("hosts.toml"))
    with pytest.raises(InventoryError, match=r"\[checks\]\.floor"):
        parse({"checks": {"floor": 1}, "hosts": [{"name": "a"}]}, Path("hosts.toml"))


def test_bandwidth_is_opt_in() -> None:
    assert "bandwidth" not in selected_checks(None, frozenset(), smoke=False)
    assert {"bandwidth", "mtu"} <= set(selected_checks(None, frozenset(), smoke=False, bandwidth=True))
    assert {"bandwidth", "mtu", "smoke"} <= set(selected_checks(None, frozenset(), smoke=True))
    assert selected_checks(frozenset({"mtu"}), frozenset(), smoke=False) == ("mtu",)


def node_script(key: bytes = b"k3y", stderr: int | None = None) -> subprocess.Popen[bytes]:
    """The node script, its key given on stdin first as the controller gives it."""
    config = json.dumps({"family": 4, "seconds": 60, "address": "127.0.0.1"})
    process = subprocess.Popen([sys.executable, "-S", "-c", node_program("bandwidth.py"), config],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
    assert process.stdin is not None
    process.stdin.write(b'{"key": "' + key + b'", "peers": ["127.0.0.1"]}\n')
    process.stdin.flush()
    return process


def ask(process: subprocess.Popen[bytes], request: dict[str, Any]) -> dict[str, Any]:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(json.dumps(request).encode() + b"\n")
    process.stdin.flush()
    answer: dict[str, Any] = json.loads(process.stdout.readline())
    return answer


def test_node_script_measures_and_echoes_on_loopback() -> None:
    sender, receiver = node_script(), node_script()
    try:
        assert sender.stdout is not None and receiver.stdout is not None
        json.loads(sender.stdout.readline())
        ports = json.loads(receiver.stdout.readline())
        # A datagram without the receiver's key gets no answer.
        stranger = node_script(b"other")
        assert stranger.stdout is not None
        json.loads(stranger.stdout.readline())
        refused = ask(stranger, {"id": 9, "mtu": ["127.0.0.1", ports["udp"]], "size": 1500, "small": 576,
                                 "timeout": 0.3, "attempts": 1, "bisect": None})
        assert refused == {"id": 9, "small": False, "full": False}
        assert stranger.stdin is not None
        stranger.stdin.close()
        stranger.wait(timeout=10)
        sent = ask(sender, {"id": 1, "send": ["127.0.0.1", ports["tcp"]], "seconds": 0.2})
        assert sent["id"] == 1 and sent["bytes"] > 1_000_000 and 0 < sent["seconds"] < 2, sent
        assert set(sent["sender"]) == {"cpu", "wait"}
        echoed = ask(sender, {"id": 2, "mtu": ["127.0.0.1", ports["udp"]], "size": 9000, "small": 576,
                              "timeout": 1.0, "attempts": 3, "bisect": None})
        assert echoed == {"id": 2, "small": True, "full": True}
        # Larger than loopback's MTU (65536): refused here, with the error's text.
        refused = ask(sender, {"id": 3, "mtu": ["127.0.0.1", ports["udp"]], "size": 70000, "small": 576,
                               "timeout": 0.2, "attempts": 1, "bisect": None})
        assert refused["small"] is True and isinstance(refused["full"], str), refused
    finally:
        for process in (sender, receiver):
            assert process.stdin is not None
            process.stdin.close()
            process.wait(timeout=10)
            assert process.returncode == 0


def test_the_node_script_ends_only_after_the_answer_it_is_writing() -> None:
    """Stdin closed while a thread is inside its answer's write (stdout full: a controller
    slow to read): the script ends once that answer is written whole, with status 0 and
    nothing on stderr. Ended by the interpreter's shutdown, it stopped its daemon threads where
    they were: the answer under way was lost, or, with the thread stopped holding stdout's
    lock, CPython aborted a second later (SIGABRT, "could not acquire lock for
    <_io.BufferedWriter name='<stdout>'> at interpreter shutdown"), seen on the local cluster."""
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never read: no echo, no ICMP
    silent.bind(("127.0.0.1", 0))
    process = node_script(stderr=subprocess.PIPE)
    try:
        assert process.stdin is not None and process.stdout is not None and process.stderr is not None
        held = fcntl.fcntl(process.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)  # a page: the least a pipe holds
        json.loads(process.stdout.readline())
        requests = [{"id": index, "mtu": ["127.0.0.1", silent.getsockname()[1]], "size": 600, "small": 100,
                     "timeout": 0.05, "attempts": 1, "bisect": None} for index in range(200)]
        process.stdin.write(b"".join(json.dumps(request).encode() + b"\n" for request in requests))
        process.stdin.flush()
        # Full: no room for even the shortest answer, so one is being written and waits.
        shortest = len(json.dumps({"small": False, "full": False, "id": 0})) + 1
        deadline = time.monotonic() + 30
        while waiting(process.stdout.fileno()) <= held - shortest and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiting(process.stdout.fileno()) > held - shortest
        process.stdin.close()
        # It waits for that answer: at EOF it used to end within milliseconds, the answer lost.
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=0.5)
        out = process.stdout.read()  # drained only now
        assert process.wait(timeout=10) == 0, process.stderr.read()
        assert process.stderr.read() == b""
        assert len(out) > held and all(json.loads(line)["small"] is False for line in out.splitlines())
    finally:
        silent.close()
        if process.poll() is None:
            process.kill()
            process.wait()


def waiting(descriptor: int) -> int:
    """Bytes in a pipe not yet read."""
    return struct.unpack("i", fcntl.ioctl(descriptor, termios.FIONREAD, b"\0\0\0\0"))[0]


def test_report_and_matrix_show_every_figure() -> None:
    from io import StringIO

    from torchherd.checks.results import CheckReport
    from torchherd.console import make_console
    from torchherd.console.checks import render_report
    from torchherd.console.matrix import render_bandwidth

    transfers = ring(4, {"node2": 0.05 * G}, IDLE) + ring(4, {"node2": 0.05 * G}, IDLE, alone=True)
    seen = observed(4, transfers)
    report = CheckReport(tuple(bandwidth.analyse(seen)), bandwidth=bandwidth.figures(seen))
    assert report.as_json()["bandwidth"]["nodes"]["node2"] == {"in_gbit": 0.05, "out_gbit": 0.05}
    out = StringIO()
    console = make_console(out, width=200)
    render_report(console, report)
    render_bandwidth(console, report.bandwidth or {}, names(4))
    text = out.getvalue()
    assert "bandwidth (bit/s in/out at best; median 10G): node0 10G/10G, node1 10G/10G, node2 50M/50M" in text
    assert "WARN node2 bandwidth: node2 is slow: 4 of its links are under 50% of the cluster's median" in text
    assert "bandwidth: rows sent to columns" in text
    row = next(line for line in text.splitlines() if line.startswith("node1 ") and "50M" in line)
    assert row.split() == ["node1", "10G", "-", "50M", "·"]


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _dropped(sock: socket.socket) -> bool:
    """The other end closed the connection without a word (a reset: it had unread bytes)."""
    sock.settimeout(5)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def test_the_bandwidth_listener_takes_no_stranger() -> None:
    """Another user on the node connects to the receiver's port: it listens on the job's
    address only, at most a few connections wait for a header (each 2 s at most), and a
    header that is not the check's (not JSON, not an object, wrong types) is dropped
    without a word on stderr (whose pipe shares the SSH window with the answers)."""
    receiver = node_script(stderr=subprocess.PIPE)
    idle: list[socket.socket] = []
    try:
        assert receiver.stdout is not None and receiver.stderr is not None
        port = json.loads(receiver.stdout.readline())["tcp"]
        with pytest.raises(OSError):  # another address of this machine: not the job's
            socket.create_connection(("127.0.0.2", port), timeout=2).close()
        base = _threads(receiver.pid)
        for _ in range(100):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        assert _threads(receiver.pid) <= base + 16, _threads(receiver.pid)
        for header in (b"[1]\n", b"42\n", b'{"key": "k3y", "seconds": [1]}\n', b'{"key": 7}\n', b"\xff\xfe\n",
                       b'{"key": "k3y", "seconds": 1e400}\n'):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(header)
                assert _dropped(sock), header
        assert _dropped(idle[0]), "an idle stranger is dropped"
        sender = node_script()
        try:
            assert sender.stdout is not None
            json.loads(sender.stdout.readline())
            sent = ask(sender, {"id": 1, "send": ["127.0.0.1", port], "seconds": 0.2})
            assert sent["bytes"] > 0, sent  # the check itself still measures
        finally:
            assert sender.stdin is not None
            sender.stdin.close()
            sender.wait(timeout=10)
    finally:
        for sock in idle:
            sock.close()
        assert receiver.stdin is not None
        receiver.stdin.close()
        receiver.wait(timeout=10)
    assert receiver.stderr.read() == b""


def test_strangers_dribbling_a_byte_at_a_time_hold_no_receiver_slot() -> None:
    """16 strangers, each sending a byte every half second and never a line, take every slot
    a receiver has; the header's 2 s are in all, not per read: they are dropped by then, and
    the check's own sender measures."""
    import threading

    receiver = node_script(stderr=subprocess.PIPE)
    stop = threading.Event()
    strangers: list[socket.socket] = []
    try:
        assert receiver.stdout is not None and receiver.stderr is not None
        port = json.loads(receiver.stdout.readline())["tcp"]
        strangers = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(16)]

        def dribble() -> None:
            while not stop.wait(0.5):
                for sock in strangers:
                    try:
                        sock.send(b"{")
                    except OSError:
                        pass

        threading.Thread(target=dribble, daemon=True).start()
        time.sleep(3.5)
        sender = node_script()
        try:
            assert sender.stdout is not None
            json.loads(sender.stdout.readline())
            sent = ask(sender, {"id": 1, "send": ["127.0.0.1", port], "seconds": 0.2})
            assert isinstance(sent.get("bytes"), int) and sent["bytes"] > 0, sent
        finally:
            assert sender.stdin is not None
            sender.stdin.close()
            sender.wait(timeout=10)
        stop.set()
        assert all(_dropped(sock) for sock in strangers)
    finally:
        stop.set()
        for sock in strangers:
            sock.close()
        assert receiver.stdin is not None
        receiver.stdin.close()
        receiver.wait(timeout=10)


def _echoed(port: int, datagram: bytes, source: str = "127.0.0.1", wait: float = 0.5) -> list[bytes]:
    """What the echo at ``port`` sends back to ``source`` for ``datagram`` (each answer)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((source, 0))
        sock.sendto(datagram, ("127.0.0.1", port))
        sock.settimeout(wait)
        answers = []
        try:
            while True:
                answers.append(sock.recv(65535))
        except socket.timeout:
            return answers


def test_the_mtu_echo_is_no_reflector() -> None:
    """Someone who read the check's traffic cannot make a node send MTU-sized datagrams to
    an address of their choosing: a request carries an HMAC of itself (never the key), is
    answered once (a copy is not), only to the check's own nodes, and at a bounded rate."""
    import hashlib
    import hmac

    echo = node_script()
    try:
        assert echo.stdout is not None
        port = json.loads(echo.stdout.readline())["udp"]

        def request(token: bytes, size: int = 9000) -> bytes:
            said = token + b" " + str(size).encode()
            return said + b" " + hmac.new(b"k3y", said, hashlib.sha256).hexdigest()[:32].encode() + b" pad"

        assert _echoed(port, b"t0 9000 k3y pad") == [], "the key itself, in clear, is no request"
        first = _echoed(port, request(b"t1"))
        assert len(first) == 1 and first[0].startswith(b"t1 ") and len(first[0]) == 9000 - 28
        assert _echoed(port, request(b"t1")) == [], "a copy of a request is not answered again"
        assert _echoed(port, request(b"t2"), source="127.0.0.2") == [], "not one of the check's nodes"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # a flood of fresh requests
            sock.bind(("127.0.0.1", 0))
            for index in range(2000):
                sock.sendto(request(b"f%d" % index, 600), ("127.0.0.1", port))
            sock.settimeout(0.5)
            answered = 0
            try:
                while sock.recv(65535):
                    answered += 1
            except socket.timeout:
                pass
        assert answered <= 600, answered
        # the check itself still works: its own request, through the script's own echo_once
        asked = ask(echo, {"id": 4, "mtu": ["127.0.0.1", port], "size": 1500, "small": 576, "timeout": 1.0,
                           "attempts": 2, "bisect": None})
        assert asked == {"id": 4, "small": True, "full": True}, asked
    finally:
        assert echo.stdin is not None
        echo.stdin.close()
        echo.wait(timeout=10)


def test_the_preflight_probes_each_worker_with_the_master_and_ring_neighbours() -> None:
    """One pair each (a round trip is both ways); the worker sends, the master echoes."""
    from torchherd.checks.links import preflight_pairs

    assert preflight_pairs(["n0"], "n0") == []
    assert preflight_pairs(["n0", "n1"], "n0") == [("n1", "n0")]
    assert preflight_pairs(["n0", "n1", "n2", "n3"], "n0") == [
        ("n1", "n0"), ("n2", "n0"), ("n3", "n0"), ("n1", "n2"), ("n2", "n3")]
    pairs = preflight_pairs([f"n{index}" for index in range(256)], "n0")
    sent = Counter(first for first, _ in pairs)
    assert len(pairs) == 255 + 254 and max(sent.values()) == 2 and "n0" not in sent
