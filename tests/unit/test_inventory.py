"""The inventory: every bad input exits 2 with one line naming the file and the key."""

from __future__ import annotations

import json
import shutil
import subprocess
from io import StringIO
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchherd.cli import main
from torchherd.console import make_console
from torchherd.errors import InventoryError
from torchherd.inventory import load, parse, valid_hostname, valid_ruser

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
[cluster]
master = "b"
port = 29600
nproc_per_node = "gpu"

[defaults]
user = "ml"
python = "/venv/bin/python"
env = { NCCL_DEBUG = "WARN", OMP_NUM_THREADS = 4 }

[[hosts]]
name = "a"
address = "10.0.0.1"

[[hosts]]
name = "b"
ssh_port = 2222
env = { NCCL_SOCKET_IFNAME = "eth1" }
setup = "source ~/venv/bin/activate"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.toml"
    path.write_text(text)
    return path


def test_good_inventory_is_parsed_with_defaults_applied(tmp_path: Path) -> None:
    inventory = load(write(tmp_path, GOOD))
    assert [host.name for host in inventory.hosts] == ["b", "a"]  # the master is rank 0
    master, worker = inventory.hosts
    assert inventory.cluster.port == 29600
    assert inventory.cluster.nproc_per_node == "gpu"
    assert inventory.cluster.rdzv_backend == "static"
    assert master.ssh_port == 2222 and worker.ssh_port is None
    assert master.address == "b" and worker.address == "10.0.0.1"
    assert master.user == worker.user == "ml"
    assert dict(master.env) == {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "4", "NCCL_SOCKET_IFNAME": "eth1"}
    assert dict(worker.env) == {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "4"}
    assert master.setup == "source ~/venv/bin/activate" and worker.setup == ""
    assert worker.workdir == "~"


def test_example_inventory_is_valid() -> None:
    inventory = load(ROOT / "hosts.example.toml")
    assert [host.name for host in inventory.hosts] == ["node0", "node1"]


def test_addresses_that_are_names_ips_or_aliases_are_accepted(tmp_path: Path) -> None:
    addresses = ["node-1.example.com", "10.0.0.7", "fe80::1", "2001:db8::2", "gpu_a", "GPU-7"]
    text = "".join(f'[[hosts]]\nname = "n{index}"\naddress = "{address}"\n' for index, address in enumerate(addresses))
    assert [host.address for host in load(write(tmp_path, text)).hosts] == addresses


