"""torchherd bandwidth: one node's end of the link measurements, and its path-MTU echo.

Standard library only, Python >= 3.8, Linux; needs no root. Run as
``PYTHON -S -c SOURCE CONFIG`` where CONFIG is a JSON object:
  family   4 or 6        the family of the addresses the job uses
  seconds  S             the longest this process lives (it ends at EOF on stdin too)
  address  A             the node's address the job uses: the only one bound
  echo_rate N            echo answers a second at most (default ECHO_RATE; the preflight's
                         master echoes for every worker)
It reads the check's key and its nodes' addresses from the first line on stdin,
{"key": HEX, "peers": [ADDRESS, ...]} (never on a command line; the same on every node of
one check), binds a TCP and a UDP port (any free one,
on the job's address), prints {"tcp": PORT, "udp": PORT} (or {"error": TEXT}) on one line (so
every node that answered has its key before any peer's request), and then serves only
what carries that key:
  - receives: every TCP connection sends a header line {"seconds": D, "key": K} (within
    HEADER_SECONDS, at most RECEIVERS connections at once: a stranger's is dropped) and then data
    until it shuts its side; the receiver counts what arrives (for at most D + DRAIN
    seconds) and answers on the same connection with one line
    {"bytes": B, "seconds": S, "cpu": F, "wait": F}: B bytes arrived in S seconds after
    the first read (whose bytes are not counted); F: this thread's share of those seconds
    on a CPU, and waiting on a run queue for one (/proc/thread-self/schedstat);
  - echoes: every UDP datagram "TOKEN SIZE MAC ..." is answered with a datagram of SIZE
    bytes (IP and UDP headers included) beginning "TOKEN", sent with don't-fragment. MAC
    is an HMAC of "TOKEN SIZE" with the key (the key itself never travels in a datagram);
    a token is answered once, only to one of the peers, at most ECHO_RATE a second: no one
    who reads the traffic can make a node send large datagrams to an address of theirs;
  - on stdin, one JSON request a line, each answered with one line carrying its "id":
    {"id": I, "send": [HOST, PORT], "seconds": D}: sends to that receiver for D seconds,
    answers {"id": I, "bytes": B, "seconds": S, "receiver": {"cpu": F, "wait": F},
    "sender": {"cpu": F, "wait": F}} or {"id": I, "error": TEXT};
    {"id": I, "mtu": [HOST, PORT], "size": N, "small": M, "timeout": T, "attempts": A,
    "bisect": T2 or null}: datagrams of N bytes with don't-fragment, to that echo and back
    (an answer within one of A tries of T seconds each). Answers {"id": I, "small": OK,
    "full": OK} and, when the small passed and the full did not, "out" (N bytes there,
    small back) and "back" (small there, N bytes back), one try each, and with "bisect"
    "largest": the largest size found to pass both ways (one try of T2 seconds per size);
    OK is true, false, or the error's text.
"""

import hashlib
import hmac
import ipaddress
import json
import os
import select
import socket
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

CHUNK = 256 * 1024
DRAIN = 1.0
"""Seconds a receiver keeps counting after the sender's D: a slow link's queued bytes."""
IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IPV6_MTU_DISCOVER = getattr(socket, "IPV6_MTU_DISCOVER", 23)
PMTUDISC_DO = 2
"""Set don't-fragment and never fragment locally (IP_PMTUDISC_DO, IPV6_PMTUDISC_DO)."""
BISECT_STEP = 32
"""Bytes: the bisection for the largest size that passes stops this close."""
HEADER_SECONDS = 2.0
"""How long a connection may take to send its header, in all (not per read): a stranger's
idle or dribbling one is dropped then."""
RECEIVERS = 16
"""Connections served at once; more are closed at once (the check makes one per link of a round)."""
MAX_SECONDS = 600.0
ECHO_RATE = 500
"""Echo answers a second at most (a check's whole MTU round is a few per pair)."""
RATE = {"value": ECHO_RATE}
"""This run's limit (the config's echo_rate, when given)."""
SEEN_TOKENS = 65536
"""Tokens remembered, so that a copy of a request is not answered again."""
OUT_LOCK = threading.Lock()
SLOTS = threading.BoundedSemaphore(RECEIVERS)
KEY = {"value": b""}
"""The check's key, from the first line on stdin (nothing is served without one)."""
PEERS: Dict[str, Any] = {"addresses": frozenset(), "own": ""}
"""The check's nodes' addresses (the only ones the echo answers), and this node's own."""


