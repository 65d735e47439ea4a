"""The import contracts mean what they say: each one fails when it is broken.

``make lint`` runs import-linter over the contracts of pyproject.toml. Here each contract
is broken on purpose, on a copy of the source tree (never in the repository): one module
that makes the forbidden import is written into the copy, ``lint-imports`` runs on it with
that contract alone, and must fail naming the contract and the module. The copy without
the module keeps every contract, so the failure is the violation's doing. Import-linter
cannot see attribute access, so the rule that the lab uses only the public ``Kube`` is
checked here from the lab's source.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorsa.k8s.kube import Kube

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SOURCE_ROOTS = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]
CONTRACTS = {c["id"]: c for c in PYPROJECT["tool"]["importlinter"]["contracts"]}
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# contract id -> a module that breaks it: (path in the tree, source)
VIOLATIONS = {
    # The core opening a database: nobody forbade sqlite3, the core's list does not allow it.
    "core-allowed-imports": ("operator/prorsa/core/forecast/violation.py", "import sqlite3\n"),
    # The core reaching up into an adapter layer.
    "operator-layers": ("operator/prorsa/core/forecast/violation.py", "import prorsa.clusters\n"),
    # The forecast reaching up to a stage of the tick that uses it.
    "core-layers": ("operator/prorsa/core/forecast/violation.py", "import prorsa.core.demand\n"),
    "contract-pydantic-only": ("sdk/prorsa_contract/violation.py", "import numpy\n"),
    "sdk-contract-only": ("sdk/prorsa_sdk/violation.py", "import prorsa.core.spec\n"),
    # The SDK's emitter core reaching up to a driver, and doing a driver's I/O. A module of
    # the copy that exists already gets the import appended (and is restored after).
    "sdk-layers": ("sdk/prorsa_sdk/emitter_core.py", "import prorsa_sdk.sync_emitter\n"),
    "sdk-core-no-io": ("sdk/prorsa_sdk/emitter_core.py", "import httpx\n"),
    "agent-contract-only": ("engine_image/prorsa_agent/violation.py", "import prorsa_sdk\n"),
    "operator-without-lab": ("operator/prorsa/k8s/violation.py", "import prorsa_lab.sim\n"),
    "operator-runs-agent": ("operator/prorsa/k8s/violation.py", "import prorsa_agent.config\n"),
    # The demo reaching past the engine double's facade into one of its modules.
    "engine-double-one-path": (
        "tools/prorsa_lab/demo/violation.py",
        "import prorsa_lab.doubles.engine.model\n",
    ),
    # The emulator reaching into the engine double it is meant to know nothing of.
    "lab-doubles-apart": (
        "tools/prorsa_lab/doubles/kube/violation.py",
        "import prorsa_lab.doubles.engine.model\n",
    ),
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The source packages and pyproject.toml, copied: the Python files alone."""
    if not LINT_IMPORTS.exists():
        pytest.skip(f"no {LINT_IMPORTS} (the test extra installs import-linter)")
    dst = tmp_path_factory.mktemp("contracts")

    def not_python(folder: str, names: list[str]) -> list[str]:
        return [
            n
            for n in names
            if n == "__pycache__" or (Path(folder, n).is_file() and not n.endswith(".py"))
        ]

    for root in SOURCE_ROOTS:
        shutil.copytree(ROOT / root, dst / root, ignore=not_python)
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    # The "allowed" contract type, which lint-imports loads from the repository root.
    (dst / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "import_allowlist.py", dst / "scripts")
    return dst


