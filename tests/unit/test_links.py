"""The links as check --bandwidth measured them, kept for a later run's replication."""

from __future__ import annotations

from pathlib import Path

from torchherd.engine.records.links import KEPT_SECONDS, keep_links, links_file, measured_link

FIGURES = {"links": [{"from": "node0", "to": "node1", "gbit": 2.4}, {"from": "node1", "to": "node0", "gbit": None},
                     {"from": "node1", "to": "node2", "gbit": 0.8}]}
ADDRESSES = {"node0": "10.0.0.1", "node1": "10.0.0.2"}


def test_each_measured_link_is_kept_by_its_hosts_addresses_in_bytes_per_second(tmp_path: Path) -> None:
    keep_links(FIGURES, ADDRESSES, now=1000.0, directory=tmp_path)
    assert measured_link("10.0.0.1", "10.0.0.2", now=1000.0, directory=tmp_path) == 300e6
    assert measured_link("10.0.0.2", "10.0.0.1", now=1000.0, directory=tmp_path) is None  # it failed: no figure
    assert links_file(tmp_path).stat().st_mode & 0o777 == 0o600


def test_a_new_measure_replaces_the_old_and_an_old_one_stands_no_longer(tmp_path: Path) -> None:
    keep_links(FIGURES, ADDRESSES, now=1000.0, directory=tmp_path)
    keep_links({"links": [{"from": "node0", "to": "node1", "gbit": 8.0}]}, ADDRESSES, now=2000.0, directory=tmp_path)
    assert measured_link("10.0.0.1", "10.0.0.2", now=2000.0, directory=tmp_path) == 1e9
    assert measured_link("10.0.0.1", "10.0.0.2", now=2000.0 + KEPT_SECONDS + 1, directory=tmp_path) is None


def test_a_damaged_file_keeps_nothing(tmp_path: Path) -> None:
    links_file(tmp_path).write_text('{"10.0.0.1 10.0.0.2": ["fast", 1]')
    assert measured_link("10.0.0.1", "10.0.0.2", directory=tmp_path) is None
    links_file(tmp_path).write_text('{"10.0.0.1 10.0.0.2": [true, 1], "10.0.0.2 10.0.0.1": [-5, 1]}')
    assert measured_link("10.0.0.1", "10.0.0.2", directory=tmp_path) is None
    assert measured_link("10.0.0.2", "10.0.0.1", directory=tmp_path) is None