def schedstat() -> Optional[Tuple[int, int]]:
    """This thread's nanoseconds on a CPU and waiting on a run queue, so far."""
    try:
        with open("/proc/thread-self/schedstat") as file:
            words = file.read().split()
        return int(words[0]), int(words[1])
    except (OSError, ValueError, IndexError):
        return None


def shares(before: Optional[Tuple[int, int]], seconds: float) -> Dict[str, Optional[float]]:
    after = schedstat()
    if before is None or after is None or seconds <= 0:
        return {"cpu": None, "wait": None}
    return {"cpu": round((after[0] - before[0]) / 1e9 / seconds, 3),
            "wait": round((after[1] - before[1]) / 1e9 / seconds, 3)}


def answer(document: Dict[str, Any]) -> None:
    with OUT_LOCK:
        sys.stdout.write(json.dumps(document) + "\n")
        sys.stdout.flush()


def read_line(sock: socket.socket, limit: int = 4096, seconds: Optional[float] = None) -> bytes:
    """Up to a line; with ``seconds``, what came by then in all (a stranger sending a byte
    now and then holds a receiver slot no longer than that): socket.timeout after it."""
    data = b""
    deadline = time.monotonic() + seconds if seconds is not None else None
    while b"\n" not in data and len(data) < limit:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("no header in time")
            sock.settimeout(left)
        chunk = sock.recv(limit - len(data))
        if not chunk:
            break
        data += chunk
    return data


def check_header(line: bytes) -> Optional[float]:
    """The seconds of a header that carries the check's key; None for anything else
    (not JSON, not an object, another key, a number out of range)."""
    try:
        header = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(header, dict) or not KEY["value"]:
        return None
    key, seconds = header.get("key"), header.get("seconds")
    if not isinstance(key, str) or key.encode() != KEY["value"]:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_SECONDS:
        return None
    return float(seconds)


def receive(conn: socket.socket) -> None:
    """Counts one sender's bytes and tells it what arrived, then drains what is left.
    Every error ends the connection quietly: this runs for whoever connects."""
    try:
        seconds = check_header(read_line(conn, seconds=HEADER_SECONDS).partition(b"\n")[0])
        if seconds is None:
            return
        conn.settimeout(10.0)
        buffer = bytearray(1024 * 1024)
        view = memoryview(buffer)
        counted, started, last = 0, None, None
        stats = schedstat()
        limit = seconds + DRAIN
        while True:
            size = conn.recv_into(view)
            now = time.monotonic()
            if not size:
                break
            if started is None:
                started = now  # the first read's bytes arrived before it: not counted
            else:
                counted += size
            last = now
            if now - started > limit:
                break
        spent = (last - started) if started is not None and last is not None else 0.0
        report: Dict[str, Any] = {"bytes": counted, "seconds": round(spent, 6)}
        report.update(shares(stats, spent))
        conn.sendall(json.dumps(report).encode("utf-8") + b"\n")
        conn.settimeout(2.0)
        while conn.recv_into(view):
            pass
    except Exception:  # noqa: BLE001 - a stranger's connection: nothing of it may reach stderr
        pass
    finally:
        conn.close()
        SLOTS.release()


def accept_loop(server: socket.socket) -> None:
    while True:
        try:
            conn = server.accept()[0]
        except OSError:
            return
        if not SLOTS.acquire(blocking=False):
            conn.close()  # more than the check ever opens at once: a stranger's
            continue
        try:
            threading.Thread(target=receive, args=(conn,), daemon=True).start()
        except RuntimeError:  # no thread to be had
            conn.close()
            SLOTS.release()


def headers(family: int) -> int:
    return 48 if family == socket.AF_INET6 else 28


def dont_fragment(sock: socket.socket, family: int) -> None:
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER, PMTUDISC_DO)
    else:
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, PMTUDISC_DO)


def mac(token: bytes, size: bytes) -> bytes:
    """What proves an echo request comes from the check: never the key itself."""
    return hmac.new(KEY["value"], token + b" " + size, hashlib.sha256).hexdigest()[:32].encode()


def plain(address: str) -> str:
    """An address as compared with the peers': without an IPv6 scope, in its one form."""
    try:
        return str(ipaddress.ip_address(address.split("%")[0]))
    except ValueError:
        return address


