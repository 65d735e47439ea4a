"""The source layout: every package is installed, and no two modules of a package share a name.

A module's file name is what a reader sees in tracebacks, logs and ``git log --stat``, with
its folder: ``doubles/kube/watch.py`` says which watch it is, so a name need be unique only
within its subpackage, and a name does not repeat what its package already says
(``kube/watch.py``, not ``kube/kube_watch.py``). No class of the operator package is longer
than a reader can hold: one that grows past :data:`MAX_CLASS_LINES` is cut along what it
does.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

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


# Tests of their own, run by pytest with this suite's conftest: each starts the operator.
WHOLE_OPERATOR_TESTS = """
import asyncio
import subprocess
import sys

import pytest

# `prorsa operator` as the lab's replicas run it; a flag it refuses ends it at once.
OPERATOR = [sys.executable, "-m", "prorsa.cli", "operator", "--no-such-flag"]


def test_unmarked_runs_the_operator():
    subprocess.run(OPERATOR, capture_output=True)


def test_unmarked_runs_the_operator_in_this_process():
    from prorsa.shell.process import OperatorProcess

    asyncio.run(OperatorProcess.run(None))


@pytest.fixture(scope="module")
def operator_once():
    return subprocess.run(OPERATOR, capture_output=True).returncode


def test_unmarked_runs_the_operator_in_a_module_fixture(operator_once):
    pass


@pytest.mark.slow
def test_marked_runs_the_operator():
    assert subprocess.run(OPERATOR, capture_output=True).returncode == 2


def test_unmarked_asks_the_operator_for_its_help():
    assert subprocess.run([*OPERATOR[:4], "--help"], capture_output=True).returncode == 0
"""


def test_a_test_that_runs_the_operator_without_the_slow_mark_fails(
    pytester: pytest.Pytester,
) -> None:
    """`make test-fast` leaves out the tests marked slow: one that runs the whole operator
    and does not say so fails, naming itself and the mark (tests/conftest.py), whether it
    starts the operator as a process, in this one, or in a fixture of its module."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_whole_operator=WHOLE_OPERATOR_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2, errors=1)
    out = result.stdout.str()
    for test, what in [
        ("test_unmarked_runs_the_operator", "prorsa operator"),
        ("test_unmarked_runs_the_operator_in_this_process", "OperatorProcess.run"),
        ("test_unmarked_runs_the_operator_in_a_module_fixture", "prorsa operator"),
    ]:
        assert (
            f"test_whole_operator.py::{test} runs the whole operator ({what}) without the "
            "mark `slow`"
        ) in out, out


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


# A class of the operator package that passes this many lines is cut along what it does, as
# the Controller was cut along its tick and the trajectory table along its parts.
MAX_CLASS_LINES = 400
# Longer still, each with the change that cuts it. The list only shrinks: an entry that is
# no longer over the bound (or no longer there) fails the test too.
LONG_CLASSES: dict[str, str] = {}


def class_lengths(package: Path) -> dict[str, int]:
    """Lines of every class (nested ones too) under ``package``, by ``module::Class``."""
    lengths: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lengths[f"{module}::{node.name}"] = node.end_lineno - node.lineno + 1
    return lengths


def test_no_class_of_the_operator_package_is_over_400_lines() -> None:
    lengths = class_lengths(ROOT / "operator" / "prorsa")
    assert "core/forecast/table.py::TrajectoryTable" in lengths  # the walk found the package
    over = {name: n for name, n in lengths.items() if n > MAX_CLASS_LINES}
    new = {name: n for name, n in over.items() if name not in LONG_CLASSES}
    assert not new, (
        f"classes over {MAX_CLASS_LINES} lines (operator/prorsa/): {new}; cut each along "
        "what it does"
    )
    done = sorted(set(LONG_CLASSES) - set(over))
    assert not done, f"no longer over {MAX_CLASS_LINES} lines: drop {done} from LONG_CLASSES"
