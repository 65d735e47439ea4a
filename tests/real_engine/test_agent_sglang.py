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
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from prorsa_contract.agent_api import EngineState, RoleResult
from prorsa_lab.sglang_cpu.environment import CpuEngineEnv
from prorsa_lab.sglang_cpu.sglang_pod import SglangPod
from prorsa_sdk.resumable import ResumableGeneration

from .engine_helpers import PdRouter, Timings, reference_output, running

# The parity tests at the end also run against the engine double, in `make test`: the
# real-engine mark is on each test (and on the real engine's parameter), not the module.
pytestmark = pytest.mark.asyncio(loop_scope="module")
real_engine = pytest.mark.real_engine

TOKEN = "agent-token-real"
ADMIN_KEY = "engine-admin-key-real"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]
TIMINGS = Timings("agent")


@pytest.fixture(scope="module", autouse=True)
def _write_timings() -> Iterator[None]:
    yield
    TIMINGS.write()


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
        TIMINGS.add("engine_start_two_at_once", time.monotonic() - started)
        await router.start()
        try:
            env = Cluster(pods[0], pods[1], router)
            async with httpx.AsyncClient(timeout=60) as client:
                started = time.monotonic()
                result = await env.flip(client, pods[0], "prefill")
                TIMINGS.add("flip_idle_via_agent", result.seconds)
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


async def _state(client: httpx.AsyncClient, pod: SglangPod) -> EngineState:
    reply = await client.get(f"{pod.agent_url}/v1/state")
    assert reply.status_code == 200
    return EngineState.model_validate(reply.json())


# ------------------------------------------------------------------ the engine and smg


@real_engine
async def test_pd_output_through_smg_is_the_models_own(cluster, client, engine_env):
    """The decode engine continues from the KV the prefill engine sent: its greedy output
    is the model's (a plain forward pass), token for token."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    started = time.monotonic()
    reply = await client.post(f"{cluster.router.url}/generate", json=body)
    TIMINGS.add("pd_request_12_tokens", time.monotonic() - started)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == reference_output(engine_env, PROMPT, 12)
    decode = cluster.by_role("decode")
    loads = (await client.get(f"{decode.engine_url}/v1/loads", params={"include": "all"})).json()
    assert loads["loads"][0]["disaggregation"]["mode"] == "decode"


@real_engine
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


@real_engine
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


@real_engine
@real_engine
async def test_a_raw_flip_and_an_abort(cluster, client):
    """SGLang's own times, without the agent: ``/pd_role_switch`` both ways on an idle
    engine out of the router, and ``abort_all`` on a busy one until it is empty."""
    pod = cluster.by_role("decode")
    await cluster.router.remove(pod)
    for role in ("prefill", "decode"):
        body: dict[str, Any] = {"new_role": role}
        if role == "decode":
            body["decode_cuda_graph_memory_gb"] = 0
        started = time.monotonic()
        reply = await client.post(f"{pod.engine_url}/pd_role_switch", json=body, headers=ADMIN)
        TIMINGS.add(f"raw_flip_to_{role}", time.monotonic() - started)
        assert reply.status_code == 200 and reply.json()["success"], reply.text
    await cluster.router.add(pod, "decode")
    tasks = await _long_generations(cluster.router.url, 2, 400)
    await _running(client, pod, 2)
    await asyncio.sleep(0.5)
    started = time.monotonic()
    reply = await client.post(
        f"{pod.engine_url}/abort_request", json={"abort_all": True}, headers=ADMIN
    )
    assert reply.status_code == 200
    while (await _state(client, pod)).running_requests:
        await asyncio.sleep(0.02)
    TIMINGS.add("abort_all_until_empty", time.monotonic() - started)
    for out, resumes in await asyncio.gather(*tasks):
        assert len(out["output_ids"]) == 400 and resumes >= 1


@real_engine
async def test_the_not_idle_refusal(cluster, client):
    """A busy engine refuses a switch with SGLang's own words and safe_to_restore."""
    decode = cluster.by_role("decode")
    tasks = await _long_generations(cluster.router.url, 2, 200)
    try:
        await _running(client, decode, 1)
        started = time.monotonic()
        reply = await client.post(
            f"{decode.engine_url}/pd_role_switch", json={"new_role": "prefill"}, headers=ADMIN
        )
        assert reply.status_code == 400
        body = reply.json()
        assert body["success"] is False and body["safe_to_restore"] is True
        assert "instance is not idle" in body["message"]
        assert body["old_role"] == "decode"
        TIMINGS.add("not_idle_refusal", time.monotonic() - started)
    finally:
        for out, _ in await asyncio.gather(*tasks):
            assert len(out["output_ids"]) == 200


