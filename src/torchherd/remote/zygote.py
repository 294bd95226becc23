"""A warm Python per node: it has imported torch once, and forks each process of the job.

Standard library only, Python >= 3.8, Linux. Shipped like every node program
(``torchherd.remote.program("zygote.py")``) and started as ``PYTHON -u -c PROGRAM serve
PRELOAD...`` (no ``-I``/``-S``: it imports what the job imports, with the job's
environment and ``sys.path``). It imports each PRELOAD module (``torch``,
``torch.distributed.run``; never CUDA), makes a private directory (``mkdtemp``, 0700) and
in it ``sock`` (a unix socket, 0600) and ``python``, a tiny client that stands in for the
interpreter: ``DIR/python -m torch.distributed.run ...`` starts torchrun's agent, and
``PYTHON_EXEC=DIR/python`` makes the agent start each rank through it too. Its first
line on stdout is ``{"dir": DIR}`` (or ``{"error": why}``); it ends, killing every
child it forked, when its stdin ends (the controller's channel), on SIGTERM/SIGINT/SIGHUP.

The client (``DIR/python ARGS...``) connects to ``sock`` and sends its arguments, its
environment, its working directory and its stdin, stdout and stderr (SCM_RIGHTS). The
zygote forks; the child starts a session of its own (a fresh process group, as torchrun
gives each rank), takes those fds, directory, environment (``os.environ`` and the
initial environment ``/proc/PID/environ`` shows, so the supervisor's teardown and the
rank finders see the job's variables) and arguments, and runs the script or module as
``__main__`` from its first line (``runpy``). The client relays every signal it gets to
the child's process group and exits as the child did (a signal: by the same signal).
The zygote kills a child whose client is gone (SIGKILLed by a teardown).

A child is forked only when it is safe, else the client runs the real interpreter
(``exec``, cold) and says why on stderr: CUDA initialised in the zygote, a thread more
than the preload left, an option or a ``PYTHON*`` variable that changes how Python starts
and that the zygote did not start with, or no zygote to reach.

``PYTHON -c PROGRAM start -m torch.distributed.run ...`` (``start_main``; the supervisor's
``warm_start``, where no zygote of the controller's is there) is torchrun started warm on
its own: it imports torch, forks a zygote that serves only it, and runs torchrun's agent
itself, whose ranks fork from that zygote.

A warm torchrun agent (either way) that serves the rendezvous store keeps it up, once its
job has ended well, until the other agents have left torchrun's exit barrier (``_linger``).
"""

from __future__ import annotations

import array
import json
import os
import selectors
import signal
import socket
import struct
import sys
import tempfile
from typing import Dict, List, Optional, Set, Tuple

HEADER = struct.Struct("!I")
MAX_REQUEST = 16 * 1024 * 1024
SOCKET_NAME = "sock"
CLIENT_NAME = "python"
PROGRAM_NAME = "program.py"
ENV_PAD = "TORCHHERD_ZYGOTE_ROOM"
"""Room in the zygote's initial environment block: a child writes its own environment there."""
ENV_ROOM = 120 * 1024
"""Below Linux's MAX_ARG_STRLEN (128 KiB): one variable of it passes ``execve``."""
KILL_GRACE = 5.0
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGABRT, signal.SIGCONT, signal.SIGWINCH)
STARTUP_VARIABLES_KEPT = ("PYTHONUNBUFFERED", "PYTHONFAULTHANDLER")
"""``PYTHON*`` variables a child applies itself; any other one must be as the zygote had it."""
AGENT_MODULE = "torch.distributed.run"
COLD_NOTE = "torchherd: started cold (%s)\n"
STORE_LINGER = 30.0
"""At most this long the rendezvous host's agent keeps its store up after its job ended well,
for the other agents still leaving torchrun's exit barrier (``_linger``)."""
TCP_ESTABLISHED, TCP_LISTEN = "01", "0A"


# -- the messages -------------------------------------------------------------------