def test_an_existing_identity_file_is_kept_as_written(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("not really a key")
    inventory = load(write(tmp_path, f'[defaults]\nidentity_file = "{key}"\n[[hosts]]\nname = "a"\n'))
    assert inventory.hosts[0].identity_file == str(key)


def test_ssh_config_path_is_relative_to_the_inventory(tmp_path: Path) -> None:
    (tmp_path / "cfg").write_text("Host a\n")
    inventory = load(write(tmp_path, '[cluster]\nssh_config = "cfg"\n[[hosts]]\nname = "a"\n'))
    assert inventory.cluster.ssh_config == tmp_path / "cfg"


BAD = [
    ('[cluster]\nprot = 1\n[[hosts]]\nname = "a"\n', "[cluster].prot: unknown key", "did you mean 'port'?"),
    ('[defaults]\npyhton = "x"\n[[hosts]]\nname = "a"\n', "[defaults].pyhton: unknown key",
     "did you mean 'python'?"),
    ('[[hosts]]\nname = "a"\nadress = "x"\n', "hosts[0].adress: unknown key", "did you mean 'address'?"),
    ('[[hosts]]\nname = "a"\n[[hosts]]\nname = "a"\n', "hosts[1].name: duplicate host name 'a'", "unique"),
    ('[cluster]\nmaster = "c"\n[[hosts]]\nname = "a"\n', "[cluster].master: 'c' is not one of the hosts (a)", ""),
    ('[cluster]\nport = "29500"\n[[hosts]]\nname = "a"\n',
     "[cluster].port: expected a port number from 1 to 65535, got a string '29500'", ""),
    ('[cluster]\nport = 70000\n[[hosts]]\nname = "a"\n',
     "[cluster].port: expected a port number from 1 to 65535, got an integer 70000", ""),
    ('[defaults]\nssh_port = 0\n[[hosts]]\nname = "a"\n', "[defaults].ssh_port: expected a port number", ""),
    ('[cluster]\nnproc_per_node = 0\n[[hosts]]\nname = "a"\n', "[cluster].nproc_per_node: expected a positive", ""),
    ('[cluster]\nrdzv_backend = "etcd"\n[[hosts]]\nname = "a"\n',
     "[cluster].rdzv_backend: expected one of 'static', 'c10d', got a string 'etcd'", ""),
    ('[defaults]\nenv = { A = [1] }\n[[hosts]]\nname = "a"\n', "[defaults].env.A: expected a string, got a list",
     "quote"),
    ('[defaults]\nenv = "A=1"\n[[hosts]]\nname = "a"\n', "[defaults].env: expected a table", ""),
    ('[[hosts]]\nname = 3\n', "hosts[0].name: expected a non-empty string, got an integer 3", ""),
    ('[[hosts]]\naddress = "x"\n', "hosts[0].name: missing", ""),
    ('[[hosts]]\nname = "a b"\n', "hosts[0].name: 'a b' is not a usable host name", ""),
    ('[cluster]\nport = 1\n', "hosts: no hosts listed", "[[hosts]]"),
    ('hosts = []\n', "hosts: no hosts listed", ""),
    ('hosts = "a"\n', "hosts: expected [[hosts]] tables", ""),
    ('[cluster]\nport = 1\n[[hosts]\nname = "a"\n', "TOML syntax error", "line 3"),
    ('[clusters]\nport = 1\n[[hosts]]\nname = "a"\n', "clusters: unknown key", "did you mean 'cluster'?"),
    ('[cluster]\nssh_timeout = -1\n[[hosts]]\nname = "a"\n', "[cluster].ssh_timeout: expected a positive", ""),
    ('[[hosts]]\nname = "a"\naddress = "a;reboot"\n',
     "hosts[0].address: 'a;reboot' is not a host name, an IP address or an ssh_config alias", "letters"),
    ('[[hosts]]\nname = "a"\naddress = "$(id)"\n', "hosts[0].address: '$(id)' is not a host name", ""),
    ('[[hosts]]\nname = "a"\naddress = "node0\\n"\n', "hosts[0].address: 'node0\\n' holds a control character", "one line"),
    ('[[hosts]]\nname = "a"\naddress = "-oProxyCommand=x"\n', "hosts[0].address: '-oProxyCommand=x' is not", ""),
    ('[[hosts]]\nname = "a"\naddress = "root@a"\n', "hosts[0].address: 'root@a' is not", "user and ssh_port"),
    ('[defaults]\nidentity_file = "/nonexistent/key"\n[[hosts]]\nname = "a"\n',
     "[defaults].identity_file: '/nonexistent/key': no such file", "fix the path"),
    ('[[hosts]]\nname = "a"\nidentity_file = "~/no-such-torchherd-key"\n',
     "hosts[0].identity_file: '~/no-such-torchherd-key': no such file", ""),
    ('[cluster]\nssh_config = "no-such-ssh-config"\n[[hosts]]\nname = "a"\n',
     "[cluster].ssh_config: ", "relative to the inventory"),
]


@pytest.mark.parametrize("text,message,hint", BAD)
def test_bad_inventory_names_file_and_key(tmp_path: Path, text: str, message: str, hint: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(InventoryError) as caught:
        load(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)
    assert hint in f"{caught.value} {caught.value.hint}"


@pytest.mark.parametrize("text,message,hint", BAD)
def test_cli_exits_2_with_one_line_and_no_traceback(tmp_path: Path, text: str, message: str, hint: str) -> None:
    path = write(tmp_path, text)
    out = StringIO()
    code = main(["-i", str(path), "hosts"], console=make_console(out, width=300))
    lines = out.getvalue().splitlines()
    assert code == 2
    assert lines[0].startswith(f"error: {path}: ") and message in lines[0]
    assert "Traceback" not in out.getvalue()


def test_missing_file_exits_2(tmp_path: Path) -> None:
    out = StringIO()
    code = main(["hosts", "-i", str(tmp_path / "nope.toml")], console=make_console(out, width=300))
    assert code == 2
    assert out.getvalue().splitlines() == [
        f"error: {tmp_path / 'nope.toml'}: inventory file not found",
        "  hint: pass one with -i FILE or set TORCHHERD_INVENTORY; write one with `torchherd init -H HOSTS` (or "
        "`torchherd init --example`: every key, explained); or give the hosts with -H instead",
    ]


def test_inventory_from_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHHERD_INVENTORY", str(write(tmp_path, '[[hosts]]\nname = "solo"\n')))
    out = StringIO()
    assert main(["hosts"], console=make_console(out, width=200)) == 0
    assert "solo (master)" in out.getvalue()


def test_hosts_table_exact_text(tmp_path: Path) -> None:
    path = write(tmp_path, '[cluster]\nnproc_per_node = 2\n[defaults]\nuser = "u"\n'
                           '[[hosts]]\nname = "n0"\naddress = "10.1.1.1"\n[[hosts]]\nname = "n1"\nssh_port = 2200\n')
    out = StringIO()
    assert main(["-i", str(path), "hosts"], console=make_console(out, width=120)) == 0
    assert out.getvalue().splitlines()[1:] == [  # piped: plain columns, no box
        "name         SSH target  node_rank  nproc  python   workdir",
        "n0 (master)  u@10.1.1.1  0          2      python3  ~",
        "n1           u@n1:2200   1          2      python3  ~",
    ]


def test_ssh_config_alias_is_resolved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "cfg").write_text("Host n0\n  HostName 10.9.9.9\n  User alice\n  Port 2022\n")
    path = write(tmp_path, '[cluster]\nssh_config = "cfg"\n[[hosts]]\nname = "n0"\n[[hosts]]\nname = "n1"\n'
                           'user = "bob"\n')
    assert main(["-i", str(path), "hosts", "--json"], console=make_console(StringIO())) == 0
    hosts = json.loads(capsys.readouterr().out)["hosts"]
    assert [host["ssh"] for host in hosts] == ["alice@10.9.9.9:2022", "bob@n1"]


def test_fifty_thousand_hosts_parse_in_linear_time(tmp_path: Path) -> None:
    """The duplicate-name check was a scan of the hosts so far: 50,000 hosts took 116 s. The
    parse's own CPU time is what is bounded (about 2 s here), not the wall's: a loaded machine
    (CI's other tests beside it) stretched the wall to 18 s."""
    import time

    count = 50_000
    text = "".join(f'[[hosts]]\nname = "n{index}"\naddress = "10.{index >> 16}.{(index >> 8) & 255}.{index & 255}"\n'
                   for index in range(count))
    path = write(tmp_path, text)
    started = time.process_time()
    inventory = load(path)
    cpu = time.process_time() - started
    assert len(inventory.hosts) == count
    assert cpu < 10.0, f"{count} hosts took {cpu:.1f} s of CPU"
    entries = [{"name": host.name} for host in inventory.hosts] + [{"name": "n7"}]
    with pytest.raises(InventoryError, match=rf"hosts\[{count}\].name: duplicate host name 'n7'"):
        parse({"hosts": entries}, path)


# OpenSSH's checks of what reaches %r and %h (readconf.c ssh_valid_ruser / ssh_valid_hostname).
# The named cases are OpenSSH's own (regress/proxyjump.sh, "command-line -J invalid characters");
# the rest follow its rules. Where an OpenSSH client is installed, `ssh -G` is the oracle too.

USERS = {"ubuntu": True, "a.b_c-d": True, "a$HOME": True, "a b": True, "dom\\user": True, "é": True,
         "user;with;semicolon": False, "user'with'quote": False, "user`with`backtick": False,
         "user(with)brace": False, "a$(id)": False, "a{b}": False, "a|b": False, "a&b": False, "a<b": False,
         'a"b': False, "-x": False, "a -x": False, "a\\": False, "a\tb": False, "a\nb": False, "": False}
HOSTS = {"node1": True, "10.0.0.1": True, "fe80::1": True, "a_b": True, "é.example": True,
         "host;with;semicolon": False, "host'with'quote": False, "host`with`backtick": False,
         "host$with$dollar": False, "host(with)brace": False, "-x": False, "a b": False, "a,b": False,
         "a\\b": False, "a{b}": False, "a|b": False, "a&b": False, "": False}


@pytest.mark.parametrize("user,valid", USERS.items())
def test_users_are_checked_as_openssh_does(user: str, valid: bool) -> None:
    assert valid_ruser(user) is valid


@pytest.mark.parametrize("host,valid", HOSTS.items())
def test_hosts_are_checked_as_openssh_does(host: str, valid: bool) -> None:
    assert valid_hostname(host) is valid


SSH = shutil.which("ssh")
needs_ssh = pytest.mark.skipif(SSH is None, reason="no OpenSSH client here to compare with")


def _ssh_accepts(*args: str) -> bool:
    assert SSH is not None
    return subprocess.run([SSH, "-G", "-F", "/dev/null", *args], capture_output=True, check=False).returncode == 0


@needs_ssh
@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="ab-;'`\"$(){}|&<> \\,.@", min_size=1, max_size=6))
def test_users_and_hosts_agree_with_ssh_g(text: str) -> None:
    assert valid_ruser(text) == _ssh_accepts("-l", text, "somehost"), text
    if "@" not in text:  # ssh reads user@host itself
        assert valid_hostname(text) == _ssh_accepts("--", text), text


def test_nproc_per_node_in_defaults_is_every_host_s_count() -> None:
    hosts = [{"name": "a"}, {"name": "b", "nproc_per_node": 2}]
    inventory = parse({"defaults": {"nproc_per_node": 4, "python": "/p"}, "hosts": hosts}, Path("h.toml"))
    assert inventory.cluster.nproc_per_node == 4
    assert [(host.name, host.nproc_per_node, host.python) for host in inventory.hosts] == [
        ("a", None, "/p"), ("b", 2, "/p")]  # None: the cluster's count
    with pytest.raises(InventoryError) as caught:
        parse({"cluster": {"nproc_per_node": 1}, "defaults": {"nproc_per_node": 2}, "hosts": hosts}, Path("h.toml"))
    assert (str(caught.value), caught.value.hint) == (
        "h.toml: [defaults].nproc_per_node: [cluster].nproc_per_node is set too",
        "keep one of them: both are every host's process count")
    with pytest.raises(InventoryError, match=r"^h.toml: \[defaults\].nproc_per_node: expected a positive integer"):
        parse({"defaults": {"nproc_per_node": 0}, "hosts": hosts}, Path("h.toml"))
