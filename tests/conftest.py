"""The whole suite's settings: which tests a run of ``scripts/test`` takes in each of its
phases, and how the cluster tests are shared between pytest-xdist workers.

``--phase`` (``scripts/test`` passes it; a plain ``pytest`` runs every phase at once):

* ``unit``: every test not marked ``cluster`` (no root needed), on four workers (``-n 4``).
* ``cluster``: the cluster tests not marked ``serial``, on three workers with ``--dist
  loadgroup``. Every test of one module is in one group (the module's name), so a
  module-scoped cluster is built once, on one worker (an ``xdist_group`` mark of a test's
  own takes its place).
* ``serial``: the cluster tests marked ``serial``, one at a time on one worker.
  They measure time or CPU (node-loss detection, the terminal's rates, bandwidth and MTU,
  the straggler, scale, the checks' and the hang watch's budgets of seconds): another
  cluster test beside them at the same weight would bend what they see. ``scripts/test``
  runs them after the cluster phase (with ``TORCHHERD_TEST_AT_ONCE=1``, beside it, the
  cluster phase in a CPU cgroup that weighs a quarter of theirs: docs/testing.md). A module split between the phases builds its
  module-scoped cluster once in each.

The shared fakes and builders are in ``tests/support`` (pytest's ``pythonpath`` in
pyproject.toml puts tests/ and tests/cluster on ``sys.path``), never in a test module: no
test module imports another (tests/unit/test_suite_marks.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

PHASES = ("unit", "cluster", "serial")
# The cluster phase's modules, longest first (measured: docs/testing.md). Each worker takes
# the next module when it is almost done with its last (scripts/test passes
# --no-loadscope-reorder, so this order holds): longest first leaves no long module to
# start near the end while the other workers idle. Modules not named here come last.
LONGEST_FIRST = ("test_slurm", "test_containers", "test_run_recovery", "test_detach_retries", "test_check",
                 "test_detach", "test_run", "test_localhost_without_sshd", "test_uv_project", "test_ssh_topologies",
                 "test_api", "test_ssh_aliases", "test_one_command", "test_run_report", "test_local_cluster",
                 "test_slurm_containers", "test_getting_started", "test_ssh_host_keys", "test_run_scripts",
                 "test_transport")
# The unit tests that take longest (wall time: most wait on processes they start) first, two
# at a time to each worker as it asks (scripts/test passes --maxschedchunk 2). Measured (runs
# 65-67), test_warm_start's rendezvous test took 46-53 s and started about 100 s in: the unit
# phase ran on a minute after the other workers had finished. Tests of modules not named here
# keep their order, after these.
UNIT_LONGEST_FIRST = ("test_warm_start", "test_supervisor", "test_fuzz", "test_detached_supervisor",
                      "test_offline_project", "test_one_box", "test_shared_nodes", "test_engine",
                      "test_torch_imports", "test_ddp_demo")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--phase", choices=PHASES, default=None,
                     help="run only this phase of scripts/test: unit, cluster (not serial) or serial")


def _longest_first(item: pytest.Item, order: tuple[str, ...] = LONGEST_FIRST) -> int:
    name = item.module.__name__ if item.module else ""
    return order.index(name) if name in order else len(order)


def phase_of(item: pytest.Item) -> str:
    if item.get_closest_marker("cluster") is None:
        return "unit"
    return "serial" if item.get_closest_marker("serial") is not None else "cluster"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (its hook has no order)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    phase = config.getoption("phase")
    if phase is not None:
        kept = [item for item in items if phase_of(item) == phase]
        dropped = [item for item in items if phase_of(item) != phase]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    if phase == "cluster":
        items.sort(key=_longest_first)  # stable: a module's tests stay together, in their order
    elif phase == "unit":
        items.sort(key=lambda item: _longest_first(item, UNIT_LONGEST_FIRST))
    for item in items:
        if item.get_closest_marker("cluster") is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__ if item.module else item.nodeid))


CPU_ACCOUNTING = Path("/sys/fs/cgroup/cpuacct")
"""cgroup v1's CPU accounting hierarchy (apart from the ``cpu`` one that ``scripts/test``
weighs its phases with)."""
_CPU_GROUP = pytest.StashKey[Path]()
_CPU_AT_START = pytest.StashKey[float]()


def pytest_configure(config: pytest.Config) -> None:
    """With ``TORCHHERD_TEST_CPU=1`` (``scripts/test`` sets it), this pytest process (an
    xdist worker, or a run without workers) moves into a CPU accounting group of its own,
    where every process it starts then is (the local cluster's sshd, and what they start),
    so that each test's CPU seconds can be read: the group's usage when it ends less when it
    started (a process a test left running counts in the next). Nothing where cgroup v1's
    cpuacct is not writable."""
    if os.environ.get("TORCHHERD_TEST_CPU") != "1":
        return
    for stale in CPU_ACCOUNTING.glob("torchherd-test-cpu-*"):  # of a pytest process gone (killed)
        if not Path(f"/proc/{stale.name.rsplit('-', 1)[1]}").exists():
            with contextlib.suppress(OSError):
                stale.rmdir()  # only an empty group goes
    group = CPU_ACCOUNTING / f"torchherd-test-cpu-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
    except OSError:
        return
    config.stash[_CPU_GROUP] = group


def pytest_unconfigure(config: pytest.Config) -> None:
    """This process out of its accounting group, and the group removed once the last process
    of it has ended (a cluster's processes may take seconds to go after its teardown)."""
    group = config.stash.get(_CPU_GROUP, None)
    if group is None:
        return
    with contextlib.suppress(OSError):
        (CPU_ACCOUNTING / "cgroup.procs").write_text(f"{os.getpid()}\n")
    deadline = time.monotonic() + 10
    while True:
        try:
            group.rmdir()
            return
        except OSError:  # a process of it left: the leftover checks name those, the next run removes it
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)


def _cpu_seconds(config: pytest.Config) -> float | None:
    group = config.stash.get(_CPU_GROUP, None)
    try:
        return int((group / "cpuacct.usage").read_text()) / 1e9 if group is not None else None
    except (OSError, ValueError):
        return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """When each test started and on which worker, as properties in the JUnit XML that
    ``scripts/test`` keeps: ``scripts/test-durations --workers`` draws each worker's busy
    and idle time from them (the test's end: its start plus the time JUnit gives it)."""
    item.user_properties.append(("started", f"{time.time():.3f}"))
    item.user_properties.append(("worker", os.environ.get("PYTEST_XDIST_WORKER", "main")))
    used = _cpu_seconds(item.config)
    if used is not None:
        item.stash[_CPU_AT_START] = used


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """The test's CPU seconds (its processes', setup and teardown included), before its
    teardown report is made: JUnit takes a test's properties from that report."""
    yield
    used, start = _cpu_seconds(item.config), item.stash.get(_CPU_AT_START, None)
    if used is not None and start is not None:
        item.user_properties.append(("cpu", f"{used - start:.2f}"))


@pytest.fixture(scope="session", autouse=True)
def _private_history(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What a test's runs and checks keep on this machine (the run history, the measured
    links, the imports of torch a preflight reuses) goes to the session's own state
    directory, never the user's; one test's never changes what another sees beyond its
    session (the cluster tests' ``state_home`` gives a test its own)."""
    saved = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("XDG_STATE_HOME", None)
        else:
            os.environ["XDG_STATE_HOME"] = saved


@pytest.fixture
def other_user() -> Iterator[str]:
    """A second local account (the cluster's nodes share this machine's /etc/passwd), removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a second local user")
    if shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("needs useradd and runuser")
    name = "th" + uuid.uuid4().hex[:10]
    subprocess.run(["useradd", "-M", "-s", "/bin/sh", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False)
