"""``container``: on every node whose job runs in an image, the runtime is installed and answers
this user, the image is there, its id is the master's (the same bytes on every node, not
only the same tag), and Python and torch run inside it (their versions read there)."""

from __future__ import annotations

from typing import Any

from torchherd.checks.model import Observed
from torchherd.checks.results import CheckResult
from torchherd.inventory import Host
from torchherd.remote.container import OCI_RUNTIMES, RUNTIME, RUNTIMES
from torchherd.words import count

CHECK = "container"
UNUSABLE = ("permission denied", "cannot connect to the docker daemon", "is the docker daemon running",
            "connect: no such file", "cannot re-exec", "newuidmap", "no subuid ranges")
"""What a runtime says when it is there but will not serve this user."""


WOULD_LOAD = "--image-archive would load it"


def short(image_id: str) -> str:
    return plain(image_id)[:12]


def plain(image_id: str) -> str:
    """An id as podman says it (docker adds ``sha256:``)."""
    return image_id.removeprefix("sha256:")


def analyse(observed: Observed) -> list[CheckResult]:
    hosts = [host for host in observed.inventory.hosts if host.container is not None]
    results = []
    reference = _reference(observed, hosts)
    for host in hosts:
        missing = observed.missing(host.name)
        if missing is not None:
            results.append(CheckResult(host.name, CHECK, "skip", missing))
            continue
        facts = observed.containers.get(host.name)
        result = _node(host, facts or {"error": "no answer"}, reference)
        if result.status == "pass" and uses_gpus(observed.nproc_of(host), facts or {}):
            result = _gpus(host, facts or {}, result)
        results.append(result)
    return results + _would_load(hosts, results)


def _would_load(hosts: list[Host], results: list[CheckResult]) -> list[CheckResult]:
    """One line for the cluster per image an archive would load: on how many nodes."""
    marked = {result.node for result in results if WOULD_LOAD in result.summary}
    counted: dict[str, int] = {}
    for host in hosts:
        if host.name in marked and host.container is not None:
            counted[host.container.image] = counted.get(host.container.image, 0) + 1
    return [CheckResult("cluster", CHECK, "warn", f"image {image} missing on {count(number, 'node')}; {WOULD_LOAD}")
            for image, number in counted.items()]


def uses_gpus(nproc: int | str, facts: dict[str, Any]) -> bool:
    """The ranks use the GPUs, as the launch decides it (plan's ``_container``): nproc "gpu"
    always, "cpu" never, otherwise where the node has NVIDIA devices."""
    return nproc == "gpu" or (nproc != "cpu" and facts.get("gpus") == "yes")


CDI_FIX = "sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml there (again after a driver upgrade)"
TOOLKIT = "install nvidia-container-toolkit there"


def _gpus(host: Host, facts: dict[str, Any], passed: CheckResult) -> CheckResult:
    """The runtime can pass the GPUs in: podman through CDI (a spec of kind nvidia.com/gpu,
    which ``--device nvidia.com/gpu=all`` names), docker through the NVIDIA runtime or its
    hook (``--gpus all``). Apptainer's ``--nv`` needs only the driver on the host, and
    enroot's hooks are not looked at: both pass as they are."""
    runtime = str(facts.get("runtime", ""))
    ctk = facts.get("nvidia-ctk")
    kind = RUNTIME.get(runtime)
    setup = None if kind is None else kind.gpu_setup
    if setup == "cdi":
        devices = [str(device) for device in facts.get("cdi-devices", [])]
        specs = [path for path, kind in facts.get("cdi-specs", []) if kind == "nvidia.com/gpu"]
        if "nvidia.com/gpu=all" in devices or (not devices and specs):
            where = "nvidia.com/gpu=all" if devices else f"CDI spec {specs[0]}"
            return CheckResult(host.name, CHECK, "pass", f"{passed.summary}; GPUs passed in through {where}")
        if ctk:
            return CheckResult(host.name, CHECK, "fail", f"{runtime} on {host.name} cannot pass the GPUs in: no CDI "
                               "device nvidia.com/gpu=all (nvidia-ctk cdi list; /etc/cdi, /var/run/cdi)", CDI_FIX)
        return CheckResult(host.name, CHECK, "fail", f"{runtime} on {host.name} cannot pass the GPUs in: the NVIDIA "
                           "container toolkit is not installed (no nvidia-ctk, no CDI spec of nvidia.com/gpu in "
                           "/etc/cdi or /var/run/cdi)", f"{TOOLKIT}, then {CDI_FIX}")
    if setup == "nvidia-runtime":
        runtimes = [str(name) for name in facts.get("docker-runtimes", [])]
        if "nvidia" in runtimes or facts.get("nvidia-hook") == "yes":
            how = "the nvidia runtime" if "nvidia" in runtimes else "nvidia-container-runtime-hook"
            return CheckResult(host.name, CHECK, "pass", f"{passed.summary}; GPUs passed in through {how}")
        configure = f"sudo nvidia-ctk runtime configure --runtime={runtime} there and restart {runtime}"
        flags = " ".join(RUNTIME[runtime].gpu_words)
        return CheckResult(host.name, CHECK, "fail", f"{runtime} on {host.name} cannot pass the GPUs in ({flags}): "
                           f"no nvidia runtime in {runtime} info, no nvidia-container-runtime-hook on PATH",
                           configure if ctk else f"{TOOLKIT}, then {configure}")
    return passed


