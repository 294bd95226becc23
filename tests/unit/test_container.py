"""The job inside a container: the inventory's [container], --image, the exact command line per
runtime, and the supervisor's config. Apptainer and enroot are not installable on the test
machines (neither is a Debian package): their command lines are tested here only."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from torchherd.cli import main
from torchherd.errors import InventoryError, UsageError
from torchherd.inventory import parse, with_container
from torchherd.plan import RunOptions, build_plan
from torchherd.remote import container, wire
from torchherd.remote.container import ContainerSpec, Identity

SPEC = ContainerSpec(image="nvcr.io/nvidia/pytorch:24.05-py3", runtime="podman", name="torchherd-r1-node0",
                     run_id="r1", mounts=("/data:/data:ro",), options=("--cap-add=SYS_PTRACE",), gpus=None)
ARGV = ("python3", "-m", "torch.distributed.run", "--", "train.py")
ROOT = Identity("0:0", False, False)
USER = Identity("1000:1000", True, True)


def document(**container_table: object) -> dict[str, object]:
    return {"container": container_table, "defaults": {"workdir": "/work"},
            "hosts": [{"name": "node0"}, {"name": "node1", "container": {"image": "other:2", "mounts": ["/x:/y"]}}]}


def test_podman_as_root_without_gpus_is_exact() -> None:
    argv = container.run_argv(SPEC, "podman", ARGV, ["NCCL_DEBUG", "TORCHHERD_RUN_ID"], "/work", ROOT,
                              ["/tmp/torchherd-r1-node0"])
    assert argv == ["podman", "run", "--rm", "--name", "torchherd-r1-node0", "--replace", "--label", "torchherd.run=r1",
                    "--pull", "never", "--network", "host", "--ipc", "host", "--user", "0:0",
                    "-v", "/work:/work", "-v", "/tmp/torchherd-r1-node0:/tmp/torchherd-r1-node0",
                    "-v", "/data:/data:ro", "-w", "/work", "-e", "NCCL_DEBUG", "-e", "TORCHHERD_RUN_ID",
                    "--cap-add=SYS_PTRACE", "nvcr.io/nvidia/pytorch:24.05-py3", *ARGV]


def test_rootless_podman_keeps_the_users_id_and_passes_gpus_by_cdi() -> None:
    argv = container.run_argv(SPEC, "podman", ARGV, [], "/work", USER)
    assert argv[argv.index("--userns"):argv.index("--userns") + 2] == ["--userns", "keep-id"]
    assert "--user" not in argv
    assert argv[argv.index("--device") + 1] == "nvidia.com/gpu=all"


def test_docker_passes_the_user_and_gpus_all_only_when_the_ranks_use_gpus() -> None:
    with_gpus = container.run_argv(SPEC._replace(gpus=True), "docker", ARGV, [], "/work", ROOT)
    assert with_gpus[:2] == ["docker", "run"]
    assert with_gpus[with_gpus.index("--gpus") + 1] == "all"
    assert with_gpus[with_gpus.index("--user") + 1] == "0:0"
    cpu = container.run_argv(SPEC._replace(gpus=False), "docker", ARGV, [], "/work", USER)
    assert "--gpus" not in cpu and "--device" not in cpu
    assert cpu[cpu.index("--user") + 1] == "1000:1000"  # docker has no keep-id: the user's own ids


def test_apptainer_command_line_is_exact() -> None:
    argv = container.run_argv(SPEC._replace(runtime="apptainer", image="/images/torch.sif"), "apptainer", ARGV,
                              ["NCCL_DEBUG"], "/work", USER, ["/tmp/l"])
    assert argv == ["apptainer", "exec", "--nv", "--bind", "/work:/work", "--bind", "/tmp/l:/tmp/l",
                    "--bind", "/data:/data:ro", "--pwd", "/work", "--cap-add=SYS_PTRACE", "/images/torch.sif", *ARGV]


def test_enroot_command_line_is_exact() -> None:
    argv = container.run_argv(SPEC._replace(runtime="enroot", image="/images/torch.sqsh", gpus=False), "enroot",
                              ARGV, ["NCCL_DEBUG"], "/work", USER)
    assert argv == ["enroot", "start", "--mount", "/work:/work", "--mount", "/data:/data:ro", "--env", "NCCL_DEBUG",
                    "--cap-add=SYS_PTRACE", "/images/torch.sqsh", "sh", "-c", container.ENROOT_CD, "sh", "/work",
                    *ARGV]


def test_removal_is_by_the_run_scoped_name_and_only_for_oci_runtimes() -> None:
    assert container.remove_argv("podman", "torchherd-r1-node0") == ["podman", "rm", "-f", "torchherd-r1-node0"]
    assert container.remove_argv("docker", "n") == ["docker", "rm", "-f", "n"]
    assert container.remove_argv("apptainer", "n") is None
    assert container.remove_argv("enroot", "n") is None
    assert container.container_name("r1", "node0") != container.container_name("r2", "node0")
    assert container.container_name("r1", "node0") != container.container_name("r1", "node1")


def test_auto_picks_the_first_installed_runtime() -> None:
    assert container.resolve_runtime("auto", {"docker": "/usr/bin/docker"}.get) == "docker"
    assert container.resolve_runtime("auto", {"docker": "d", "podman": "p"}.get) == "podman"
    assert container.resolve_runtime("docker", {"podman": "p"}.get) is None
    assert container.resolve_runtime("auto", {}.get) is None


@pytest.mark.parametrize("image", ["x;rm -rf ~", "$(id)", "a b", "`x`", "img|x", "-rm", "", "x\n"])
def test_an_image_a_shell_would_read_more_into_is_refused(image: str) -> None:
    assert container.image_problem(image)


@pytest.mark.parametrize("image", ["pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime", "localhost/th:1",
                                   "nvcr.io/nvidia/pytorch@sha256:" + "a" * 64, "/images/t.sif", "docker://x/y:1"])
def test_image_references_pass(image: str) -> None:
    assert container.image_problem(image) is None


def test_inventory_container_table_and_host_override() -> None:
    inventory = parse(document(image="img:1", runtime="podman", mounts=["/usr:/usr:ro"]), Path("h.toml"))
    first, second = inventory.hosts
    assert first.container is not None and second.container is not None
    assert (first.container.image, first.container.runtime, first.container.mounts) == ("img:1", "podman",
                                                                                       ("/usr:/usr:ro",))
    assert (second.container.image, second.container.runtime, second.container.mounts) == ("other:2", "podman",
                                                                                          ("/x:/y",))
    assert parse({"hosts": [{"name": "a"}]}, Path("h.toml")).hosts[0].container is None


@pytest.mark.parametrize(("table", "named"), [
    ({"image": "x;y"}, "[container].image"),
    ({"image": "x", "runtime": "dockr"}, "[container].runtime"),
    ({"image": "x", "mounts": ["data:/data"]}, "[container].mounts"),
    ({"image": "x", "options": ["cap-add"]}, "[container].options"),
    ({"image": "x", "imag": "y"}, "[container].imag"),
])
def test_bad_container_keys_name_the_file_and_key(table: dict[str, object], named: str) -> None:
    with pytest.raises(InventoryError) as error:
        parse({"container": table, "hosts": [{"name": "a"}]}, Path("h.toml"))
    assert str(error.value).startswith(f"h.toml: {named}: ")
    assert "\n" not in str(error.value)


def test_a_host_container_without_any_image_is_refused() -> None:
    with pytest.raises(InventoryError, match=r"hosts\[0\]\.container: no image"):
        parse({"hosts": [{"name": "a", "container": {"runtime": "podman"}}]}, Path("h.toml"))


def test_flags_override_every_host_and_name_the_flag() -> None:
    inventory = parse(document(image="img:1"), Path("h.toml"))
    changed = with_container(inventory, {"image": "new:3", "runtime": "docker"})
    assert {(host.container.image, host.container.runtime) for host in changed.hosts if host.container} == {
        ("new:3", "docker")}
    with pytest.raises(InventoryError, match=r"^--image: 'a&b' is not an image name"):
        with_container(inventory, {"image": "a&b"})
    with pytest.raises(InventoryError, match=r"^--container-runtime: expected one of"):
        with_container(inventory, {"runtime": "lxc"})


@pytest.mark.parametrize(("flags", "named"), [(["--image", "x;rm"], "--image"),
                                              (["--image", "x", "--container-runtime", "lxc"], "--container-runtime")])
def test_cli_bad_image_or_runtime_exits_2_with_one_line(flags: list[str], named: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    inventory = tmp_path / "hosts.toml"
    inventory.write_text('[[hosts]]\nname = "a"\n')
    code = main(["run", "-i", str(inventory), "--dry-run", *flags, "--", "train.py"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: {named}: ")
    assert "Traceback" not in err


def test_plan_names_the_container_after_the_run_and_node_and_ships_it_to_the_supervisor() -> None:
    from torchherd.engine.ssh.job import supervisor_config

    plan = build_plan(parse(document(image="img:1", runtime="podman"), Path("h.toml")),
                      RunOptions(script="train.py", run_id="r7", nproc_per_node="cpu"))
    node = plan.nodes[1]
    assert node.container is not None
    assert (node.container.name, node.container.run_id, node.container.gpus) == ("torchherd-r7-node1", "r7", False)
    config = wire.SupervisorConfig.from_json(supervisor_config(node, "r7", 5.0).to_json())
    assert config.container == node.container
    line = node.shell_line()
    words = shlex.split(line.split(" && ", 1)[1])
    assert words[words.index("podman"):words.index("podman") + 2] == ["podman", "run"]
    assert '"$(id -u):$(id -g)"' in line


def test_supervisor_refuses_a_config_whose_container_is_bad() -> None:
    raw = wire.SupervisorConfig(run_id="r1", argv=("x",), container=SPEC).to_json()
    with pytest.raises(wire.ConfigError, match="container"):
        wire.SupervisorConfig.from_json(raw.replace("nvcr.io", "$(id)"))


def test_a_bad_image_through_the_api_is_a_usage_error() -> None:
    from torchherd import Cluster

    with pytest.raises(UsageError, match="image"):
        Cluster(hosts=["a"], container={"image": "x y"})
    cluster = Cluster(hosts=["a"], container={"image": "img:1", "runtime": "docker"})
    assert cluster.inventory.hosts[0].container is not None
    assert cluster.with_container("img:2").inventory.hosts[0].container.image == "img:2"  # type: ignore[union-attr]


def observed_with(containers: dict[str, dict[str, object]], hosts: int = 3, pull: str = "never",
                  nproc: int | str | None = None) -> object:
    from torchherd.checks.model import NodeFacts, Observed

    inventory = parse({"container": {"image": "img:1", "runtime": "auto", "pull": pull},
                       "hosts": [{"name": f"n{index}"} for index in range(hosts)]}, Path("h.toml"))
    observed = Observed(inventory=inventory, master_target="n0", nproc_per_node=nproc)
    observed.facts.update({host.name: NodeFacts(raw={}, sent=0.0, received=0.0) for host in inventory.hosts})
    observed.containers.update({name: dict(found) for name, found in containers.items()})
    return observed


VERSIONS = {"python": "3.11.7", "torch": "2.13.0", "cuda": "12.4", "nccl": "2.21.5"}


def container_results(containers: dict[str, dict[str, object]]) -> dict[str, tuple[str, str]]:
    from torchherd.checks.analysis import container as analysis

    return {result.node: (result.status, result.summary)
            for result in analysis.analyse(observed_with(containers))}  # type: ignore[arg-type]


def test_analysis_names_only_the_node_whose_image_differs_with_both_ids() -> None:
    same = {"runtime": "podman", "id": "sha256:" + "a" * 64, "versions": VERSIONS}
    found = container_results({"n0": same, "n1": {**same, "id": "sha256:" + "b" * 64}, "n2": same})
    assert [node for node, (status, _) in found.items() if status == "fail"] == ["n1"]
    assert found["n1"][1] == (f"image img:1 on n1 is sha256:{'b' * 64}, on n0 it is sha256:{'a' * 64}: "
                              "two images under one name")
    assert found["n0"][1] == ("podman, image img:1 aaaaaaaaaaaa; inside: python 3.11.7, torch 2.13.0, CUDA 12.4, "
                              "NCCL 2.21.5")


def test_analysis_never_calls_a_missing_runtime_or_image_a_mismatch() -> None:
    same = {"runtime": "docker", "id": "sha256:" + "a" * 64, "versions": VERSIONS}
    found = container_results({
        "n0": {"runtime-missing": ""},
        "n1": {"runtime": "docker", "image-error": "Error: No such image: img:1"},
        "n2": same,
    })
    assert found["n0"] == ("fail", "none of podman, docker, apptainer, enroot is installed on n0 (not on PATH)")
    assert found["n1"][0] == "fail" and found["n1"][1].startswith("image img:1 is not on n1")
    assert found["n2"][0] == "pass"


def test_analysis_tells_a_runtime_that_refuses_the_user_from_a_missing_image() -> None:
    found = container_results({"n0": {"runtime": "docker", "image-error": "permission denied while trying to "
                                       "connect to the Docker daemon socket at unix:///var/run/docker.sock"},
                               "n1": {"runtime": "podman", "id": "x", "versions-error": "127 exec: python3: not found"},
                               "n2": {"runtime": "podman", "id": "x", "versions": {"python": "3.11.7",
                                                                                    "torch_error": "ImportError: x"}}})
    assert found["n0"][1].startswith("docker on n0 does not answer this user: permission denied")
    assert found["n1"][1].startswith("python3 does not run in image img:1 on n1")
    assert found["n2"][1] == "python3 in image img:1 on n2 cannot import torch: ImportError: x"


def test_check_command_quotes_the_image_and_resolves_the_runtime_on_the_node() -> None:
    from torchherd.checks.container import node_command
    from torchherd.checks.container import parse as parse_facts

    inventory = parse({"container": {"image": "img:1", "runtime": "podman", "mounts": ["/usr:/usr:ro"]},
                       "hosts": [{"name": "a"}]}, Path("h.toml"))
    command = node_command(inventory.hosts[0])
    assert "for r in podman; do" in command
    assert "image inspect --format '{{.Id}}' img:1" in command
    assert '--user "$(id -u):$(id -g)"' in command
    assert parse_facts('runtime podman\nid abc\nversions {"python": "3.11.7"}\n') == {
        "runtime": "podman", "id": "abc", "versions": {"python": "3.11.7"}}


def test_the_check_starts_in_the_images_root_with_no_node_directory_mounted_for_it() -> None:
    """Security review 4, H1: ``python -c`` puts its start directory first on sys.path, so
    the check must not start in (or mount) the node's /tmp, where another user can leave a
    json.py; the program's first line drops the start directory anyway."""
    from torchherd.checks import gpudiag
    from torchherd.checks.container import VERSIONS, node_command

    for runtime in ("podman", "docker", "apptainer", "enroot"):
        inventory = parse({"container": {"image": "img:1", "runtime": runtime}, "hosts": [{"name": "a"}]},
                          Path("h.toml"))
        command = node_command(inventory.hosts[0])
        assert "/tmp" not in command, runtime
        assert ("-w /" in command or "--pwd /" in command or "sh / " in command), (runtime, command)
    assert VERSIONS.splitlines()[0] == "import sys; sys.path[:] = [path for path in sys.path if path]"
    host = parse({"hosts": [{"name": "a", "python": "/opt/py/bin/python"}]}, Path("h.toml")).hosts[0]
    assert gpudiag.node_command(host).startswith("/opt/py/bin/python -I -S -c ")


