"""The in-pod agent in front of the real SGLang 0.5.23 on this CPU, behind the real smg.

The three engine pods of the shared cluster (``shared_cluster.py``): each is the real agent
launching its engine exactly as in an engine pod (``--launch``: every engine starts as
decode with role switching, metrics, the decode radix cache and the admin key), smg routes
to them from the pods' role labels, and the operator flipped one to prefill at start
through its agent. These tests read that cluster and leave it as they found it (1P:2D,
nothing switching): the agent's ``/v1/state`` from the real ``/v1/loads``, the engine's
``/metrics``, the admin key, SGLang's own answers to a busy switch, an abort and a switch to
the same role. The drain, abort, flip and verification under a trainer's load, both ways,
with every abort resumed, run through the operator in ``test_operator_sglang.py``.

The parity tests at the end run the same checks against the engine double (in ``make
test`` too): where the two differed, the double was fixed. Timings go into the test output
and, with ``PRORSA_ENGINE_TIMINGS=<file>``, into a JSON file (docs/sglang-role-switch.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio

from prorsa_contract.agent_api import EngineState
from prorsa_lab.doubles.stack import Stack
from prorsa_lab.sglang_cpu.environment import CpuEngineEnv
from prorsa_lab.sglang_cpu.sglang_pod import SglangPod

from .engine_helpers import Timings, reference_output
from .shared_cluster import PROMPT, SERVED, engine_pods, pods_by_role, smg_agrees, split

# The parity tests at the end also run against the engine double, in `make test`: the
# real-engine mark is on each test (and on the real engine's parameter), not the module.
pytestmark = pytest.mark.asyncio(loop_scope="session")
real_engine = pytest.mark.real_engine

ADMIN_KEY = "engine-admin-key-double"
TIMINGS = Timings("agent")


@pytest.fixture(scope="module", autouse=True)
def _write_timings() -> Iterator[None]:
    yield
    TIMINGS.write()


@pytest_asyncio.fixture(loop_scope="session")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=120, trust_env=False, verify=False) as c:
        yield c


def _admin(pod: SglangPod) -> dict[str, str]:
    assert pod.engine_api_key, "the operator gives every engine pod its admin key"
    return {"Authorization": f"Bearer {pod.engine_api_key}"}


async def _state(client: httpx.AsyncClient, pod: SglangPod) -> EngineState:
    reply = await client.get(f"{pod.agent_url}/v1/state")
    assert reply.status_code == 200
    return EngineState.model_validate(reply.json())


# ------------------------------------------------------------------ the engine and smg


@real_engine
async def test_pd_output_through_smg_is_the_models_own(
    cluster: Stack, client: httpx.AsyncClient, engine_env: CpuEngineEnv, shared
) -> None:
    """A decode engine continues from the KV the prefill engine sent: its greedy output
    is the model's (a plain forward pass), token for token."""
    if shared.up_seconds is not None:
        TIMINGS.add("cluster_up_three_engines", shared.up_seconds)
    body = {
        "model": SERVED,
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
    }
    started = time.monotonic()
    reply = await client.post(f"{cluster.router_url}/generate", json=body)
    TIMINGS.add("pd_request_12_tokens", time.monotonic() - started)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == await reference_output(engine_env, PROMPT, 12)
    for decode in (await pods_by_role(cluster))["decode"]:
        loads = await client.get(f"{decode.engine_url}/v1/loads", params={"include": "all"})
        assert loads.json()["loads"][0]["disaggregation"]["mode"] == "decode"


@real_engine
async def test_the_agent_reads_the_real_engine(cluster: Stack, client: httpx.AsyncClient) -> None:
    """/v1/state from the real /v1/loads; the engine's /metrics has the series the docs
    name; the agent's own /metrics counts the operator's flip at start-up."""
    roles = await cluster.roles()
    for name, pod in engine_pods(cluster).items():
        state = await _state(client, pod)
        assert state.instance == name
        assert state.role == roles[name]
        assert state.healthy and not state.switching
        assert state.kv_capacity_tokens > 0
        metrics = (await client.get(f"{pod.engine_url}/metrics")).text
        for series in ("sglang:num_running_reqs", "sglang:token_usage", "sglang:gen_throughput"):
            assert series in metrics, series
        assert 'engine_type="dynamic"' in metrics  # one series across flips
    (prefill,) = (await pods_by_role(cluster))["prefill"]
    agent_metrics = (await client.get(f"{prefill.agent_url}/metrics")).text
    assert 'prorsa_agent_switches_total{result="ok",to="prefill"} 1.0' in agent_metrics
    flip = _sample(agent_metrics, 'prorsa_agent_switch_duration_seconds_sum{to="prefill"}')
    TIMINGS.add("flip_idle_via_agent", flip)


