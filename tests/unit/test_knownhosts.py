"""known_hosts as OpenSSH keeps it: one test per rule (transport.knownhosts)."""

from __future__ import annotations

import base64
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchherd.transport import knownhosts
from torchherd.transport.knownhosts import for_name, host_key_name, load, parse


def blob(kind: str = "ssh-ed25519", seed: int = 1) -> bytes:
    body = bytes([seed]) * 32
    return len(kind).to_bytes(4, "big") + kind.encode() + len(body).to_bytes(4, "big") + body


def line(hosts: str, key: bytes, marker: str = "") -> str:
    return f"{marker + ' ' if marker else ''}{hosts} {knownhosts.key_type_of(key)} {base64.b64encode(key).decode()}\n"


def verdict(text: str, name: str, key: bytes) -> str:
    return for_name(parse(text, "known_hosts"), name).verdict(key).kind


ED1, ED2, RSA = blob(seed=1), blob(seed=2), blob("ssh-rsa", seed=3)


def test_a_listed_key_is_known_and_a_case_difference_does_not_matter() -> None:
    assert verdict(line("node1,10.0.0.1", ED1), "node1", ED1) == "known"
    assert verdict(line("Node1.Example", ED1), "node1.example", ED1) == "known"
    assert verdict(line("node1", ED1), "node2", ED1) == "unknown"


def test_hashed_entries_match_only_their_name() -> None:
    hashed = knownhosts.hash_name("node1", b"s" * 20)
    assert verdict(line(hashed, ED1), "node1", ED1) == "known"
    assert verdict(line(hashed, ED1), "node2", ED1) == "unknown"
    assert verdict(line("|1|bad|entry", ED1), "node1", ED1) == "unknown"


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs OpenSSH's ssh-keygen")
def test_hashed_entries_agree_with_ssh_keygen(tmp_path: Path) -> None:
    key = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    kind, encoded = key.with_suffix(".pub").read_text().split()[:2]
    theirs = tmp_path / "theirs"
    theirs.write_text(f"[gpu-1]:2222 {kind} {encoded}\n")
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(theirs)], check=True, capture_output=True)
    assert for_name(load([str(theirs)]), "[gpu-1]:2222").verdict(base64.b64decode(encoded)).kind == "known"
    ours = tmp_path / "ours"
    ours.write_text(knownhosts.entry_line("[gpu-1]:2222", base64.b64decode(encoded), hashed=True))
    found = subprocess.run(["ssh-keygen", "-F", "[gpu-1]:2222", "-f", str(ours)], capture_output=True, text=True)
    assert found.returncode == 0 and encoded in found.stdout


def test_wildcards_and_negations() -> None:
    text = line("*.gpu.example,!bad.gpu.example", ED1) + line("node?", ED2)
    assert verdict(text, "a.gpu.example", ED1) == "known"
    assert verdict(text, "bad.gpu.example", ED1) == "unknown"
    assert verdict(text, "node7", ED2) == "known"
    assert verdict(text, "node17", ED2) == "unknown"


def test_a_port_other_than_22_is_its_own_name() -> None:
    text = line("[node1]:2222", ED1) + line("node1", ED2) + line("[*.lab]:2200", RSA)
    assert host_key_name("Node1", 2222) == "[node1]:2222" and host_key_name("node1", 22) == "node1"
    assert verdict(text, "[node1]:2222", ED1) == "known"
    assert verdict(text, "[node1]:2222", ED2) == "changed"
    assert verdict(text, "node1", ED2) == "known"
    assert verdict(text, "[a.lab]:2200", RSA) == "known"
    assert verdict(text, "a.lab", RSA) == "unknown"


def test_a_different_key_of_the_same_type_is_changed() -> None:
    result = for_name(parse(line("node1", ED1), "kh"), "node1").verdict(ED2)
    assert result.kind == "changed" and result.entry is not None and result.entry.where == "kh:1"


def test_a_key_of_another_type_than_the_one_on_record_is_refused_not_new() -> None:
    assert verdict(line("node1", ED1), "node1", RSA) == "other-type"


