"""A virtual environment holding one wheel and its declared dependencies, nothing more.

What ``pip install WHEEL`` gives a user, built without an index: the wheel is installed
with ``--no-deps`` and the distributions it declares (no extras, unless named) are this
environment's own copies, linked in. Used by the distribution tests
(``test_agent_distribution.py``, ``test_plain_install.py``).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(names: Iterable[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``names`` need, themselves included (no extras)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        dist = found[name] = importlib.metadata.distribution(name)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def clean_env() -> dict[str, str]:
    """This environment without what would put this checkout's packages on a path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def bare_venv(venv: Path, wheel: Path, dependencies: Iterable[str]) -> Path:
    """``venv`` made, ``wheel`` installed into it alone, and the distributions
    ``dependencies`` need linked in from this environment; returns ``venv``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install"]
    result = subprocess.run(
        [*install, "--no-deps", "--no-index", "--quiet", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
            env=clean_env(),
        ).stdout.strip()
    )
    ours = Path(sysconfig.get_path("purelib"))
    for dist in closure(dependencies):
        for top in {f.parts[0] for f in dist.files or ()} - {"..", "__pycache__"}:
            target = Path(str(dist.locate_file(top)))
            if target.parent == ours and not (site / top).exists():
                (site / top).symlink_to(target)
    return venv
