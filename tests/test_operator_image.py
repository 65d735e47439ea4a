"""Static checks of the operator image (the root ``Dockerfile``); no Docker engine here.

hadolint (fetched by ``scripts/ci_tools.py``) lints it; the instruction checks pin what the
issue asks for: a slim Python 3.11 base pinned to a patch version, a numeric non-root user
that matches the chart's pod security context, ``ENTRYPOINT ["prorsa"]`` with ``CMD
["operator", "-A"]`` that the real CLI accepts, and only the runtime extra installed. The
last check proves "only runtime dependencies" is enough: every module the operator imports
comes from the distributions that ``pip install .[operator]`` pulls in.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from prorsa.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
ENGINE_DOCKERFILE = ROOT / "engine_image" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
VALUES = ROOT / "charts" / "prorsa" / "values.yaml"


@dataclass(frozen=True)
class Step:
    stage: int  # index of the FROM it belongs to (-1: before the first FROM)
    keyword: str
    value: str


def instructions(text: str) -> list[Step]:
    """Instructions with continuations joined and comments dropped, tagged by build stage."""
    steps: list[Step] = []
    stage, pending = -1, ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        joined, pending = (pending + line).strip(), ""
        keyword, _, value = joined.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        steps.append(Step(stage, keyword, value.strip()))
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return steps


@pytest.fixture(scope="module")
def steps() -> list[Step]:
    return instructions(DOCKERFILE.read_text())


def final(steps: list[Step], keyword: str) -> list[Step]:
    last = max(s.stage for s in steps)
    return [s for s in steps if s.stage == last and s.keyword == keyword]


def base_images(steps: list[Step]) -> list[str]:
    args = {}
    for s in steps:
        if s.keyword == "ARG" and s.stage == -1 and "=" in s.value:
            name, default = s.value.split("=", 1)
            args[name] = default
    images = []
    for s in steps:
        if s.keyword == "FROM":
            ref = s.value.split()[0]
            images.append(re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m[1] or m[2]], ref))
    return images


def test_parser_joins_continuations_and_tracks_stages():
    text = "ARG A=1\nFROM x:1 AS b\n# c\nRUN a \\\n    && b\nFROM x:1\nUSER 1\n"
    assert instructions(text) == [
        Step(-1, "ARG", "A=1"),
        Step(0, "FROM", "x:1 AS b"),
        Step(0, "RUN", "a && b"),
        Step(1, "FROM", "x:1"),
        Step(1, "USER", "1"),
    ]


def _ci_tools():
    name = "prorsa_scripts_ci_tools"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "ci_tools.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_hadolint_finds_nothing():
    tools = _ci_tools()
    try:
        hadolint = tools.hadolint()
    except tools.ToolUnavailable as exc:
        pytest.skip(f"hadolint could not be obtained here ({exc}); the checks below still run")
    result = subprocess.run(
        [str(hadolint), "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_is_slim_python_3_11_pinned_to_a_patch_release(steps):
    images = base_images(steps)
    assert images, "no FROM"
    for image in images:
        assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", image), image
    assert len(set(images)) == 1, "build and runtime stages on different bases"


def test_runtime_stage_copies_only_the_built_venv(steps):
    froms = [s.value.split() for s in steps if s.keyword == "FROM"]
    assert len(froms) == 2 and froms[0][1:] == ["AS", "build"], "expected a build stage"
    copies = final(steps, "COPY")
    assert [c.value for c in copies] == ["--from=build /opt/prorsa /opt/prorsa"]


def test_build_stage_copies_the_operators_source_roots_and_not_the_lab(steps):
    copied = [
        a
        for s in steps
        if s.keyword == "COPY" and "--from=" not in s.value
        for a in shlex.split(s.value)[:-1]
    ]
    assert set(copied) == {
        "pyproject.toml",
        "README.md",
        "operator",
        "sdk/prorsa_contract",
        "engine_image/prorsa_agent",
    }
    # The contract is the only part of sdk/ the operator imports; the lab is never copied.
    assert not any(c.startswith(("tools", "sdk/prorsa_sdk")) or c == "sdk" for c in copied)


def test_runs_as_the_non_root_uid_the_chart_expects(steps):
    (user,) = final(steps, "USER")
    uid, _, gid = user.value.partition(":")
    # Numeric, so that the kubelet can enforce runAsNonRoot without reading /etc/passwd.
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    pod = yaml.safe_load(VALUES.read_text())["podSecurityContext"]
    assert (pod["runAsUser"], pod["runAsGroup"]) == (int(uid), int(gid))
    made = " ".join(s.value for s in final(steps, "RUN"))
    assert f"--uid {uid}" in made and f"--gid {gid}" in made
    order = [s.keyword for s in steps if s.stage == max(t.stage for t in steps)]
    assert order.index("USER") < order.index("ENTRYPOINT")


def test_entrypoint_runs_the_operator_cluster_wide(steps):
    (entry,) = final(steps, "ENTRYPOINT")
    (cmd,) = final(steps, "CMD")
    entrypoint, command = json.loads(entry.value), json.loads(cmd.value)
    assert entrypoint == ["prorsa"] and command == ["operator", "-A"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^prorsa = "prorsa\.cli:main"$', pyproject, re.M), "no prorsa script"
    args = build_parser().parse_args(command)
    assert args.command == "operator" and args.all_namespaces


def test_installs_the_operator_extra_only(steps):
    runs = " ".join(s.value for s in steps if s.keyword == "RUN")
    installs = re.findall(r"pip install ([^&;]+)", runs)
    assert len(installs) == 1
    targets = [a for a in shlex.split(installs[0]) if not a.startswith("-")]
    assert targets == [".[operator]"]
    assert "--no-cache-dir" in installs[0]
    assert "latest" not in DOCKERFILE.read_text().lower()


def runtime_closure(extra: str) -> set[str]:
    """Normalised names of the distributions ``pip install prorsa[extra]`` installs."""

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    seen: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [("prorsa", frozenset({extra}))]
    while todo:
        name, extras = todo.pop()
        key = (norm(name), extras)
        if key[0] in seen and not extras:
            continue
        seen.add(key[0])
        for line in md.requires(name) or []:
            req = Requirement(line)
            active = req.marker is None or any(
                req.marker.evaluate({"extra": e}) for e in (extras or {""})
            )
            if active:
                todo.append((req.name, frozenset(req.extras)))
    return seen


OURS = ("prorsa", "prorsa_agent", "prorsa_contract", "prorsa_sdk", "prorsa_lab")


def modules_outside(extra: str) -> list[str]:
    """Top-level modules installed here that ``pip install .[extra]`` would not bring."""
    allowed = runtime_closure(extra) | {"pip", "setuptools"}  # a fresh venv has these
    return sorted(
        module
        for module, dists in md.packages_distributions().items()
        if not {re.sub(r"[-_.]+", "-", d).lower() for d in dists} & allowed
        and module not in sys.stdlib_module_names
        and module not in OURS
    )


# Run in a child interpreter where every module of a distribution outside ``.[operator]`` is
# made unimportable, as if it were not installed (optional imports then take their fallback).
_PROBE = """
import importlib.abc, json, sys
blocked = set(json.loads(sys.argv[1]))

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None

