"""The inventory's nodesets (one [[hosts]] table for many), per-host nproc_per_node, and [sync]."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchherd.errors import InventoryError
from torchherd.inventory import load


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.toml"
    path.write_text(text)
    return path


def test_one_table_stands_for_many_and_the_address_expands_in_step(tmp_path: Path) -> None:
    inventory = load(write(tmp_path, """
[cluster]
master = "gpu03"
[defaults]
user = "ml"
[[hosts]]
name = "gpu[01-04]"
address = "10.0.0.[11-14]"
nproc_per_node = 8
[[hosts]]
name = "cpu1"
"""))
    assert [host.name for host in inventory.hosts] == ["gpu03", "gpu01", "gpu02", "gpu04", "cpu1"]
    assert [host.address for host in inventory.hosts] == ["10.0.0.13", "10.0.0.11", "10.0.0.12", "10.0.0.14", "cpu1"]
    assert {host.user for host in inventory.hosts} == {"ml"}
    assert [host.nproc_per_node for host in inventory.hosts] == [8, 8, 8, 8, None]


def test_a_name_nodeset_without_an_address_reaches_each_by_name(tmp_path: Path) -> None:
    inventory = load(write(tmp_path, '[[hosts]]\nname = "a[1-2]b[1-2]"\n'))
    assert [(host.name, host.address) for host in inventory.hosts] == [
        ("a1b1", "a1b1"), ("a1b2", "a1b2"), ("a2b1", "a2b1"), ("a2b2", "a2b2")]


@pytest.mark.parametrize("hosts,message", [
    ('name = "gpu[01-04]"\naddress = "10.0.0.[1-3]"',
     "hosts[0].address: '10.0.0.[1-3]' stands for 3 addresses but name 'gpu[01-04]' for 4 hosts"),
    ('name = "gpu[01-04]"\naddress = "10.0.0.9"',
     "hosts[0].address: '10.0.0.9' stands for 1 addresses but name 'gpu[01-04]' for 4 hosts"),
    ('name = "gpu[4-1]"', "hosts[0].name: not a host name or nodeset: 'gpu[4-1]': [4-1]: the range 4-1 ends"),
    ('name = "gpu[1-2"', "hosts[0].name: not a host name or nodeset: 'gpu[1-2': '[' without ']'"),
    ('name = "n[1-2]"\n[[hosts]]\nname = "n2"', "hosts[1].name: duplicate host name 'n2'"),
    ('name = "n1"\nnproc_per_node = 0', "hosts[0].nproc_per_node: expected a positive integer"),
])
def test_errors_name_the_file_and_key(tmp_path: Path, hosts: str, message: str) -> None:
    path = write(tmp_path, "[[hosts]]\n" + hosts + "\n")
    with pytest.raises(InventoryError) as caught:
        load(path)
    assert str(caught.value).startswith(f"{path}: {message}")


def test_sync_table(tmp_path: Path) -> None:
    inventory = load(write(tmp_path, '[sync]\ndir = "proj"\nexclude = ["data/", "*.ckpt"]\ndest = "code"\n'
                                     '[[hosts]]\nname = "a"\n'))
    assert inventory.sync is not None
    assert inventory.sync.dir == tmp_path / "proj"
    assert inventory.sync.exclude == ("data/", "*.ckpt")
    assert inventory.sync.dest == "code"
    assert load(write(tmp_path, '[[hosts]]\nname = "a"\n')).sync is None


@pytest.mark.parametrize("table,message", [
    ('exclude = "data/"', "[sync].exclude: expected a list of patterns, got a string 'data/'"),
    ('dest = ""', "[sync].dest: expected a non-empty string"),
    ('dst = "x"', "[sync].dst: unknown key"),
])
def test_sync_errors(tmp_path: Path, table: str, message: str) -> None:
    path = write(tmp_path, f"[sync]\n{table}\n[[hosts]]\nname = \"a\"\n")
    with pytest.raises(InventoryError) as caught:
        load(path)
    assert str(caught.value).startswith(f"{path}: {message}")


def test_rdzv_backend_chosen_or_defaulted(tmp_path: Path) -> None:
    assert not load(write(tmp_path, '[[hosts]]\nname = "a"\n')).cluster.rdzv_backend_set
    chosen = load(write(tmp_path, '[cluster]\nrdzv_backend = "static"\n[[hosts]]\nname = "a"\n')).cluster
    assert chosen.rdzv_backend == "static" and chosen.rdzv_backend_set
