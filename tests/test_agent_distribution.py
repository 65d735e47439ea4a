"""The light ``prorsa-agent`` distribution (``engine_image/pyproject.toml``): what engine pods run.

The engine image installs it into SGLang's interpreter, so it must hold the agent and the
wire contract and nothing of the operator, the trainer SDK or the lab, and declare only what
those two packages import. The wheel is built with pip from a copy of what
``engine_image/Dockerfile`` copies, installed into a bare virtual environment that holds only
its declared dependencies, and its ``prorsa-agent`` command then launches an engine and flips
its role there, as it does in an engine pod.
"""

from __future__ import annotations

import email
import importlib.metadata
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest
from bare_venv import bare_venv, clean_env
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from prorsa.core.spec import parse_cluster
from prorsa.k8s.groups import group_pods
from prorsa_contract import __version__ as contract_version
from prorsa_contract.labels import AGENT_COMMAND
from prorsa_lab.doubles.kubelet import runs_in_the_engine_image

ROOT = Path(__file__).resolve().parent.parent
# What engine_image/Dockerfile copies into the image (tests/test_engine_image.py checks it),
# at the same relative places: engine_image/pyproject.toml reaches ../sdk/prorsa_contract.
IMAGE_SOURCES = ("engine_image", "sdk/prorsa_contract")
LIGHT = {"pydantic", "httpx", "sniffio", "aiohttp", "prometheus-client"}
# Never in the agent's environment: the rest of Prorsa and the operator's own libraries.
LEFT_OUT = ("prorsa", "prorsa_sdk", "prorsa_lab", "numpy", "yaml", "kopf", "kubernetes")
TOKEN = "agent-wheel-token-5"


def _setuptools_major() -> int:
    return int(importlib.metadata.version("setuptools").split(".")[0])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Build from a copy: pip builds in the source tree and leaves build/ and *.egg-info.
    src = tmp_path_factory.mktemp("src")
    for source in IMAGE_SOURCES:
        shutil.copytree(
            ROOT / source,
            src / source,
            ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info", "Dockerfile"),
        )
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out)]
    if _setuptools_major() >= 77:  # `make test` installs it: no index needed
        cmd.append("--no-build-isolation")
    result = subprocess.run(
        [*cmd, str(src / "engine_image")], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = out.glob("prorsa_agent-*.whl")
    return built


def _dist_info(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as zf:
        (member,) = [n for n in zf.namelist() if n.endswith(f".dist-info/{name}")]
        return zf.read(member).decode()


def test_metadata_requires_only_what_the_agent_and_the_contract_import(wheel: Path) -> None:
    meta = email.message_from_string(_dist_info(wheel, "METADATA"))
    assert meta["Name"] == "prorsa-agent"
    requires = meta.get_all("Requires-Dist") or []
    assert {canonicalize_name(Requirement(r).name) for r in requires} == LIGHT
    assert meta["License-Expression"] == "Apache-2.0"
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert meta["Version"] == root == contract_version


def test_wheel_holds_the_agent_and_the_contract_whole_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"prorsa_agent", "prorsa_contract"}
    sources = {
        p.relative_to(root).as_posix()
        for root, package in (
            (ROOT / "engine_image", "prorsa_agent"),
            (ROOT / "sdk", "prorsa_contract"),
        )
        for p in (root / package).rglob("*")
        if p.suffix in (".py", ".typed") and "__pycache__" not in p.parts
    }
    assert sources <= names


def test_the_command_engine_pods_run_is_the_wheels_script(wheel: Path) -> None:
    scripts = _dist_info(wheel, "entry_points.txt")
    assert re.search(rf"^{AGENT_COMMAND} = prorsa_agent\.agent_cli:main$", scripts, re.M)
    engine = {"gpusPerInstance": 16, "tensorParallelSize": 16, "nodesPerInstance": 2}
    manifest = {
        "apiVersion": "prorsa.io/v1alpha1",
        "kind": "RolloutCluster",
        "metadata": {"name": "big", "namespace": "rl"},
        "spec": {"model": {"path": "/models/m"}, "engine": engine, "gpuBudget": 32},
    }
    spec = parse_cluster(manifest).spec
    leader, worker = group_pods(cluster="big", namespace="rl", index=0, role="decode", spec=spec)
    (leader_container,) = leader["spec"]["containers"]
    (worker_container,) = worker["spec"]["containers"]
    assert leader_container["command"] == ["prorsa-agent"]
    assert worker_container["command"] == ["prorsa-agent", "--worker"]
    # The fake kubelet runs what the engine image can run: these, not the full CLI's.
    assert runs_in_the_engine_image(leader_container, worker=False)
    assert runs_in_the_engine_image(worker_container, worker=True)
    assert not runs_in_the_engine_image({"command": ["prorsa", "agent"]}, worker=False)
    assert not runs_in_the_engine_image(worker_container, worker=False)


@pytest.fixture(scope="module")
def agent_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with the wheel and its declared dependencies, nothing more.

    The dependencies are this environment's own copies, linked in: no index is needed.
    """
    return bare_venv(tmp_path_factory.mktemp("venv"), wheel, LIGHT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(log: Path, proc: subprocess.Popen[str], pattern: str) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        match = re.search(pattern, log.read_text())
        if match:
            return match.group(1)
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in {log.read_text()!r}")


def test_prorsa_agent_runs_from_the_wheel_with_only_its_declared_dependencies(
    agent_venv: Path, tmp_path: Path
) -> None:
    python, command = agent_venv / "bin" / "python", agent_venv / "bin" / AGENT_COMMAND
    env = clean_env()
    probe = "import importlib.util as u, sys; print([n for n in sys.argv[1:] if u.find_spec(n)])"
    found = subprocess.run(
        [str(python), "-c", probe, *LEFT_OUT], capture_output=True, text=True, env=env
    )
    assert found.stdout.strip() == "[]", found.stdout + found.stderr

    helped = subprocess.run([str(command), "--help"], capture_output=True, text=True, env=env)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith(f"usage: {AGENT_COMMAND}") and "--launch" in helped.stdout

    # As in an engine pod: launch the engine (the SGLang double, run by this interpreter: it
    # is the engine's process, not the agent's), serve the API, flip the role, stop.
    token = tmp_path / "token"
    token.write_text(TOKEN)
    port = _free_port()
    log = tmp_path / "agent.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                str(command), "--listen", "127.0.0.1:0", "--token-file", str(token),
                "--engine-url", f"http://127.0.0.1:{port}", "--instance", "wheel-engine-0",
                "--engine-command", f"{sys.executable} -m prorsa_lab.doubles.sglang_double",
                "--health-interval", "0.1", "--poll-interval", "0.02",
                "--launch", "--", "--double-switch-seconds", "0.01",
            ],
            env=env
            | {
                "PRORSA_ENGINE_HOST": "127.0.0.1",
                "PRORSA_BOOTSTRAP_PORT": str(_free_port()),
                "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.05",
            },
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
    try:
        url = _wait_for(log, proc, r"prorsa agent listening on (http://\S+)")
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(timeout=10.0) as c:
            deadline = time.monotonic() + 60
            while c.get(f"{url}/healthz").status_code != 200:
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.05)
            assert c.get(f"{url}/v1/state").json()["instance"] == "wheel-engine-0"
            result = c.post(f"{url}/v1/role", json={"role": "prefill"}, headers=auth).json()
            assert result["ok"] is True and result["newRole"] == "prefill"
            assert "prorsa_agent_switches" in c.get(f"{url}/metrics").text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
