"""The job inside a container: what each runtime is told, and how a run's container is named.

Standard library only, Python >= 3.8: the supervisor imports this on the node (it knows
the user's uid, the workdir's real path and which runtime is installed there), the plan
imports it to validate the inventory and to show ``--dry-run``'s command. Every function
here is pure but ``resolve_runtime`` and ``node_identity``.

Docker and podman run the job as ``run --rm`` with a run-scoped name and label, the host's
network and IPC namespaces (so torchrun's addresses, ports and ``/dev/shm`` are the
node's own), the workdir mounted at the same path, the job's variables passed by name
(``-e NAME``: the values come from the runtime's own environment, never the command
line), and the user's uid:gid, so files the job writes are the user's. Apptainer and
enroot run the job as the user anyway and keep the host's process table; they are
built here and unit-tested, not run by the test suite (neither is packaged by Debian).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Callable, Dict, List, NamedTuple, Optional, Pattern, Sequence, Tuple


class Runtime(NamedTuple):
    """One container runtime: everything torchherd does differently for it, in one entry
    (``RUNTIME``), so that no other module branches on a runtime's name."""

    name: str
    oci: bool
    """Its containers outlive their client (``run --rm`` with a run-scoped name and label,
    removed by name), and it keeps images by name: inspected, pulled, saved and loaded."""
    mount_flag: str
    """What mounts ``SRC[:DST[:OPTIONS]]``."""
    env_flag: Optional[str]
    """What passes a variable by name into the container; None: the host's environment
    passes in by default."""
    gpu_words: Tuple[str, ...]
    """What passes the GPUs in."""
    workdir_flag: Optional[str]
    """What starts the job in the workdir; None: no such option, a POSIX shell in the image
    changes into it (``ENROOT_CD``)."""
    gpu_setup: Optional[str]
    """How the check sees that the GPUs can be passed in: "cdi" (a CDI spec of kind
    nvidia.com/gpu), "nvidia-runtime" (docker's nvidia runtime or its hook); None: not looked at."""
    replaces: bool = False
    """``run --replace`` takes over a container of the same name left by an earlier attempt
    whose node died; without it (docker) the supervisor removes that one first."""
    keep_id: bool = False
    """Rootless, it maps the user's own uid into the container (``--userns keep-id``)
    instead of running as ``--user UID:GID``."""
    usable_fix: str = ""
    """The hint when it does not answer this user (permission denied, no daemon)."""
    layer_line: Optional[Pattern[str]] = None
    """A line its pull prints about one layer, without a terminal: the layer's id (group 1),
    what it says of it (group 2; tests/unit/test_pull.py has their real output)."""
    layer_in: Optional[Pattern[str]] = None
    """What it says of a layer once the layer is in (matched at the start)."""
    layer_status: Optional[str] = None
    """The pull's status while it names layers; None: what it says of the layer (up to " [")."""

    def remove_argv(self, name: str) -> Optional[List[str]]:
        """What removes a container by name (stopped or not; gone already is fine); None
        where the container is the job's own process tree."""
        return [self.name, "rm", "-f", name] if self.oci and name else None

    def inspect_argv(self, image: str) -> List[str]:
        """What prints the image's id (docker writes ``sha256:``, podman does not)."""
        return [self.name, "image", "inspect", "--format", "{{.Id}}", image]

    def load_argv(self, path: str) -> List[str]:
        """What loads an image archive (``docker save``/``podman save``)."""
        return [self.name, "load", "-i", path]

    def pull_argv(self, image: str) -> List[str]:
        return [self.name, "pull", image]