def test_a_workdir_not_mounted_is_still_the_start_directory() -> None:
    argv = container.run_argv(SPEC, "podman", ARGV, [], "/", ROOT, mount_workdir=False)
    assert argv[argv.index("-w") + 1] == "/"
    assert "/:/" not in argv
    assert container.run_argv(SPEC, "podman", ARGV, [], "/work", ROOT).count("/work:/work") == 1


def test_slurm_runs_a_job_in_a_container_inside_it_never_outside() -> None:
    from torchherd.engine.schedulers import known
    from torchherd.engine.slurm.batch import batch_job
    from torchherd.engine.slurm.settings import settings_of

    inventory = parse({"cluster": {"scheduler": "slurm"}, "container": {"image": "img:1"},
                       "hosts": [{"name": "a"}, {"name": "b"}]}, Path("h.toml"), known())
    the_plan = build_plan(inventory, RunOptions(script="t.py", run_id="r1"))
    for pyxis in (False, True):
        script = batch_job(the_plan, settings_of(inventory), pyxis=pyxis).script
        assert ("--container-image=img:1" in script) is pyxis
        assert ("podman run --rm" in script) is not pyxis


def test_pull_policy_reaches_the_run_command_and_check_never_pulls() -> None:
    from torchherd.checks.container import node_command

    for policy in ("missing", "always", "never"):
        argv = container.run_argv(SPEC._replace(pull=policy), "docker", ARGV, [], "/work", ROOT)
        assert argv[argv.index("--pull") + 1] == policy
    inventory = parse({"container": {"image": "img:1", "pull": "always"}, "hosts": [{"name": "a"}]}, Path("h.toml"))
    plan = build_plan(inventory, RunOptions(script="t.py", run_id="r1"))
    # the run pulls first (engine/prepare/pull.py): the job's container itself never pulls
    assert plan.nodes[0].container is not None and plan.nodes[0].container.pull == "never"
    assert "--pull never" in plan.nodes[0].shell_line()
    assert "--pull always" not in node_command(inventory.hosts[0])
    assert "--pull never" in node_command(inventory.hosts[0])


