"""Static checks of engine_image/Dockerfile (no Docker engine here).

hadolint runs when it is on PATH; the instruction-level checks below always run: the base is
the official SGLang 0.5.23 image, the agent is installed from sources that exist, it runs as
a non-root user, the entrypoint is ``prorsa-agent --launch``, and every ``PRORSA_*`` variable
the image sets is one the agent reads.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_agent_distribution import IMAGE_SOURCES
from test_operator_image import ignore_patterns, ignored

from prorsa_agent import agent_cli
from prorsa_agent.config import ENV_VARS
from prorsa_contract.labels import AGENT_COMMAND

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "engine_image" / "Dockerfile"
AGENT_PYPROJECT = ROOT / "engine_image" / "pyproject.toml"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str
    line: int


def parse(text: str) -> list[Instruction]:
    """Dockerfile instructions, with line continuations joined and comments dropped."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are ignored
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        joined = " ".join(part for part in pending if part)
        keyword, _, value = joined.partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip(), start))
        pending = []
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return instructions


def env_pairs(value: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in shlex.split(value))


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse(DOCKERFILE.read_text())


def test_hadolint_finds_nothing():
    from test_operator_image import _ci_tools  # fetches hadolint into .cache/tools

    tools = _ci_tools()
    try:
        hadolint = str(tools.hadolint())
    except tools.ToolUnavailable as exc:
        hadolint = shutil.which("hadolint") or ""
        if not hadolint:
            pytest.skip(f"hadolint could not be obtained ({exc}); the checks below still run")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_only_known_instructions(instructions):
    known = {
        "ARG", "FROM", "LABEL", "COPY", "RUN", "USER", "WORKDIR", "ENV", "EXPOSE",
        "ENTRYPOINT", "CMD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "VOLUME", "ADD", "ONBUILD",
    }  # fmt: skip
    unknown = [(i.line, i.keyword) for i in instructions if i.keyword not in known]
    assert not unknown


def test_base_is_the_official_sglang_0_5_23_image(instructions):
    args = {}
    for inst in instructions:
        if inst.keyword == "FROM":
            break
        if inst.keyword == "ARG" and "=" in inst.value:
            name, default = inst.value.split("=", 1)
            args[name] = default
    froms = [i for i in instructions if i.keyword == "FROM"]
    assert len(froms) == 1, "one stage: the SGLang image itself"
    image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], froms[0].value)
    repository, _, tag = image.partition(":")
    assert repository == "lmsysorg/sglang"
    assert tag == "v0.5.23"


def test_the_agent_is_installed_from_sources_that_exist(instructions):
    copies = [i for i in instructions if i.keyword == "COPY"]
    sources = [src for c in copies for src in shlex.split(c.value)[:-1] if not src.startswith("--")]
    for src in sources:
        assert (ROOT / src).exists(), f"COPY source {src} is not in the repository"
    # The light prorsa-agent distribution and the one part of sdk/ it holds, at the same
    # relative places (engine_image/pyproject.toml reaches ../sdk/prorsa_contract). The
    # operator, the lab (simulator, demo, test doubles) and the trainer SDK never reach
    # SGLang's interpreter.
    assert sorted(sources) == sorted(IMAGE_SOURCES)
    places = {src: shlex.split(c.value)[-1] for c in copies for src in shlex.split(c.value)[:-1]}
    assert places == {src: f"/opt/prorsa-src/{src}" for src in IMAGE_SOURCES}
    assert not ignored("engine_image/pyproject.toml", ignore_patterns())
    runs = " ".join(i.value for i in instructions if i.keyword == "RUN")
    # SGLang's image has the agent's dependencies: pip adds nothing and upgrades nothing.
    assert "pip install --no-cache-dir --no-deps /opt/prorsa-src/engine_image" in runs
    assert "--upgrade" not in runs and " -U " not in runs  # never disturb SGLang's pins
    # The build proves the command starts and that the image has what the server imports.
    assert "prorsa-agent --help" in runs and 'python3 -c "import prorsa_agent.server"' in runs


