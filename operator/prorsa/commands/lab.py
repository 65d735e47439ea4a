"""The lab's parts that ``prorsa`` commands run, reached through entry points.

The operator names no module of the lab (package ``prorsa_lab``): the lab registers its
parts in pyproject.toml's ``[project.entry-points]`` and a command loads the one it runs,
when it runs, so no command pays for another's imports (``prorsa bench rollout`` never
loads the chaos suite and its kopf). A part that needs a library of an extra that is not
installed is refused with one line naming the extra, not a traceback: after a plain
``pip install prorsa`` every command either runs or says what to install.

Groups:
- ``prorsa.lab``: one part per command that runs the lab (``demo``, ``engine-double``,
  ``replay``).
- ``prorsa.benches``: the performance benchmarks, each a module with ``HELP``,
  ``configure(parser)`` and ``run(args) -> int``; ``prorsa bench all`` runs them all.
- ``prorsa.bench_suites``: the same for the robustness suites and the operator at scale,
  minutes to an hour each, left out of ``all``.
"""

from __future__ import annotations

import re
from importlib.metadata import EntryPoint, PackageNotFoundError, entry_points, requires
from typing import Any

LAB = "prorsa.lab"
BENCHES = "prorsa.benches"
SUITES = "prorsa.bench_suites"
DISTRIBUTION = "prorsa"
# The extra that brings everything the lab imports (pyproject.toml: operator, bench, and
# the demo's own libraries).
LAB_EXTRA = "demo"


class MissingExtra(Exception):
    """A command, or the part of the lab it runs, imports a library this installation lacks;
    the message says which extra brings it."""


def entry_point(group: str, name: str) -> EntryPoint:
    (found,) = entry_points(group=group, name=name)
    return found


def names(group: str) -> list[str]:
    """The parts registered in ``group``, by name (the order entry points are stored in)."""
    return [e.name for e in entry_points(group=group)]


def load(group: str, name: str) -> Any:
    """The part ``name`` of ``group`` (a module), imported now; :class:`MissingExtra` when
    it needs a library that is not installed."""
    try:
        return entry_point(group, name).load()
    except ModuleNotFoundError as exc:
        missing = missing_extra(exc)
        if missing is None:
            raise
        raise missing from exc


def missing_extra(exc: ModuleNotFoundError) -> MissingExtra | None:
    """What to say of ``exc`` when the module missing is a library, not Prorsa's own."""
    missing = (exc.name or "").split(".")[0]
    if not missing or missing.startswith("prorsa"):
        return None
    extra = extra_providing(missing) or LAB_EXTRA
    return MissingExtra(
        f"needs {missing}, which is not installed here; it comes with the extra "
        f"'{extra}': pip install 'prorsa[{extra}]'"
    )


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def extra_providing(module: str) -> str | None:
    """The first extra of the distribution whose requirements name ``module``'s package
    (a package whose import name differs from its distribution's, like cel-python's
    ``celpy``, is not found: the caller falls back to the lab's extra)."""
    try:
        requirements = requires(DISTRIBUTION) or []
    except PackageNotFoundError:
        return None
    for line in requirements:
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", line)
        package = re.match(r"[A-Za-z0-9._-]+", line)
        if extra and package and _canonical(package.group()) == _canonical(module):
            return extra.group(1)
    return None
