"""torchherd facts: what one node knows about itself, as one JSON document.

Standard library and torchherd.remote modules only, Python >= 3.8, Linux, read-only.
Run as ``PYTHON -c PROGRAM CONFIG`` (``checks.gather.node_program``: the modules it
imports travel with it) where CONFIG is a JSON object:
  port      int            the master port
  resolve   [str, ...]     names to resolve with the node's resolver
  route_to  [str, ...]     addresses or names; the source address of the route to
                           the first one that resolves is reported
  script    str or null    the training script, relative to workdir
  workdir   str            "~" expanded
  torch     bool or "files" import torch for its versions and GPUs (seconds of CPU); "files":
                           read its versions from torch/version.py instead (no GPU count)
  imported  [str, ...]     with torch true: fingerprints (``torch_fingerprint``) of installs
                           an earlier check or run imported on this node; where this one's
                           is among them, its versions are read from its files as "files"
                           does. Either way the torch facts carry this install's "fingerprint"
  root      str            where /sys and /proc are read for the GPU and InfiniBand
                           facts (default "/"; tests point it at a made-up tree)
  gpu_seconds float        how long after the start the GPU and kernel-log queries may
                           take before they are reported unanswered (default 15)
  listen    object or null {"ports": {"LABEL": PORT (0 = any free port)}, "seconds": S,
                           "backlog": PEERS}: after the facts, bind every port on all
                           addresses with a queue for PEERS connects (capped by somaxconn),
                           print {"bound": {LABEL: PORT}, "errors": {LABEL: MESSAGE},
                           "backlog": N} on one line, accept connections until stdin reaches
                           EOF or S seconds pass (the probes' listener, in the same round trip).
                           Meanwhile each JSON line on stdin is a connect request:
                           {"targets": [[LABEL, HOST, PORT], ...], "timeout": T,
                           "retry_timeout": T2, "budget": B, "concurrency": C,
                           "ping": HOST or null, "resolve": [NAME, ...]} (T2, B and C may be
                           left out), answered within B seconds with one line
                           {LABEL: {"result": R, "address": A, "port": P, "source": LOCAL_ADDRESS,
                           "attempts": [{"result": R, "timeout": T, "seconds": S}, ...]},
                           "ping": ..., "resolve": {NAME: ...}}. At most C connects at once;
                           each failed one is tried again after them, alone, with T2; R is
                           the last attempt's: ok, refused, timeout, unreachable, unresolved,
                           untried (no time left in B) or the error's text.
  venv      object or null {"path": VENV, "key": KEY, "project": DIR}: a uv-locked project's
                           venv; its marker is read and, when it holds KEY, the uv that built
                           it checks it against the project's lock (``uv sync --frozen
                           --offline --check``: reads, never changes, never downloads)
Prints the facts as one JSON line.
Every probe is wrapped: a failing one records its error and the others go on.
"""

import ast
import errno
import fcntl
import glob
import hashlib
import importlib.util
import ipaddress
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from torchherd.remote.proctable import command_line
from torchherd.remote.uvlock import MARKER, uv_lock_hash

OUT_LOCK = threading.Lock()
"""Held while a line goes to stdout (``say``), and by the end (``leave``)."""

STARTED = time.time()
CPU_AT_START = sum(os.times()[:4])
"""This process's CPU and its waited-for children's: the login shell's (it exec'd Python)."""
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "MASTER_", "PET_", "TORCHELASTIC_")
ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "CUDA_VISIBLE_DEVICES",
             "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")


def guarded(function: Callable[..., Any], *args: Any) -> Any:
    try:
        return function(*args)
    except Exception as error:  # one broken probe must not hide the others' facts
        return {"error": "%s: %s" % (type(error).__name__, error)}


