"""The warm interpreter (remote/zygote.py) on this machine: a real zygote process, real
forks, the client as torchrun would start it (``DIR/python -u script ARGS``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchherd.engine.ssh.warm import warmed, zygote_command, zygote_env
from torchherd.inventory import Inventory, parse
from torchherd.plan import RunOptions, build_plan
from torchherd.remote import program
from torchherd.remote.zygote import Zygote, parse_python_args, startup_differs

SCRIPT = textwrap.dedent("""\
    import os, signal, sys, time
    environ = open("/proc/self/environ", "rb").read().split(b"\\0")
    print("main", __name__, sys.argv, os.getcwd(), os.environ.get("FOO"), flush=True)
    print("own group", os.getpid() == os.getpgid(0) == os.getsid(0), flush=True)
    print("initial environ", b"FOO=" + os.environ.get("FOO", "").encode() in environ, flush=True)
    print("zygote's variable", any(item.startswith(b"ZYGOTE_ONLY=") for item in environ), flush=True)
    if sys.argv[1] == "sleep":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        print("sleeping", flush=True)
        time.sleep(60)
    if sys.argv[1] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(sys.argv[1]))
""")


class Warm:
    def __init__(self, process: subprocess.Popen[bytes], directory: str) -> None:
        self.process = process
        self.directory = directory
        self.client = os.path.join(directory, "python")

    def run(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.client, *args], cwd=cwd, env=env or client_env(), capture_output=True, text=True,
                              timeout=60)


def client_env(**extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTHON")}
    return {**env, "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "FOO": "bar", **extra}


def start_zygote(preload: list[str], env: dict[str, str] | None = None) -> Warm:
    process = subprocess.Popen([sys.executable, "-u", "-c", program("zygote.py"), "serve", *preload],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env or client_env())
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write((json.dumps({"env": {"ZYGOTE_ONLY": "1"}}) + "\n").encode())
    process.stdin.flush()
    answer = json.loads(process.stdout.readline())
    return Warm(process, answer["dir"])


def stop_zygote(warm: Warm) -> None:
    assert warm.process.stdin is not None
    warm.process.stdin.close()
    warm.process.wait(timeout=30)


@pytest.fixture(scope="module")
def warm() -> Iterator[Warm]:
    started = start_zygote(["json"])
    yield started
    stop_zygote(started)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


def test_the_private_directory_is_the_users_alone(warm: Warm) -> None:
    assert os.stat(warm.directory).st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(warm.directory, "sock")).st_mode & 0o777 == 0o600
    assert os.stat(warm.client).st_mode & 0o777 == 0o700


def test_a_forked_child_runs_the_script_as_main_with_the_clients_argv_env_cwd(warm: Warm, script: Path,
                                                                               tmp_path: Path) -> None:
    done = warm.run(["-u", str(script), "3", "x y"], tmp_path)
    assert done.returncode == 3
    assert done.stdout.splitlines() == [
        f"main __main__ ['{script}', '3', 'x y'] {tmp_path} bar",
        "own group True",
        "initial environ True",
        "zygote's variable False",
    ]
    assert "started cold" not in done.stderr


def test_a_child_looks_like_a_fresh_interpreter(warm: Warm, tmp_path: Path) -> None:
    """Its command line is the one that started it (``ps``), SIGINT raises KeyboardInterrupt,
    SIGPIPE stays ignored, and the zygote's stand-in modules are gone."""
    (tmp_path / "fresh.py").write_text(textwrap.dedent("""\
        import signal, sys
        print(open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").split(b"\\0")[1:])
        print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,
              signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN, "torchherd" in sys.modules)
    """))
    done = warm.run(["-u", str(tmp_path / "fresh.py"), "a b"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"[b'-u', b'{tmp_path / 'fresh.py'}', b'a b']", "True True False"]


def test_numpy_draws_fresh_numbers_in_each_child(tmp_path: Path) -> None:
    pytest.importorskip("numpy")
    numbers = start_zygote(["numpy.random"])
    try:
        (tmp_path / "draw.py").write_text("import numpy\nprint(numpy.random.randint(1 << 30))\n")
        draws = {numbers.run([str(tmp_path / "draw.py")], tmp_path).stdout for _ in range(3)}
        assert len(draws) == 3, draws
    finally:
        stop_zygote(numbers)


def test_a_module_runs_as_main_with_the_working_directory_on_its_path(warm: Warm, tmp_path: Path) -> None:
    (tmp_path / "mymod.py").write_text("import sys\nprint(__name__, sys.argv)\nsys.exit(4)\n")
    done = warm.run(["-m", "mymod", "a"], tmp_path)
    assert (done.returncode, done.stdout) == (4, f"__main__ ['{tmp_path / 'mymod.py'}', 'a']\n")


def test_a_module_the_zygote_preloaded_runs_as_main_without_runpys_warning(tmp_path: Path) -> None:
    """``-m torch.distributed.run`` from a zygote that imported it: a cold ``python -m`` has no
    copy of the module imported, so runpy has nothing to warn of (it did, on every warm agent)."""
    preloaded = start_zygote(["json.tool"])  # a package's module, as torch.distributed.run is
    try:
        done = subprocess.run([preloaded.client, "-m", "json.tool", "--compact"], cwd=tmp_path, env=client_env(),
                              input='{"a": [1, 2]}', capture_output=True, text=True, timeout=60)
    finally:
        stop_zygote(preloaded)
    assert (done.returncode, done.stdout, done.stderr) == (0, '{"a":[1,2]}\n', "")


def test_the_client_relays_a_signal_and_exits_as_the_child_did(warm: Warm, script: Path, tmp_path: Path) -> None:
    client = subprocess.Popen([warm.client, "-u", str(script), "sleep"], cwd=tmp_path, env=client_env(),
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert client.stdout is not None
    while "sleeping" not in client.stdout.readline():
        pass
    os.killpg(client.pid, signal.SIGTERM)  # as torchrun's close does
    assert client.wait(timeout=30) == 7



def sleeping_client(client_path: str, script: Path, tmp_path: Path) -> subprocess.Popen[str]:
    """The script's ``sleep`` run through a zygote's client, once its child says it sleeps."""
    client = subprocess.Popen([client_path, "-u", str(script), "sleep"], cwd=tmp_path, env=client_env(),
                              stdout=subprocess.PIPE, text=True)
    assert client.stdout is not None
    while "sleeping" not in client.stdout.readline():
        pass
    return client

def test_a_child_killed_by_a_signal_kills_its_client_with_it(warm: Warm, script: Path, tmp_path: Path) -> None:
    assert warm.run(["-u", str(script), "die"], tmp_path).returncode == -signal.SIGKILL


def test_a_child_whose_client_is_killed_is_killed_by_the_zygote(warm: Warm, script: Path, tmp_path: Path) -> None:
    client = sleeping_client(warm.client, script, tmp_path)
    child = _children(warm.process.pid)
    assert len(child) == 1
    client.kill()
    client.wait()
    assert _gone(child[0])


def test_an_option_python_would_need_starts_cold_and_says_why(warm: Warm, script: Path, tmp_path: Path) -> None:
    done = warm.run(["-X", "utf8", str(script), "5"], tmp_path)
    assert done.returncode == 5
    assert done.stderr == "torchherd: started cold (python option -X)\n"
    assert "zygote's variable False" in done.stdout


def test_a_python_variable_the_zygote_did_not_start_with_starts_cold(warm: Warm, script: Path, tmp_path: Path) -> None:
    done = warm.run(["-u", str(script), "0"], tmp_path, client_env(PYTHONOPTIMIZE="1"))
    assert done.returncode == 0
    assert done.stderr == "torchherd: started cold (PYTHONOPTIMIZE differs from the warm interpreter's)\n"


def test_a_thread_in_the_zygote_makes_every_start_cold(script: Path, tmp_path: Path) -> None:
    (tmp_path / "threader.py").write_text("import threading, time\n"
                                          "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    env = client_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env["PYTHONPATH"]]))
    threaded = start_zygote(["threader"], env)
    try:
        done = threaded.run(["-u", str(script), "2"], tmp_path, env)
        assert done.returncode == 2
        assert done.stderr == "torchherd: started cold (the warm interpreter has started a thread)\n"
    finally:
        stop_zygote(threaded)


def test_cuda_initialised_in_the_zygote_refuses_to_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        zygote = Zygote("/nonexistent", listener)
        # This test's process is pytest's, whose other tests may have left threads: the
        # thread rule has its test above; here only CUDA decides.
        monkeypatch.setattr(threading, "active_count", lambda: 1)
        zygote.tasks = len(os.listdir("/proc/self/task"))
        assert zygote.unsafe() == ""
        fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
        monkeypatch.setitem(sys.modules, "torch", fake)
        assert zygote.unsafe() == "CUDA is initialised in the warm interpreter"
    finally:
        listener.close()


def test_without_a_zygote_the_client_starts_cold(script: Path, tmp_path: Path) -> None:
    gone = start_zygote(["json"])
    client = gone.client
    shutil_copy = tmp_path / "client"
    shutil_copy.mkdir()
    stop_zygote(gone)
    assert not os.path.exists(gone.directory)  # the zygote removed its directory
    # The client of a zygote gone, kept by hand: the script still runs, cold.
    (shutil_copy / "python").write_text(f"#!/bin/sh\nexec {sys.executable} -I -S {shutil_copy / 'program.py'} client "
                                        f"{sys.executable} \"$@\"\n")
    (shutil_copy / "program.py").write_text(program("zygote.py"))
    os.chmod(shutil_copy / "python", 0o700)
    done = subprocess.run([str(shutil_copy / "python"), "-u", str(script), "6"], cwd=tmp_path, env=client_env(),
                          capture_output=True, text=True, timeout=60)
    assert client.endswith("/python")
    assert done.returncode == 6
    assert done.stderr.startswith("torchherd: started cold (no warm interpreter: ")


def test_an_error_raised_while_the_jobs_traceback_prints_leaves_the_zygote_serving(tmp_path: Path) -> None:
    """torchrun's agent turns SIGTERM into an exception, which can come while its last
    traceback prints (seen in CI: node0's agent, torn down after a rank failed): the
    child exits 1 and the zygote, its directory and its other children stay."""
    broken = tmp_path / "broken.py"
    broken.write_text("import traceback\n"
                      "def interrupted(*args, **kwargs):\n"
                      "    raise KeyboardInterrupt('a signal while the traceback prints')\n"
                      "traceback.print_exc = interrupted\n"
                      "raise RuntimeError('the job failed')\n", encoding="utf-8")
    fine = tmp_path / "fine.py"
    fine.write_text("print('still warm')\n", encoding="utf-8")
    started = start_zygote(["json"])
    try:
        done = started.run(["-u", str(broken)], tmp_path)
        assert done.returncode == 1, done.stderr
        assert os.path.isdir(started.directory) and started.process.poll() is None
        again = started.run(["-u", str(fine)], tmp_path)
        assert (again.returncode, again.stdout) == (0, "still warm\n"), again.stderr
    finally:
        stop_zygote(started)


def test_the_zygote_ending_kills_what_it_forked(script: Path, tmp_path: Path) -> None:
    ending = start_zygote(["json"])
    client = sleeping_client(ending.client, script, tmp_path)
    child = _children(ending.process.pid)
    stop_zygote(ending)  # its stdin ends: SIGTERM to each child's group (the script exits 7)
    assert client.wait(timeout=30) == 7
    assert _gone(child[0])
    assert not os.path.exists(ending.directory)


@pytest.mark.parametrize(("args", "expected"), [
    (["-u", "train.py", "-x"], ({"unbuffered": True, "script": "train.py", "argv": ["train.py", "-x"]}, "")),
    (["-m", "torch.distributed.run", "--nnodes", "2"],
     ({"unbuffered": False, "module": "torch.distributed.run", "argv": ["torch.distributed.run", "--nnodes", "2"]},
      "")),
    (["--", "-odd.py"], ({"unbuffered": False, "script": "-odd.py", "argv": ["-odd.py"]}, "")),
    (["-O", "train.py"], (None, "python option -O")),
    (["-c", "pass"], (None, "python option -c")),
    ([], (None, "no script")),
    (["-"], (None, "no script")),
])
def test_python_arguments(args: list[str], expected: tuple[object, str]) -> None:
    assert parse_python_args(args) == expected


def test_startup_variables_compared_but_those_a_child_applies() -> None:
    assert startup_differs({"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "PYTHON_EXEC": "x"}, {}) == ""
    assert startup_differs({"PYTHONPATH": "/a"}, {"PYTHONPATH": "/b"}) == "PYTHONPATH differs from the warm interpreter's"
    assert startup_differs({}, {"PYTHONHOME": "/h"}) == "PYTHONHOME differs from the warm interpreter's"


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(word) for word in f.read().split()]


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    time.sleep(0.05)
                    continue
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------- the controller's side (engine.ssh.warm)


def warm_inventory(env: dict[str, str] | None = None) -> Inventory:
    document = {
        "cluster": {"master": "a", "port": 29511, "nproc_per_node": 1},
        "defaults": {"python": "/opt/venv/bin/python", "workdir": "~/proj dir", "env": env or {"NCCL_DEBUG": "WARN"}},
        "hosts": [{"name": "a", "address": "10.0.0.1"}, {"name": "b", "address": "10.0.0.2",
                                                        "setup": "source ~/venv/bin/activate"}],
    }
    return parse(document, Path("hosts.toml"))


def test_a_warm_node_starts_torchrun_and_its_ranks_through_the_client() -> None:
    plan = build_plan(warm_inventory(), RunOptions(script="train.py", script_args=("--lr", "0.1"), run_id="r1"))
    warm_plan, started = warmed(plan, {"b": "/tmp/torchherd-warm-x"})
    assert started == ("b",)
    a, b = warm_plan.nodes
    assert a == plan.nodes[0]  # no warm Python: as it was
    assert b.argv == ("/tmp/torchherd-warm-x/python", *plan.nodes[1].argv[1:])
    assert b.argv[1:3] == ("-m", "torch.distributed.run") and b.argv[-3:] == ("train.py", "--lr", "0.1")
    assert b.env == {**plan.nodes[1].env, "PYTHON_EXEC": "/tmp/torchherd-warm-x/python"}


def test_a_job_with_its_own_python_exec_keeps_it() -> None:
    plan = build_plan(warm_inventory({"PYTHON_EXEC": "/opt/mine"}), RunOptions(script="train.py", run_id="r1"))
    warm_plan, started = warmed(plan, {"a": "/tmp/w"})
    assert started == ("a",)
    assert warm_plan.nodes[0].env["PYTHON_EXEC"] == "/opt/mine"


def test_the_zygote_starts_after_the_setup_in_the_workdir_with_the_env_on_stdin() -> None:
    plan = build_plan(warm_inventory({"SECRET_TOKEN": "hunter2"}), RunOptions(script="train.py", run_id="r1"))
    line = zygote_command(plan.nodes[1])
    assert line.startswith("cd ~/'proj dir' && { source ~/venv/bin/activate\n} >&2 && exec /opt/venv/bin/python -u -c ")
    assert line.endswith(" serve torch torch.distributed.run")
    assert "hunter2" not in line
    env = zygote_env(plan.nodes[1])
    assert env["SECRET_TOKEN"] == "hunter2" and "TORCHHERD_SUPERVISOR" not in env