def test_a_bad_pull_policy_names_the_flag_or_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InventoryError, match=r"^h\.toml: \[container\]\.pull: expected one of 'missing'"):
        parse({"container": {"image": "x", "pull": "sometimes"}, "hosts": [{"name": "a"}]}, Path("h.toml"))
    inventory = tmp_path / "hosts.toml"
    inventory.write_text('[[hosts]]\nname = "a"\n')
    assert main(["run", "-i", str(inventory), "--dry-run", "--image", "x", "--pull", "often", "--", "t.py"]) == 2
    assert capsys.readouterr().err.startswith("error: --pull: expected one of 'missing', 'always', 'never'")


def test_an_empty_container_flag_is_refused_not_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    """`--image "$IMAGE"` with $IMAGE unset must not quietly run on the host's Python."""
    for flag, said in (("--image", 'error: --image: expected an image name such as "nvcr.io/nvidia/pytorch:24.05-py3"'),
                       ("--container-runtime", "error: --container-runtime: expected one of 'auto', 'podman'"),
                       ("--pull", "error: --pull: expected one of 'missing', 'always', 'never'")):
        assert main(["run", "-H", "a", "--dry-run", flag, "", "--", "t.py"]) == 2, flag
        assert capsys.readouterr().err.startswith(said), flag