def send_message(sock: socket.socket, message: Dict[str, object], fds: Tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    framed = HEADER.pack(len(data)) + data
    if fds:
        sock.sendmsg([framed[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        framed = framed[1:]
    sock.sendall(framed)


def receive_message(sock: socket.socket, want_fds: int = 0) -> Tuple[Optional[Dict[str, object]], List[int]]:
    """One message and the fds that came with it; (None, []) when the peer is gone."""
    fds: List[int] = []
    data = b""
    if want_fds:
        room = socket.CMSG_SPACE(want_fds * array.array("i").itemsize)
        first, ancillary, _flags, _address = sock.recvmsg(1, room)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if not first:
            return None, fds
        data = first
    data += _exactly(sock, HEADER.size - len(data))
    if len(data) < HEADER.size:
        return None, fds
    (size,) = HEADER.unpack(data)
    if size > MAX_REQUEST:
        return None, fds
    body = _exactly(sock, size)
    if len(body) < size:
        return None, fds
    message = json.loads(body.decode())
    return (message if isinstance(message, dict) else None), fds


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


# -- what a child runs ----------------------------------------------------------------


def parse_python_args(args: List[str]) -> Tuple[Optional[Dict[str, object]], str]:
    """The interpreter's arguments as the child takes them: ({unbuffered, module or
    script, argv}, "") or (None, why the child cannot: an option it does not emulate)."""
    unbuffered = False
    index = 0
    while index < len(args):
        word = args[index]
        if word == "-u":
            unbuffered = True
            index += 1
        elif word == "-m" and index + 1 < len(args):
            module = args[index + 1]
            return {"unbuffered": unbuffered, "module": module, "argv": [module] + args[index + 2:]}, ""
        elif word == "--":
            index += 1
            break
        elif word.startswith("-") and word != "-":
            return None, "python option %s" % word
        else:
            break
    if index >= len(args) or args[index] == "-":
        return None, "no script"
    return {"unbuffered": unbuffered, "script": args[index], "argv": args[index:]}, ""


def startup_differs(env: Dict[str, str], mine: Dict[str, str]) -> str:
    """A ``PYTHON*`` variable that would start Python otherwise than the zygote started, or ""."""
    names = sorted(name for name in set(env) | set(mine)
                   if name.startswith("PYTHON") and name not in STARTUP_VARIABLES_KEPT and name != "PYTHON_EXEC")
    for name in names:
        if env.get(name) != mine.get(name):
            return "%s differs from the warm interpreter's" % name
    return ""


def rewrite_initial_environ(env: Dict[str, str]) -> bool:
    """Writes ``env`` over this process's initial environment block (what
    ``/proc/self/environ`` shows, read by the supervisor's teardown and the rank finders)
    when it fits; the C library's pointers into it are gone by then (``os.environ`` was
    cleared and refilled). False when it does not fit or cannot be found."""
    return _rewrite_block(47, [name + "=" + value for name, value in env.items()])


def rewrite_command_line(argv: List[str]) -> bool:
    """Writes ``argv`` over this process's command line (``/proc/self/cmdline``, what ``ps``
    shows), as setproctitle does, when it fits: the rank shows as the command that started it."""
    return _rewrite_block(45, argv)


def _rewrite_block(field: int, words: List[str]) -> bool:
    """Fields ``field`` and ``field + 1`` of ``/proc/self/stat`` (after the command name)
    bound the block: arg_start/arg_end (45, 46) or env_start/env_end (47, 48)."""
    try:
        import ctypes

        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[field]), int(fields[field + 1])
        block = b"".join(word.encode("utf-8", "surrogateescape") + b"\0" for word in words if "\0" not in word)
        if start <= 0 or len(block) > end - start:
            return False
        ctypes.memmove(start, block + b"\0" * (end - start - len(block)), end - start)
        return True
    except (OSError, ValueError, IndexError, ImportError):
        return False


def run_child(request: Dict[str, object], fds: List[int]) -> None:
    """In the forked child: become the job's process, run it, never return."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        # As a fresh interpreter has them: SIGINT raises KeyboardInterrupt, SIGPIPE stays
        # ignored (Python's own start ignores it), every other default.
        for number in RELAYED + (signal.SIGCHLD,):
            signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        for name in [name for name in sys.modules if name == "torchherd" or name.startswith("torchherd.")]:
            del sys.modules[name]  # the loader's stand-ins: the job's own torchherd, if any, is imported afresh
        env = {str(k): str(v) for k, v in dict(request["env"]).items()}  # type: ignore[call-overload]
        os.chdir(str(request["cwd"]))
        os.environ.clear()
        os.environ.update(env)
        rewrite_initial_environ(env)
        words = request.get("args")
        rewrite_command_line([str(request.get("python") or sys.executable)]
                             + ([str(word) for word in words] if isinstance(words, list) else []))
        _fresh_random_state()
        code = _run_python(request)
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:  # noqa: BLE001 - the job's own error: its traceback, as python prints it
        code = 1
        _print_traceback()
    _finish(code)


def _fresh_random_state() -> None:
    """The entropy a fresh process draws at its start: ``random`` reseeds itself after a
    fork; numpy's global generator (torch imports numpy) does not, and every rank would
    draw the zygote's numbers."""
    numpy_random = sys.modules.get("numpy.random")
    seed = getattr(numpy_random, "seed", None)
    if callable(seed):
        try:
            seed()
        except Exception:  # noqa: BLE001 - a numpy that cannot reseed keeps what it has
            pass


def _run_python(request: Dict[str, object]) -> int:
    import io
    import runpy

    spec = dict(request["spec"])  # type: ignore[call-overload]
    if spec["unbuffered"] or os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout = io.TextIOWrapper(open(1, "wb", 0, closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", 0, closefd=False), write_through=True,
                                      errors="backslashreplace")
    else:
        sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=os.isatty(1))
        sys.stderr = io.TextIOWrapper(open(2, "wb", 0, closefd=False), write_through=True,
                                      errors="backslashreplace")
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False))
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    sys.argv = [str(word) for word in spec["argv"]]
    if "module" in spec:
        sys.path.insert(0, os.getcwd())
        module = str(spec["module"])
        preloaded = sys.modules.get(module)
        if preloaded is not None and not hasattr(preloaded, "__path__"):
            # A cold ``python -m`` has no copy of its own module imported, only what the module
            # imports: runpy would warn that it found one (its RuntimeWarning on every warm agent).
            del sys.modules[module]
        stores = _keep_rendezvous_stores() if module == AGENT_MODULE else []
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        _linger(stores)
    else:
        script = str(spec["script"])
        sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
        runpy.run_path(script, run_name="__main__")
    return 0


# -- the rendezvous host's store --------------------------------------------------------
#
# torchrun's agents end with an exit barrier on the rendezvous store, which the host's agent
# serves: each adds itself, the last sets a key, and all wait for that key. The host, told of
# the key, ends at once and its store with it, while the last agent may not yet have sent its
# wait: it logs "Error waiting on exit barrier" and a C++ traceback on a job that went well
# (torch issue 69520). A warm agent keeps the store it served until every other agent has
# closed its connection to it (or STORE_LINGER has passed), and only then ends.


def _keep_rendezvous_stores() -> List[object]:
    """Every TCPStore torchrun's rendezvous makes in this process, kept past the agent's own
    last reference to it: the static backend's (torchrun's default, ``--master-addr``) and the
    c10d backend's (nothing of a backend this torch does not have)."""
    kept: List[object] = []
    _keep_made_by("torch.distributed.elastic.rendezvous.static_tcp_rendezvous", "TCPStore", kept)
    _keep_made_by("torch.distributed.elastic.rendezvous.c10d_rendezvous_backend", "_create_tcp_store", kept)
    return kept


def _keep_made_by(module_name: str, maker: str, kept: List[object]) -> None:
    """``module_name``'s ``maker`` replaced by one that also appends what it made to ``kept``."""
    import importlib

    try:
        module = importlib.import_module(module_name)
    except BaseException:  # noqa: BLE001 - a torch without it: the agent runs as it would
        return
    make = getattr(module, maker, None)
    if make is None:
        return

    def keeping(*args: object, **kwargs: object) -> object:
        store = make(*args, **kwargs)
        kept.append(store)
        return store

    setattr(module, maker, keeping)


def _linger(stores: List[object], limit: float = STORE_LINGER) -> None:
    """Serve each store this process listens on until no other process is connected to it."""
    import time

    ports = [port for port in (getattr(store, "port", None) for store in stores) if isinstance(port, int)]
    deadline = time.monotonic() + limit
    try:
        while ports and time.monotonic() < deadline:
            ports = [port for port in ports if _others_connected(port)]
            if ports:
                time.sleep(0.02)
    except BaseException:  # noqa: BLE001 - a teardown's signal ends the wait, not the ending
        pass
    del stores[:]


def _others_connected(port: int) -> bool:
    """Whether this process listens on ``port`` and another process is connected to it: a
    connection it accepted whose other end is no socket of its own."""
    mine = _socket_inodes()
    sockets = [entry for name in ("tcp", "tcp6") for entry in _tcp_table("/proc/net/" + name)]
    if not any(local[1] == port and state == TCP_LISTEN and inode in mine
               for local, _remote, state, inode in sockets):
        return False
    own_ends = {local for local, _remote, _state, inode in sockets if inode in mine}
    return any(local[1] == port and state == TCP_ESTABLISHED and inode in mine and remote not in own_ends
               for local, remote, state, inode in sockets)


def _socket_inodes() -> Set[str]:
    inodes: Set[str] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink("/proc/self/fd/" + fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _tcp_table(path: str) -> List[Tuple[Tuple[str, int], Tuple[str, int], str, str]]:
    """``/proc/net/tcp``'s rows: (local, remote, state, inode), each end as (address, port)."""
    try:
        with open(path) as table:
            rows = table.read().splitlines()[1:]
    except OSError:
        return []
    return [(_endpoint(words[1]), _endpoint(words[2]), words[3], words[9])
            for words in (row.split() for row in rows) if len(words) > 9]


def _endpoint(text: str) -> Tuple[str, int]:
    """``0100007F:1F90`` (the kernel's 32-bit words, each in host order) as ("127.0.0.1", 8080);
    an IPv4-mapped IPv6 address as its IPv4 one, so both ends of one connection compare equal."""
    import ipaddress

    address, port = text.split(":")
    raw = bytes.fromhex(address)
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    ip = ipaddress.ip_address(packed)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (str(mapped or ip), int(port, 16))


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(str(code) + "\n")
    return 1


def _finish(code: int) -> None:
    """The interpreter's own ending, as far as a forked child can have it: non-daemon
    threads joined, atexit handlers, streams flushed; then ``_exit`` (the zygote's
    stack below this frame is not the child's to unwind)."""
    try:
        import threading

        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:  # noqa: BLE001 - the ending must end
        pass
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    finally:
        os._exit(code)


# -- the zygote -----------------------------------------------------------------------


class Zygote:
    def __init__(self, directory: str, listener: socket.socket) -> None:
        self.directory = directory
        self.listener = listener
        self.selector = selectors.DefaultSelector()
        self.children: Dict[int, socket.socket] = {}
        self.clients: Dict[socket.socket, int] = {}
        self.tasks = len(os.listdir("/proc/self/task"))
        self.startup_env = dict(os.environ)
        self.stopping = False
        self.wake: Tuple[int, int] = (-1, -1)

    def unsafe(self) -> str:
        """Why forking now would not be safe, or ""."""
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and cuda.is_initialized():
            return "CUDA is initialised in the warm interpreter"
        import threading

        if threading.active_count() > 1 or len(os.listdir("/proc/self/task")) > self.tasks:
            return "the warm interpreter has started a thread"
        return ""

    def serve(self, stdin: int) -> None:
        wake_r, wake_w = self.wake = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(number, self._stop)
        self.selector.register(self.listener, selectors.EVENT_READ, "listen")
        self.selector.register(wake_r, selectors.EVENT_READ, "wake")
        self.selector.register(stdin, selectors.EVENT_READ, "stdin")
        while not self.stopping:
            for key, _events in self.selector.select(1.0):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    try:
                        os.read(wake_r, 512)
                    except BlockingIOError:
                        pass
                elif key.data == "stdin":
                    if not os.read(stdin, 4096):
                        self.stopping = True
                else:
                    self._client_gone(key.fileobj)  # type: ignore[arg-type]
            self._reap()
        self.shutdown()

    def _stop(self, *_args: object) -> None:
        self.stopping = True

    def _accept(self) -> None:
        try:
            conn, _address = self.listener.accept()
        except OSError:
            return
        conn.setblocking(True)
        conn.settimeout(10.0)
        try:
            request, fds = receive_message(conn, 3)
        except (OSError, ValueError):
            request, fds = None, []
        try:
            if request is None or len(fds) != 3:
                conn.close()
                return
            why = self.unsafe() or startup_differs({str(k): str(v) for k, v in dict(request["env"]).items()},  # type: ignore[call-overload]
                                                   self.startup_env)
            if why:
                send_message(conn, {"refused": why})
                conn.close()
                return
            pid = os.fork()
            if pid == 0:
                # Whatever is raised in the child (torchrun's agent turns SIGTERM into an
                # exception, which can come while its last traceback prints) must never
                # unwind into the zygote's frames: their cleanup would remove the zygote's
                # directory and kill its other children, from the child.
                try:
                    self.listener.close()
                    for other in list(self.clients):
                        other.close()
                    self.selector.close()
                    for fd in self.wake:
                        os.close(fd)
                    run_child(request, fds)
                finally:
                    os._exit(1)
            self.children[pid] = conn
            self.clients[conn] = pid
            send_message(conn, {"pid": pid})
            conn.settimeout(None)
            self.selector.register(conn, selectors.EVENT_READ, "client")
        except OSError:
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def _client_gone(self, conn: socket.socket) -> None:
        """A client said something (it never does) or went away: its child goes too."""
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        if data:
            return
        pid = self.clients.pop(conn, None)
        self.selector.unregister(conn)
        conn.close()
        if pid is not None and pid in self.children:
            self.children[pid] = None  # type: ignore[assignment]
            _kill_group(pid, signal.SIGKILL)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            self.clients.pop(conn, None)
            try:
                self.selector.unregister(conn)
                send_message(conn, {"status": status})
            except (OSError, KeyError, ValueError):
                pass
            conn.close()

    def shutdown(self) -> None:
        """Every child's group SIGTERM, then SIGKILL after a grace; the directory removed."""
        import time

        for pid in list(self.children):
            _kill_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE
        while self.children and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.02)
        for pid in list(self.children):
            _kill_group(pid, signal.SIGKILL)
        while self.children:
            self._reap()
            time.sleep(0.01)
        remove_directory(self.directory)


def _kill_group(pid: int, number: int) -> None:
    try:
        os.killpg(pid, number)
    except OSError:
        try:
            os.kill(pid, number)
        except OSError:
            pass


def remove_directory(directory: str) -> None:
    for name in (SOCKET_NAME, CLIENT_NAME, PROGRAM_NAME):
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass
    try:
        os.rmdir(directory)
    except OSError:
        pass


def own_program() -> Optional[str]:
    """The ``-c`` text this process was started with: the client runs the same program."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return None
    if b"-c" not in words:
        return None
    return words[words.index(b"-c") + 1].decode()


def prepare(parent: Optional[str]) -> Tuple[str, socket.socket]:
    """The private directory, its client and its listening socket (0600 before it listens)."""
    directory = tempfile.mkdtemp(prefix="torchherd-warm-", dir=parent)
    program = own_program()
    if program is None:
        raise OSError("cannot read this program's own text")
    path = os.path.join(directory, PROGRAM_NAME)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(program)
    client = os.path.join(directory, CLIENT_NAME)
    script = "#!/bin/sh\nexec %s -I -S %s client %s \"$@\"\n" % (_sh(sys.executable), _sh(path), _sh(sys.executable))
    with open(os.open(client, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700), "w") as f:
        f.write(script)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(os.path.join(directory, SOCKET_NAME))
    finally:
        os.umask(old)
    listener.listen(64)
    return directory, listener


def _sh(word: str) -> str:
    return "'" + word.replace("'", "'\"'\"'") + "'"


def _first_line(fd: int) -> str:
    """One line of ``fd``, read a byte at a time: what follows stays for the serve loop
    (and for the program ``exec`` starts again)."""
    data = b""
    while not data.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break
        data += byte
    return data.decode()


def _with_room() -> None:
    """Starts this program again (``exec``: the same pid and channel) with room in its
    initial environment block for the largest environment a child will write there."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            words = [word.decode() for word in f.read().split(b"\0")[:-1]]
        os.execve(sys.executable, [sys.executable] + words[1:], dict(os.environ, **{ENV_PAD: "x" * ENV_ROOM}))
    except OSError:
        pass  # no room: the children's /proc/PID/environ is the zygote's (see rewrite_initial_environ)


def serve_main(args: List[str]) -> int:
    parent = None
    if args[:1] == ["--dir"] and len(args) > 1:
        parent, args = args[1], args[2:]
    if ENV_PAD not in os.environ:
        try:
            settings = json.loads(_first_line(0) or "{}")
        except ValueError:
            settings = {}
        env = settings.get("env") if isinstance(settings, dict) else None
        if isinstance(env, dict):
            os.environ.update({str(name): str(value) for name, value in env.items()})
        _with_room()
    os.environ.pop(ENV_PAD, None)
    try:
        for module in args:
            __import__(module)
        directory, listener = prepare(parent)
    except BaseException as exc:  # noqa: BLE001 - reported on the channel: the run goes on cold
        print(json.dumps({"error": "%s: %s" % (type(exc).__name__, exc)}), flush=True)
        return 1
    zygote = Zygote(directory, listener)
    print(json.dumps({"dir": directory, "pid": os.getpid(), "python": sys.executable}), flush=True)
    try:
        zygote.serve(0)
    finally:
        remove_directory(directory)
    return 0


# -- a job's first process, warm -------------------------------------------------------


def start_main(args: List[str]) -> int:
    """``PYTHON -c PROGRAM start PYTHON-ARGS...`` (the supervisor's ``warm_start``): the
    job's own first process (torchrun's agent, ``-m torch.distributed.run ...``) imports
    torch and the module it runs, forks a zygote that serves only it, and runs the module
    itself, its ranks forking from that zygote (``PYTHON_EXEC``): one import of torch per
    node, not one per process. The agent stays the supervisor's job process, in its process
    group: a teardown's signal reaches it as it reaches a cold torchrun, and it ends its ranks
    itself, with their grace. The zygote leaves that group (its own session) and ends when
    the agent does (the end of a pipe only the agent holds, even where the agent is
    SIGKILLed), killing what it forked. Where that cannot be, the agent starts cold: the
    real interpreter, ``exec``, with a note on stderr."""
    spec, why = parse_python_args(args)
    if spec is not None and "module" not in spec:
        spec, why = None, "a script, not a module"
    if spec is not None and ENV_PAD not in os.environ:
        _with_room()
    os.environ.pop(ENV_PAD, None)
    if spec is not None:
        try:
            for module in ("torch", str(spec["module"])):
                __import__(module)
            directory, listener = prepare(None)
        except BaseException as exc:  # noqa: BLE001 - the cold start says it again, as python does
            spec, why = None, "%s: %s" % (type(exc).__name__, exc)
    if spec is None:
        sys.stderr.write(COLD_NOTE % why)
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable] + args)
    ends, held = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(held)
            os.setsid()
            Zygote(directory, listener).serve(ends)
        finally:
            os._exit(0)
    os.close(ends)
    listener.close()
    os.environ.setdefault("PYTHON_EXEC", os.path.join(directory, CLIENT_NAME))
    rewrite_command_line([sys.executable] + args)
    code = 1
    try:
        code = _run_python({"spec": spec})
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:  # noqa: BLE001 - the agent's own error: its traceback, as python prints it
        _print_traceback()
    finally:
        os.close(held)
        _wait_for(pid)
    _finish(code)
    return code