def run_tool(argv: List[str], timeout: float = 5.0) -> Optional[Dict[str, Any]]:
    path = shutil.which(argv[0]) or next((p for p in ("/usr/sbin/" + argv[0], "/sbin/" + argv[0])
                                          if os.access(p, os.X_OK)), None)
    if path is None:
        return None
    try:
        done = subprocess.run([path] + argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as error:
        return {"code": -1, "out": "", "err": str(error)}
    return {"code": done.returncode, "out": done.stdout.decode("utf-8", "replace"),
            "err": done.stderr.decode("utf-8", "replace")[-2000:]}


def resolve(name: str) -> Dict[str, Any]:
    try:
        infos = socket.getaddrinfo(name, None, 0, socket.SOCK_STREAM)
    except socket.gaierror as error:
        return {"error": error.strerror or str(error)}
    addresses = []
    for _, _, _, _, sockaddr in infos:
        if sockaddr[0] not in addresses:
            addresses.append(sockaddr[0])
    return {"addresses": addresses}


def gloo_address(hostname: str) -> Dict[str, Any]:
    # gloo binds the first getaddrinfo(gethostname()) result it can bind, loopback included.
    try:
        infos = socket.getaddrinfo(hostname, None, 0, socket.SOCK_STREAM)
    except socket.gaierror as error:
        return {"error": error.strerror or str(error)}
    for family, kind, proto, _, sockaddr in infos:
        try:
            probe = socket.socket(family, kind, proto)
            try:
                probe.bind((sockaddr[0], 0) if family == socket.AF_INET else (sockaddr[0], 0, 0, 0))
            finally:
                probe.close()
        except OSError:
            continue
        return {"address": sockaddr[0]}
    return {"error": "no result can be bound"}


def shell_seconds() -> float:
    """How long this process ran before the script started. The command sshd gave the
    login shell execs Python, so that is the shell's startup (its startup files) plus
    Python's own, a few tens of ms: measured here, it does not depend on when the
    controller reads the answer."""
    with open("/proc/self/stat") as file:
        fields = file.read().rpartition(")")[2].split()
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: ticks after boot
    return round(time.clock_gettime(time.CLOCK_BOOTTIME) - started - (time.time() - STARTED), 3)


def cpu_contention() -> Dict[str, Any]:
    """How contended the node's CPUs are: PSI's share of the last 10 s in which some task
    waited for a CPU (Linux 4.20+), and the 1-minute load against the usable CPUs."""
    found: Dict[str, Any] = {"load": os.getloadavg()[0], "cpus": len(os.sched_getaffinity(0))}
    for word in (read_text("/proc/pressure/cpu") or "").split():
        if word.startswith("avg10="):
            found["pressure"] = float(word[len("avg10="):])
            break
    return found


def ioctl_value(name: str, request: int, offset: int, size: int) -> bytes:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = struct.pack("256s", name.encode()[:15])
        return fcntl.ioctl(sock.fileno(), request, packed)[offset:offset + size]
    finally:
        sock.close()


def interfaces() -> List[Dict[str, Any]]:
    found: List[Dict[str, Any]] = []
    for _, name in socket.if_nameindex():
        entry: Dict[str, Any] = {"name": name, "addresses": []}
        try:
            entry["addresses"].append(socket.inet_ntoa(ioctl_value(name, 0x8915, 20, 4)))
        except OSError:
            pass
        try:
            entry["mtu"] = struct.unpack("i", ioctl_value(name, 0x8921, 16, 4))[0]
        except OSError:
            pass
        try:
            mask = socket.inet_ntoa(ioctl_value(name, 0x891B, 20, 4))
            entry["networks"] = [str(ipaddress.ip_interface("%s/%s" % (entry["addresses"][0], mask)).network)]
        except (OSError, IndexError, ValueError):
            entry["networks"] = []
        found.append(entry)
    extra = run_tool(["ip", "-o", "addr", "show"])
    if extra and extra["code"] == 0:
        for line in extra["out"].splitlines():
            words = line.split()
            if len(words) > 3 and words[2] in ("inet", "inet6"):
                address = words[3].split("/")[0]
                for entry in found:
                    if entry["name"] == words[1].split("@")[0]:
                        add_address(entry, address, words[3])
    return found


def add_address(entry: Dict[str, Any], address: str, with_prefix: str) -> None:
    """``ip -o addr``'s view added to the ioctl's: every address, and its subnet (which
    the probe plan covers pairwise)."""
    if address not in entry["addresses"]:
        entry["addresses"].append(address)
    try:
        network = str(ipaddress.ip_interface(with_prefix).network)
    except ValueError:
        return
    if network not in entry["networks"]:
        entry["networks"].append(network)


def route(targets: List[str], port: int) -> Dict[str, Any]:
    for target in targets:
        try:
            info = socket.getaddrinfo(target, port, 0, socket.SOCK_DGRAM)[0]
        except socket.gaierror:
            continue
        sock = socket.socket(info[0], socket.SOCK_DGRAM)
        try:
            sock.connect(info[4])  # a UDP connect sends nothing but picks the route
            return {"target": target, "address": info[4][0], "source": sock.getsockname()[0]}
        except OSError as error:
            return {"target": target, "address": info[4][0], "error": str(error)}
        finally:
            sock.close()
    return {"error": "none of %s resolves" % ", ".join(targets)}


def socket_owners() -> Dict[str, str]:
    owners: Dict[str, str] = {}
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            pid = fd.split("/")[2]
            owners.setdefault(link[8:-1], pid)
    return owners


def listeners(port: int) -> List[Dict[str, Any]]:
    found: List[Dict[str, Any]] = []
    owners: Optional[Dict[str, str]] = None
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as file:
                rows = file.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            words = row.split()
            local, state, inode = words[1], words[3], words[9]
            if state != "0A" or int(local.rsplit(":", 1)[1], 16) != port:
                continue
            owners = owners if owners is not None else socket_owners()
            pid = owners.get(inode)
            found.append({"pid": pid, "command": (command_line(int(pid)).strip() or None) if pid else None})
    return found


def free_port_near(port: int) -> Optional[int]:
    for candidate in range(port + 1, port + 50):
        sock = socket.socket()
        try:
            sock.bind(("", candidate))
            return candidate
        except OSError:
            continue
        finally:
            sock.close()
    return None


def read_text(path: str) -> Optional[str]:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return None


def firewall() -> Dict[str, Any]:
    tools: Dict[str, Any] = {}
    for name, argv in (("iptables", ["iptables", "-S"]), ("ip6tables", ["ip6tables", "-S"]),
                       ("nft", ["nft", "list", "ruleset"]), ("ufw", ["ufw", "status", "verbose"]),
                       ("firewalld", ["firewall-cmd", "--list-all"])):
        tools[name] = run_tool(argv)
    return {"euid": os.geteuid(), "tools": tools}


def shm() -> Dict[str, Any]:
    stats = os.statvfs("/dev/shm")
    return {"bytes": stats.f_frsize * stats.f_blocks}


def script_hash(workdir: str, script: str) -> Dict[str, Any]:
    path = script if os.path.isabs(script) else os.path.join(os.path.expanduser(workdir), script)
    try:
        with open(path, "rb") as file:
            return {"path": path, "sha256": hashlib.sha256(file.read()).hexdigest()}
    except OSError as error:
        return {"path": path, "error": error.strerror or str(error)}


UV_CHECK_SECONDS = 60.0


def venv_state(config: Dict[str, Any]) -> Dict[str, Any]:
    path = os.path.expanduser(config["path"])
    project = os.path.expanduser(config["project"])
    state: Dict[str, Any] = {"path": path, "lock_hash": uv_lock_hash(project), "marker": None}
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as file:
            marker = json.load(file)
    except (OSError, ValueError):
        return state
    if not isinstance(marker, dict) or marker.get("key") != config["key"]:
        return state
    state["marker"] = marker
    env = dict(os.environ, UV_PROJECT_ENVIRONMENT=path)
    env.pop("VIRTUAL_ENV", None)
    try:
        done = subprocess.run([str(marker["uv"]), "sync", "--frozen", "--offline", "--check", "--python",
                               str(marker["python"])], cwd=project, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=UV_CHECK_SECONDS, check=False)
    except (OSError, subprocess.SubprocessError, KeyError) as error:
        state["check"] = {"error": str(error)}
        return state
    lines = [line.strip() for line in done.stdout.decode("utf-8", "replace").splitlines() if line.strip()]
    state["check"] = {"code": done.returncode, "lines": lines[-40:]}
    return state


SMI_QUERIES = {
    "nvidia_smi": (["nvidia-smi", "--query-gpu=index,name,memory.used,driver_version",
                    "--format=csv,noheader,nounits"], 10.0),
    "compute_apps": (["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"], 5.0),
    "query": (["nvidia-smi", "-q", "-x"], 10.0),
    "nvlink": (["nvidia-smi", "nvlink", "-s"], 5.0),
}
"""Every nvidia-smi call, run at once: each costs the driver's initialisation (up to
seconds per call on a node without persistence mode), and one after the other they
would add up."""
SMI_LIMIT = 8 << 20
"""Bytes of one nvidia-smi output sent back; more is cut and marked (the controller's
reader refuses bigger documents anyway)."""
GPU_SECONDS = 15.0
"""How long after the script's start the GPU and kernel-log facts may take (each query's
own timeout is shorter; this bounds one stuck where a timeout cannot kill it)."""
XID_LINES = 200
"""The last Xid lines of the kernel log sent back: enough to name every GPU that had one."""


def capped(done: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if done is not None and len(done["out"]) > SMI_LIMIT:
        done = dict(done, out=done["out"][:SMI_LIMIT], truncated=True)
    return done


PCI_GPU_CLASSES = ("0x030000", "0x030200")
"""VGA and 3D controllers: GPUs (an NVSwitch is a bridge, 0x068000, and is not one)."""


def pci_gpus(root: str) -> List[Dict[str, Optional[str]]]:
    """The NVIDIA GPUs on the PCI bus (sysfs), each with the driver bound to it: one the
    driver bound but nvidia-smi does not list is lost; one bound to vfio-pci is passed
    through to a VM on purpose."""
    base = os.path.join(root, "sys/bus/pci/devices")
    found: List[Dict[str, Optional[str]]] = []
    for name in sorted(os.listdir(base))[:4096] if os.path.isdir(base) else []:
        device = os.path.join(base, name)
        if (read_text(os.path.join(device, "vendor")) or "").strip() != "0x10de":
            continue
        if (read_text(os.path.join(device, "class")) or "").strip() not in PCI_GPU_CLASSES:
            continue
        if os.path.exists(os.path.join(device, "physfn")):  # an SR-IOV virtual function (vGPU), not a GPU
            continue
        driver = os.path.join(device, "driver")
        bound = os.path.basename(os.path.realpath(driver)) if os.path.islink(driver) else None
        found.append({"bus": name[:32], "driver": bound[:64] if bound else None})
    return found


PERSISTENCED = "nvidia-persiste"
"""nvidia-persistenced's name in /proc/<pid>/comm (the kernel keeps 15 characters)."""


def persistenced(root: str) -> bool:
    """Whether nvidia-persistenced runs here: it keeps the GPUs initialised between jobs,
    the way drivers from 580 on want (they deprecate ``nvidia-smi -pm 1``)."""
    base = os.path.join(root, "proc")
    for name in os.listdir(base) if os.path.isdir(base) else []:
        if name.isdigit() and (read_text(os.path.join(base, name, "comm")) or "").strip() == PERSISTENCED:
            return True
    return False


def gpus(root: str) -> Dict[str, Any]:
    facts: Dict[str, Any] = {}
    if shutil.which("nvidia-smi") is None:
        return facts
    facts["pci"] = guarded(pci_gpus, root)
    facts["persistenced"] = guarded(persistenced, root)
    threads = [threading.Thread(target=lambda key=key, argv=argv, timeout=timeout:
                                facts.__setitem__(key, capped(guarded(run_tool, argv, timeout))), daemon=True)
               for key, (argv, timeout) in SMI_QUERIES.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return facts


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1][:200] if lines else ""


def xid_lines(lines: List[str]) -> List[str]:
    """The Xid lines, and the driver's "fallen off the bus" message with the two lines
    before it (newer drivers spread it over three lines, the GPU's address on the first)."""
    kept = []
    for number, line in enumerate(lines):
        if "NVRM: Xid" in line:
            kept.append(line[:400])
        elif "fallen off the bus" in line:
            kept.append(" ".join(part.strip() for part in lines[max(0, number - 2):number + 1])[:600])
    return kept


def kernel_xids(root: str) -> Optional[Dict[str, Any]]:
    """The kernel log's NVIDIA Xid lines since boot (dmesg, else journalctl -k), or why
    this user cannot read it; None where there is no NVIDIA driver."""
    if not os.path.exists(os.path.join(root, "proc/driver/nvidia")) and shutil.which("nvidia-smi") is None:
        return None
    tried = []
    for argv in (["dmesg"], ["journalctl", "-k", "-b", "--no-pager", "-q"]):
        done = run_tool(argv, timeout=5.0)
        if done is None:
            tried.append("%s: not installed" % argv[0])
            continue
        said = last_line(done["err"])
        # journalctl exits 0 when it may not read the system journal: it says so on stderr.
        if done["code"] != 0 or "permission" in said.lower() or "no journal files" in said.lower():
            tried.append("%s: %s" % (argv[0], said or "exit status %s" % done["code"]))
            continue
        return {"source": argv[0], "lines": xid_lines(done["out"].splitlines())[-XID_LINES:]}
    return {"error": "; ".join(tried)}


def infiniband(root: str) -> Dict[str, Any]:
    """Every InfiniBand/RoCE port in sysfs (state, physical state, rate, link layer), and
    whether the GPUDirect RDMA module is loaded."""
    base = os.path.join(root, "sys/class/infiniband")
    ports: List[Dict[str, str]] = []
    for device in sorted(os.listdir(base))[:64] if os.path.isdir(base) else []:
        port_dir = os.path.join(base, device, "ports")
        for port in sorted(os.listdir(port_dir))[:8] if os.path.isdir(port_dir) else []:
            entry = {"device": device[:64], "port": port[:8]}
            for name in ("state", "phys_state", "rate", "link_layer"):
                entry[name] = (read_text(os.path.join(port_dir, port, name)) or "").strip()[:100]
            ports.append(entry)
    modules = [name for name in ("nvidia_peermem", "nv_peer_mem") if os.path.isdir(os.path.join(root, "sys/module", name))]
    version = read_text(os.path.join(root, "proc/driver/nvidia/version")) or ""
    # The open kernel modules let NCCL register GPU memory through DMA-BUF, without peermem.
    return {"ports": ports, "peermem": modules, "kernel": os.uname().release,
            "open_driver": "Open Kernel Module" in version}


class Background:
    """``function(*args)`` in a thread, started now; ``result()`` waits for it. The GPU
    and kernel-log queries take longest and run meanwhile with the other facts."""

    def __init__(self, function: Callable[..., Any], *args: Any) -> None:
        self.value: Any = None
        self.thread = threading.Thread(target=self.run, args=(function,) + args, daemon=True)
        self.thread.start()

    def run(self, function: Callable[..., Any], *args: Any) -> None:
        self.value = guarded(function, *args)

    def result(self, deadline: float) -> Any:
        """The answer, or an error when it has not come by ``deadline`` (time.time()): a
        GPU in a bad state can leave nvidia-smi stuck in the kernel, where no timeout
        kills it, and the other facts must still be printed."""
        self.thread.join(max(0.0, deadline - time.time()))
        if self.thread.is_alive():
            return {"error": "no answer within %d s" % round(deadline - STARTED)}
        return self.value


def torch_facts() -> Dict[str, Any]:
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
    except BaseException as error:  # a broken install can raise anything, even SystemExit
        return {"error": "%s: %s" % (type(error).__name__, error)}
    facts: Dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda, "nccl": None, "gpus": 0}
    try:
        facts["gpus"] = torch.cuda.device_count()
        if torch.cuda.is_available():
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call,unused-ignore]
    except Exception as error:
        facts["gpu_error"] = str(error)
    return facts