def test_runs_as_a_non_root_user(instructions):
    users = [i.value for i in instructions if i.keyword == "USER"]
    assert users, "no USER: the engine would run as root"
    assert users[-1].split(":")[0] not in ("root", "0")
    entry_index = next(n for n, i in enumerate(instructions) if i.keyword == "ENTRYPOINT")
    user_index = max(n for n, i in enumerate(instructions) if i.keyword == "USER")
    assert user_index < entry_index


def test_entrypoint_is_the_agent_in_exec_form(instructions):
    (entry,) = [i for i in instructions if i.keyword == "ENTRYPOINT"]
    assert json.loads(entry.value) == ["prorsa-agent", "--launch"]
    assert not [i for i in instructions if i.keyword == "CMD"]
    # The command the operator gives engine pods, and the script the installed wheel has.
    scripts = tomllib.loads(AGENT_PYPROJECT.read_text())["project"]["scripts"]
    assert AGENT_COMMAND in scripts and json.loads(entry.value)[0] == AGENT_COMMAND


def test_environment_matches_what_the_agent_reads(instructions):
    env: dict[str, str] = {}
    for inst in instructions:
        if inst.keyword == "ENV":
            env.update(env_pairs(inst.value))
    prorsa = {k for k in env if k.startswith("PRORSA_")}
    assert prorsa <= ENV_VARS, f"unknown to the agent: {sorted(prorsa - ENV_VARS)}"
    assert env["PRORSA_AGENT_LISTEN"].endswith(":8080")  # the CONTRACT's agent port
    assert env["PRORSA_TRANSFER_BACKEND"] in ("mooncake", "mori")  # the two that switch
    exposed = {p for i in instructions if i.keyword == "EXPOSE" for p in i.value.split()}
    assert {"8080", env["PRORSA_ENGINE_PORT"], env["PRORSA_BOOTSTRAP_PORT"]} <= exposed
    # The agent's source reads no PRORSA_* variable the image could not know about.
    read = set(re.findall(r"PRORSA_[A-Z_]+", Path(agent_cli.__file__).read_text()))
    assert read <= ENV_VARS


def test_parser_handles_continuations_and_comments():
    text = "# c\nFROM a:1\nRUN x \\\n    # inner\n    && y\nENV A=1 \\\n  B='two words'\n"
    parsed = parse(text)
    assert [(i.keyword, i.value) for i in parsed] == [
        ("FROM", "a:1"),
        ("RUN", "x && y"),
        ("ENV", "A=1 B='two words'"),
    ]
    assert env_pairs(parsed[2].value) == {"A": "1", "B": "two words"}


# A child interpreter where the packages the engine image leaves out cannot be imported.
_PROBE = """
import importlib, importlib.abc, pkgutil, sys
blocked = set(sys.argv[1].split(","))

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None

sys.meta_path.insert(0, NotInstalled())
exec(sys.argv[2])
"""


def probe(blocked: list[str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(blocked), code],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_agent_needs_nothing_of_prorsa_but_the_contract():
    code = (
        "import prorsa_agent\n"
        "for m in pkgutil.walk_packages(prorsa_agent.__path__, 'prorsa_agent.'):\n"
        # __main__ runs the agent; kv_backend runs inside SGLang's scheduler (it imports
        # SGLang: the image's check below, tests/real_engine/test_kv_store_sglang.py).
        "    if m.name not in ('prorsa_agent.__main__', 'prorsa_agent.kv_backend'):\n"
        "        importlib.import_module(m.name)\n"
        "print('ok')"
    )
    result = probe(["prorsa", "prorsa_sdk", "prorsa_lab"], code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_the_image_check_prorsa_agent_help_runs_without_the_rest_of_prorsa():
    code = "from prorsa_agent.agent_cli import main; sys.exit(main(['--help']))"
    result = probe(["prorsa", "prorsa_sdk", "prorsa_lab"], code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: prorsa-agent")


def test_prorsa_agent_still_runs_from_the_full_cli():
    """Images built with the whole distribution, and a development checkout, keep it."""
    code = "from prorsa.cli import main; sys.exit(main(['agent', '--help']))"
    result = probe(["prorsa_sdk", "prorsa_lab"], code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: prorsa agent")
