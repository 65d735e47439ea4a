"""The in-pod agent in front of the real SGLang 0.5.23 on this CPU, behind the real smg.

Two engines, each launched by its own agent exactly as in an engine pod (``--launch``: every
engine starts as decode with role switching, metrics, the decode radix cache, HiCache and
the admin key), sit behind smg in PD mode. The test plays the operator: it takes an engine
out of smg before its agent flips it and puts it back in its new role. A trainer's load of
long greedy generations runs through smg with :class:`prorsa_sdk.ResumableGeneration`; the
engines swap roles twice (each way) under that load, so the agent drains, aborts at its
deadline and flips, and the client resumes every aborted request through smg: every call
is answered with its whole token budget.

The flip, drain and abort times go into the test report (``record_property``) and, with
``PRORSA_ENGINE_TIMINGS=<file>``, into a JSON file (docs/sglang-role-switch.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from prorsa_contract.agent_api import EngineState, RoleResult
from prorsa_lab.sglang_cpu.engine_pod import SglangPod
from prorsa_lab.sglang_cpu.environment import MODEL_SCRIPT, CpuEngineEnv
from prorsa_sdk.resumable import ResumableGeneration

from .conftest import ROOT, PdRouter, running

pytestmark = [pytest.mark.real_engine, pytest.mark.asyncio(loop_scope="module")]

TOKEN = "agent-token-real"
ADMIN_KEY = "engine-admin-key-real"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]
TIMINGS: dict[str, list[float]] = {}


def _timing(name: str, seconds: float) -> None:
    TIMINGS.setdefault(name, []).append(round(seconds, 3))


@pytest.fixture(scope="module", autouse=True)
def _write_timings() -> Any:
    yield
    out = os.environ.get("PRORSA_ENGINE_TIMINGS")
    if out and TIMINGS:
        path = Path(out)
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps(old | {"agent": TIMINGS}, indent=2))


class Cluster:
    """Two real engine pods and smg; ``prefill``/``decode`` name the pods by current role."""

    def __init__(self, a: SglangPod, b: SglangPod, router: PdRouter) -> None:
        self.pods = (a, b)
        self.router = router
        self.roles = {a.instance: "decode", b.instance: "decode"}

    def by_role(self, role: str) -> SglangPod:
        return next(p for p in self.pods if self.roles[p.instance] == role)

    async def flip(
        self, client: httpx.AsyncClient, pod: SglangPod, role: str, *, drain: float = 2.0
    ) -> RoleResult:
        """What the operator does: out of the router, flip through the agent, back in."""
        await self.router.remove(pod)
        reply = await client.post(
            f"{pod.agent_url}/v1/role",
            json={"role": role, "drainTimeoutSeconds": drain},
            headers=AUTH,
            timeout=300,
        )
        result = RoleResult.model_validate(reply.json())
        assert reply.status_code == 200 and result.ok, (reply.status_code, reply.text)
        self.roles[pod.instance] = role
        await self.router.add(pod, role)
        return result


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(engine_env: CpuEngineEnv, tmp_path_factory) -> AsyncIterator[Cluster]:
    logs = tmp_path_factory.mktemp("real-engines")
    pods = [
        SglangPod(
            env=engine_env,
            instance=name,
            token=TOKEN,
            engine_api_key=ADMIN_KEY,
            log_dir=logs,
        )
        for name in ("engine-a", "engine-b")
    ]
    router = PdRouter(log_dir=logs)
    started = time.monotonic()
    async with running(pods):
        _timing("engine_start_two_at_once", time.monotonic() - started)
        await router.start()
        try:
            env = Cluster(pods[0], pods[1], router)
            async with httpx.AsyncClient(timeout=60) as client:
                started = time.monotonic()
                result = await env.flip(client, pods[0], "prefill")
                _timing("flip_idle_via_agent", result.seconds)
            await router.add(pods[1], "decode")
            yield env
        finally:
            router.stop()
            for pod in pods:
                print(f"--- {pod.instance} engine log (tail) ---\n{pod.log_tail(15)}")


@pytest_asyncio.fixture(loop_scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        yield c


def _reference(env: CpuEngineEnv, ids: list[int], n: int) -> list[int]:
    """The model's greedy continuation by a plain forward pass (tiny_model.py)."""
    query = json.dumps({"input_ids": ids, "max_new_tokens": n})
    out = subprocess.run(
        [str(env.python), str(ROOT / MODEL_SCRIPT), str(env.model), "--reference", query],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return list(json.loads(out.stdout))


async def _state(client: httpx.AsyncClient, pod: SglangPod) -> EngineState:
    reply = await client.get(f"{pod.agent_url}/v1/state")
    assert reply.status_code == 200
    return EngineState.model_validate(reply.json())


# ------------------------------------------------------------------ the engine and smg


async def test_pd_output_through_smg_is_the_models_own(cluster, client, engine_env):
    """The decode engine continues from the KV the prefill engine sent: its greedy output
    is the model's (a plain forward pass), token for token."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    reply = await client.post(f"{cluster.router.url}/generate", json=body)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == _reference(engine_env, PROMPT, 12)
    decode = cluster.by_role("decode")
    loads = (await client.get(f"{decode.engine_url}/v1/loads", params={"include": "all"})).json()
    assert loads["loads"][0]["disaggregation"]["mode"] == "decode"


async def test_the_agent_reads_the_real_engine(cluster, client):
    """/v1/state from the real /v1/loads; the engine's /metrics has the series the docs
    name; the agent's own /metrics counts the setup's flip."""
    for pod in cluster.pods:
        state = await _state(client, pod)
        assert state.instance == pod.instance
        assert state.role == cluster.roles[pod.instance]
        assert state.healthy and not state.switching
        assert state.kv_capacity_tokens > 0
        metrics = (await client.get(f"{pod.engine_url}/metrics")).text
        for series in ("sglang:num_running_reqs", "sglang:token_usage", "sglang:gen_throughput"):
            assert series in metrics, series
        assert 'engine_type="dynamic"' in metrics  # one series across flips
    prefill = cluster.by_role("prefill")
    agent_metrics = (await client.get(f"{prefill.agent_url}/metrics")).text
    assert 'prorsa_agent_switches_total{result="ok",to="prefill"} 1.0' in (agent_metrics)


async def test_the_admin_key_guards_the_control_endpoints(cluster, client):
    """SGLang launched with the agent's --admin-api-key refuses a switch or an abort
    without it; generation, loads and server info stay open to the router."""
    pod = cluster.by_role("decode")
    url = pod.engine_url
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        switch = await client.post(
            f"{url}/pd_role_switch", json={"new_role": "prefill"}, headers=headers
        )
        assert switch.status_code == 401, switch.text
        abort = await client.post(f"{url}/abort_request", json={"abort_all": True}, headers=headers)
        assert abort.status_code == 401, abort.text
    for path in ("/v1/loads", "/server_info", "/health", "/metrics"):
        assert (await client.get(f"{url}{path}")).status_code == 200, path
    same = await client.post(f"{url}/pd_role_switch", json={"new_role": "decode"}, headers=ADMIN)
    assert same.status_code == 200 and same.json()["success"] is True


async def _long_generations(router: str, count: int, tokens: int) -> list[asyncio.Task[Any]]:
    async def one(i: int) -> tuple[dict[str, Any], int]:
        async with httpx.AsyncClient(base_url=router, timeout=600, trust_env=False) as http:
            gen = ResumableGeneration(http, max_resumes=8, max_retries=12, retry_base=0.25)
            body = {
                "input_ids": [*PROMPT, 40 + i],
                "sampling_params": {
                    "max_new_tokens": tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
            out = await gen.generate(body)
            return out, gen.resumes

    return [asyncio.create_task(one(i)) for i in range(count)]


async def _running(client: httpx.AsyncClient, pod: SglangPod, n: int) -> None:
    deadline = time.monotonic() + 120
    while (await _state(client, pod)).running_requests < n:
        assert time.monotonic() < deadline, "the load never reached the engine"
        await asyncio.sleep(0.1)


async def test_the_not_idle_refusal(cluster, client):
    """A busy engine refuses a switch with SGLang's own words and safe_to_restore."""
    decode = cluster.by_role("decode")
    tasks = await _long_generations(cluster.router.url, 2, 200)
    try:
        await _running(client, decode, 1)
        reply = await client.post(
            f"{decode.engine_url}/pd_role_switch", json={"new_role": "prefill"}, headers=ADMIN
        )
        assert reply.status_code == 400
        body = reply.json()
        assert body["success"] is False and body["safe_to_restore"] is True
        assert "instance is not idle" in body["message"]
        assert body["old_role"] == "decode"
    finally:
        for out, _ in await asyncio.gather(*tasks):
            assert len(out["output_ids"]) == 200


async def test_swaps_under_load_lose_no_token(cluster, client):
    """Both engines swap roles under a load of long generations, twice (each engine each
    way): the agent drains, aborts what is left at its deadline and flips; every client
    resumes through smg and gets its whole budget; the engines report their new roles."""
    tokens, count = 160, 4
    for swap in range(2):
        old_decode, old_prefill = cluster.by_role("decode"), cluster.by_role("prefill")
        tasks = await _long_generations(cluster.router.url, count, tokens)
        await _running(client, old_decode, count)
        started = time.monotonic()
        to_prefill = await cluster.flip(client, old_decode, "prefill", drain=1.0)
        to_decode = await cluster.flip(client, old_prefill, "decode", drain=1.0)
        _timing("swap_under_load", time.monotonic() - started)
        _timing("flip_busy_via_agent", to_prefill.seconds)
        _timing("flip_after_prefill_drain_via_agent", to_decode.seconds)
        assert to_prefill.aborted_requests >= 1, to_prefill
        results = await asyncio.gather(*tasks)
        for out, _ in results:
            assert len(out["output_ids"]) == tokens
            assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert sum(resumes for _, resumes in results) >= to_prefill.aborted_requests
        for pod in cluster.pods:
            state = await _state(client, pod)
            assert state.role == cluster.roles[pod.instance] and state.healthy
            info = (await client.get(f"{pod.engine_url}/server_info")).json()
            assert info["internal_states"][0]["disaggregation_mode"] == cluster.roles[pod.instance]
        del swap