@real_engine
async def test_swaps_under_load_lose_no_token(cluster, client):
    """Both engines swap roles under a load of long generations, twice (each engine each
    way): the agent drains, aborts what is left at its deadline and flips; every client
    resumes through smg and gets its whole budget; the engines report their new roles."""
    tokens, count = 600, 3
    for swap in range(2):
        old_decode, old_prefill = cluster.by_role("decode"), cluster.by_role("prefill")
        tasks = await _long_generations(cluster.router.url, count, tokens)
        await _running(client, old_decode, count)
        await asyncio.sleep(1.0)  # some tokens out: an abort now leaves a partial answer
        started = time.monotonic()
        to_prefill = await cluster.flip(client, old_decode, "prefill", drain=0.5)
        to_decode = await cluster.flip(client, old_prefill, "decode", drain=0.5)
        TIMINGS.add("swap_under_load", time.monotonic() - started)
        TIMINGS.add("flip_busy_via_agent", to_prefill.seconds)
        TIMINGS.add("flip_after_prefill_drain_via_agent", to_decode.seconds)
        assert to_prefill.aborted_requests >= 1, to_prefill
        results = await asyncio.gather(*tasks)
        for out, _ in results:
            assert len(out["output_ids"]) == tokens
            assert out["meta_info"]["finish_reason"]["type"] == "length"
        # An abort reaches the client as finish_reason "abort" and is resumed (asserted in
        # test_a_raw_flip_and_an_abort); which requests a drain deadline cuts varies.
        TIMINGS.add("swap_resumes", float(sum(resumes for _, resumes in results)))
        for pod in cluster.pods:
            role = cluster.roles[pod.instance]
            deadline = time.monotonic() + 60  # a health probe may be out on a busy machine
            while not ((state := await _state(client, pod)).role == role and state.healthy):
                assert time.monotonic() < deadline, (pod.instance, state)
                await asyncio.sleep(0.5)
            info = (await client.get(f"{pod.engine_url}/server_info")).json()
            assert info["internal_states"][0]["disaggregation_mode"] == role
        del swap


# ------------------------------------------------ the double and the real engine, same checks
#
# Each test below runs against the engine double (in `make test` too) and against the
# real engine; where they differed, the double was fixed.

LOAD_FIELDS = {
    "timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs",
    "num_waiting_uncached_tokens", "num_used_tokens", "num_total_tokens",
    "num_active_tokens", "num_prealloc_ready_tokens", "max_total_num_tokens",
    "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate", "utilization",
    "total_prefill_uncached_tokens", "total_prefill_busy_us", "decode_moments", "memory",
    "disaggregation", "queues",
}  # fmt: skip
DISAGG_FIELDS = {
    "mode", "prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs", "decode_transfer_queue_reqs", "decode_retracted_queue_reqs",
    "kv_transfer_speed_gb_s", "kv_transfer_latency_ms",
}  # fmt: skip


class Engine:
    """A decode engine under test: its URL, and a way to keep it busy."""

    def __init__(self, url: str, busy_url: str) -> None:
        self.url = url
        self.busy_url = busy_url  # where a generation goes: the double itself, or smg

    def busy(self, tokens: int = 300) -> asyncio.Task[httpx.Response]:
        async def generate() -> httpx.Response:
            body = {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
            }
            async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
                return await http.post(f"{self.busy_url}/generate", json=body)

        return asyncio.create_task(generate())

    async def running(self, client: httpx.AsyncClient) -> int:
        loads = (await client.get(f"{self.url}/v1/loads")).json()["loads"]
        return sum(int(load["num_running_reqs"]) for load in loads)


@pytest_asyncio.fixture(
    loop_scope="module", params=["double", pytest.param("sglang", marks=real_engine)]
)
async def engine(request) -> AsyncIterator[Engine]:
    if request.param == "sglang":
        cluster: Cluster = request.getfixturevalue("cluster")
        pod = cluster.by_role("decode")
        yield Engine(pod.engine_url, cluster.router.url)
        return
    from prorsa_lab.doubles.sglang_double import EngineConfig, EngineDouble, TimingModel

    config = EngineConfig(
        role="decode",
        admin_api_key=ADMIN_KEY,
        timing=TimingModel(decode_step_seconds=0.01),
    )
    async with EngineDouble(config) as double:
        yield Engine(double.url, double.url)


async def _until_running(client: httpx.AsyncClient, engine: Engine) -> None:
    deadline = time.monotonic() + 120
    while not await engine.running(client):
        assert time.monotonic() < deadline, "the generation never reached the engine"
        await asyncio.sleep(0.05)


