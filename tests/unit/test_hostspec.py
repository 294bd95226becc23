"""Hosts without an inventory file: -H, --nodelist, DeepSpeed/MPI hostfiles, --include/--exclude,
--master, and `torchherd init` (no node is contacted: nothing here opens a socket)."""

from __future__ import annotations

import json
import stat
from io import StringIO
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from support.cli import cli
from torchherd.api import Cluster
from torchherd.console import make_console
from torchherd.errors import UsageError
from torchherd.inventory import load
from torchherd.inventory.hostspec import host_items, hostfile_items, load_any, looks_like_hostfile
from torchherd.inventory.writer import ssh_config_aliases, unfilled


def test_host_items_take_user_port_and_nodesets() -> None:
    assert host_items("node0,ubuntu@node1:2222,root@gpu[01-02]:22") == [
        {"name": "node0"}, {"name": "node1", "user": "ubuntu", "ssh_port": 2222},
        {"name": "gpu01", "user": "root", "ssh_port": 22}, {"name": "gpu02", "user": "root", "ssh_port": 22}]


@pytest.mark.parametrize("text,message", [
    ("node0,,node1", "-H: empty host"),
    ("node0:ssh", "-H 'node0:ssh': 'ssh' is not an SSH port"),
    ("node0:70000", "-H 'node0:70000': '70000' is not an SSH port"),
    ("gpu[3-1]", "-H 'gpu[3-1]': [3-1]: the range 3-1 ends below its start"),
    ("node0,node0", "-H: host 'node0' is listed twice"),
    ("a@b@c", "-H 'a@b@c': expected [user@]host[:port]"),
    ("[fe80::1]", "-H '[fe80::1]': -H does not take IPv6 addresses"),
    ("no/slash", "-H 'no/slash': 'no/slash' is not a usable host name"),
    ("@node1", "-H '@node1': an empty user before '@'"),
    ("node0,@gpu[1-2]:2222", "-H '@gpu[1-2]:2222': an empty user before '@'"),
])
def test_host_item_errors_name_the_flag(text: str, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        host_items(text)
    assert str(caught.value).startswith(message)


def test_from_hosts_first_is_master_unless_told() -> None:
    cluster = Cluster.from_hosts("node0,node1,node2", python="/venv/bin/python", workdir="~/proj", nproc_per_node=2)
    assert cluster.hosts == ("node0", "node1", "node2")
    assert {host.python for host in cluster.inventory.hosts} == {"/venv/bin/python"}
    assert cluster.inventory.cluster.nproc_per_node == 2
    assert Cluster.from_hosts(["node0", "node1"], master="node1").hosts == ("node1", "node0")
    with pytest.raises(UsageError, match="--master node9: not one of the hosts given with -H"):
        Cluster.from_hosts("node0,node1", master="node9")


def test_hostfiles_of_deepspeed_openmpi_and_mpich(tmp_path: Path) -> None:
    text = "# DeepSpeed\nworker-1 slots=4\nworker-2 slots=2 max_slots=8\n\ngpu[01-02]\nmpich:3\n"
    path = tmp_path / "hostfile"
    path.write_text(text)
    assert looks_like_hostfile(path, text)
    assert [(table["name"], table.get("nproc_per_node")) for table in hostfile_items(path, text)] == [
        ("worker-1", 4), ("worker-2", 2), ("gpu01", None), ("gpu02", None), ("mpich", 3)]
    cluster = Cluster.from_file(path, python="/venv/bin/python")
    assert cluster.hosts[:2] == ("worker-1", "worker-2")
    plan = cluster.plan("train.py", run_id="r1")
    assert [node.nproc_per_node for node in plan.nodes] == [4, 2, 1, 1, 3]
    assert plan.rdzv_backend == "c10d"


@pytest.mark.parametrize("text,message", [
    ("a slots=x\n", ":1: slots=x: expected a positive integer"),
    ("a\nb gpus=2\n", ":2: gpus: unknown key"),
    ("a\na\n", ":2: host 'a' is listed twice (first on line 1)"),
    ("a slots=2\n@b slots=2\n", ":2: '@b': an empty user before '@'"),
    ("a slots = 4\nb slots = x\n", ":2: slots=x: expected a positive integer"),
    ("// PRRTE comment\na slots=2 // two\nb slotz = 2\n", ":3: slotz: unknown key"),
    ("/* a block\n   comment */\nu@a@b slots=2\n", ":3: 'u@a@b': more than one '@'"),
    ("a slots=2\nthis is bad slots=1\n", ":2: 'is': expected key=value after the host"),
])
def test_hostfile_errors_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "hostfile"
    path.write_text(text)
    with pytest.raises(UsageError) as caught:
        Cluster.from_file(path)
    assert str(caught.value).startswith(f"{path}{message}")


def test_toml_is_never_taken_for_a_hostfile(tmp_path: Path) -> None:
    text = '[[hosts]]\nname = "a"\n'
    assert not looks_like_hostfile(tmp_path / "hosts", text)
    assert not looks_like_hostfile(tmp_path / "x.toml", "a slots=2\n")


def test_include_exclude_and_master(tmp_path: Path) -> None:
    cluster = Cluster.from_hosts("gpu[01-04],cpu1")
    assert cluster.select(include="gpu[02-03],cpu*").hosts == ("gpu02", "gpu03", "cpu1")
    assert cluster.select(exclude="gpu01").hosts == ("gpu02", "gpu03", "gpu04", "cpu1")
    assert cluster.select(exclude="gpu01").inventory.cluster.master == "gpu02"
    assert cluster.select(exclude="cpu1").override(master="gpu03").hosts == ("gpu03", "gpu01", "gpu02", "gpu04")
    with pytest.raises(UsageError, match="--include gpu9: no such host") as caught:
        cluster.select(include="gpu9")
    assert "did you mean" in caught.value.hint
    with pytest.raises(UsageError, match="no host is left"):
        cluster.select(exclude="gpu*,cpu1")


def test_cli_hosts_without_an_inventory_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = cli("hosts", "-H", "root@gpu[01-02]:2222,cpu1", "--python", "/v/bin/python", "--workdir", "/w",
                    "--nproc-per-node", "2", "--master", "cpu1", "--json", cwd=tmp_path)
    out = capsys.readouterr().out
    assert code == 0, out
    rows = json.loads(out)["hosts"]
    assert [(row["name"], row["node_rank"], row["master"]) for row in rows] == [
        ("cpu1", 0, True), ("gpu01", 1, False), ("gpu02", 2, False)]
    assert {(row["python"], row["workdir"], row["nproc_per_node"]) for row in rows} == {("/v/bin/python", "/w", 2)}
    assert "2222" in rows[1]["ssh"]


def test_cli_dry_run_with_a_nodelist_and_exclude(tmp_path: Path) -> None:
    code, out = cli("run", "--nodelist", "n[1-3]", "--exclude", "n2", "--dry-run", "--", "train.py", cwd=tmp_path)
    assert code == 0, out
    assert "n1 (node_rank 0)" in out and "n3 (node_rank 1)" in out and "n2" not in out


@pytest.mark.parametrize("args,message", [
    (["run", "-H", "a", "--nodelist", "b", "--", "x.py"], "error: -H and --nodelist: give one of them"),
    (["-i", "h.toml", "run", "-H", "a", "--", "x.py"], "error: -i h.toml and -H: give the hosts one way"),
    (["check", "-H", "a,b", "--include", "c"], "error: --include c: no such host"),
    (["hosts", "-H", "gpu[1-"], "error: -H 'gpu[1-': '[' without ']'"),
])
def test_cli_usage_errors_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    code, out = cli(*args, cwd=tmp_path)
    assert code == 2
    assert out.splitlines()[0].startswith(message), out


def test_init_from_hosts_writes_a_private_commented_inventory_that_loads(tmp_path: Path) -> None:
    code, out = cli("init", "-H", "root@gpu[01-04]:2222,cpu1", "--python", "/opt/venv/bin/python", cwd=tmp_path)
    assert code == 0, out
    path = tmp_path / "hosts.toml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert 'name = "gpu[01-04]"' in text and "FILL IN" in text
    assert "wrote hosts.toml: 5 hosts" in out and "fill in: workdir, nproc_per_node" in out
    inventory = load(path)
    assert [host.name for host in inventory.hosts] == ["gpu01", "gpu02", "gpu03", "gpu04", "cpu1"]
    assert inventory.hosts[0].ssh_port == 2222 and inventory.hosts[0].python == "/opt/venv/bin/python"
    code, out = cli("init", "-H", "x", cwd=tmp_path)
    assert code == 2 and "already exists; init never overwrites" in out
    assert path.read_text() == text


def test_init_from_ssh_config(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n  User me\nHost gpu1 gpu2\n  HostName 10.0.0.1\nHost web\n")
    code, out = cli("-i", "mine.toml", "init", "--from-ssh-config", "gpu*", "--ssh-config", str(config),
                    cwd=tmp_path)
    assert code == 0, out
    inventory = load(tmp_path / "mine.toml")
    assert [host.name for host in inventory.hosts] == ["gpu1", "gpu2"]
    assert inventory.cluster.ssh_config == config  # the aliases resolve afterwards too
    assert f'ssh_config = "{config}"' in (tmp_path / "mine.toml").read_text()
    from torchherd.transport.ssh import resolve_target

    assert resolve_target(inventory.hosts[0], inventory.cluster.ssh_config).describe() == "me@10.0.0.1"
    assert "then: torchherd -i mine.toml hosts; torchherd -i mine.toml check -- train.py" in out.splitlines()
    assert ssh_config_aliases(config.read_text(), "*") == ["gpu1", "gpu2", "web"]
    code, out = cli("-i", "other.toml", "init", "--from-ssh-config", "db*", "--ssh-config", str(config),
                    cwd=tmp_path)
    assert code == 2 and "no Host entry" in out


def test_init_from_another_ssh_config_writes_it_into_the_inventory_and_keeps_dash_i(tmp_path: Path) -> None:
    """The aliases it found resolve only through that file; the next steps name the inventory."""
    config = tmp_path / "cluster_ssh"
    config.write_text("Host gpu1\n  HostName 10.0.0.1\n  Port 2222\n")
    code, out = cli("-i", "h2.toml", "init", "--from-ssh-config", "gpu*", "--ssh-config", str(config),
                    "--python", "/opt/venv/bin/python", "--nproc-per-node", "2", cwd=tmp_path)
    assert code == 0, out
    assert out.splitlines()[-1] == "then: torchherd -i h2.toml hosts; torchherd -i h2.toml check -- train.py"
    text = (tmp_path / "h2.toml").read_text()
    assert f'ssh_config = "{config}"  # the OpenSSH config the hosts\' aliases come from' in text.splitlines()
    assert "# Fill in what is marked FILL IN, then: torchherd -i h2.toml hosts; torchherd -i h2.toml check -- " \
           "train.py" in text.splitlines()
    assert load(tmp_path / "h2.toml").cluster.ssh_config == config
    code, out = cli("-i", "h2.toml", "hosts", cwd=tmp_path)
    assert code == 0 and "10.0.0.1:2222" in out, out


def test_an_inventory_still_marked_fill_in_warns_once_naming_each_key(tmp_path: Path) -> None:
    code, out = cli("init", "-H", "gpu1,gpu2", "--python", "/opt/venv/bin/python", cwd=tmp_path)
    assert code == 0, out
    code, out = cli("hosts", cwd=tmp_path)
    assert code == 0, out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: hosts.toml: still marked FILL IN: nproc_per_node (line 8), workdir (line 12); "
                        "check each value, then delete the marker"], out
    text = (tmp_path / "hosts.toml").read_text()
    (tmp_path / "hosts.toml").write_text(text.replace("# FILL IN: ", "# "))
    code, out = cli("hosts", cwd=tmp_path)
    assert code == 0 and "warning:" not in out, out
    assert unfilled('x = 1  # FILL IN: y\n# FILL IN alone\nname = "a"  # not FILL IN\n') == [(1, "x")]


def test_nproc_per_node_in_defaults_is_the_clusters(tmp_path: Path) -> None:
    (tmp_path / "hosts.toml").write_text('[defaults]\nnproc_per_node = 4\n[[hosts]]\nname = "a"\n')
    assert load(tmp_path / "hosts.toml").cluster.nproc_per_node == 4
    (tmp_path / "hosts.toml").write_text('[cluster]\nnproc_per_node = 2\n[defaults]\nnproc_per_node = 4\n'
                                         '[[hosts]]\nname = "a"\n')
    code, out = cli("hosts", cwd=tmp_path)
    assert code == 2 and out.splitlines()[0] == ("error: hosts.toml: [defaults].nproc_per_node: "
                                                 "[cluster].nproc_per_node is set too"), out


def test_init_example_writes_the_shipped_example_which_loads(tmp_path: Path) -> None:
    """A pip user has no checkout: the example ships in the package."""
    code, out = cli("-i", "ex.toml", "init", "--example", cwd=tmp_path)
    assert (code, out) == (0, "wrote ex.toml: the example inventory, every key explained; edit it for your hosts\n")
    shipped = Path(__file__).resolve().parents[2] / "src" / "torchherd" / "hosts.example.toml"
    assert (tmp_path / "ex.toml").read_text() == shipped.read_text()
    assert stat.S_IMODE((tmp_path / "ex.toml").stat().st_mode) == 0o600
    assert [host.name for host in load(tmp_path / "ex.toml").hosts] == ["node0", "node1"]
    code, out = cli("-i", "ex2.toml", "init", "--example", "-H", "a", cwd=tmp_path)
    assert code == 2 and out.splitlines()[0] == "error: --example and -H: the example is written as it is", out


def test_init_example_script_writes_the_shipped_ddp_script_and_says_how_to_run_it(tmp_path: Path) -> None:
    """A pip user's first job: the example DDP script ships in the package (examples/ddp_demo.py)."""
    code, out = cli("init", "--example-script", cwd=tmp_path)
    assert (code, out) == (0, "wrote train.py: a small DDP training script (CPU or GPU, torch only); run it here: "
                              "torchherd run -H localhost --nproc-per-node 2 -- train.py\n")
    shipped = Path(__file__).resolve().parents[2] / "examples" / "ddp_demo.py"
    assert (tmp_path / "train.py").read_text() == shipped.read_text()
    assert stat.S_IMODE((tmp_path / "train.py").stat().st_mode) == 0o600
    assert not (tmp_path / "hosts.toml").exists()
    code, out = cli("init", "--example-script", cwd=tmp_path)
    assert (code, out.splitlines()[0]) == (2, "error: --example-script train.py: already exists; init never "
                                              "overwrites a file"), out
    code, out = cli("init", "--example-script", "my train.py", "-H", "a", cwd=tmp_path)
    assert (code, out.splitlines()[0]) == (2, "error: --example-script and -H: the script is written alone"), out
    code, out = cli("init", "--example-script", "my train.py", cwd=tmp_path)
    assert out.endswith("-- 'my train.py'\n") and (tmp_path / "my train.py").is_file(), out


def test_init_without_hosts_writes_placeholders(tmp_path: Path) -> None:
    code, out = cli("init", cwd=tmp_path)
    assert code == 0, out
    assert "placeholders" in out and "the hosts" in out
    assert [host.name for host in load(tmp_path / "hosts.toml").hosts] == ["node0", "node1"]


# Hostfiles as their own tools read them. The facts come from DeepSpeed's suite
# (microsoft/DeepSpeed tests/unit/launcher/test_run.py: test_hostfile_good, test_hostfiles_bad),
# Open MPI's documentation (open-mpi/ompi docs/launching-apps/quickstart.rst, scheduling.rst)
# and PRRTE's hostfile lexer and docs (openpmix/prrte src/util/hostfile/hostfile_lex.l:
# '#' and '//' comments, /* */ blocks, '=' a token of its own; docs/hosts/hostfiles.rst:
# user@host). The test code is this project's.


def _hosts_of(tmp_path: Path, text: str) -> list[tuple[str, str | None, int | None]]:
    path = tmp_path / "hostfile"
    path.write_text(text)
    assert looks_like_hostfile(path, text)
    return [(host.name, host.user, host.nproc_per_node) for host in load_any(path).hosts]


def test_deepspeed_good_hostfile(tmp_path: Path) -> None:
    text = ("\n    worker-1 slots=2\n    worker-2 slots=2\n\n    localhost slots=1\n    123.23.12.10 slots=2\n\n"
            "    #worker-1 slots=3\n    # this is a comment\n\n    ")
    assert _hosts_of(tmp_path, text) == [("worker-1", None, 2), ("worker-2", None, 2), ("localhost", None, 1),
                                         ("123.23.12.10", None, 2)]


@pytest.mark.parametrize("text,line", [
    ("\n    worker-1 slots=2\n    worker-2 slots=1\n    worker-1 slots=1\n    ", 4),  # duplicate host
    ("\n    this is bad slots=1\n    ", 2),  # incorrect whitespace
    ("\n    worker-1 slots=2\n    this is bad slots=1\n    worker-2 slots=4\n    missingslots\n\n    ", 3),
])
def test_deepspeed_bad_hostfiles_name_the_line(tmp_path: Path, text: str, line: int) -> None:
    path = tmp_path / "hostfile"
    path.write_text(text)
    with pytest.raises(UsageError) as caught:
        load_any(path)
    assert str(caught.value).startswith(f"{path}:{line}: ")


def test_deepspeed_empty_hostfile_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    path.write_text("\n    \n")
    with pytest.raises(UsageError):
        load_any(path)


def test_open_mpi_documented_hostfiles(tmp_path: Path) -> None:
    assert _hosts_of(tmp_path, "node1.example.com\nnode2.example.com\nnode3.example.com slots=2\n"
                               "node4.example.com slots=10\n") == [
        ("node1.example.com", None, None), ("node2.example.com", None, None), ("node3.example.com", None, 2),
        ("node4.example.com", None, 10)]
    assert _hosts_of(tmp_path, "node0 slots=2 max_slots=20\nnode1 slots=2 max_slots=20\n") == [
        ("node0", None, 2), ("node1", None, 2)]
    assert _hosts_of(tmp_path, "# We want to allow launching a maximum of 2 processes on this host\n"
                               "# (e.g., potentially because it has two processor cores):\nbar.example.com slots=2\n"
                               ) == [("bar.example.com", None, 2)]


def test_prrte_user_at_host_equals_spacing_and_comments(tmp_path: Path) -> None:
    text = ("user01@node01  slots=4\n"
            "node02 slots = 2   // two GPUs\n"
            "/* a block comment\n   over two lines */ node03 slots =1 max-slots= 8\n"
            "node04 count=3 username=ops port = 2222\n")
    assert _hosts_of(tmp_path, text) == [("node01", "user01", 4), ("node02", None, 2), ("node03", None, 1),
                                         ("node04", "ops", 3)]
    path = tmp_path / "hostfile"
    assert load_any(path).host("node04").ssh_port == 2222


def test_cli_takes_a_prrte_hostfile_without_a_toml_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "hostfile").write_text("ops@worker-1 slots = 4\n// spare\nworker-2 slots=2\n")
    code, _ = cli("-i", "hostfile", "hosts", "--json", cwd=tmp_path)
    rows = json.loads(capsys.readouterr().out)["hosts"]
    assert code == 0
    assert [(row["name"], row["nproc_per_node"]) for row in rows] == [("worker-1", 4), ("worker-2", 2)]
    assert rows[0]["ssh"].startswith("ops@worker-1")