def _reference(observed: Observed, hosts: list[Host]) -> dict[str, tuple[str, str]]:
    """Per image name, the first node (the master first) that has it, and its id there. Only
    nodes whose runtime answered and that hold the image compare: a missing runtime or image
    is that node's own failure, never another node's mismatch."""
    found: dict[str, tuple[str, str]] = {}
    for host in hosts:
        facts = observed.containers.get(host.name) or {}
        if host.container is not None and host.container.archive is not None:
            # The archive is what every node will have: a node with another image under
            # the name is loaded over, not compared with the master's.
            found[host.container.image] = (host.container.archive.path, host.container.archive.image_id)
        elif facts.get("id") and host.container is not None:
            found.setdefault(host.container.image, (host.name, str(facts["id"])))
    return found


def _node(host: Host, facts: dict[str, Any], references: dict[str, tuple[str, str]]) -> CheckResult:
    settings = host.container
    assert settings is not None
    image = settings.image
    if "error" in facts:
        return CheckResult(host.name, CHECK, "fail", f"could not look at the container runtime on {host.name}: "
                           f"{facts['error']}")
    if "runtime-missing" in facts:
        wanted = f"none of {', '.join(RUNTIMES)} is" if settings.runtime == "auto" else \
            f"{settings.runtime} is not"
        return CheckResult(host.name, CHECK, "fail", f"{wanted} installed on {host.name} (not on PATH)",
                           "install the runtime there, or name the one it has: [container].runtime")
    runtime = str(facts.get("runtime", settings.runtime))
    if "image-error" in facts:
        error = str(facts["image-error"])
        if any(word in error.lower() for word in UNUSABLE):
            return CheckResult(host.name, CHECK, "fail", f"{runtime} on {host.name} does not answer this user: "
                               f"{error[:300]}", _usable_fix(runtime))
        if settings.archive is not None and runtime in OCI_RUNTIMES:
            return CheckResult(host.name, CHECK, "warn", f"image {image} is not on {host.name}: {WOULD_LOAD} "
                               f"({settings.archive.path}, {short(settings.archive.image_id)})")
        if settings.pull != "never" and runtime in OCI_RUNTIMES:
            return CheckResult(host.name, CHECK, "warn", f"image {image} is not on {host.name} yet: the launch pulls "
                               f"it (pull = {settings.pull}); its id is compared once it is there")
        return CheckResult(host.name, CHECK, "fail", f"image {image} is not on {host.name} ({runtime}: "
                           f"{error[:200]})", f"{runtime} pull {image} there, or {runtime} load an archive of it, "
                           "or run with --pull missing")
    image_id = str(facts.get("id", ""))
    first, first_id = references.get(image, (host.name, image_id))
    if plain(image_id) != plain(first_id) and settings.archive is not None:
        return CheckResult(host.name, CHECK, "warn", f"image {image} on {host.name} is {short(image_id)}, the archive's "
                           f"is {short(first_id)}: {WOULD_LOAD} over it ({settings.archive.path})")
    if plain(image_id) != plain(first_id):
        return CheckResult(host.name, CHECK, "fail",
                           f"image {image} on {host.name} is {image_id}, on {first} it is {first_id}: two images "
                           "under one name", f"pull or load {first}'s image on {host.name} (or name the image by "
                           "digest: name@sha256:...)")
    if "versions-error" in facts:
        return CheckResult(host.name, CHECK, "fail", f"{host.python} does not run in image {image} on {host.name}: "
                           f"{str(facts['versions-error'])[:300]}",
                           "set python (the interpreter inside the image) in the inventory, and mounts it needs")
    versions = facts.get("versions") or {}
    if "torch_error" in versions:
        return CheckResult(host.name, CHECK, "fail", f"{host.python} in image {image} on {host.name} cannot import "
                           f"torch: {versions['torch_error']}", "use an image with torch, or mount it in (mounts)")
    shown = (f"{runtime}, image {image} {short(image_id)}; inside: python {versions.get('python')}, torch "
             f"{versions.get('torch')}, CUDA {versions.get('cuda') or '-'}, NCCL {versions.get('nccl') or '-'}")
    return CheckResult(host.name, CHECK, "pass", shown)


def _usable_fix(runtime: str) -> str:
    kind = RUNTIME.get(runtime)
    return kind.usable_fix if kind is not None and kind.usable_fix else f"make {runtime} usable by this user"
