"""The source layout: every package is installed, and no two modules share a name.

A module's file name is what a reader sees in tracebacks, logs and ``git log --stat``; two
``engine.py`` files for two different engines make every one of them ambiguous.
"""

from __future__ import annotations

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


def test_no_two_modules_share_a_file_name() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in modules():
        by_name[path.name].append(path.relative_to(ROOT).as_posix())
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"rename so each name says what it holds: {shared}"


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
