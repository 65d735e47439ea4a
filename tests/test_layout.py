"""The source layout: every package is installed, and no two modules of a package share a name.

A module's file name is what a reader sees in tracebacks, logs and ``git log --stat``, with
its folder: ``doubles/kube/watch.py`` says which watch it is, so a name need be unique only
within its subpackage, and a name does not repeat what its package already says
(``kube/watch.py``, not ``kube/kube_watch.py``).
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SOURCE_ROOTS = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]
# Names that mean the same thing in every package.
GENERIC = {"__init__.py", "__main__.py", "conftest.py"}


def modules() -> list[Path]:
    return [
        path
        for root in SOURCE_ROOTS
        for path in (ROOT / root).rglob("*.py")
        if "__pycache__" not in path.parts and path.name not in GENERIC
    ]


def test_no_two_modules_of_a_package_share_a_file_name() -> None:
    """Unique within a subpackage: a module and a subpackage of one folder never share a name."""
    by_name: dict[tuple[Path, str], list[str]] = defaultdict(list)
    for path in modules():
        by_name[path.parent, path.stem].append(path.relative_to(ROOT).as_posix())
    for package in {path.parent for path in modules()}:
        for sub in package.iterdir():
            if (sub / "__init__.py").exists():
                by_name[package, sub.name].append(sub.relative_to(ROOT).as_posix() + "/")
    shared = {name: paths for (_, name), paths in by_name.items() if len(paths) > 1}
    assert not shared, f"rename so each name says what it holds: {shared}"


def test_no_module_repeats_its_package_name() -> None:
    """``kube/watch.py``, not ``kube/kube_watch.py``: the folder already says it."""
    stutter = [
        path.relative_to(ROOT).as_posix()
        for path in modules()
        if path.stem.startswith(path.parent.name + "_")
    ]
    assert not stutter, f"drop the package's name from these file names: {stutter}"


def test_every_package_is_under_a_source_root() -> None:
    """A top-level package outside the roots would be left out of `pip install -e .`."""
    packages = {
        init.parent.relative_to(ROOT).parts[0]
        for init in ROOT.glob("*/*/__init__.py")
        # tests/real_engine is a package of tests (its conftest must not shadow tests/'s).
        if not init.parent.name.startswith(".") and init.parent.parent.name != "tests"
    }
    assert packages <= set(SOURCE_ROOTS), packages - set(SOURCE_ROOTS)
    assert {"operator", "sdk", "engine_image", "tools"} <= set(SOURCE_ROOTS)
    for root in SOURCE_ROOTS:  # and each root holds a package (no stale entry)
        assert list((ROOT / root).glob("*/__init__.py")), root


def test_every_slow_mark_names_a_test_that_exists() -> None:
    """`make test-fast` leaves out what tests/conftest.py lists: a renamed test or module
    must not fall out of the list unnoticed (and then slow the fast run down)."""
    from conftest import SLOW_MODULES, SLOW_TESTS

    tests = ROOT / "tests"
    for module in SLOW_MODULES:
        assert (tests / module).is_file(), f"tests/conftest.py SLOW_MODULES: no {module}"
    for module, names in SLOW_TESTS.items():
        tree = ast.parse((tests / module).read_text())
        defined = {
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        assert names <= defined, f"tests/conftest.py SLOW_TESTS: not in {module}: {names - defined}"


def test_the_contract_package_says_what_it_holds() -> None:
    """`prorsa_contract` is what every side depends on: its docstring lists each module."""
    import prorsa_contract

    package = Path(prorsa_contract.__file__).parent
    doc = prorsa_contract.__doc__ or ""
    missing = [
        path.stem
        for path in sorted(package.glob("*.py"))
        if path.name != "__init__.py" and f"prorsa_contract.{path.stem}`" not in doc
    ]
    assert not missing, f"sdk/prorsa_contract/__init__.py: list these modules: {missing}"