class Echoes:
    """Which requests the echo answers: authenticated, from a peer, once, at a bounded rate."""

    def __init__(self) -> None:
        self.seen: Dict[bytes, None] = {}
        self.window, self.count = 0, 0

    def answers(self, words: List[bytes], peer: str) -> bool:
        if not KEY["value"] or len(words) < 3 or (PEERS["addresses"] and plain(peer) not in PEERS["addresses"]):
            return False
        if not hmac.compare_digest(words[2], mac(words[0], words[1])) or words[0] in self.seen:
            return False
        now = int(time.monotonic())
        if now != self.window:
            self.window, self.count = now, 0
        if self.count >= RATE["value"]:
            return False
        self.count += 1
        self.seen[words[0]] = None
        if len(self.seen) > SEEN_TOKENS:
            del self.seen[next(iter(self.seen))]
        return True


def echo_loop(sock: socket.socket, family: int) -> None:
    echoes = Echoes()
    while True:
        try:
            data, peer = sock.recvfrom(65535)
        except OSError:
            return
        words = data[:128].split(b" ")
        try:
            if not echoes.answers(words, str(peer[0])):
                continue
            size = max(len(words[0]) + 1, min(65507, int(words[1])) - headers(family))
        except (ValueError, IndexError):
            continue
        try:
            sock.sendto(words[0] + b" " + b"x" * (size - len(words[0]) - 1), peer)
        except OSError:  # too big for this side's own interface: the asker sees no answer
            continue


def send(request: Dict[str, Any], family: int) -> Dict[str, Any]:
    host, port = request["send"]
    seconds = float(request["seconds"])
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        sock.connect((host, int(port)))
        sock.sendall(json.dumps({"seconds": seconds, "key": KEY["value"].decode()}).encode("utf-8") + b"\n")
        data = memoryview(b"\0" * CHUNK)
        stats = schedstat()
        started = time.monotonic()
        sock.settimeout(seconds + DRAIN + 5.0)
        while time.monotonic() - started < seconds:
            sock.sendall(data)
        sender = shares(stats, time.monotonic() - started)
        sock.shutdown(socket.SHUT_WR)
        report = json.loads(read_line(sock).decode("utf-8"))
        return {"bytes": report["bytes"], "seconds": report["seconds"], "sender": sender,
                "receiver": {"cpu": report.get("cpu"), "wait": report.get("wait")}}
    except (OSError, ValueError, KeyError) as error:
        return {"error": "%s: %s" % (type(error).__name__, error)}
    finally:
        sock.close()


def echo_once(sock: socket.socket, family: int, size: int, reply: int, timeout: float, attempts: int) -> Any:
    """True when a datagram of ``size`` bytes got one of ``reply`` bytes back, within
    ``attempts`` tries of ``timeout`` seconds; False when none came; else the error's text."""
    for _ in range(attempts):
        token = os.urandom(6).hex().encode()
        size_word = str(reply).encode()
        head = token + b" " + size_word + b" " + mac(token, size_word) + b" "
        payload = head + b"x" * max(0, size - headers(family) - len(head))
        try:
            sock.send(payload)
        except OSError as error:  # EMSGSIZE: this side already knows the path is smaller
            return os.strerror(error.errno) if error.errno else str(error)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([sock], [], [], left)[0]:
                break
            try:
                data = sock.recv(65535)
            except OSError:
                break  # e.g. ECONNREFUSED from an ICMP answer: try again
            if data.startswith(token + b" ") and len(data) + headers(family) == max(reply, len(token) + 1 + headers(family)):
                return True
    return False


def mtu(request: Dict[str, Any], family: int) -> Dict[str, Any]:
    host, port = request["mtu"]
    full, small = int(request["size"]), int(request["small"])
    timeout, attempts = float(request["timeout"]), int(request["attempts"])
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        dont_fragment(sock, family)
        if PEERS["own"]:  # from the job's address: the one the peer's echo answers
            sock.bind(socket.getaddrinfo(PEERS["own"], 0, family, socket.SOCK_DGRAM, 0, socket.AI_NUMERICHOST)[0][4])
        sock.connect((host, int(port)))
        found: Dict[str, Any] = {"small": echo_once(sock, family, small, small, timeout, attempts)}
        found["full"] = echo_once(sock, family, full, full, timeout, attempts)
        if found["small"] is True and found["full"] is not True:
            # Which way loses them: one try each, the full size has just failed every try.
            found["out"] = echo_once(sock, family, full, small, timeout, 1)
            found["back"] = echo_once(sock, family, small, full, timeout, 1)
            if request.get("bisect"):
                found["largest"] = largest(sock, family, small, full, float(request["bisect"]))
        return found
    except OSError as error:
        return {"error": "%s: %s" % (type(error).__name__, error)}
    finally:
        sock.close()


