"""Every test module under tests/cluster needs the local cluster (root, network
namespaces) and says so with the ``cluster`` mark, so ``-m "not cluster"`` runs without
root; no unit test module carries that mark."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def _marks(path: Path) -> set[str]:
    """The marks a module's ``pytestmark`` gives every test in it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(target, ast.Name) and target.id == "pytestmark"
                                                for target in node.targets):
            return {item.attr for item in ast.walk(node.value) if isinstance(item, ast.Attribute)
                    and isinstance(item.value, ast.Attribute) and item.value.attr == "mark"}
    return set()


def test_every_cluster_test_module_is_marked_cluster() -> None:
    modules = sorted((TESTS / "cluster").glob("test_*.py"))
    assert modules
    assert [path.name for path in modules if "cluster" not in _marks(path)] == []


def test_no_unit_test_module_is_marked_cluster() -> None:
    assert [path.name for path in sorted((TESTS / "unit").glob("test_*.py")) if "cluster" in _marks(path)] == []


def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports test modules by their base name (rootdir-relative "prepend" mode):
    a unit and a cluster module of one name stop the whole run at collection."""
    names = [path.name for path in sorted(TESTS.glob("*/test_*.py"))]
    assert sorted({name for name in names if names.count(name) > 1}) == []


def _imported_modules(path: Path) -> set[str]:
    """The top-level names of every module ``path`` imports, function-local imports included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_no_test_module_imports_another_or_a_conftest() -> None:
    """What several test modules share lives in tests/support (issue 36): a test module
    imported by another runs its module-level code twice and ties the two together."""
    modules = sorted(TESTS.glob("**/*.py"))
    assert len(modules) > 100
    offending = {str(path.relative_to(TESTS)): sorted(name for name in _imported_modules(path)
                                                      if name.startswith("test_") or name == "conftest")
                 for path in modules}
    assert {path: names for path, names in offending.items() if names} == {}


def test_no_conftest_puts_a_test_directory_on_sys_path() -> None:
    """pytest's pythonpath (pyproject.toml) names tests/ and tests/cluster; no conftest adds more."""
    assert [str(path.relative_to(TESTS)) for path in sorted(TESTS.glob("**/conftest.py"))
            if any(change in path.read_text() for change in ("sys.path.insert", "sys.path.append", "sys.path["))] == []


def test_every_cluster_phase_module_has_its_place_in_the_longest_first_order() -> None:
    """A module LONGEST_FIRST does not name is handed out last: a long one then runs alone at
    the end while the other worker idles. Wholly serial modules never reach that phase."""
    tree = ast.parse((TESTS / "conftest.py").read_text())
    order = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(target, ast.Name) and target.id == "LONGEST_FIRST" for target in node.targets))
    modules = {path.stem for path in (TESTS / "cluster").glob("test_*.py") if "serial" not in _marks(path)}
    assert sorted(modules - set(order)) == []
    assert sorted(set(order) - modules) == []  # nor a module that is gone or now serial


def test_every_test_module_is_under_tests_unit_or_tests_cluster() -> None:
    """scripts/test's unit phase collects tests/unit alone, and its cluster and serial phases
    tests/cluster alone (when no path is given): a test module elsewhere would never run."""
    modules = sorted(TESTS.glob("**/test_*.py"))
    assert modules and [str(path.relative_to(TESTS)) for path in modules
                        if path.parent not in (TESTS / "unit", TESTS / "cluster")] == []