def torch_files() -> Dict[str, Any]:
    """torch's versions read from its files (torch/version.py), without importing it: for a
    node whose ranks imported this very torch moments ago (a triage after a failed attempt),
    where the import would cost seconds of CPU and prove nothing new. No GPU count, no NCCL
    version (those need the import; the gpu check counts with nvidia-smi)."""
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return {"error": "ModuleNotFoundError: No module named 'torch'"}
        path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read(), path)
    except BaseException as error:  # as torch_facts: a broken install can raise anything
        return {"error": "%s: %s" % (type(error).__name__, error)}
    values: Dict[str, Any] = {}
    for statement in tree.body:
        target = (statement.targets[0] if isinstance(statement, ast.Assign) and len(statement.targets) == 1
                  else statement.target if isinstance(statement, ast.AnnAssign) else None)
        value = getattr(statement, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = value.value
    if not isinstance(values.get("__version__"), str):
        return {"error": "%s names no __version__" % path}
    found: Dict[str, Any] = {"version": values["__version__"], "cuda": values.get("cuda"), "nccl": None, "files": True}
    if values.get("cuda") is None and values.get("hip") is None:
        found["gpus"] = 0  # a build without CUDA or ROCm sees no GPU, whatever the node has
    return found


FINGERPRINT_FILES = ("__init__.py", "version.py", "lib/libtorch_cpu.so", "lib/libtorch_cuda.so", "lib/libtorch_python.so")
FINGERPRINT_VARIABLES = ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHOME", "CUDA_VISIBLE_DEVICES",
                         "CUDA_HOME", "NCCL_HOME")


