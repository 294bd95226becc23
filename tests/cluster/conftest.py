"""Fixtures for tests against the local multi-host test cluster (see localcluster.py).

* ``cluster``: a module-scoped 3-node cluster (node0..node2).
* ``start_cluster(n, workdir)`` (tests/support/cluster_build.py): the same for a fixture
  of another scope (call ``down()``).
* ``make_cluster``: a factory, ``make_cluster(n)`` -> a running cluster with a
  prefix of its own; every cluster it made is torn down after the test.
* ``state_home``: ``$XDG_STATE_HOME`` (the run records) in the test's own directory.
* ``runs``: starts detached runs (``Runs.detach``); every run a test started is stopped
  (its recovering controller too) and its files on the nodes removed, pass or fail.

Tests skip, with the reason, where no cluster can run (not root, no ``ip netns``).
At the end of the session a check fails the run if anything of a cluster made
here is still there (namespace, veth, bridge, sshd, torchrun).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from localcluster import (
    STATE_ROOT,
    LocalCluster,
    leftovers,
    list_clusters,
    teardown,
    unavailable_reason,
)

from support.cluster_build import (
    PREFIX_RE,
    Runs,
    made_prefixes,
    new_prefix,
    skip_unless_available,
    start_cluster,
)
from support.cluster_runs import Controller


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line(
            "markers", "timeout(seconds): fail a test that runs longer (pytest-timeout)"
        )


@pytest.fixture
def cluster_prefix() -> Callable[[], str]:
    """``cluster_prefix()``: a fresh prefix that the end-of-session leftover check
    covers (for clusters made some other way, e.g. by scripts/local-cluster)."""

    def make() -> str:
        prefix = new_prefix()
        made_prefixes.append((prefix, ()))
        return prefix

    return make


def _remove_dead_clusters() -> None:
    """Under a lock: workers that start together must not tear one cluster down twice at once."""
    STATE_ROOT.mkdir(mode=0o755, parents=True, exist_ok=True)
    with open(STATE_ROOT / ".hygiene.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for info in list_clusters():
            prefix = str(info.get("prefix", ""))
            owner = info.get("owner_pid")
            if PREFIX_RE.fullmatch(prefix) and isinstance(owner, int) and not _pid_alive(owner):
                teardown(prefix)


@pytest.fixture(scope="session", autouse=True)
def _cluster_hygiene() -> Iterator[None]:
    """Before: remove clusters of dead earlier pytest runs. After: nothing of
    ours may be left. Per process: each pytest-xdist worker checks what it made."""
    if unavailable_reason() is None:
        _remove_dead_clusters()
    yield
    problems = [item for prefix, inodes in made_prefixes for item in leftovers(prefix, inodes)]
    assert not problems, "local clusters left behind:\n" + "\n".join(problems)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three running nodes, node0..node2, for the whole test module."""
    skip_unless_available()
    created = start_cluster(3, tmp_path_factory.mktemp("cluster"))
    try:
        yield created
    finally:
        created.down()


@pytest.fixture
def make_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., LocalCluster]]:
    """``make_cluster(n, **kwargs)``: a running n-node cluster, torn down after the test."""
    created: list[LocalCluster] = []

    def factory(n: int = 2, **kwargs: object) -> LocalCluster:
        workdir = tmp_path_factory.mktemp(f"cluster{n}")
        made = start_cluster(n, workdir, **kwargs)
        created.append(made)
        return made

    try:
        yield factory
    finally:
        errors = []
        for made in reversed(created):
            try:
                made.down()
            except Exception as exc:  # keep tearing down the others
                errors.append(f"{made!r}: {exc}")
        assert not errors, "\n".join(errors)


@pytest.fixture
def state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture
def runs(state_home: Path) -> Iterator[Runs]:
    made = Runs(state_home)
    try:
        yield made
    finally:
        made.cleanup()


@pytest.fixture
def controllers() -> Iterator[Callable[..., Controller]]:
    """Starts controllers (``run --no-check`` in a process: ``support.cluster_runs.Controller``); kills
    any still running when the test ends (pass or fail)."""
    started: list[Controller] = []

    def start(cluster: LocalCluster, log_dir: Path, *args: str) -> Controller:
        started.append(Controller(cluster, log_dir, *args))
        return started[-1]

    yield start
    for controller in started:
        controller.stop()