@pytest.mark.parametrize("text", [
    '[cluster]\nport = 29500\n[[hosts]]\nname = "a"\n',
    '# comment\nhosts = [{ name = "a" }]\n',
    '[[hosts]]\nname="a"\n',
    "[defaults]\n",
])
def test_toml_is_told_from_a_hostfile_by_its_content(tmp_path: Path, text: str) -> None:
    assert not looks_like_hostfile(tmp_path / "inventory", text)


@given(st.lists(st.tuples(st.sampled_from(["", "ops@", "u-1@"]), st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True),
                          st.sampled_from(["", " slots=2", " slots = 3", " slots= 4 max_slots =9", ":5"]),
                          st.sampled_from(["", "  # c", " // c"])),
                min_size=1, max_size=6, unique_by=lambda line: line[1]))
def test_any_well_formed_hostfile_reads_as_written(lines: list[tuple[str, str, str, str]]) -> None:
    text = "".join(f"{user}{host}{slots}{comment}\n" for user, host, slots, comment in lines)
    assert looks_like_hostfile(Path("hostfile"), text)
    tables = hostfile_items(Path("hostfile"), text)
    assert [table["name"] for table in tables] == [host for _, host, _, _ in lines]
    for table, (user, _, slots, _) in zip(tables, lines):
        assert table.get("user") == (user[:-1] or None)
        written = slots.replace(" ", "").removeprefix(":").removeprefix("slots=").split("max")[0]
        assert table.get("nproc_per_node") == (int(written) if written else None)