def torch_fingerprint() -> Optional[str]:
    """What identifies the torch this Python would import, without importing it: the
    interpreter, torch's directory and its main files (size, mtime, inode: a reinstall or
    an upgrade changes them) and the variables that change what the import loads. Equal
    fingerprints on a node: the import that once succeeded would load the same files."""
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return None
        directory = os.path.realpath(list(spec.submodule_search_locations)[0])
        seen: List[Any] = [os.path.realpath(sys.executable), sys.version, directory]
        names = list(FINGERPRINT_FILES) + sorted(name for name in os.listdir(directory)
                                                  if name.startswith("_C") and name.endswith(".so"))
        for name in names:
            try:
                stat = os.stat(os.path.join(directory, name))
            except OSError:
                seen.append([name, None])
                continue
            seen.append([name, stat.st_size, stat.st_mtime_ns, stat.st_ino])
        seen.append([[name, os.environ.get(name)] for name in FINGERPRINT_VARIABLES])
    except BaseException:  # as torch_facts: whatever fails, the import decides
        return None
    return hashlib.sha256(json.dumps(seen).encode()).hexdigest()[:32]


def torch_of(config: Dict[str, Any]) -> Dict[str, Any]:
    """The torch facts ``config`` asks for (see the module's docstring)."""
    fingerprint = torch_fingerprint()
    known = config.get("imported") or []
    if config.get("torch", True) == "files" or (fingerprint is not None and fingerprint in known):
        found = torch_files()
    else:
        found = torch_facts()
    if fingerprint is not None:
        found["fingerprint"] = fingerprint
    return found


