"""The light ``prorsa-sdk`` distribution (``sdk/pyproject.toml``): what a trainer installs.

A trainer that only emits events must not pull in the operator's dependencies (numpy,
aiohttp, prometheus-client, kopf, ...). The wheel is built from ``sdk/`` with pip, as a
user would, then its metadata and its code are checked: the code runs from the wheel in an
interpreter where every operator dependency fails to import.
"""

from __future__ import annotations

import email
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIGHT = {"pydantic", "httpx", "sniffio"}
HEAVY = ("numpy", "aiohttp", "prometheus_client", "kopf", "kubernetes", "yaml")
OPERATOR = ("prorsa", "prorsa_agent", "prorsa_lab")


def _setuptools_major() -> int:
    return int(importlib.metadata.version("setuptools").split(".")[0])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Build from a copy: pip builds in the source tree and leaves build/ and *.egg-info.
    src = tmp_path_factory.mktemp("src") / "sdk"
    shutil.copytree(
        ROOT / "sdk", src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    )
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)]
    if _setuptools_major() >= 77:  # `make test` installs it: no index needed
        cmd.insert(4, "--no-build-isolation")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = out.glob("prorsa_sdk-*.whl")
    return built


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(zf.read(name))


def test_metadata_requires_only_the_light_dependencies(wheel: Path) -> None:
    meta = metadata(wheel)
    assert meta["Name"] == "prorsa-sdk"
    requires = meta.get_all("Requires-Dist") or []
    names = {re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0].lower() for r in requires}
    assert names == LIGHT
    assert not names & {"numpy", "aiohttp", "prometheus-client", "kopf", "kubernetes", "pyyaml"}
    assert meta["License-Expression"] == "Apache-2.0"


def test_sdk_version_matches_the_operator(wheel: Path) -> None:
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    from prorsa import __version__ as operator_version
    from prorsa_contract import __version__ as contract_version

    assert metadata(wheel)["Version"] == root == operator_version == contract_version


def test_wheel_holds_the_contract_and_the_sdk_whole(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"prorsa_contract", "prorsa_sdk"}
    sources = {
        p.relative_to(ROOT / "sdk").as_posix()
        for package in top
        for p in (ROOT / "sdk" / package).rglob("*")
        if p.suffix in (".py", ".typed")
    }
    assert sources <= set(names)


BLOCKED_RUN = """
import importlib, importlib.abc, pkgutil, sys

BLOCKED = set(sys.argv[2].split(","))

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed with prorsa-sdk")
        return None

sys.meta_path.insert(0, Blocker())
sys.path.insert(0, sys.argv[1])
import prorsa_contract, prorsa_sdk
for package in (prorsa_contract, prorsa_sdk):
    assert package.__file__.startswith(sys.argv[1]), package.__file__
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)

from prorsa_sdk import EventEmitter, TrajectoryTracker
tracker = TrajectoryTracker()
tracker.apply({"id": "e1", "type": "sample_dispatched", "trajectory": "t1", "ts": 1.0,
               "group": "g", "task": "math"})
print(tracker.snapshot(ts=2.0).model_dump_json())
"""


def test_the_sdk_runs_from_the_wheel_without_the_operator_dependencies(
    wheel: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    blocked = ",".join(HEAVY + OPERATOR)
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, str(site), blocked],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    snapshot = result.stdout.strip().splitlines()[-1]
    assert '"trajectory":"t1"' in snapshot and '"state":"starting"' in snapshot
