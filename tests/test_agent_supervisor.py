"""The agent's ``--launch`` path: it runs the engine, restarts it with backoff, stops it.

SGLang cannot run here, so the launched engine is the SGLang double as a process
(``python -m prorsa_lab.doubles.sglang_double``), started with the very command line the
agent builds for SGLang; its injected crash ends the process as a real engine crash would.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from prorsa_agent.config import (
    AgentConfig,
    BootstrapGateConfig,
    LaunchSpec,
    RestartBackoff,
    engine_argv,
)
from prorsa_agent.server import Agent
from prorsa_contract.agent_api import EngineState, RoleResult
from prorsa_lab.doubles.sglang_double import FAST_TIMEOUTS

TOKEN = "launch-token-19"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DOUBLE = (sys.executable, "-m", "prorsa_lab.doubles.sglang_double")
FAST_BACKOFF = RestartBackoff(initial=0.05, factor=2.0, maximum=0.4, stable_after=30.0)


def _bootstrap_env(port: int) -> dict[str, str]:
    """The gate on a free port (not SGLang's 8998), opening within a fraction of a second."""
    return {"PRORSA_BOOTSTRAP_PORT": str(port), "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.05"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(
    tmp_path: Path,
    *,
    extra: Sequence[str] = (),
    command: Sequence[str] = DOUBLE,
    gate: bool = False,
) -> AgentConfig:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    url = f"http://127.0.0.1:{_free_port()}"
    bootstrap = (
        BootstrapGateConfig(port=_free_port(), engine_port=_free_port(), hold=0.0) if gate else None
    )
    argv = engine_argv(
        command=command,
        engine_url=url,
        env_args=["--host", "127.0.0.1"],
        explicit=["--double-switch-seconds", "0.01", "--double-health-timeout", "1", *extra],
        bootstrap_gate=bootstrap,
    )
    return AgentConfig(
        bootstrap_gate=bootstrap,
        engine_url=url,
        token_file=token,
        instance="launch-0",
        listen_host="127.0.0.1",
        listen_port=0,
        timeouts=FAST_TIMEOUTS,
        launch=LaunchSpec(argv=tuple(argv), backoff=FAST_BACKOFF, stop_grace=5.0),
    )


async def _until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _healthz(client: httpx.AsyncClient, agent: Agent) -> httpx.Response:
    return await client.get(f"{agent.url}/healthz")


async def _wait_healthy(client: httpx.AsyncClient, agent: Agent) -> None:
    async def healthy() -> bool:
        return (await _healthz(client, agent)).status_code == 200

    await _until(healthy)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_launch_switch_crash_restart(tmp_path):
    config = _config(tmp_path, gate=True)
    assert config.bootstrap_gate is not None
    gate = f"http://127.0.0.1:{config.bootstrap_gate.port}/health"
    async with httpx.AsyncClient(timeout=10.0) as client, Agent(config) as agent:
        health = await _healthz(client, agent)
        assert health.status_code == 503 and health.json()["status"] == "starting"
        await _wait_healthy(client, agent)
        state = EngineState.model_validate((await client.get(f"{agent.url}/v1/state")).json())
        assert state.role == "decode" and state.healthy  # every engine starts as decode
        assert (await client.get(gate)).status_code == 503  # decode: closed
        result = await client.post(f"{agent.url}/v1/role", json={"role": "prefill"}, headers=AUTH)
        assert RoleResult.model_validate(result.json()).ok
        assert (await client.get(gate)).status_code == 200
        assert agent.supervisor is not None
        first_pid = agent.supervisor.pid
        assert first_pid is not None

        # The engine process dies: no prefill behind the bootstrap port any more.
        await client.post(f"{config.engine_url}/_double/crash")

        async def down() -> bool:
            return (await _healthz(client, agent)).json()["status"] in ("down", "starting")

        await _until(down)
        assert (await client.get(gate)).status_code == 503
        await _wait_healthy(client, agent)
        assert agent.supervisor.restarts == 1 and agent.supervisor.pid != first_pid
        assert agent.supervisor.last_exit == 70
        state = EngineState.model_validate((await client.get(f"{agent.url}/v1/state")).json())
        assert state.role == "decode"  # a restarted engine is back in its launch role
        metrics = (await client.get(f"{agent.url}/metrics")).text
        assert "prorsa_agent_engine_restarts_total 1.0" in metrics
        assert (await _healthz(client, agent)).json()["engineRestarts"] == 1
    assert _gone(agent.supervisor.pid or first_pid)


async def test_crash_mid_switch_is_reported_then_the_engine_comes_back(tmp_path):
    config = _config(tmp_path, extra=["--double-crash-on-switch"])
    async with httpx.AsyncClient(timeout=10.0) as client, Agent(config) as agent:
        await _wait_healthy(client, agent)
        response = await client.post(f"{agent.url}/v1/role", json={"role": "prefill"}, headers=AUTH)
        assert response.status_code == 502
        result = RoleResult.model_validate(response.json())
        assert result.safe_to_restore is False and "stopped answering" in result.message
        # The supervisor restarts the engine; a fresh process clears the failed state.
        await _wait_healthy(client, agent)
        assert agent.supervisor is not None and agent.supervisor.restarts == 1


async def test_a_crash_loop_backs_off_exponentially_up_to_the_cap(tmp_path):
    command = (sys.executable, "-c", "import sys; sys.exit(3)")
    config = _config(tmp_path, command=command)
    async with httpx.AsyncClient(timeout=10.0) as client, Agent(config) as agent:
        sup = agent.supervisor
        assert sup is not None

        async def five_restarts() -> bool:
            return sup.restarts >= 5

        await _until(five_restarts)
        assert sup.delays[:5] == [0.05, 0.1, 0.2, 0.4, 0.4]
        assert sup.last_exit == 3
        health = await _healthz(client, agent)
        assert health.status_code == 503
        assert health.json()["status"] in ("down", "starting")
        state = EngineState.model_validate((await client.get(f"{agent.url}/v1/state")).json())
        assert state.healthy is False
        refused = await client.post(f"{agent.url}/v1/role", json={"role": "prefill"}, headers=AUTH)
        assert refused.status_code == 503


async def test_stopping_the_agent_stops_the_engine(tmp_path):
    config = _config(tmp_path)
    agent = Agent(config)
    await agent.start()
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            await _wait_healthy(client, agent)
    finally:
        await agent.stop()
    assert agent.supervisor is not None and agent.supervisor.pid is not None
    assert _gone(agent.supervisor.pid)
    assert agent.supervisor.restarts == 0  # a requested stop is not a crash
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{config.engine_url}/health", timeout=2.0)


def _reap(proc: subprocess.Popen[str]) -> None:
    """Kill the process if it still runs, wait for it and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _read_url(proc: subprocess.Popen[str], pattern: str, timeout: float = 30.0) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match.group(1)
    proc.kill()
    raise AssertionError(f"no {pattern!r} in {seen!r}")


def test_prorsa_agent_command_launches_the_engine_from_the_environment(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    port = _free_port()
    env = {
        **os.environ,
        "PRORSA_MODEL_PATH": "org/model-from-env",
        "PRORSA_TP_SIZE": "2",
        "PRORSA_ENGINE_HOST": "127.0.0.1",
        "PRORSA_EXTRA_ARGS": '["--max-total-tokens", "12345"]',
        "PRORSA_INSTANCE": "cli-engine-0",
        **_bootstrap_env(bootstrap := _free_port()),
    }
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "prorsa.cli", "agent",
            "--listen", "127.0.0.1:0",
            "--token-file", str(token),
            "--engine-url", f"http://127.0.0.1:{port}",
            "--engine-command", f"{sys.executable} -m prorsa_lab.doubles.sglang_double",
            "--health-interval", "0.1", "--poll-interval", "0.02",
            "--launch", "--", "--double-switch-seconds", "0.01",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        url = _read_url(proc, r"prorsa agent listening on (http://\S+)")
        with httpx.Client(timeout=10.0) as c:
            deadline = time.monotonic() + 30
            while c.get(f"{url}/healthz").status_code != 200:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
            info = c.get(f"http://127.0.0.1:{port}/server_info").json()
            assert info["model_path"] == "org/model-from-env"
            assert info["tp_size"] == 2 and info["max_total_num_tokens"] == 12345
            assert info["enable_pd_role_switch"] is True and info["enable_metrics"] is True
            assert info["internal_states"][0]["disaggregation_mode"] == "decode"
            assert c.get(f"{url}/v1/state").json()["instance"] == "cli-engine-0"
            # The pod's bootstrap port is the agent's: closed to decode engines' heartbeats
            # while this one is decode, SGLang's own server (always 200) behind it.
            gate = f"http://127.0.0.1:{bootstrap}/health"
            assert c.get(gate).status_code == 503
            assert info["disaggregation_bootstrap_port"] == bootstrap + 1000
            assert c.get(f"http://127.0.0.1:{bootstrap + 1000}/health").status_code == 200
            result = c.post(f"{url}/v1/role", json={"role": "prefill"}, headers=AUTH).json()
            assert result["ok"] is True and result["newRole"] == "prefill"
            assert c.get(gate).status_code == 200
            # Out of prefill and straight back: the gate closes, and the flip back is
            # reported only once it has been closed for the hold (3 heartbeats of 0.05 s).
            left = time.monotonic()
            result = c.post(f"{url}/v1/role", json={"role": "decode"}, headers=AUTH).json()
            assert result["ok"] is True and c.get(gate).status_code == 503
            result = c.post(f"{url}/v1/role", json={"role": "prefill"}, headers=AUTH).json()
            assert result["ok"] is True and time.monotonic() - left >= 0.15
            assert c.get(gate).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0)
    finally:
        _reap(proc)


def test_prorsa_agent_gives_the_engine_its_admin_key_and_keeps_it_out_of_the_log(tmp_path):
    """The key file becomes SGLang's --admin-api-key; the engine then refuses admin calls
    without it, the agent's own calls carry it, and what both print never shows it."""
    token, key_file = tmp_path / "token", tmp_path / "admin-key"
    token.write_text(TOKEN)
    key = "engine-admin-key-7Qp_Zr2"
    key_file.write_text(key + "\n")
    port = _free_port()
    env = {
        **os.environ,
        "PRORSA_ENGINE_API_KEY_FILE": str(key_file),
        "PRORSA_ENGINE_HOST": "127.0.0.1",
        "PRORSA_INSTANCE": "key-engine-0",
        **_bootstrap_env(_free_port()),
    }
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "prorsa.cli", "agent",
            "--listen", "127.0.0.1:0",
            "--token-file", str(token),
            "--engine-url", f"http://127.0.0.1:{port}",
            "--engine-command", f"{sys.executable} -m prorsa_lab.doubles.sglang_double",
            "--health-interval", "0.1", "--poll-interval", "0.02",
            "--launch", "--", "--double-switch-seconds", "0.01",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        url = _read_url(proc, r"prorsa agent listening on (http://\S+)")
        engine = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=10.0) as c:
            deadline = time.monotonic() + 30
            while c.get(f"{url}/healthz").status_code != 200:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
            flip = {"new_role": "prefill"}
            assert c.post(f"{engine}/pd_role_switch", json=flip).status_code == 401
            wrong = {"Authorization": "Bearer not-the-key"}
            assert c.post(f"{engine}/pd_role_switch", json=flip, headers=wrong).status_code == 401
            assert c.post(f"{engine}/abort_request", json={"abort_all": True}).status_code == 401
            # What the router needs stays open: SGLang's admin key guards admin calls only.
            assert c.get(f"{engine}/v1/loads").status_code == 200
            assert c.get(f"{engine}/health").status_code == 200
            result = c.post(f"{url}/v1/role", json={"role": "prefill"}, headers=AUTH).json()
            assert result["ok"] is True and result["newRole"] == "prefill"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert proc.stdout is not None and proc.stderr is not None
        printed = proc.stdout.read() + proc.stderr.read()
    finally:
        _reap(proc)
    # The engine printed its server arguments (SGLang logs the key there) and the agent its
    # command line: both went through the agent, with the key replaced.
    assert "server_args=" in printed and "--admin-api-key=<redacted>" in printed
    assert key not in printed


def test_prorsa_agent_command_refuses_a_bad_configuration(tmp_path):
    base = [sys.executable, "-m", "prorsa.cli", "agent", "--listen", "127.0.0.1:0"]
    missing = subprocess.run(base, capture_output=True, text=True, env={**os.environ})
    assert missing.returncode == 2 and "--token-file is required" in missing.stderr
    token = tmp_path / "t"
    token.write_text("x")
    flags_without_launch = subprocess.run(
        [*base, "--token-file", str(token), "--", "--model-path", "m"],
        capture_output=True,
        text=True,
    )
    assert flags_without_launch.returncode == 2
    assert "need --launch" in flags_without_launch.stderr
    mismatch = subprocess.run(
        [*base, "--token-file", str(token), "--engine-url", "http://127.0.0.1:30000",
         "--launch", "--", "--port", "31000"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert mismatch.returncode == 2 and "does not match --engine-url" in mismatch.stderr


async def test_a_health_probe_answered_before_a_crash_does_not_mark_the_dead_engine_healthy(
    tmp_path,
):
    # The probe asks /health, the engine answers and then dies before the answer is read:
    # the exit is recorded first, and the late "ok" must not undo it.
    agent = Agent(_config(tmp_path))
    gate = asyncio.Event()

    class Supervisor:
        generation, state, running = 1, "running", True

    class Engine:
        async def health(self, path: str, *, timeout: float) -> bool:
            await gate.wait()
            return True

    sup = Supervisor()
    agent.supervisor = sup  # type: ignore[assignment]
    agent._engine = Engine()  # type: ignore[assignment]
    probe = asyncio.create_task(agent._probe())
    await asyncio.sleep(0)
    sup.state, sup.running = "backoff", False
    agent._engine_exited(70, 0.9)
    gate.set()
    await probe
    assert agent.health.effective[0] == "down"
    assert "exited with 70" in agent.health.effective[1]