sys.meta_path.insert(0, NotInstalled())
import prorsa.cli, prorsa.commands.operator, prorsa.shell.handlers, prorsa.control.runtime
import prorsa.ingest, prorsa.control.metrics
prorsa.cli.build_parser().parse_args(["operator", "-A"])
print("ok")
"""


def test_the_operator_runs_on_its_runtime_dependencies_alone():
    allowed = runtime_closure("operator") | {"pip", "setuptools"}  # a fresh venv has these
    assert {"kopf", "kubernetes", "aiohttp", "pydantic"} <= allowed
    assert not {"pytest", "hypothesis", "kmock", "matplotlib"} & allowed
    blocked = [*modules_outside("operator"), "prorsa_lab", "prorsa_sdk"]  # not in the image
    assert "pytest" in blocked and "matplotlib" in blocked  # the probe really hides them
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(blocked)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# -- the build context ---------------------------------------------------------------------------


def ignore_patterns() -> list[str]:
    lines = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus ``**``) as a regex on relative paths."""
    out, i = "", 0
    pattern = pattern.strip("/")
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` (or a folder above it) out of the build context."""
    parts = Path(path).parts
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!"))
        if any(regex.fullmatch("/".join(parts[: n + 1])) for n in range(len(parts))):
            verdict = not negate
    return verdict


def test_ignore_matcher_follows_docker_semantics():
    patterns = ["**/__pycache__", "*.egg-info", "tests", "docs/*.md", "!docs/keep.md"]
    assert ignored("operator/prorsa/__pycache__/x.pyc", patterns)
    assert ignored("prorsa.egg-info/PKG-INFO", patterns)
    assert ignored("tests/test_x.py", patterns)
    assert ignored("docs/a.md", patterns) and not ignored("docs/keep.md", patterns)
    assert not ignored("operator/tests_helper.py", patterns)


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, ENGINE_DOCKERFILE], ids=["operator", "engine"])
def test_copy_sources_exist_and_stay_in_the_build_context(dockerfile):
    """One .dockerignore serves both images: it must not drop what either one COPYs."""
    patterns = ignore_patterns()
    for step in instructions(dockerfile.read_text()):
        if step.keyword != "COPY" or "--from=" in step.value:
            continue
        sources = [a for a in shlex.split(step.value) if not a.startswith("--")][:-1]
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source} does not exist"
            assert not ignored(source, patterns), f"{source} is excluded by .dockerignore"


def test_build_context_leaves_out_local_state():
    patterns = ignore_patterns()
    for path in (".git/HEAD", ".venv/bin/python", ".cache/tools/helm", "tests/test_chart.py",
                 "operator/prorsa/__pycache__/cli.cpython-311.pyc", "bench-out/x.png",
                 "engine_image/build/lib/prorsa_agent/server.py",
                 "engine_image/prorsa_agent.egg-info/PKG-INFO"):  # fmt: skip
        assert ignored(path, patterns), path