def test_a_missing_image_that_the_launch_will_pull_is_a_warning() -> None:
    from torchherd.checks.analysis import container as analysis

    observed = observed_with({"n0": {"runtime": "podman", "image-error": "Error: img:1: image not known"}}, hosts=1,
                             pull="missing")
    (result,) = analysis.analyse(observed)  # type: ignore[arg-type]
    assert (result.status, result.summary) == ("warn", "image img:1 is not on n0 yet: the launch pulls it "
                                               "(pull = missing); its id is compared once it is there")


# ------------------------------------------------------------------ a lost node's container


@pytest.mark.parametrize(("answer", "code", "printed"), [
    ("echo torchherd-r1-node2", 0, "removed"),
    ('echo "Error: no container with name or ID \\"torchherd-r1-node2\\" found: no such container" >&2; exit 1', 0, ""),
    ('echo "Error: No such container: torchherd-r1-node2" >&2; exit 1', 0, ""),
    ('echo "Error: cannot remove: device busy" >&2; exit 125', 1, ""),
])
def test_the_lost_nodes_removal_says_removed_only_when_there_was_one(tmp_path: Path, answer: str, code: int,
                                                                     printed: str) -> None:
    """A stand-in ``podman``, alone on PATH: the command's verdict from each answer."""
    import subprocess

    from torchherd.engine.ssh.containers import remove_command

    (tmp_path / "podman").write_text(f'#!/bin/sh\n[ "$*" = "rm -f torchherd-r1-node2" ] || exit 9\n{answer}\n')
    (tmp_path / "podman").chmod(0o755)
    done = subprocess.run(["/bin/sh", "-c", remove_command(("podman", "docker"), "torchherd-r1-node2")],
                          capture_output=True, text=True, env={"PATH": str(tmp_path)}, timeout=10)
    assert (done.returncode, done.stdout.strip()) == (code, printed), done
    if code:
        assert done.stderr.strip() == "Error: cannot remove: device busy"