def listen_backlog(wanted: int) -> int:
    # Every peer connects at most once per socket in a burst: a queue that holds them all
    # cannot overflow, however late this process gets the CPU to accept. The kernel caps
    # the backlog at somaxconn anyway; reading it keeps the figure honest.
    somaxconn = read_text("/proc/sys/net/core/somaxconn")
    ceiling = int(somaxconn) if somaxconn and somaxconn.strip().isdigit() else 4096
    return max(64, min(wanted, ceiling))


def listen(config: Dict[str, Any]) -> None:
    sockets: Dict[int, Any] = {}
    labels: Dict[int, str] = {}
    bound: Dict[str, int] = {}
    errors: Dict[str, str] = {}
    backlog = listen_backlog(int(config.get("backlog") or 64))
    for label, port in config["ports"].items():
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # As torch's TCPStore does: a port with only TIME_WAIT leftovers counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
            sock.listen(backlog)
        except OSError as error:
            errors[label] = os.strerror(error.errno) if error.errno else str(error)
            sock.close()
            continue
        sock.setblocking(False)
        bound[label] = sock.getsockname()[1]
        sockets[sock.fileno()], labels[sock.fileno()] = sock, label
    say({"bound": bound, "errors": errors, "backlog": backlog})
    held: List[socket.socket] = []
    pending = b""
    deadline = time.time() + config["seconds"]
    while time.time() < deadline:
        ready: List[Any] = select.select(list(sockets.values()) + [sys.stdin], [], [], 0.2)[0]
        for sock in ready:
            if sock is sys.stdin:
                data = os.read(sys.stdin.fileno(), 65536)
                if not data:
                    return
                pending = serve_requests(pending + data)
            else:
                held += drain(sock, labels[sock.fileno()] == "master")