def _sample(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in the metrics")


@real_engine
async def test_the_admin_key_guards_the_control_endpoints(
    cluster: Stack, client: httpx.AsyncClient
) -> None:
    """SGLang launched with the agent's --admin-api-key (the cluster's engine admin key
    Secret) refuses a switch or an abort without it; generation, loads and server info stay
    open to the router."""
    pod = (await pods_by_role(cluster))["decode"][0]
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
    """A decode engine under test: its URL, its admin key, and a way to keep it busy."""

    def __init__(
        self, url: str, busy_url: str, *, admin_key: str, spread: int = 1, real: bool = False
    ) -> None:
        self.real = real
        self.url = url
        self.busy_url = busy_url  # where a generation goes: the double itself, or smg
        self.admin = {"Authorization": f"Bearer {admin_key}"}
        # smg spreads generations over this many decode engines (round robin): sending that
        # many puts one on this engine.
        self.spread = spread

    def busy(self, tokens: int = 300) -> list[asyncio.Task[httpx.Response]]:
        async def generate(i: int) -> httpx.Response:
            body = {
                "model": SERVED,
                "input_ids": [*PROMPT, 40 + i],
                "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
            }
            async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
                return await http.post(f"{self.busy_url}/generate", json=body)

        return [asyncio.create_task(generate(i)) for i in range(self.spread)]

    async def running(self, client: httpx.AsyncClient) -> int:
        loads = (await client.get(f"{self.url}/v1/loads")).json()["loads"]
        return sum(int(load["num_running_reqs"]) for load in loads)


@pytest_asyncio.fixture(
    loop_scope="session", params=["double", pytest.param("sglang", marks=real_engine)]
)
async def engine(request) -> AsyncIterator[Engine]:
    if request.param == "sglang":
        cluster: Stack = request.getfixturevalue("cluster")
        decodes = (await pods_by_role(cluster))["decode"]
        pod = decodes[0]
        assert cluster.router_url and pod.engine_api_key
        yield Engine(
            pod.engine_url,
            cluster.router_url,
            admin_key=pod.engine_api_key,
            spread=len(decodes),
            real=True,
        )
        # Left as found: every engine serving, smg agreeing, the split the cluster came up in.
        await cluster.wait_for(lambda: smg_agrees(cluster), timeout=120, what="smg's workers")
        assert await split(cluster, 1, 2)
        return
    from prorsa_lab.doubles.sglang_double import EngineConfig, EngineDouble, TimingModel

    config = EngineConfig(
        role="decode",
        admin_api_key=ADMIN_KEY,
        timing=TimingModel(decode_step_seconds=0.01),
    )
    async with EngineDouble(config) as double:
        yield Engine(double.url, double.url, admin_key=ADMIN_KEY)


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
    assert {"Authorization": f"Bearer {info['admin_api_key']}"} == engine.admin


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
        f"{engine.url}/pd_role_switch", json={"new_role": "decode"}, headers=engine.admin
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
    # Long enough to be running when the abort lands: 300 tokens once finished first on an
    # idle CPU engine (one request decodes at 300 tokens/s there).
    tokens = 1200
    tasks = engine.busy(tokens)
    await _until_running(client, engine)
    started = time.monotonic()
    reply = await client.post(
        f"{engine.url}/pd_role_switch", json={"new_role": "prefill"}, headers=engine.admin
    )
    refused = time.monotonic() - started
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
    started = time.monotonic()
    abort = await client.post(
        f"{engine.url}/abort_request", json={"abort_all": True}, headers=engine.admin
    )
    assert abort.status_code == 200 and abort.content == b""
    while await engine.running(client):
        await asyncio.sleep(0.02)
    emptied = time.monotonic() - started
    outs = [(await task).json() for task in tasks]
    assert all(o["meta_info"]["finish_reason"]["type"] in ("abort", "length") for o in outs)
    # The generation on this engine (smg sent one to each decode engine) was cut.
    (out,) = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "abort"]
    assert 0 < len(out["output_ids"]) < tokens
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])
    if engine.real:
        TIMINGS.add("not_idle_refusal", refused)
        TIMINGS.add("abort_all_until_empty", emptied)


async def test_a_health_check_passes_idle_and_while_busy(engine: Engine, client):
    """The agent reads ``/health_generate`` after every flip and while the engine serves.
    SGLang answers it with its own one-token request when idle, and with any output that
    arrives after the check began when busy (``http_server.py`` ``health_generate``): a busy
    engine is never reported unhealthy because its check waited behind the batch."""
    assert (await client.get(f"{engine.url}/health_generate")).status_code == 200
    # Long enough to be still running after the check on an idle machine (300 tokens took
    # under 3.5 s there and had ended); aborted below.
    tasks = engine.busy(1200)
    await _until_running(client, engine)
    assert (await client.get(f"{engine.url}/health_generate")).status_code == 200
    assert await engine.running(client)  # the check cut nothing
    await client.post(f"{engine.url}/abort_request", json={"abort_all": True}, headers=engine.admin)
    await asyncio.gather(*tasks)


async def test_metrics_have_the_series_the_docs_name(engine: Engine, client):
    for task in engine.busy(20):
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