def test_revoked_keys_are_refused_even_when_also_listed_as_good() -> None:
    text = line("node1", ED1) + line("*", ED1, "@revoked")
    result = for_name(parse(text, "kh"), "node1").verdict(ED1)
    assert result.kind == "revoked" and result.entry is not None and result.entry.line == 2
    assert for_name(parse(text, "kh"), "node1").keys == ()
    assert verdict(line("other", ED1, "@revoked") + line("node1", ED1), "node1", ED1) == "known"


def test_a_revoked_key_in_a_global_file_counts(tmp_path: Path) -> None:
    user, system = tmp_path / "user", tmp_path / "global"
    user.write_text(line("node1", ED1))
    system.write_text(line("*", ED1, "@revoked"))
    assert for_name(load([str(user), str(system)]), "node1").verdict(ED1).kind == "revoked"


def test_a_host_vouched_for_only_by_a_ca_cannot_be_verified() -> None:
    text = line("*.example", RSA, "@cert-authority")
    assert verdict(text, "a.example", ED1) == "cert-authority"
    assert verdict(text + line("a.example", ED1), "a.example", ED1) == "known"


def test_keys_in_global_files_count_and_missing_files_are_no_error(tmp_path: Path) -> None:
    system = tmp_path / "ssh_known_hosts"
    system.write_text(line("node1", ED1))
    entries = load([str(tmp_path / "missing"), str(tmp_path), str(system)])
    assert for_name(entries, "node1").verdict(ED1).kind == "known"


def test_a_host_key_alias_is_looked_up_as_written() -> None:
    assert verdict(line("stable-name", ED1), "stable-name", ED1) == "known"


def test_lines_that_are_not_entries_are_skipped() -> None:
    text = ("# comment\n\n@unknown-marker node1 ssh-ed25519 AAAA\nnode1 ssh-ed25519 not-base64!\n"
            f"node1 ssh-rsa {base64.b64encode(ED1).decode()}\nnode1\n" + line("node1", ED2))
    entries = parse(text, "kh")
    assert [entry.line for entry in entries] == [7]


def test_append_creates_ssh_dir_0700_and_hashes_when_asked(tmp_path: Path) -> None:
    home = tmp_path / "home"
    path = home / ".ssh" / "known_hosts"
    knownhosts.append(str(path), knownhosts.entry_line("node1", ED1, hashed=True), str(home))
    assert stat.S_IMODE(os.stat(home / ".ssh").st_mode) == 0o700
    written = path.read_text()
    assert written.startswith("|1|") and "node1" not in written
    assert for_name(load([str(path)]), "node1").verdict(ED1).kind == "known"


def test_append_keeps_lines_apart_and_refuses_other_missing_directories(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    path.write_text(line("node0", ED2).rstrip("\n"))
    knownhosts.append(str(path), knownhosts.entry_line("node1", ED1, hashed=False), str(tmp_path))
    assert path.read_text().splitlines()[1].startswith("node1 ssh-ed25519 ")
    with pytest.raises(OSError):
        knownhosts.append(str(tmp_path / "nowhere" / "kh"), "x\n", str(tmp_path))


@given(st.from_regex(r"[a-z0-9][a-z0-9.-]{0,20}", fullmatch=True), st.binary(min_size=1, max_size=32),
       st.integers(1, 65535))
def test_hashed_names_match_exactly_themselves(name: str, salt: bytes, port: int) -> None:
    recorded = host_key_name(name, port)
    entry = parse(knownhosts.entry_line(recorded, ED1, hashed=True, salt=salt), "kh")[0]
    assert entry.matches(recorded)
    assert not entry.matches(recorded + "x")


def test_a_file_is_read_again_once_a_key_is_recorded_in_it(tmp_path: Path) -> None:
    # load() keeps each file parsed while it is unchanged (every node's connection loads it).
    path = tmp_path / "known_hosts"
    path.write_text(line("node1", ED1))
    assert [entry.hosts for entry in load([str(path)])] == ["node1"]
    knownhosts.append(str(path), line("node2", ED2), str(tmp_path))
    assert [entry.hosts for entry in load([str(path)])] == ["node1", "node2"]
    assert for_name(load([str(path)]), "node2").verdict(ED2).kind == "known"