# DeepSpeed's slot selection in --include/--exclude. The cases are the facts of DeepSpeed's
# own suite (microsoft/DeepSpeed tests/unit/launcher/test_run.py: test_parser_local,
# test_parser_multinode, test_parser_errors, for runner.py's parse_resource_filter) over a
# hostfile of `worker-N slots=4` hosts; the test code is this project's. Two deliberate
# differences: torchherd takes --include and --exclude together (include, then exclude),
# and a selection that leaves no host is exit 2 where DeepSpeed returns an empty pool.


def _pool(tmp_path: Path, slots: dict[str, int]) -> Cluster:
    path = tmp_path / "hostfile"
    path.write_text("".join(f"{name} slots={count}\n" for name, count in slots.items()))
    return Cluster.from_file(path)


def _chosen(cluster: Cluster) -> dict[str, list[int]]:
    """Host -> its slots, as the job will see them; every host's process count is its slots'."""
    result = {}
    for host in cluster.inventory.hosts:
        visible = host.env.get("CUDA_VISIBLE_DEVICES")
        count = host.nproc_per_node
        assert isinstance(count, int)
        result[host.name] = [int(slot) for slot in visible.split(",")] if visible else list(range(count))
        assert len(result[host.name]) == count
    return result


ONE = {"worker-0": 4}
TWO = {"worker-0": 4, "worker-1": 4}