RUNTIME = {runtime.name: runtime for runtime in (
    Runtime("podman", oci=True, mount_flag="-v", env_flag="-e", gpu_words=("--device", "nvidia.com/gpu=all"),
            workdir_flag="-w", gpu_setup="cdi", replaces=True, keep_id=True,
            usable_fix="rootless podman needs subuid/subgid ranges for the user (sudo usermod --add-subuids ...)",
            layer_line=re.compile(r"Copying blob (?:sha256:)?([0-9a-f]{12,64})(?:\s+(.*))?$"),
            layer_in=re.compile(r"done|skipped"), layer_status="copying layers"),
    Runtime("docker", oci=True, mount_flag="-v", env_flag="-e", gpu_words=("--gpus", "all"),
            workdir_flag="-w", gpu_setup="nvidia-runtime",
            usable_fix="add the user to the docker group (sudo usermod -aG docker USER, then log in again), "
                       "or start dockerd",
            layer_line=re.compile(r"([0-9a-f]{12}): (.+)$"), layer_in=re.compile(r"(?:Pull complete|Already exists)\Z")),
    Runtime("apptainer", oci=False, mount_flag="--bind", env_flag=None, gpu_words=("--nv",), workdir_flag="--pwd",
            gpu_setup=None),
    Runtime("enroot", oci=False, mount_flag="--mount", env_flag="--env", gpu_words=("--env", "NVIDIA_VISIBLE_DEVICES"),
            workdir_flag=None, gpu_setup=None),
)}
"""Every runtime, in the order ``auto`` tries them: podman needs no daemon, so where it is
installed it runs."""
RUNTIMES = tuple(RUNTIME)
RUNTIME_CHOICES = ("auto",) + RUNTIMES
OCI_RUNTIMES = tuple(runtime.name for runtime in RUNTIME.values() if runtime.oci)
"""Runtimes whose containers outlive their client and must be removed by name."""
PULL_CHOICES = ("missing", "always", "never")

IMAGE = re.compile(r"(?:/|\./)?[A-Za-z0-9_][A-Za-z0-9._/:@+-]{0,511}\Z")
"""An image reference (``nvcr.io/nvidia/pytorch:24.05-py3``, ``name@sha256:...``), or an
Apptainer ``.sif`` / enroot ``.sqsh`` file or ``docker://`` URI: nothing a shell reads as more."""
MOUNT_PART = re.compile(r"[A-Za-z0-9._/~+@=-]+\Z")
MOUNT_OPTIONS = re.compile(r"[A-Za-z0-9=,._-]+\Z")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
LABEL = "torchherd.run"
"""The label every container of a run carries: ``LABEL=<run id>``."""
NAME_PREFIX = "torchherd-"
SHM_NOTE = "--ipc host: the node's own /dev/shm, as large as the node gives it"
ENROOT_CD = 'cd -- "$1" && shift && exec "$@"'
"""enroot has no working-directory option: a POSIX shell in the image changes into it."""


class ContainerSpec(NamedTuple):
    """One node's container, as the controller decided it (``wire.SupervisorConfig.container``)."""

    image: str
    runtime: str = "auto"
    """One of RUNTIME_CHOICES; "auto" is resolved on the node (``resolve_runtime``)."""
    name: str = ""
    """Run-scoped: ``container_name(run_id, node)``; the label carries the run id."""
    run_id: str = ""
    mounts: Tuple[str, ...] = ()
    """``SRC[:DST[:OPTIONS]]``, as ``-v``/``--bind`` take them."""
    options: Tuple[str, ...] = ()
    """More options of the runtime's run command, each one word (``--cap-add=SYS_PTRACE``)."""
    gpus: Optional[bool] = None
    """Pass the GPUs through; None: where the node has NVIDIA devices."""
    pull: str = "never"
    """docker/podman ``run --pull``: "never" for a job's container (the run's pull step,
    ``engine.prepare.pull``, brought the image first); the check's throwaway container too."""

    def to_json_object(self) -> Dict[str, object]:
        return {"image": self.image, "runtime": self.runtime, "name": self.name, "run_id": self.run_id,
                "mounts": list(self.mounts), "options": list(self.options), "gpus": self.gpus, "pull": self.pull}

    @classmethod
    def from_json_object(cls, raw: object) -> Optional["ContainerSpec"]:
        """None for None; ValueError names the key that is wrong."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError("config key 'container' must be an object or null")
        strings = {key: raw.get(key, "never" if key == "pull" else None)
                   for key in ("image", "runtime", "name", "run_id", "pull")}
        if not all(isinstance(value, str) for value in strings.values()):
            raise ValueError("config key 'container' needs image, runtime, name, run_id and pull strings")
        lists = {key: raw.get(key) for key in ("mounts", "options")}
        if not all(isinstance(value, list) and all(isinstance(item, str) for item in value)
                   for value in lists.values()):
            raise ValueError("config key 'container' needs mounts and options lists of strings")
        gpus = raw.get("gpus")
        if gpus is not None and not isinstance(gpus, bool):
            raise ValueError("config key 'container.gpus' must be true, false or null")
        spec = cls(image=str(strings["image"]), runtime=str(strings["runtime"]), name=str(strings["name"]),
                   run_id=str(strings["run_id"]), mounts=tuple(lists["mounts"] or ()),
                   options=tuple(lists["options"] or ()), gpus=gpus, pull=str(strings["pull"]))
        problem = spec_problem(spec)
        if problem:
            raise ValueError("config key 'container': " + problem)
        return spec


# ------------------------------------------------------------------ validation

def image_problem(image: object) -> Optional[str]:
    """Why ``image`` is no image reference (None when it is one)."""
    if not isinstance(image, str) or not image:
        return "expected an image name such as \"nvcr.io/nvidia/pytorch:24.05-py3\""
    if not IMAGE.match(image):
        return ("%r is not an image name: only letters, digits and . _ / : @ + - (a shell would read the "
                "rest)" % image)
    repository = _repository(image)
    if repository != repository.lower():
        return ("%r: docker and podman take only lower case in a repository name (%r); write %r"
                % (image, repository, image.replace(repository, repository.lower(), 1)))
    return None


def _repository(image: str) -> str:
    """The repository path of a registry reference (``nvcr.io/nvidia/pytorch:24.05`` ->
    ``nvidia/pytorch``: the registry host may be any case); "" for a file (``/x.sif``) or
    a ``scheme://`` reference, which are not docker's to refuse."""
    if image.startswith(("/", "./")) or "://" in image:
        return ""
    name = image.split("@", 1)[0]
    head, slash, tail = name.rpartition("/")
    name = head + slash + tail.split(":", 1)[0]
    first, _, rest = name.partition("/")
    registry = rest and ("." in first or ":" in first or first == "localhost")
    return rest if registry else name