def test_the_lost_containers_note_names_the_removed_and_the_command_for_the_left() -> None:
    from torchherd.console.recovery import recovery_note
    from torchherd.engine.events import LostContainers

    assert recovery_note(LostContainers(("node2",))) == (
        "the run's container removed from node2, lost in an attempt", "dim")
    assert recovery_note(LostContainers((), (("node5", "torchherd-r1-node5", "podman or docker",
                                                "not reached: timed out"),))) == (
        "node5 may still hold the run's container torchherd-r1-node5 (not reached: timed out): once it is back, "
        "run podman rm -f torchherd-r1-node5 or docker rm -f torchherd-r1-node5 there", "bold yellow")


# ------------------------------------------------------------------ the NVIDIA container toolkit

TOOLKIT_DATA = Path(__file__).resolve().parent / "data" / "nvidia-toolkit"


def toolkit_facts(runtime: str, *lines: str) -> dict[str, object]:
    """A node's facts as ``parse`` reads the check command's output: the image's id and versions,
    then the GPU lines given."""
    from torchherd.checks.container import parse as parse_facts

    text = "\n".join([*lines, f"runtime {runtime}", "id sha256:" + "a" * 64,
                      "versions " + json.dumps(VERSIONS)]) + "\n"
    return parse_facts(text)


