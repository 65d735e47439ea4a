"""A real SGLang 0.5.23 engine flipped by the in-pod agent (needs CUDA; skipped otherwise).

The agent launches ``python -m sglang.launch_server`` with a small model exactly as the
engine image does (``prorsa agent --launch``; every engine starts as decode), then flips it
to prefill, to decode and to prefill again while a light load runs, and checks after each
flip that ``/server_info`` reports the new role and that the engine still generates. It also
checks the prefix cache the agent asks for (docs/engine-flags.md): the engine launched as
decode reports a radix cache and HiCache, and once flipped to prefill a repeated prompt
finds its prefix cached (SGLang would otherwise run a flipped prefill with no cache). The
flip times are printed, attached to the test report (``record_property``) and, when
``PRORSA_GPU_REPORT`` names a file, written there as JSON.

Run on a GPU machine with SGLang 0.5.23 installed (e.g. inside the engine image)::

    PRORSA_GPU_MODEL=Qwen/Qwen2.5-0.5B-Instruct pytest -s tests/gpu/test_sglang_role_switch.py

Settings: ``PRORSA_GPU_MODEL`` (a local path or a Hub id), ``PRORSA_GPU_ENGINE_ARGS`` (more
SGLang flags, shell-quoted), ``PRORSA_GPU_STARTUP_TIMEOUT`` (seconds, default 900),
``MOONCAKE_PROTOCOL`` (default ``tcp`` so that one GPU without RDMA works).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.gpu

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's in-process stand-in for a PD peer
TOKEN = "gpu-check-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is not None:
        try:
            import torch

            return bool(torch.cuda.is_available())
        except Exception:
            return False
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def _skip_reason() -> str | None:
    if not _cuda_available():
        return "CUDA is not available"
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed (pip install sglang==0.5.23, or use the engine image)"
    version = importlib.metadata.version("sglang")
    if version != "0.5.23":
        return f"SGLang {version} is installed; this check is for 0.5.23"
    return None


_REASON = _skip_reason()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Load(threading.Thread):
    """A light, steady load: one short generation at a time, with a fake PD peer."""

    def __init__(self, engine_url: str) -> None:
        super().__init__(daemon=True)
        self.engine_url = engine_url
        self.stop = threading.Event()
        self.finishes: list[str] = []
        self.errors: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=120.0) as client:
            while not self.stop.is_set():
                body = {
                    "text": "Write one sentence about the sea.",
                    "bootstrap_host": FAKE_BOOTSTRAP_HOST,
                    "bootstrap_room": random.randrange(1 << 62),
                    "sampling_params": {"max_new_tokens": 32, "temperature": 0.0},
                }
                try:
                    response = client.post(f"{self.engine_url}/generate", json=body)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    continue
                if response.status_code != 200:
                    self.errors.append(f"HTTP {response.status_code}: {response.text[:200]}")
                else:
                    self.finishes.append(response.json()["meta_info"]["finish_reason"]["type"])
                time.sleep(0.2)


def _echo(stream) -> None:
    for line in stream:
        print(line, end="")


def _generate_once(engine_url: str, text: str = "The capital of France is") -> dict:
    body = {
        "text": text,
        "bootstrap_host": FAKE_BOOTSTRAP_HOST,
        "bootstrap_room": random.randrange(1 << 62),
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
    }
    response = httpx.post(f"{engine_url}/generate", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    return response.json()


def test_real_engine_flips_prefill_decode_prefill_under_load(tmp_path: Path, record_property):
    model = os.environ.get("PRORSA_GPU_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    startup_timeout = float(os.environ.get("PRORSA_GPU_STARTUP_TIMEOUT", "900"))
    token = tmp_path / "token"
    token.write_text(TOKEN)
    engine_port, bootstrap_port = _free_port(), _free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    env = {**os.environ}
    env.setdefault("MOONCAKE_PROTOCOL", "tcp")
    engine_args = [
        "--model-path", model,
        "--tp-size", "1",
        "--host", "127.0.0.1",
        "--disaggregation-transfer-backend", "mooncake",
        "--disaggregation-bootstrap-port", str(bootstrap_port),
        "--mem-fraction-static", "0.6",
        *shlex.split(os.environ.get("PRORSA_GPU_ENGINE_ARGS", "")),
    ]  # fmt: skip
    agent = subprocess.Popen(
        [
            sys.executable, "-m", "prorsa.cli", "agent",
            "--listen", "127.0.0.1:0",
            "--token-file", str(token),
            "--engine-url", engine_url,
            "--instance", "gpu-engine-0",
            "--health-interval", "2",
            "--launch", "--", *engine_args,
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    load: _Load | None = None
    flips: list[dict] = []
    try:
        agent_url = None
        assert agent.stdout is not None
        for line in agent.stdout:
            print(line, end="")
            match = re.search(r"prorsa agent listening on (http://\S+)", line)
            if match:
                agent_url = match.group(1)
                break
        assert agent_url, "the agent did not start"
        # Keep reading the agent's (and SGLang's) output so that the pipe never fills up.
        threading.Thread(target=_echo, args=(agent.stdout,), daemon=True).start()
        deadline = time.monotonic() + startup_timeout
        with httpx.Client(timeout=30.0) as client:
            while client.get(f"{agent_url}/healthz").status_code != 200:
                assert agent.poll() is None, "the agent exited"
                assert time.monotonic() < deadline, "SGLang did not become healthy in time"
                time.sleep(2)
            state = client.get(f"{agent_url}/v1/state").json()
            assert state["role"] == "decode" and state["kvCapacityTokens"] > 0
            cache_on = "--disable-radix-cache" not in engine_args
            if cache_on:
                info = client.get(f"{engine_url}/server_info").json()  # resolved server args
                assert info["disable_radix_cache"] is False, "a decode launch lost its radix cache"
                assert info["enable_hierarchical_cache"] is True
            assert _generate_once(engine_url)["meta_info"]["completion_tokens"] > 0

            load = _Load(engine_url)
            load.start()
            time.sleep(3)
            for role in ("prefill", "decode", "prefill"):
                response = client.post(
                    f"{agent_url}/v1/role",
                    json={"role": role, "drainTimeoutSeconds": 10},
                    headers=AUTH,
                    timeout=900.0,
                )
                result = response.json()
                assert response.status_code == 200 and result["ok"], result
                flips.append(
                    {
                        "to": role,
                        "seconds": result["seconds"],
                        "abortedRequests": result["abortedRequests"],
                    }
                )
                info = client.get(f"{engine_url}/server_info").json()
                assert info["internal_states"][0]["disaggregation_mode"] == role
                assert client.get(f"{engine_url}/health_generate").status_code == 200
                out = _generate_once(engine_url)
                assert out["meta_info"]["completion_tokens"] > 0
                assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")
                time.sleep(3)
            if cache_on:  # the last flip was to prefill: a repeated prompt hits the cache
                prompt = "Summarise the rules of chess. " * 40
                _generate_once(engine_url, prompt)
                cached = _generate_once(engine_url, prompt)["meta_info"].get("cached_tokens", 0)
                assert cached > 0, "a prefill engine flipped from decode has no prefix cache"
            load.stop.set()
            load.join(timeout=180)
            assert not load.errors, load.errors[:5]
            assert load.finishes, "the load generated nothing"
            metrics = client.get(f"{agent_url}/metrics").text
            assert 'prorsa_agent_switches_total{result="ok",to="prefill"} 2.0' in metrics
    finally:
        if load is not None:
            load.stop.set()
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=120)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    print("flip times:", json.dumps(flips))
    record_property("flips", json.dumps(flips))
    report = os.environ.get("PRORSA_GPU_REPORT")
    if report:
        Path(report).write_text(json.dumps({"model": model, "flips": flips}, indent=2))