def _print_traceback() -> None:
    try:
        import traceback

        traceback.print_exc()
    except BaseException:  # noqa: BLE001 - a signal handler of the job's raising mid-print
        pass


def _wait_for(pid: int) -> None:
    while True:
        try:
            os.waitpid(pid, 0)
            return
        except InterruptedError:
            continue
        except ChildProcessError:
            return


# -- the client -----------------------------------------------------------------------


def client_main(python: str, args: List[str]) -> int:
    """``DIR/python ARGS...``: the job's process forked from the zygote, else the real
    interpreter ``python`` (the zygote's own)."""
    directory = os.path.dirname(os.path.abspath(sys.argv[0]))
    spec, why = parse_python_args(args)
    sock = None
    if spec is not None:
        sock, why = _ask(directory, spec, python, args)
    if sock is None:
        sys.stderr.write(COLD_NOTE % why)
        sys.stderr.flush()
        os.execve(python, [python] + args, child_env(spec))
    return _relay(sock)


def child_env(spec: Optional[Dict[str, object]]) -> Dict[str, str]:
    """The environment the job's process gets: the client's, less ``PYTHON_EXEC`` (which
    made torchrun start this client) for a rank; torchrun's agent keeps it for its ranks."""
    env = dict(os.environ)
    if spec is None or spec.get("module") != AGENT_MODULE:
        env.pop("PYTHON_EXEC", None)
    return env