def drain(sock: socket.socket, hold: bool) -> List[socket.socket]:
    """Accepts every connection waiting on ``sock`` (one per select round let a burst of
    peers overflow the queue). Connections to the master port stay open until the end:
    the connecting side closes first, so no TIME_WAIT is left on the master port to block
    the next bind. The ephemeral ports are never bound again: those close at once, which
    keeps the descriptors few when hundreds of peers probe one node."""
    kept: List[socket.socket] = []
    while True:
        try:
            accepted = sock.accept()[0]
        except (BlockingIOError, InterruptedError):
            return kept
        except OSError:  # e.g. ECONNABORTED for one connection: the others still wait
            continue
        if hold:
            kept.append(accepted)
        else:
            accepted.close()


def serve_requests(data: bytes) -> bytes:
    """Each complete line on stdin is a connect request (see ``connect``); it runs in a
    thread so this listener keeps serving the peers that probe it meanwhile."""
    *lines, rest = data.split(b"\n")
    for line in lines:
        if line.strip():
            threading.Thread(target=connect, args=(json.loads(line.decode("utf-8")),), daemon=True).start()
    return rest


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


CONNECTS_AT_ONCE = 32
"""Connects in flight on one node when the request does not say: bounded, so a node with
hundreds of targets never fires them all at once (one thread per target did, and the
listeners' queues overflowed into false timeouts)."""
RETRIES_AT_ONCE = 64
NOT_RETRIED = ("ok", "unresolved", "untried")