def lint_imports(tree: Path, *contracts: str) -> tuple[int, str]:
    """``lint-imports`` on the copy (only ``contracts``, when given): exit code, output."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(str(tree / r) for r in SOURCE_ROOTS)}
    args = [str(LINT_IMPORTS), "--no-cache", "--no-logo"]
    for contract in contracts:
        args += ["--contract", contract]
    done = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


class Violations:
    """Modules written into the copy for one test (or imports appended to one of its
    modules), undone after it."""

    def __init__(self, tree: Path) -> None:
        self.tree = tree
        self.written: list[Path] = []
        self.appended: dict[Path, str] = {}

    def write(self, path: str, source: str) -> None:
        target = self.tree / path
        if target.exists():
            self.appended.setdefault(target, target.read_text())
            target.write_text(target.read_text() + source)
            return
        target.write_text(source)
        self.written.append(target)

    def undo(self) -> None:
        for path in self.written:
            path.unlink()
        for path, text in self.appended.items():
            path.write_text(text)


def module_name(path: str) -> str:
    """The dotted name of the module at ``path`` (under a source root)."""
    return ".".join(Path(path).with_suffix("").parts[1:])


@pytest.fixture
def violation(tree: Path) -> Iterator[Violations]:
    violations = Violations(tree)
    yield violations
    violations.undo()


def test_the_copy_keeps_every_contract(tree: Path) -> None:
    code, out = lint_imports(tree)
    assert code == 0, out
    assert f"{len(CONTRACTS)} kept, 0 broken" in out


def test_every_contract_has_a_violation_here() -> None:
    assert set(CONTRACTS) == set(VIOLATIONS)


@pytest.mark.parametrize("contract", sorted(VIOLATIONS))
def test_a_violation_breaks_its_contract(tree: Path, violation: Violations, contract: str) -> None:
    path, source = VIOLATIONS[contract]
    violation.write(path, source)
    code, out = lint_imports(tree, contract)
    assert code != 0, out
    assert f"{CONTRACTS[contract]['name']} BROKEN" in out
    assert module_name(path) in out  # the module the violation is in


# What the core must never do, each a module it is not allowed: adapters and what they drive,
# the contract's I/O helpers, event loops, threads and processes (their C halves too), the
# network, files, clocks, logs, and loading modules by name.
CORE_NEVER = [
    "aiohttp", "kopf", "kubernetes", "httpx", "prometheus_client",
    "prorsa.k8s", "prorsa.ingest", "prorsa.clusters", "prorsa.engines", "prorsa.control",
    "prorsa.shell", "prorsa.commands", "prorsa.cli",
    "prorsa_sdk", "prorsa_agent", "prorsa_lab",
    "prorsa_contract.aio", "prorsa_contract.serving_tls",
    "asyncio", "threading", "_thread", "concurrent", "multiprocessing", "subprocess", "signal",
    "selectors", "socket", "_socket", "ssl", "http", "urllib", "sqlite3",
    "io", "os", "pathlib", "shutil", "tempfile", "glob", "yaml",
    "time", "datetime", "logging", "importlib",
]  # fmt: skip


def test_the_core_imports_nothing_that_does_io(tree: Path, violation: Violations) -> None:
    """Every module the core may not import, each named when imported: none of them needs to
    be listed anywhere for the contract to refuse it."""
    contract = CONTRACTS["core-allowed-imports"]
    assert contract["type"] == "allowed"
    assert not {m.split(".")[0] for m in CORE_NEVER} & set(contract["allowed_modules"])
    violation.write(
        "operator/prorsa/core/forecast/violation.py",
        "".join(f"import {module}\n" for module in CORE_NEVER),
    )
    code, out = lint_imports(tree, "core-allowed-imports")
    assert code != 0 and f"{contract['name']} BROKEN" in out, out
    missed = [m for m in CORE_NEVER if f"prorsa.core.forecast.violation -> {m} " not in out]
    assert not missed, out


def test_a_core_module_in_no_layer_breaks_the_core_layers(
    tree: Path, violation: Violations
) -> None:
    """The core's layers are exhaustive: a new module must be given its place."""
    violation.write("operator/prorsa/core/violation.py", '"""A module in no layer."""\n')
    code, out = lint_imports(tree, "core-layers")
    assert code != 0 and "- prorsa.core.violation" in out, out


# -- the lab and the operator's Kubernetes client -------------------------------------------


def private_uses(source: str, names: set[str]) -> list[int]:
    """Lines of ``source`` that reach for one of ``names`` on an object not their own."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr in names
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    )


KUBE_INTERNALS = {n for n in vars(Kube) if n.startswith("_") and not n.startswith("__")}


def test_the_lab_uses_only_the_public_kube() -> None:
    """The lab's fakes (kubelet, LeaderWorkerSet controller) and stack share the operator's
    ``Kube``: through its public methods only (``Kube.call`` for the calls that are not the
    operator's), so that changing the operator's internals cannot change the doubles."""
    assert {"_call", "_plain"} <= KUBE_INTERNALS
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "tools" / "prorsa_lab").rglob("*.py"))
        for line in private_uses(path.read_text(), KUBE_INTERNALS)
    ]
    assert not found, f"the lab uses Kube internals: {found}"


def test_a_private_kube_call_is_found() -> None:
    source = "async def f(kube):\n    x = 1\n    return kube._plain(await self.kube._call(g))\n"
    assert private_uses(source, KUBE_INTERNALS) == [3, 3]
    assert private_uses("class K:\n    def f(self):\n        self._call()\n", KUBE_INTERNALS) == []
