"""The local project as --sync sees it: .gitignore rules, the walk, what a node lacks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchherd.tree import NodeHas, decide, ignored, parse_rules, project_root, walk


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