def attempt(host: str, port: int, timeout: float, deadline: float) -> Dict[str, Any]:
    """One connect, only when its whole timeout fits before the deadline: a connect cut
    short would be weaker evidence than the others."""
    if time.monotonic() + timeout > deadline:
        return {"result": "untried"}
    started = time.monotonic()
    outcome = connect_one(host, port, timeout)
    outcome.update(timeout=timeout, seconds=round(time.monotonic() - started, 3))
    return outcome


def connect_all(targets: List[List[Any]], timeout: float, deadline: float, width: int) -> Dict[str, Any]:
    """``attempt`` on every (label, host, port), ``width`` threads pulling from one list."""
    results: Dict[str, Any] = {}
    waiting = list(reversed(targets))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not waiting:
                    return
                label, host, port = waiting.pop()
            results[label] = attempt(host, port, timeout, deadline)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, min(width, len(targets))))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def probe(config: Dict[str, Any], started: float) -> Dict[str, Any]:
    """The burst (bounded), then every failed target again, alone: all the retries at once
    but never with the burst, each with the longer timeout. A connect that times out
    once may have met a full queue on a loaded node; a DROP rule fails every time."""
    timeout = float(config["timeout"])
    retry_timeout = float(config.get("retry_timeout") or 2 * timeout)
    # By default three waves of timeouts in the burst, then the retries.
    deadline = started + float(config.get("budget") or 3 * timeout + retry_timeout)
    targets = config["targets"]
    first = connect_all(targets, timeout, deadline, int(config.get("concurrency") or CONNECTS_AT_ONCE))
    failed = [target for target in targets if first[target[0]]["result"] not in NOT_RETRIED]
    # The retries get the longer timeout when it fits, at least the burst's, or none.
    retry_timeout = max(timeout, min(retry_timeout, deadline - time.monotonic()))
    second = connect_all(failed, retry_timeout, deadline, RETRIES_AT_ONCE) if failed else {}
    return {label: merged([first[label], second.get(label)], port) for label, _, port in targets}