def mount_problem(mount: object) -> Optional[str]:
    """Why ``mount`` is no ``SRC[:DST[:OPTIONS]]`` with absolute paths (None when it is one)."""
    if not isinstance(mount, str) or not mount or CONTROL.search(mount):
        return "expected \"SRC[:DST[:OPTIONS]]\", got %r" % (mount,)
    parts = mount.split(":")
    paths = parts[:2]
    if len(parts) > 3 or not all(MOUNT_PART.match(part) and part.startswith(("/", "~")) for part in paths):
        return "%r: expected \"SRC[:DST[:OPTIONS]]\" with absolute paths (\"/data:/data:ro\")" % mount
    if len(parts) == 3 and not MOUNT_OPTIONS.match(parts[2]):
        return "%r: the options (after the second ':') are words such as ro or rw,z" % mount
    return None


def option_problem(option: object) -> Optional[str]:
    if not isinstance(option, str) or not option.startswith("-") or CONTROL.search(option):
        return "expected an option of the runtime (\"--cap-add=SYS_PTRACE\"), got %r" % (option,)
    return None


def spec_problem(spec: ContainerSpec) -> Optional[str]:
    """The first thing wrong in ``spec`` (None when nothing is)."""
    if spec.runtime not in RUNTIME_CHOICES:
        return "runtime %r: expected one of %s" % (spec.runtime, ", ".join(RUNTIME_CHOICES))
    if spec.pull not in PULL_CHOICES:
        return "pull %r: expected one of %s" % (spec.pull, ", ".join(PULL_CHOICES))
    for problem in (image_problem(spec.image), *map(mount_problem, spec.mounts), *map(option_problem, spec.options)):
        if problem:
            return problem
    if spec.name and not re.match(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z", spec.name):
        return "name %r: letters, digits, '_', '.' and '-' only" % spec.name
    return None


def container_name(run_id: str, node: str) -> str:
    """The run's container on ``node``: the run id makes it the run's own (two runs, or two
    users, on one node never share one), the node name a sibling's on a shared host."""
    return NAME_PREFIX + run_id + "-" + re.sub(r"[^A-Za-z0-9_.-]", "-", node)


# ------------------------------------------------------------------ on the node

def resolve_runtime(runtime: str, which: Callable[[str], Optional[str]] = shutil.which) -> Optional[str]:
    """The runtime's command on this node: itself when installed, the first of RUNTIMES
    installed for "auto"; None when there is none."""
    for candidate in (RUNTIMES if runtime == "auto" else (runtime,)):
        if which(candidate):
            return candidate
    return None


class Identity(NamedTuple):
    """Who runs the job on the node, and what the node has."""

    user: str
    """``UID:GID``: the container's processes run as the user, so the files they write are the user's."""
    rootless: bool
    """Not root: rootless podman maps the user's own uid into the container (``keep-id``)."""
    gpus: bool
    """NVIDIA devices are there (``/dev/nvidiactl``)."""


def node_identity() -> Identity:
    uid = os.getuid()
    return Identity("%d:%d" % (uid, os.getgid()), uid != 0, os.path.exists("/dev/nvidiactl"))


def _mount_words(flag: str, mounts: Sequence[str]) -> List[str]:
    words: List[str] = []
    for mount in mounts:
        words += [flag, mount]
    return words


def _same_path_mounts(paths: Sequence[str], seen: Sequence[str]) -> List[str]:
    """Each path mounted at itself, once, unless a given mount already ends there."""
    targets = {mount.split(":")[1] if ":" in mount else mount for mount in seen}
    unique: List[str] = []
    for path in paths:
        if path and path not in targets and path + ":" + path not in unique:
            unique.append(path + ":" + path)
    return unique


def run_argv(spec: ContainerSpec, runtime: str, argv: Sequence[str], env_names: Sequence[str], workdir: str,
             identity: Identity, binds: Sequence[str] = (), mount_workdir: bool = True,
             named: bool = True) -> List[str]:
    """The command that runs ``argv`` in ``spec``'s image with ``runtime`` (resolved, not
    "auto"), in ``workdir`` (mounted at itself unless ``mount_workdir`` is false, as are
    ``binds``: torchrun's log directory), with the variables ``env_names`` taken from the
    runtime's own environment. ``named`` false: a throwaway container, no ``--name``
    (``--rm`` removes it)."""
    gpus = identity.gpus if spec.gpus is None else spec.gpus
    own = _same_path_mounts([workdir, *binds] if mount_workdir else list(binds), spec.mounts)
    mounts = own + list(spec.mounts)
    names = sorted(set(env_names))
    kind = RUNTIME.get(runtime)
    if kind is None:
        raise ValueError("not a container runtime: %r" % runtime)
    passed = []  # type: List[str]
    if kind.env_flag is not None:
        for name in names:
            passed += [kind.env_flag, name]
    if kind.oci:
        words = [runtime, "run", "--rm"] + (["--name", spec.name] if named else [])
        if kind.replaces and spec.name and named:
            # A container of this run's own name left by an attempt whose node died (its
            # supervisor with it) would refuse the name when the node is back in a later
            # attempt: podman replaces it (docker has no --replace: the supervisor removes it).
            words.append("--replace")
        words += ["--label", LABEL + "=" + spec.run_id, "--pull", spec.pull, "--network", "host", "--ipc", "host"]
        if kind.keep_id and identity.rootless:
            # rootless podman: the user's uid inside is mapped to the user's uid outside
            words += ["--userns", "keep-id"]
        else:
            words += ["--user", identity.user]
        if gpus:
            words += list(kind.gpu_words)
        words += _mount_words(kind.mount_flag, mounts) + [str(kind.workdir_flag), workdir] + passed
        return words + list(spec.options) + [spec.image] + list(argv)
    if kind.workdir_flag is not None:
        # apptainer: the host's environment (the job's variables included) passes in by default
        words = [runtime, "exec"] + (list(kind.gpu_words) if gpus else [])
        words += _mount_words(kind.mount_flag, mounts) + [kind.workdir_flag, workdir] + passed
        return words + list(spec.options) + [spec.image] + list(argv)
    # enroot: no working-directory option, a POSIX shell in the image changes into it
    words = [runtime, "start"] + _mount_words(kind.mount_flag, mounts) + passed
    if gpus:
        words += list(kind.gpu_words)
    return words + list(spec.options) + [spec.image, "sh", "-c", ENROOT_CD, "sh", workdir] + list(argv)


def remove_argv(runtime: str, name: str) -> Optional[List[str]]:
    """What removes the run's container (stopped or not; gone already is fine); None for
    runtimes whose container is the job's own process tree (apptainer, enroot)."""
    kind = RUNTIME.get(runtime)
    return None if kind is None else kind.remove_argv(name)

