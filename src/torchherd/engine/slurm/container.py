"""A SLURM job step inside the plan's container: pyxis's ``srun --container-image`` where
the cluster has pyxis, else the container runtime on each allocated node, in the task.

Pure: shell words only. Every value from the inventory reaches the script through
``shlex.quote``; the words SLURM fills in (``$SLURMD_NODENAME``, ``$SLURM_JOB_ID``, the
task's log directory) stay double-quoted expansions.

Without pyxis the task runs the same command line the SSH supervisor would
(``remote/container.run_argv``), picked on the node for the runtime found there, the
user (root or not: rootless podman maps the user's own uid) and whether the node has
NVIDIA devices. There is no supervisor on a SLURM node: the task itself owns the
container. It starts the runtime's client in the background and waits for it, so that a
SIGTERM (``scancel``, ``--kill-on-bad-exit``) runs its trap at once, within SLURM's
``KillWait``, and the trap removes the container by its run-scoped name; so does the
task's end, whatever ended the client (a client killed before its ``--rm`` leaves the
container in the runtime's list otherwise).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

from torchherd.remote import container as containers
from torchherd.remote.container import ContainerSpec, Identity

PYXIS_FLAG = "--container-image"
"""What ``srun --help`` lists where pyxis (NVIDIA's SPANK plugin) is installed."""

PYXIS_PROBE = "srun --help 2>&1"
"""Asked on the submit host: its srun is the one the batch script's step runs with the
cluster's plugstack (pyxis's options are listed only where the plugin is loaded)."""

PYXIS_RUNTIMES = ("auto", "enroot")
"""Runtimes pyxis stands for: it is enroot, driven by SLURM. A runtime named otherwise
(``podman``, ``docker``, ``apptainer``) runs on the nodes as asked, pyxis or not."""

PYXIS_OPTION = re.compile(r"--(?:no-)?container-[a-z-]+(?:=\S+)?\Z")

NAME_VAR = "torchherd_name"
"""The task's shell variables are prefixed: a job variable of the same name (exported,
passed into the container by name) is never changed."""
_SENTINELS = {"@HOME@": '"$HOME"', "@LOGS@": '"$logs"', "@USER@": '"$(id -u):$(id -g)"',
              "@NAME@": f'"${NAME_VAR}"'}


def has_pyxis(srun_help: str) -> bool:
    """Whether ``srun --help``'s text lists pyxis's image option."""
    return re.search(r"(?m)^\s*" + re.escape(PYXIS_FLAG) + r"\b", srun_help) is not None


def uses_pyxis(spec: ContainerSpec, pyxis: bool) -> bool:
    return pyxis and spec.runtime in PYXIS_RUNTIMES


def path_word(path: str) -> str:
    """``path`` as one shell word usable anywhere in a word: a leading ``~`` becomes
    ``"$HOME"`` (tilde expansion happens at a word's start only, never after ``:``)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def _mount_word(mount: str, options_join: str = ",") -> str:
    """``SRC[:DST[:OPTIONS]]`` as a shell word, with ``~`` in either path the user's home."""
    parts = mount.split(":")
    words = [path_word(part) for part in parts[:2]]
    if len(parts) == 3:
        words.append(shlex.quote(parts[2].replace(",", options_join)))
    return ":".join(words)


def pyxis_image(image: str) -> str:
    """``image`` as pyxis takes it: enroot's ``[REGISTRY#]IMAGE[:TAG]`` URI
    (``nvcr.io/nvidia/pytorch:24.05-py3`` becomes ``nvcr.io#nvidia/pytorch:24.05-py3``); a
    squashfs file's path is kept; a ``docker://`` prefix is enroot's own default."""
    if image.startswith(("/", "./")):
        return image
    image = image.removeprefix("docker://")
    first, slash, rest = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost") and "#" not in image:
        return first + "#" + rest
    return image


def pyxis_options(spec: ContainerSpec, workdir: str, notes: list[str]) -> list[str]:
    """The step's pyxis options, as shell words: the image, the workdir mounted at itself
    and made the working directory, the run directory (where the task writes its exit
    record) mounted at itself, then ``mounts`` (pyxis joins a mount's flags with ``+``).
    ``options`` that are pyxis's own (``--container-*``) go to srun; others are another
    runtime's and are left out, with a note."""
    mounts = [f"{path_word(workdir)}:{path_word(workdir)}", '"$TORCHHERD_DIR":"$TORCHHERD_DIR"']
    mounts += [_mount_word(mount, "+") for mount in spec.mounts]
    words = [shlex.quote(f"{PYXIS_FLAG}={pyxis_image(spec.image)}"), "--container-mounts=" + ",".join(mounts),
             "--container-workdir=" + path_word(workdir)]
    kept = [option for option in spec.options if PYXIS_OPTION.match(option)]
    left = [option for option in spec.options if option not in kept]
    words += [shlex.quote(option) for option in kept]
    notes.append(f"pyxis: srun --container-image={pyxis_image(spec.image)}: each task (the cd, the setup and "
                 "torchrun) runs inside the image; pyxis removes the container when the step ends")
    if left:
        notes.append(f"pyxis: left out options that are not pyxis's: {' '.join(left)}")
    if spec.pull == "never":
        notes.append("pyxis: enroot imports the image on each node as the step starts (pull = \"never\" is "
                     "podman's and docker's)")
    return words


def _shell_word(word: str, values: Mapping[str, str]) -> str:
    """One argv word as a shell word: its literal parts quoted, each sentinel replaced by
    the shell expansion it stands for."""
    pieces = re.split("(" + "|".join(map(re.escape, values)) + ")", word)
    return "".join(values[piece] if piece in values else shlex.quote(piece) if piece else "" for piece in pieces) \
        or "''"


def node_run_command(spec: ContainerSpec, argv_words: Sequence[str], env_names: Sequence[str],
                     workdir: str) -> str:
    """The task's job inside the container with the runtime found on the node: a
    ``case`` over runtime, root or not, and NVIDIA devices or not, each arm the SSH
    supervisor's own command line (``run_argv``); the client in the background, its
    container removed by name on SIGTERM and at the end. Its status is the client's."""
    values = dict(_SENTINELS)
    values["@WORKDIR@"] = path_word(workdir)
    values["@ARGV@"] = " ".join(argv_words)
    spec = spec._replace(name="@NAME@", mounts=tuple(
        ":".join(part if index == 2 else _home_sentinel(part) for index, part in enumerate(mount.split(":")))
        for mount in spec.mounts))
    runtimes = containers.RUNTIMES if spec.runtime == "auto" else (spec.runtime,)
    arms: dict[str, list[str]] = {}
    for runtime in runtimes:
        for rootless in ((False, True) if runtime == "podman" else (False,)):
            for gpus in (False, True):
                argv = containers.run_argv(spec, runtime, ["@ARGV@"], env_names, "@WORKDIR@",
                                           Identity("@USER@", rootless, gpus), ["@LOGS@"])
                line = " ".join(values["@ARGV@"] if word == "@ARGV@" else _shell_word(word, values) for word in argv)
                pattern = f"{runtime}:{'*' if runtime != 'podman' else int(rootless)}:{int(gpus)}"
                arms.setdefault(line, []).append(pattern)
    gpus_test = {None: '[ -e /dev/nvidiactl ] && echo 1 || echo 0', True: "echo 1", False: "echo 0"}[spec.gpus]
    removal = " ".join(_remove_arms(runtimes))
    case = ['case "$torchherd_runtime:$torchherd_rootless:$torchherd_gpus" in']
    case += [f"  {'|'.join(patterns)}) {line} & ;;" for line, patterns in arms.items()]
    case.append("esac")
    return "\n".join([
        f"{NAME_VAR}={shlex.quote(containers.NAME_PREFIX + spec.run_id)}-\"$SLURMD_NODENAME-$SLURM_JOB_ID\"",
        f"torchherd_runtime=\"$(for candidate in {' '.join(runtimes)}; do command -v \"$candidate\" >/dev/null "
        '&& { echo "$candidate"; break; }; done)"',
        'if [ -z "$torchherd_runtime" ]; then echo "torchherd: no container runtime on $SLURMD_NODENAME: '
        f'{" or ".join(runtimes)} is not installed there" >&2; false; else',
        '[ "$(id -u)" = 0 ] && torchherd_rootless=0 || torchherd_rootless=1',
        f"torchherd_gpus=$({gpus_test})",
        f"torchherd_remove() {{ case \"$torchherd_runtime\" in {removal} esac; }}",
        # SIGTERM interrupts the wait below at once: the container goes within KillWait.
        "trap 'torchherd_remove; kill -TERM \"$torchherd_child\" 2>/dev/null' TERM INT HUP",
        *case,
        'torchherd_child=$!; wait "$torchherd_child"; torchherd_code=$?; trap - TERM INT HUP; torchherd_remove; '
        '(exit "$torchherd_code")',
        "fi"])


def _home_sentinel(path: str) -> str:
    return "@HOME@" + path[1:] if path == "~" or path.startswith("~/") else path


def _remove_arms(runtimes: Sequence[str]) -> list[str]:
    arms = []
    for runtime in runtimes:
        argv = containers.remove_argv(runtime, "@NAME@")
        if argv is not None:
            words = " ".join(_shell_word(word, _SENTINELS) for word in argv)
            arms.append(f"{runtime}) {words} >/dev/null 2>&1 ;;")
    return arms + ["*) ;;"]