def merged(attempts: List[Optional[Dict[str, Any]]], port: int) -> Dict[str, Any]:
    """The last attempt's outcome, with every attempt made (result, timeout, seconds)."""
    made = [one for one in attempts if one is not None and one["result"] != "untried"]
    if not made:
        return {"result": "untried", "port": port, "attempts": []}
    outcome = dict(made[-1], port=port)
    outcome["attempts"] = [{key: one[key] for key in ("result", "timeout", "seconds", "detail") if key in one}
                           for one in made]
    outcome.pop("timeout", None)
    outcome.pop("seconds", None)
    return outcome


def connect(config: Dict[str, Any]) -> None:
    started = time.monotonic()
    results: Dict[str, Any] = {}
    pinger = None
    if config.get("ping"):
        pinger = threading.Thread(target=lambda: results.__setitem__("ping", ping(config["ping"])))
        pinger.start()
    results["resolve"] = {name: resolve(name) for name in config.get("resolve", [])}
    results.update(probe(config, started))
    if pinger is not None:
        pinger.join()
    say(results)


def main() -> None:
    config = json.loads(sys.argv[1])
    root = config.get("root") or "/"
    gpu = Background(gpus, root)
    xids = Background(kernel_xids, root)
    hostname = socket.gethostname()
    facts = {
        "time": STARTED,
        "shell_seconds": guarded(shell_seconds),
        "shell_cpu_seconds": round(CPU_AT_START, 3),
        "cpu_contention": guarded(cpu_contention),
        "hostname": hostname,
        "fqdn": guarded(socket.getfqdn),
        "hostname_resolution": resolve(hostname),
        "gloo": guarded(gloo_address, hostname),
        "etc_hosts": read_text("/etc/hosts"),
        "resolve": {name: resolve(name) for name in config["resolve"]},
        "interfaces": guarded(interfaces),
        "route": guarded(route, config["route_to"], config["port"]),
        "port_range": read_text("/proc/sys/net/ipv4/ip_local_port_range"),
        "listeners": guarded(listeners, config["port"]),
        "free_port": guarded(free_port_near, config["port"]),
        "firewall": guarded(firewall),
        "env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES},
        "shm": guarded(shm),
        "container": [p for p in ("/.dockerenv", "/run/.containerenv") if os.path.exists(p)],
        "python": {"executable": sys.executable, "version": sys.version.split()[0]},
        "script": guarded(script_hash, config["workdir"], config["script"]) if config["script"] else None,
        "infiniband": guarded(infiniband, root),
        "ping": bool(shutil.which("ping")),
        "venv": guarded(venv_state, config["venv"]) if config.get("venv") else None,
    }
    if config.get("torch", True):
        facts["torch"] = torch_of(config)
    deadline = STARTED + float(config.get("gpu_seconds") or GPU_SECONDS)
    facts["gpu"], facts["kernel_xids"] = gpu.result(deadline), xids.result(deadline)
    say(facts)
    if config.get("listen"):
        listen(config["listen"])


def say(document: Dict[str, Any]) -> None:
    """One line on stdout, whole: the listener's probes answer from threads of their own."""
    with OUT_LOCK:
        sys.stdout.write(json.dumps(document) + "\n")
        sys.stdout.flush()


def leave() -> None:
    """Ends the process without the interpreter's shutdown, once no thread is writing a
    line. A shutdown stops the daemon threads where they are: a probe's thread stopped
    inside its answer's write keeps stdout's lock, the final flush waits a second for it,
    and CPython aborts (SIGABRT, no exit status); the bandwidth script did, under load."""
    with OUT_LOCK:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


main()
leave()