async def test_loads_have_sglangs_fields(engine: Engine, client):
    body = (await client.get(f"{engine.url}/v1/loads", params={"include": "all"})).json()
    assert set(body) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    assert body["version"] == "0.5.23"
    (load,) = body["loads"]
    assert set(load) == LOAD_FIELDS
    assert set(load["disaggregation"]) == DISAGG_FIELDS
    assert load["disaggregation"]["mode"] == "decode"
    assert set(load["memory"]) == {"weight_gb", "kv_cache_gb", "graph_gb", "token_capacity"}
    assert set(load["queues"]) == {"waiting", "grammar", "paused", "retracted", "prealloc_ready"}
    core = (await client.get(f"{engine.url}/v1/loads", params={"include": "core"})).json()
    assert not set(core["loads"][0]) & {"memory", "disaggregation", "queues"}


async def test_server_info_has_what_the_agent_reads(engine: Engine, client):
    info = (await client.get(f"{engine.url}/server_info")).json()
    assert info["version"] == "0.5.23"
    # Start-up phase durations, not a time stamp; the agent compares it to see a restart.
    startup = info["startup_time"]
    assert {"load_weight", "kv_cache_allocation", "scheduler_e2e", "cuda_graph"} <= set(startup)
    state = info["internal_states"][0]
    assert state["disaggregation_mode"] == "decode"
    assert state["decode_cuda_graph_bs"] == [] or isinstance(state["decode_cuda_graph_bs"], list)
    assert isinstance(state["decode_cuda_graph_memory_gb"], int | float)
    assert isinstance(state["memory_usage"], dict)
    # /server_info is open to anyone who reaches the engine port, and it carries the admin
    # key in clear (SGLang 0.5.23 redacts only watermark secrets): docs/security.md.
    assert info["admin_api_key"] == ADMIN_KEY


async def test_control_endpoints_need_the_admin_key(engine: Engine, client):
    for path, body in (
        ("/pd_role_switch", {"new_role": "prefill"}),
        ("/abort_request", {"abort_all": True}),
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            reply = await client.post(f"{engine.url}{path}", json=body, headers=headers)
            assert reply.status_code == 401, (path, reply.text)
    for path in ("/v1/loads", "/server_info", "/health", "/metrics", "/model_info"):
        assert (await client.get(f"{engine.url}{path}")).status_code == 200, path


async def test_a_switch_to_the_same_role(engine: Engine, client):
    """The scheduler says "already in target role"; the tokenizer manager, which answers
    the HTTP call, replaces every success message by "ok" (``tokenizer_control_mixin.py``)."""
    reply = await client.post(
        f"{engine.url}/pd_role_switch", json={"new_role": "decode"}, headers=ADMIN
    )
    assert reply.status_code == 200
    body = reply.json()
    assert {k: body[k] for k in ("success", "message", "old_role", "new_role")} == {
        "success": True,
        "message": "ok",
        "old_role": "decode",
        "new_role": "decode",
    }


async def test_busy_refusal_then_abort_with_partial_output(engine: Engine, client):
    task = engine.busy()
    await _until_running(client, engine)
    reply = await client.post(
        f"{engine.url}/pd_role_switch", json={"new_role": "prefill"}, headers=ADMIN
    )
    assert reply.status_code == 400
    body = reply.json()
    assert {k: body[k] for k in ("success", "message", "old_role", "new_role")} == {
        "success": False,
        "message": "instance is not idle; drain all requests before switching",
        "old_role": "decode",
        "new_role": "prefill",
    }
    assert body["safe_to_restore"] is True
    await asyncio.sleep(0.3)
    abort = await client.post(
        f"{engine.url}/abort_request", json={"abort_all": True}, headers=ADMIN
    )
    assert abort.status_code == 200 and abort.content == b""
    out = await task
    assert out.status_code == 200
    meta = out.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < len(out.json()["output_ids"]) < 300
    assert meta["completion_tokens"] == len(out.json()["output_ids"])


async def test_metrics_have_the_series_the_docs_name(engine: Engine, client):
    task = engine.busy(20)
    assert (await task).status_code == 200
    text = (await client.get(f"{engine.url}/metrics")).text
    for series in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:token_usage",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:time_to_first_token_seconds",
    ):
        assert f"\n{series}" in text, series
    # Scheduler gauges survive a flip (engine_type "dynamic"); the tokenizer's counters
    # keep the launch mode.
    assert 'sglang:num_running_reqs{engine_type="dynamic"' in text
    assert 'sglang:generation_tokens_total{engine_type="decode"' in text