def cdi_list() -> list[str]:
    return ["cdi-device " + line for line in (TOOLKIT_DATA / "nvidia-ctk-1.17-cdi-list.txt").read_text().splitlines()]


def docker_runtimes(name: str) -> str:
    return "docker-runtimes " + (TOOLKIT_DATA / f"docker-info-runtimes-{name}.json").read_text().strip()


def test_the_check_command_reads_cdi_specs_as_grep_finds_their_kind(tmp_path: Path) -> None:
    """The command's CDI scan, run by sh over a copy of a real spec (the node's /etc/cdi is
    the machine's own: not written by a test), and its lines parsed."""
    import subprocess

    from torchherd.checks.container import node_command
    from torchherd.checks.container import parse as parse_facts

    inventory = parse({"container": {"image": "img:1"}, "hosts": [{"name": "a"}]}, Path("h.toml"))
    command = node_command(inventory.hosts[0])
    start, end = command.index("for f in /etc/cdi"), command.index("done", command.index("for f in /etc/cdi")) + 4
    scan = command[start:end].replace("/etc/cdi/", f"{tmp_path}/etc/").replace("/var/run/cdi/", f"{tmp_path}/run/")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "nvidia.yaml").write_text((TOOLKIT_DATA / "nvidia.yaml").read_text())
    (tmp_path / "etc" / "other.json").write_text('{"cdiVersion": "0.6.0", "kind": "vendor.com/fpga", "devices": []}')
    done = subprocess.run(["/bin/sh", "-c", scan], capture_output=True, text=True, timeout=10)
    assert parse_facts(done.stdout)["cdi-specs"] == [(f"{tmp_path}/etc/nvidia.yaml", "nvidia.com/gpu"),
                                                      (f"{tmp_path}/etc/other.json", "vendor.com/fpga")]


