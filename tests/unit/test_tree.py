"""The local project as --sync sees it: .gitignore rules, the walk, what a node lacks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchherd.tree import NodeHas, decide, ignored, parse_rules, project_root, refusal, walk


@pytest.mark.parametrize("patterns,path,is_dir,expected", [
    (["*.pyc"], "a/b/c.pyc", False, True),
    (["*.pyc"], "a/b/c.py", False, False),
    (["build/"], "build", True, True),
    (["build/"], "src/build", True, True),
    (["build/"], "build", False, False),
    (["/build"], "src/build", True, False),
    (["/build"], "build", False, True),
    (["doc/frotz"], "doc/frotz", True, True),
    (["doc/frotz"], "a/doc/frotz", True, False),
    (["**/logs"], "a/b/logs", True, True),
    (["**/logs"], "logs", True, True),
    (["data/**"], "data/x/y.bin", False, True),
    (["a/**/b"], "a/b", False, True),
    (["a/**/b"], "a/x/y/b", False, True),
    (["*.log", "!keep.log"], "keep.log", False, False),
    (["*.log", "!keep.log"], "drop.log", False, True),
    (["file?.txt"], "file1.txt", False, True),
    (["file[0-9].txt"], "filea.txt", False, False),
    (["file[!0-9].txt"], "filea.txt", False, True),
    (["\\#notes"], "#notes", False, True),
    (["# a comment", "", "x"], "x", False, True),
    (["trailing   "], "trailing", False, True),
])
def test_gitignore_rules(patterns: list[str], path: str, is_dir: bool, expected: bool) -> None:
    assert ignored(parse_rules("\n".join(patterns)), path, is_dir) is expected


def test_rules_of_a_subdirectory_apply_below_it_only() -> None:
    rules = parse_rules("/out\n*.tmp", base="pkg")
    assert ignored(rules, "pkg/out", True)
    assert not ignored(rules, "out", True)
    assert ignored(rules, "pkg/deep/x.tmp", False)
    assert not ignored(rules, "x.tmp", False)


def make_project(root: Path) -> Path:
    (root / ".git" / "info").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / ".git" / "info" / "exclude").write_text("secret.txt\n")
    (root / ".gitignore").write_text("__pycache__/\n*.ckpt\n/outputs/\n")
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "pkg" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\0")
    (root / "pkg" / ".gitignore").write_text("local.cfg\n")
    (root / "pkg" / "local.cfg").write_text("x")
    (root / "pkg" / "model.py").write_text("print('model')\n")
    (root / "train.py").write_text("print('train')\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / "weights.ckpt").write_bytes(b"w" * 10)
    (root / "secret.txt").write_text("s")
    (root / "outputs").mkdir()
    (root / "outputs" / "log.txt").write_text("l")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"b" * 100)
    os.symlink("train.py", root / "link.py")
    return root


def test_walk_honours_gitignore_exclude_and_never_sends_git(tmp_path: Path) -> None:
    listing = walk(make_project(tmp_path), exclude=["data/"])
    paths = [entry.path for entry in listing.entries]
    assert paths == [".gitignore", "link.py", "pkg/.gitignore", "pkg/model.py", "run.sh", "train.py"]
    entries = listing.by_path()
    assert entries["run.sh"].executable and not entries["train.py"].executable
    assert entries["link.py"].link == "train.py"
    assert listing.total_bytes == sum(entry.size for entry in listing.entries)


def test_outside_a_git_repository_gitignore_files_are_plain_files(tmp_path: Path) -> None:
    (tmp_path / ".gitignore").write_text("*.txt\n")
    (tmp_path / "a.txt").write_text("a")
    assert [entry.path for entry in walk(tmp_path).entries] == [".gitignore", "a.txt"]
    assert [entry.path for entry in walk(tmp_path, exclude=["*.txt"]).entries] == [".gitignore"]


def test_project_root_is_the_enclosing_repository(tmp_path: Path) -> None:
    project = make_project(tmp_path / "repo")
    assert project_root(project / "pkg") == project.resolve()
    (tmp_path / "plain" / "sub").mkdir(parents=True)
    assert project_root(tmp_path / "plain" / "sub") == (tmp_path / "plain" / "sub").resolve()


def test_decide_sends_what_differs_and_records_what_is_equal() -> None:
    answer = NodeHas("/w", need=("a.py",), have={"b.py": "11", "c.py": "22"}, same=3, delete=("old.py",))
    transfer = decide(answer, {"b.py": "11", "c.py": "99"})
    assert transfer.send == frozenset({"a.py", "c.py"})
    assert transfer.equal == ("b.py",)
    assert transfer.delete == ("old.py",)


def make_careless_project(root: Path) -> Path:
    """A project as a directory picks it up over time: keys, credentials, secrets, old logs."""
    files = {"train.py": "t", "id_utils.py": "kept: not a key", ".envrc": "kept", "env.py": "kept",
             ".ssh/id_ed25519": "k", ".ssh/config": "c", ".gnupg/pubring.kbx": "g", ".aws/credentials": "a",
             ".netrc": "n", "certs/server.pem": "p", "keys/id_rsa": "r", "keys/id_rsa.pub": "r",
             "keys/id_ed25519_sk-cert.pub": "c", ".env": "SECRET=1", "app/.env.local": "SECRET=2",
             "torchherd-logs/r1/node0.log": "old run", "sub/torchherd-logs/r2/node0.log": "older run",
             "mylogs/r3/node0.log": "--log-dir mylogs"}
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_private_material_and_logs_are_left_out_and_what_was_private_is_said(tmp_path: Path) -> None:
    root = make_careless_project(tmp_path)
    listing = walk(root, leave_out=[root / "mylogs", tmp_path.parent / "elsewhere"])
    assert [entry.path for entry in listing.entries] == [".envrc", "env.py", "id_utils.py", "train.py"]
    assert listing.private == (".aws/", ".env", ".gnupg/", ".netrc", ".ssh/", "app/.env.local", "certs/server.pem",
                               "keys/id_ed25519_sk-cert.pub", "keys/id_rsa", "keys/id_rsa.pub")
    assert listing.complete


def test_an_include_pattern_takes_private_material_back_never_the_logs(tmp_path: Path) -> None:
    root = make_careless_project(tmp_path)
    listing = walk(root, exclude=["*.pub"], include=[".env", "*.pub", "torchherd-logs/"],
                   leave_out=[root / "mylogs"])
    paths = [entry.path for entry in listing.entries]
    assert ".env" in paths and "keys/id_rsa.pub" in paths and "keys/id_ed25519_sk-cert.pub" in paths
    assert "app/.env.local" not in paths and "keys/id_rsa" not in paths
    assert not any("logs/" in path for path in paths)
    taken = walk(root, exclude=["!.ssh/"]).by_path()  # gitignore's own negation works as well
    assert ".ssh/config" in taken and ".ssh/id_ed25519" not in taken  # a key within is named on its own


def test_the_log_directory_is_left_out_inside_a_git_repository_too(tmp_path: Path) -> None:
    root = make_project(tmp_path / "repo")
    (root / "torchherd-logs" / "r1").mkdir(parents=True)
    (root / "torchherd-logs" / "r1" / "node0.log").write_text("old")
    assert not any(entry.path.startswith("torchherd-logs") for entry in walk(root).entries)


def test_a_directory_outside_git_over_the_thresholds_is_refused_saying_what_would_travel(tmp_path: Path) -> None:
    root = tmp_path / "plain"
    root.mkdir()
    for index in range(6):
        (root / f"f{index}.txt").write_text("x" * 10)
    (root / ".env").write_text("not counted: never sent")
    home = tmp_path / "home"
    assert refusal(root, home=home, max_files=6) is None
    assert refusal(root, home=home, max_files=5) == (
        f"{root} is not in a git repository and would send 6 files (60 B) to every node")
    assert refusal(root, home=home, max_bytes=59) == (
        f"{root} is not in a git repository and would send 6 files (60 B) to every node")
    assert refusal(root, ["f0.txt"], home=home, max_files=5) is None  # what is excluded is not sent
    (root / ".git").mkdir()
    assert refusal(root, home=home, max_files=5) is None  # a git repository: its .gitignore says what goes


def test_the_home_directory_and_above_are_refused_git_or_not(tmp_path: Path) -> None:
    home = tmp_path / "home" / "me"
    (home / ".git").mkdir(parents=True)  # a dotfiles repository
    (home / "notes.txt").write_text("n")
    assert refusal(home, home=home) == f"{home} is your home directory; it would send 1 file (1 B) to every node"
    assert refusal(home.parent, home=home) == (
        f"{home.parent} is above your home directory {home}; it would send 1 file (1 B) to every node")
    assert refusal(home / ".git", home=home) is None


def test_a_refusal_counts_no_further_than_it_needs(tmp_path: Path) -> None:
    for index in range(20):
        (tmp_path / f"f{index}").write_text("")
    listing = walk(tmp_path, limit=7)
    assert len(listing.entries) == 7 and not listing.complete


def test_the_filesystem_root_is_refused_without_walking_it(tmp_path: Path) -> None:
    assert refusal(Path("/"), home=tmp_path) == (
        "/ is the filesystem's root; it would send every file of this machine to every node")


def test_a_link_that_cannot_be_read_is_skipped_not_an_internal_error(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "cwd").symlink_to("/nowhere")

    def refused(path: object) -> str:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "readlink", refused)
    listing = walk(tmp_path)
    assert [entry.path for entry in listing.entries] == ["a.py"]
    assert listing.skipped == ("cwd: cannot read the link (Permission denied)",)