def largest(sock: socket.socket, family: int, low: int, high: int, timeout: float) -> int:
    """The largest size that passes both ways, ``low`` passing and ``high`` not; the
    common 1500 first, where the black hole usually is. One try per size: a lost answer
    only makes the figure smaller, and a dozen sizes that fail must not take minutes."""
    attempts = 1
    if low < 1500 < high:
        if echo_once(sock, family, 1500, 1500, timeout, attempts) is True:
            low = 1500
        else:
            high = 1500
    while high - low > BISECT_STEP:
        middle = (low + high) // 2
        if echo_once(sock, family, middle, middle, timeout, attempts) is True:
            low = middle
        else:
            high = middle
    return low


def serve(request: Dict[str, Any], family: int) -> None:
    if "send" in request:
        found = send(request, family)
    elif "mtu" in request:
        found = mtu(request, family)
    else:
        found = {"error": "unknown request"}
    found["id"] = request.get("id")
    answer(found)


def bind(family: int, address: str) -> Tuple[List[socket.socket], Dict[str, Any]]:
    """The receiver and the echo, on the job's address only (its scope too, for IPv6)."""
    try:
        where = socket.getaddrinfo(address or None, 0, family, socket.SOCK_STREAM, 0,
                                   socket.AI_NUMERICHOST | socket.AI_PASSIVE)[0][4]
    except socket.gaierror:  # not an address (the controller sends one): every address, as without one
        where = socket.getaddrinfo(None, 0, family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)[0][4]
    server = socket.socket(family, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(where)
    server.listen(64)
    echo = socket.socket(family, socket.SOCK_DGRAM)
    dont_fragment(echo, family)
    echo.bind(where)
    return [server, echo], {"tcp": server.getsockname()[1], "udp": echo.getsockname()[1]}


def first_line(deadline: float) -> Tuple[bytes, bytes]:
    """The first line on stdin (empty at EOF or after the deadline), and what came after it."""
    data = b""
    while b"\n" not in data and time.monotonic() < deadline:
        if not select.select([sys.stdin], [], [], 0.5)[0]:
            continue
        chunk = os.read(sys.stdin.fileno(), 65536)
        if not chunk:
            break
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line, rest


def quiet(args: Any) -> None:
    """A thread's uncaught exception: not a word on stderr, whose pipe shares the SSH
    window with the answers (a stranger could fill it)."""


def main() -> None:
    threading.excepthook = quiet
    config = json.loads(sys.argv[1])
    family = socket.AF_INET6 if config.get("family") == 6 else socket.AF_INET
    deadline = time.monotonic() + float(config.get("seconds") or 300)
    line, pending = first_line(deadline)
    try:
        first = json.loads(line.decode("utf-8"))
        KEY["value"] = str(first["key"]).encode()
        PEERS["addresses"] = frozenset(plain(str(address)) for address in first.get("peers") or ())
    except (ValueError, KeyError, TypeError, AttributeError):
        answer({"error": "no key on the first line of stdin"})
        return
    PEERS["own"] = str(config.get("address") or "")
    if isinstance(config.get("echo_rate"), int) and config["echo_rate"] > 0:
        RATE["value"] = config["echo_rate"]
    try:
        (server, echo), bound = bind(family, str(config.get("address") or ""))
    except OSError as error:
        answer({"error": "%s: %s" % (type(error).__name__, error)})
        return
    threading.Thread(target=accept_loop, args=(server,), daemon=True).start()
    threading.Thread(target=echo_loop, args=(echo, family), daemon=True).start()
    answer(bound)
    pending = start_requests(pending, family)
    while time.monotonic() < deadline:
        if not select.select([sys.stdin], [], [], 0.5)[0]:
            continue
        data = os.read(sys.stdin.fileno(), 65536)
        if not data:
            return
        pending = start_requests(pending + data, family)


def start_requests(data: bytes, family: int) -> bytes:
    """Each complete line a request served in a thread of its own; what follows the last is kept."""
    *lines, rest = data.split(b"\n")
    for line in lines:
        if line.strip():
            threading.Thread(target=serve, args=(json.loads(line.decode("utf-8")), family), daemon=True).start()
    return rest


def leave() -> None:
    """Ends the process without the interpreter's shutdown, once no thread is writing an
    answer. A shutdown stops the daemon threads where they are: one stopped inside its
    answer's write keeps stdout's lock, the final flush waits a second for it, and CPython
    aborts ("could not acquire lock for <_io.BufferedWriter name='<stdout>'> at interpreter
    shutdown"): SIGABRT, no exit status, and the check waited 2 s for the script to end.
    Seen on the loaded local cluster in about one preflight in ten."""
    with OUT_LOCK:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


main()
leave()
