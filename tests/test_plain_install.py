"""``pip install prorsa`` without extras: every command runs or says which extra to install.

The wheel of the whole distribution is built from a copy of the checkout and installed
into a bare virtual environment with the base dependencies alone (no kopf, kubernetes,
cryptography, matplotlib, kmock, smg: the extras), as a new user's first install is. Each
``prorsa`` command and each ``prorsa bench`` benchmark is asked for ``--help`` there: it
prints its usage, or one line naming the missing library and the extra that brings it,
never a traceback.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bare_venv import bare_venv, clean_env

from prorsa.cli import COMMANDS
from prorsa.commands import lab

ROOT = Path(__file__).resolve().parent.parent
# What the wheel is built from: the four source roots and the project's metadata.
SOURCES = ("operator", "sdk", "engine_image", "tools", "pyproject.toml", "README.md")
EXTRA_LIBRARIES = ("kopf", "kubernetes", "cryptography", "matplotlib", "kmock", "smg")
NEEDS_EXTRA = re.compile(
    r"^prorsa [a-z -]+: error: needs (\w+), which is not installed here; it comes with the "
    r"extra '(\w+)': pip install 'prorsa\[\2\]'$"
)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``prorsa`` command of a plain install."""
    src = tmp_path_factory.mktemp("src")
    for source in SOURCES:
        if (ROOT / source).is_dir():
            shutil.copytree(
                ROOT / source,
                src / source,
                ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"),
            )
        else:
            shutil.copy(ROOT / source, src / source)
    out = tmp_path_factory.mktemp("wheel")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    built = subprocess.run(
        [*pip_wheel, "--quiet", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = out.glob("prorsa-*.whl")
    venv = bare_venv(tmp_path_factory.mktemp("venv"), wheel, ["prorsa"])
    return venv / "bin" / "prorsa"


def run(prorsa: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(prorsa), *args], capture_output=True, text=True, timeout=120, env=clean_env()
    )


def test_the_plain_install_has_none_of_the_extras(plain: Path) -> None:
    python = plain.with_name("python")
    probe = "import importlib.util as u, sys; print(*[n for n in sys.argv[1:] if u.find_spec(n)])"
    found = subprocess.run(
        [str(python), "-c", probe, *EXTRA_LIBRARIES, "prorsa_lab", "numpy"],
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert found.stdout.split() == ["prorsa_lab", "numpy"], found.stderr


def every_help() -> list[list[str]]:
    """Every command's ``--help``, and every benchmark's."""
    benches = [*lab.names(lab.BENCHES), *lab.names(lab.SUITES), "all"]
    return [
        ["--help"],
        *([name, "--help"] for name in COMMANDS),
        *(["bench", name, "--help"] for name in benches),
    ]


@pytest.mark.parametrize("args", every_help(), ids=" ".join)
def test_every_help_runs_or_names_the_extra(plain: Path, args: list[str]) -> None:
    done = run(plain, *args)
    assert "Traceback" not in done.stderr, done.stderr
    if done.returncode == 0:
        assert done.stdout.startswith(f"usage: prorsa {' '.join(args[:-1])}".rstrip()), done.stdout
        return
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    match = NEEDS_EXTRA.match(line)
    assert match, line
    assert match.group(1) in EXTRA_LIBRARIES


def test_the_simulator_runs_without_extras_and_the_chaos_suite_names_its_extra(
    plain: Path,
) -> None:
    """``prorsa bench rollout --help`` loads the simulator alone (it used to load every
    benchmark, the chaos suite's kopf too); the chaos suite itself needs the operator's extra."""
    rollout = run(plain, "bench", "rollout", "--help")
    assert rollout.returncode == 0, rollout.stderr
    assert "usage: prorsa bench rollout" in rollout.stdout
    chaos = run(plain, "bench", "chaos", "--help")
    assert chaos.returncode == 2
    match = NEEDS_EXTRA.match(chaos.stderr.strip())
    assert match, chaos.stderr
    assert chaos.stderr.startswith("prorsa bench chaos: error: needs ")
    assert match.group(1) in ("kopf", "kubernetes")  # whichever it imports first
    assert match.group(2) == "operator"


@pytest.mark.parametrize(
    ("args", "extra"),
    [(["operator", "-A"], "operator"), (["demo", "--no-live", "--duration", "1"], "operator")],
    ids=["operator", "demo"],
)
def test_a_command_that_needs_an_extra_says_which_when_it_runs(
    plain: Path, args: list[str], extra: str
) -> None:
    done = run(plain, *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    match = NEEDS_EXTRA.match(line)
    assert match and match.group(2) == extra, line