@pytest.mark.parametrize("pool,include,exclude,expected", [
    (ONE, None, None, {"worker-0": [0, 1, 2, 3]}),
    (ONE, None, "worker-0:1", {"worker-0": [0, 2, 3]}),
    (ONE, None, "worker-0:1,2", {"worker-0": [0, 3]}),
    (ONE, "worker-0:1", None, {"worker-0": [1]}),
    (ONE, "worker-0:1,1", None, {"worker-0": [1]}),
    (ONE, "worker-0:1@worker-0:0,1", None, {"worker-0": [0, 1]}),
    (ONE, "worker-0", None, {"worker-0": [0, 1, 2, 3]}),
    (TWO, None, None, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
    (TWO, "worker-1:0,3", None, {"worker-1": [0, 3]}),
    (TWO, None, "worker-1", {"worker-0": [0, 1, 2, 3]}),
    (TWO, None, "worker-0:0,1@worker-1:3", {"worker-0": [2, 3], "worker-1": [0, 1, 2]}),
    (TWO, "worker-0:0,1,2@worker-1", "worker-0:1@worker-1:0", {"worker-0": [0, 2], "worker-1": [1, 2, 3]}),
    (TWO, "worker-[0-1]:2,3", None, {"worker-0": [2, 3], "worker-1": [2, 3]}),
    (TWO, "worker-*:0", None, {"worker-0": [0], "worker-1": [0]}),
])
def test_deepspeed_slot_selection(tmp_path: Path, pool: dict[str, int], include: str | None, exclude: str | None,
                                  expected: dict[str, list[int]]) -> None:
    cluster = _pool(tmp_path, pool).select(include, exclude)
    assert _chosen(cluster) == expected
    assert cluster.inventory.cluster.master == next(iter(expected))


@pytest.mark.parametrize("pool,include,exclude,message", [
    (ONE, None, "worker-0", "no host is left"),
    (ONE, None, "worker-0:0,1,2,3", "no host is left"),
    (TWO, "jeff", None, "--include jeff: no such host"),
    (TWO, None, "jeff", "--exclude jeff: no such host"),
    (TWO, "worker-1:4", None, "--include 'worker-1:4': worker-1 has no slot 4 (its slots are 0-3)"),
    (TWO, None, "worker-1:4", "--exclude 'worker-1:4': worker-1 has no slot 4"),
    (TWO, None, "worker-1@worker-0:1@5", "--exclude 5: no such host"),
    (TWO, "worker-0:a", None, "--include 'worker-0:a': 'a' is not a slot number"),
    (TWO, "worker-0,worker-1:0", None, "--include 'worker-0,worker-1:0': a slot list follows one host"),
])
def test_deepspeed_slot_selection_errors(tmp_path: Path, pool: dict[str, int], include: str | None,
                                         exclude: str | None, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        _pool(tmp_path, pool).select(include, exclude)
    assert message in str(caught.value)


def test_slots_need_a_slot_count() -> None:
    with pytest.raises(UsageError, match="choosing slots of a needs its slot count"):
        Cluster.from_hosts("a,b", nproc_per_node="gpu").select(include="a:0")


def test_slots_index_the_hosts_own_visible_devices() -> None:
    cluster = Cluster(hosts=[{"name": "a", "env": {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}}], nproc_per_node=4)
    host = cluster.select(exclude="a:0,2").inventory.hosts[0]
    assert host.env["CUDA_VISIBLE_DEVICES"] == "5,7" and host.nproc_per_node == 2


def test_cli_dry_run_shows_the_chosen_slots(tmp_path: Path) -> None:
    code, out = cli("run", "-H", "worker-0,worker-1", "--nproc-per-node", "4", "--exclude", "worker-0:0,1@worker-1:3",
                    "--dry-run", "--", "train.py", cwd=tmp_path)
    assert code == 0, out
    assert "CUDA_VISIBLE_DEVICES=2,3" in out and "CUDA_VISIBLE_DEVICES=0,1,2" in out, out
    assert "--nproc-per-node 2" in out or "--nproc_per_node=2" in out or "nproc-per-node=2" in out, out


@given(st.lists(st.integers(1, 8), min_size=1, max_size=4), st.data())
def test_exclude_removes_exactly_the_slots_named(counts: list[int], data: st.DataObject) -> None:
    pool = {f"w{index}": count for index, count in enumerate(counts)}
    removed = {name: data.draw(st.sets(st.integers(0, count - 1))) for name, count in pool.items()}
    spec = "@".join(f"{name}:{','.join(map(str, sorted(slots)))}" for name, slots in removed.items() if slots)
    expected = {name: [slot for slot in range(count) if slot not in removed[name]] for name, count in pool.items()}
    expected = {name: slots for name, slots in expected.items() if slots}
    cluster = Cluster(hosts=[{"name": name, "nproc_per_node": count} for name, count in pool.items()])
    if not expected:
        with pytest.raises(UsageError, match="no host is left"):
            cluster.select(exclude=spec)
        return
    chosen = _chosen(cluster.select(exclude=spec) if spec else cluster)
    assert chosen == expected


# `torchherd hosts` at 80 columns (a terminal's default, and what a pipe gets) and `init`'s comments.

WIDE = ('[defaults]\npython = "/home/someone/projects/torchherd-demo/.venv/bin/python"\n'
        'workdir = "~/projects/torchherd-demo/work"\n'
        '[[hosts]]\nname = "hn1"\naddress = "10.213.7.11"\nuser = "demo"\n'
        '[[hosts]]\nname = "hn2"\naddress = "10.213.7.12"\nuser = "demo"\n')


def _table(width: int, terminal: bool = True) -> str:
    from torchherd.console.hosts import render_hosts
    from torchherd.inventory import loads

    out = StringIO()
    inventory = loads(WIDE.encode(), Path("hosts.toml"))
    render_hosts(make_console(out, width=width, terminal=terminal), inventory, ["demo@10.213.7.11", "demo@10.213.7.12"])
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


def test_piped_hosts_table_keeps_every_column_whole_in_plain_text() -> None:
    assert _table(80, terminal=False) == """\
hosts.toml: 2 hosts, master hn1:29500, rendezvous static
name          SSH target        node_rank  nproc  python                                                  workdir
hn1 (master)  demo@10.213.7.11  0          1      /home/someone/projects/torchherd-demo/.venv/bin/python  ~/projects/torchherd-demo/work
hn2           demo@10.213.7.12  1          1      /home/someone/projects/torchherd-demo/.venv/bin/python  ~/projects/torchherd-demo/work"""


def test_hosts_table_at_80_columns_shortens_paths_and_says_what_it_left_out() -> None:
    assert _table(80) == """\
hosts.toml: 2 hosts, master hn1:29500, rendezvous static
┏━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━┓
┃ name         ┃ SSH target       ┃ node_rank ┃ nproc ┃ python                 ┃
┡━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━╇━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━┩
│ hn1 (master) │ demo@10.213.7.11 │ 0         │ 1     │ /home/some…/bin/python │
│ hn2          │ demo@10.213.7.12 │ 1         │ 1     │ /home/some…/bin/python │
└──────────────┴──────────────────┴───────────┴───────┴────────────────────────┘
workdir left out at 80 columns (torchherd hosts --json has every column)"""


def test_hosts_table_wider_keeps_both_ends_of_each_path() -> None:
    assert _table(100).splitlines()[4] == (
        "│ hn1 (master) │ demo@10.213.7.11 │ 0         │ 1     │ /home/so…/bin/python │ ~/projects/to…/work │")
    assert "/home/someone/projects/torchherd-demo/.venv/bin/python" in _table(150)
    assert all(len(line) <= width for width in (60, 80, 100) for line in _table(width).splitlines())


@given(st.text(alphabet="ab/.-_", min_size=1, max_size=80), st.integers(16, 80))
def test_middle_keeps_both_ends_within_the_width(text: str, width: int) -> None:
    from torchherd.console.hosts import middle

    short = middle(text, width)
    assert len(short) <= width
    if len(text) <= width:
        assert short == text
    else:
        head, tail = short.split("…")
        assert text.startswith(head) and text.endswith(tail) and head and tail


def test_init_keeps_two_spaces_before_a_comment_after_a_long_value(tmp_path: Path) -> None:
    code, out = cli("-i", "h.toml", "init", "-H", "a", "--python", "/opt/venv/bin/python", "--workdir",
                    "/srv/some/long/work/directory", cwd=tmp_path)
    assert code == 0, out
    text = (tmp_path / "h.toml").read_text()
    assert 'python = "/opt/venv/bin/python"  # the interpreter' in text
    assert 'workdir = "/srv/some/long/work/directory"  # where the job runs' in text
    assert 'port = 29500                # the master port' in text  # short values keep the column
    for line in text.splitlines():
        if "#" in line and not line.startswith("#"):
            assert line.split("#", 1)[0].endswith("  "), line