@pytest.mark.parametrize(("runtime", "lines", "status", "summary_end", "fix"), [
    ("podman", ["nvidia-ctk /usr/bin/nvidia-ctk", *cdi_list()], "pass",
     "; GPUs passed in through nvidia.com/gpu=all", ""),
    ("podman", ["cdi-spec /etc/cdi/nvidia.yaml kind: nvidia.com/gpu"], "pass",
     "; GPUs passed in through CDI spec /etc/cdi/nvidia.yaml", ""),
    ("podman", ["nvidia-ctk /usr/bin/nvidia-ctk"], "fail",
     "podman on n0 cannot pass the GPUs in: no CDI device nvidia.com/gpu=all (nvidia-ctk cdi list; /etc/cdi, "
     "/var/run/cdi)", "sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml there (again after a driver upgrade)"),
    ("podman", [], "fail",
     "podman on n0 cannot pass the GPUs in: the NVIDIA container toolkit is not installed (no nvidia-ctk, no CDI "
     "spec of nvidia.com/gpu in /etc/cdi or /var/run/cdi)",
     "install nvidia-container-toolkit there, then sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml there "
     "(again after a driver upgrade)"),
    ("docker", [docker_runtimes("nvidia")], "pass", "; GPUs passed in through the nvidia runtime", ""),
    ("docker", [docker_runtimes("plain"), "nvidia-hook yes"], "pass",
     "; GPUs passed in through nvidia-container-runtime-hook", ""),
    ("docker", [docker_runtimes("plain")], "fail",
     "docker on n0 cannot pass the GPUs in (--gpus all): no nvidia runtime in docker info, no "
     "nvidia-container-runtime-hook on PATH",
     "install nvidia-container-toolkit there, then sudo nvidia-ctk runtime configure --runtime=docker there and "
     "restart docker"),
], ids=["podman-cdi-list", "podman-cdi-file", "podman-ctk-no-spec", "podman-nothing", "docker-nvidia-runtime",
        "docker-hook", "docker-nothing"])
def test_gpu_ranks_need_the_toolkit_of_their_runtime(runtime: str, lines: list[str], status: str, summary_end: str,
                                                     fix: str) -> None:
    from torchherd.checks.analysis import container as analysis

    (result,) = analysis.analyse(observed_with({"n0": toolkit_facts(runtime, *lines)}, hosts=1,  # type: ignore[arg-type]
                                               nproc="gpu"))
    assert (result.status, result.fix) == (status, fix), result
    assert result.summary.endswith(summary_end) if status == "pass" else result.summary == summary_end


def test_the_toolkit_is_asked_for_only_where_the_ranks_use_gpus() -> None:
    from torchherd.checks.analysis import container as analysis

    bare = toolkit_facts("podman", "gpus no")
    with_devices = toolkit_facts("podman", "gpus yes")
    assert [r.status for r in analysis.analyse(observed_with({"n0": bare}, hosts=1, nproc=2))] == ["pass"]  # type: ignore[arg-type]
    assert [r.status for r in analysis.analyse(observed_with({"n0": with_devices}, hosts=1, nproc=2))] == ["fail"]  # type: ignore[arg-type]
    assert [r.status for r in analysis.analyse(observed_with({"n0": with_devices}, hosts=1, nproc="cpu"))] == ["pass"]  # type: ignore[arg-type]


def test_each_runtime_is_one_entry_of_the_table() -> None:
    """What torchherd does differently per runtime is read from its ``Runtime`` entry, never
    from its name: the lists ``auto`` tries and the OCI ones follow from the table."""
    assert container.RUNTIMES == ("podman", "docker", "apptainer", "enroot")
    assert container.OCI_RUNTIMES == ("podman", "docker")
    assert all(name == entry.name for name, entry in container.RUNTIME.items())
    docker, podman, apptainer = (container.RUNTIME[name] for name in ("docker", "podman", "apptainer"))
    assert docker.remove_argv("torchherd-r-n0") == ["docker", "rm", "-f", "torchherd-r-n0"]
    assert podman.remove_argv("") is None and apptainer.remove_argv("torchherd-r-n0") is None
    assert podman.inspect_argv("img:1") == ["podman", "image", "inspect", "--format", "{{.Id}}", "img:1"]
    assert docker.load_argv("/tmp/a.tar") == ["docker", "load", "-i", "/tmp/a.tar"]
    assert docker.pull_argv("img:1") == ["docker", "pull", "img:1"]
    assert [entry.name for entry in container.RUNTIME.values() if entry.replaces] == ["podman"]
    assert [entry.name for entry in container.RUNTIME.values() if entry.keep_id] == ["podman"]
    assert all(entry.usable_fix for entry in container.RUNTIME.values() if entry.oci)