def _ask(directory: str, spec: Dict[str, object], python: str,
         args: List[str]) -> Tuple[Optional[socket.socket], str]:
    env = child_env(spec)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.path.join(directory, SOCKET_NAME))
        send_message(sock, {"env": env, "cwd": os.getcwd(), "spec": spec, "python": python, "args": args},
                     (0, 1, 2))
        reply, _fds = receive_message(sock)
    except OSError as exc:
        sock.close()
        return None, "no warm interpreter: %s" % (exc.strerror or exc)
    if reply is None or "pid" not in reply:
        sock.close()
        return None, str(reply.get("refused")) if reply else "the warm interpreter did not answer"
    global _child
    _child = int(reply["pid"])  # type: ignore[call-overload]
    return sock, ""


_child = 0


def _forward(number: int, _frame: object) -> None:
    if _child > 0:  # never 0: killpg(0) is the client's own group
        _kill_group(_child, number)


def _relay(sock: socket.socket) -> int:
    for number in RELAYED:
        signal.signal(number, _forward)
    while True:
        try:
            reply, _fds = receive_message(sock)
            break
        except InterruptedError:
            continue
    status = reply.get("status") if reply else None
    if not isinstance(status, int):
        return 1
    if os.WIFSIGNALED(status):
        died = os.WTERMSIG(status)
        try:
            signal.signal(died, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP: never caught, nothing to reset
            pass
        os.kill(os.getpid(), died)
        return 128 + died
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def main(argv: List[str]) -> int:
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    if argv[:1] == ["client"] and len(argv) > 1:
        return client_main(argv[1], argv[2:])
    if argv[:1] == ["start"] and len(argv) > 1:
        return start_main(argv[1:])
    sys.stderr.write("usage: zygote.py serve [--dir DIR] [MODULE...] | client PYTHON PYTHON-ARGS... | start PYTHON-ARGS...\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
