"""The operator end to end with the real SGLang 0.5.23 engines on this CPU.

The API emulator, the operator (kopf, real webhook), the fake kubelet running each engine
pod as the real agent launching the real SGLang from the pod's ``PRORSA_*`` environment,
and the router Deployment as the real smg with Kubernetes discovery: three one-CPU
instances (the most this machine runs at once), every engine launched as decode and one
flipped to prefill by the operator at start. A trainer's load of long greedy generations
runs through smg with :class:`prorsa_sdk.ResumableGeneration` while the trainer's
lifecycle events move demand to prefill and back: the operator switches both ways, every
call is answered with its whole token budget, and an answer's tokens are the model's own
(the KV moved from a prefill engine to a decode engine).

Then the failure cases on the same engines: an engine killed in the middle of its flip; smg
dropping its workers (the router process dies) while the operator waits for it; and the
prefill engine lost with its bootstrap port while requests keep coming. Each must leave the
cluster converged: smg listing every pod with its role, no pod left ``draining``, no switch
in progress, every request answered with its whole budget.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from prorsa_contract.labels import DRAINING
from prorsa_lab.doubles.stack import Stack, cluster_manifest, stack
from prorsa_lab.sglang_cpu.environment import CpuEngineEnv
from prorsa_lab.sglang_cpu.sglang_pod import CPU_TIMEOUTS, SglangPod
from prorsa_sdk.resumable import ResumableGeneration

from .engine_helpers import Timings, reference_output

pytestmark = [pytest.mark.real_engine, pytest.mark.asyncio(loop_scope="module")]

SERVED = "tiny"
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]
START = 900.0  # three engines loading at once on a loaded 2-core machine
READINESS_SECONDS = 12.0  # the pods' readinessProbe: 2 failures 5 s apart
TIMINGS = Timings("operator")


@pytest.fixture(scope="module", autouse=True)
def _write_timings() -> Iterator[None]:
    yield
    TIMINGS.write()


def manifest(env: CpuEngineEnv) -> dict[str, Any]:
    return cluster_manifest(
        model={"path": str(env.model), "servedName": SERVED},
        engine={
            "image": "prorsa/engine:0.5.23",
            "gpusPerInstance": 1,
            "tensorParallelSize": 1,
            "gpuResourceName": "",
            # SGLang's HiCache host tier needs CUDA (docs/testing.md).
            "env": [{"name": "PRORSA_DISABLE_HICACHE", "value": "1"}],
        },
        gpuBudget=3,
        roles={"prefill": {"min": 1, "initial": 1}, "decode": {"min": 1}},
        router={"enabled": True, "policy": "round_robin"},
        switching={"drainTimeoutSeconds": 2, "cooldownSeconds": 0},
    )


async def split(env: Stack, prefill: int, decode: int) -> bool:
    counts = await env.count_roles()
    return counts.get("prefill", 0) == prefill and counts.get("decode", 0) == decode


async def smg_agrees(env: Stack) -> bool:
    """smg lists every engine pod with its role label's type (and nothing draining)."""
    router = env.kubelet.router
    if router is None:
        return False
    want = {}
    for pod in await env.pods():
        ip = (pod.get("status") or {}).get("podIP")
        role = pod["metadata"]["labels"].get("prorsa.io/role")
        if not ip or role == DRAINING:
            return False
        want[ip] = role
    async with httpx.AsyncClient(trust_env=False) as client:
        workers = await router.workers(client)
    got = {
        str(w.get("url", "")).split("://", 1)[-1].rsplit(":", 1)[0]: w.get("worker_type")
        for w in workers or []
        if w.get("is_healthy")
    }
    return len(want) == 3 and got == want


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(engine_env: CpuEngineEnv, tmp_path_factory) -> AsyncIterator[Stack]:
    logs = tmp_path_factory.mktemp("operator-real-engines")
    async with stack(
        real_engines=engine_env,
        agent_timeouts=CPU_TIMEOUTS,
        run_router=True,
        log_dir=logs,
        tick_seconds=1.0,
        router_settle_timeout=60.0,
    ) as env:
        started = time.monotonic()
        await env.create_cluster(manifest(engine_env))
        try:
            await env.wait_for(lambda: split(env, 1, 2), timeout=START, what="1P:2D")
            await env.wait_for(lambda: smg_agrees(env), timeout=120, what="smg's workers")
            TIMINGS.add("cluster_up_three_engines", time.monotonic() - started)
            yield env
        finally:
            for name, runtime in env.kubelet.pods.items():
                if isinstance(runtime.pod, SglangPod):
                    print(f"--- {name} engine log (tail) ---\n{runtime.pod.log_tail(12)}")


class _ModelNotFoundIsBusy(httpx.AsyncBaseTransport):
    """smg 1.13.0 under Kubernetes discovery answers 404 (no such model) while no worker of
    the model is registered, as right after it restarts: the trainer's client takes that
    for a 503 and retries (``ResumableGeneration`` retries 5xx only)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if response.status_code != 404 or request.url.path != "/generate":
            return response
        await response.aread()
        return httpx.Response(503, headers=response.headers, content=response.content)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Load:
    """A trainer's generations through smg, resumed across aborts; all checked at the end."""

    def __init__(self, env: Stack, *, count: int, tokens: int) -> None:
        assert env.router_url is not None
        self.tokens = tokens
        self.resumes = 0
        self.tasks = [asyncio.create_task(self._one(env.router_url, i)) for i in range(count)]

    async def _one(self, router: str, i: int) -> dict[str, Any]:
        transport = _ModelNotFoundIsBusy(httpx.AsyncHTTPTransport())
        async with httpx.AsyncClient(
            base_url=router, timeout=900, trust_env=False, transport=transport
        ) as http:
            gen = ResumableGeneration(http, max_resumes=20, max_retries=30, retry_base=0.2)
            body = {
                "model": SERVED,
                "input_ids": [*PROMPT, 50 + i],
                "sampling_params": {
                    "max_new_tokens": self.tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
            out = await gen.generate(body)
            self.resumes += gen.resumes
            return out

    async def finished(self) -> list[dict[str, Any]]:
        outs = await asyncio.gather(*self.tasks)
        for out in outs:
            assert len(out["output_ids"]) == self.tokens, "tokens lost"
            assert out["meta_info"]["finish_reason"]["type"] == "length"
        return list(outs)


LIVE: set[str] = set()
"""Trajectories a test's demand phases left live: the next phase drops them first."""


async def demand(env: Stack, events: list[dict[str, Any]]) -> None:
    """Post a demand phase in place of the one before (its trajectories dropped)."""
    gone = [env.event("trajectory_dropped", t) for t in sorted(LIVE)]
    LIVE.clear()
    if gone:
        assert (await env.post(gone)).status_code == 200
    LIVE.update(e["trajectory"] for e in events)
    assert (await env.post(events)).status_code == 200


# Demand large enough that a switch pays for what it costs (the Controller prices a switch by
# its measured duration, here that of the real engines' first flip through smg).
def prefill_heavy(env: Stack, n: int = 60, tokens: int = 20_000) -> list[dict[str, Any]]:
    return [
        env.event("request_queued", f"p{env._ids}-{i}", prompt_tokens=tokens, turn=0)
        for i in range(n)
    ]


def decode_heavy(env: Stack, prefill_pod: str, n: int = 12) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        t = f"d{env._ids}-{i}"
        out.append(env.event("request_queued", t, prompt_tokens=20_000, turn=0))
        out.append(env.event("prefill_started", t, instance=prefill_pod))
    return out


async def test_the_operator_switches_both_ways_under_load(env: Stack, engine_env: CpuEngineEnv):
    load = Load(env, count=4, tokens=2000)
    started = time.monotonic()
    await demand(env, prefill_heavy(env))
    await env.wait_for(lambda: split(env, 2, 1), timeout=300, what="a flip to 2P:1D")
    TIMINGS.add("operator_switch_to_prefill", time.monotonic() - started)
    await env.wait_for(lambda: smg_agrees(env), timeout=120, what="smg after the flip")

    started = time.monotonic()
    roles = await env.roles()
    prefill_pod = next(n for n, r in roles.items() if r == "prefill")
    await demand(env, decode_heavy(env, prefill_pod))
    await env.wait_for(lambda: split(env, 1, 2), timeout=300, what="a flip back to 1P:2D")
    TIMINGS.add("operator_switch_to_decode", time.monotonic() - started)
    await env.wait_for(lambda: smg_agrees(env), timeout=120, what="smg after the flip back")

    await load.finished()
    history = (await env.get_cluster())["status"]["switchHistory"]
    succeeded = [h for h in history if h["result"] == "succeeded"]
    assert {(h["from"], h["to"]) for h in succeeded} >= {
        ("decode", "prefill"),
        ("prefill", "decode"),
    }
    for h in succeeded:
        TIMINGS.add("operator_switch_seconds", float(h.get("seconds") or 0.0))

    # The KV moves: an answer through smg is the model's own greedy continuation.
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        body = {"model": SERVED, "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12}}
        body["sampling_params"]["temperature"] = 0
        reply = await client.post(f"{env.router_url}/generate", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["output_ids"] == reference_output(engine_env, PROMPT, 12)


async def _draining_pod(env: Stack) -> str | None:
    roles = await env.roles()
    return next((name for name, role in roles.items() if role == DRAINING), None)


async def _converged(env: Stack) -> bool:
    """Three engine pods serving in PD roles, smg agreeing, no switch in progress."""
    if not await smg_agrees(env):
        return False
    status = (await env.get_cluster()).get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
    return conditions.get("Switching") != "True"


async def test_an_engine_killed_in_the_middle_of_its_flip(env: Stack):
    """The engine dies while its agent flips it: the agent reports an unsafe failure, the
    operator replaces the pod, a fresh engine comes up as decode, the cluster converges, and
    the load that was on it is resumed elsewhere."""
    load = Load(env, count=3, tokens=400)
    before = {n: r.uid for n, r in env.kubelet.pods.items()}
    await demand(env, prefill_heavy(env))
    victim = await env.wait_for(lambda: _draining_pod(env), timeout=300, what="a draining pod")
    runtime = env.kubelet.pods[victim]
    assert isinstance(runtime.pod, SglangPod) and runtime.pod.agent is not None
    agent_url = runtime.pod.agent_url

    async def flipping() -> bool:
        async with httpx.AsyncClient(verify=False, timeout=5, trust_env=False) as client:
            progress = (await client.get(f"{agent_url}/v1/role")).json()
        return bool(progress["switching"])

    await env.wait_for(flipping, timeout=120, what=f"{victim}'s agent flipping it")
    pid = runtime.pod.engine_pid
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    killed = time.monotonic()
    await env.wait_for(
        lambda: _replaced(env, victim, before[victim]), timeout=120, what="the pod replaced"
    )
    await env.wait_for(lambda: _converged(env), timeout=START, what="convergence")
    TIMINGS.add("killed_mid_flip_to_converged", time.monotonic() - killed)
    # Demand stays prefill-heavy (fresh events, larger: the failed switch raised the
    # Controller's measured switch cost): the operator gets to the split it wants.
    await demand(env, prefill_heavy(env, n=120))
    await env.wait_for(lambda: split(env, 2, 1), timeout=300, what="2P:1D after the kill")
    await env.wait_for(lambda: _converged(env), timeout=300, what="convergence at 2P:1D")
    await load.finished()
    history = (await env.get_cluster())["status"]["switchHistory"]
    assert any(h["pod"] == victim and h["result"] == "replaced" for h in history), history


async def _replaced(env: Stack, name: str, uid: str) -> bool:
    runtime = env.kubelet.pods.get(name)
    return runtime is not None and runtime.uid != uid


async def test_smg_dropping_its_workers_mid_switch(env: Stack):
    """smg dies while the operator waits for it to drop a draining pod: the kubelet starts
    it again, it rediscovers the pods from the API server, and the switch completes."""
    load = Load(env, count=3, tokens=400)
    roles = await env.roles()
    prefill_pod = next(n for n, r in roles.items() if r == "prefill")
    # Demand back to decode: the queued prompts go, decodes are coming.
    await demand(env, decode_heavy(env, prefill_pod))
    await env.wait_for(lambda: _draining_pod(env), timeout=300, what="a draining pod")
    router = env.kubelet.router
    assert router is not None and router.process is not None
    router.process.kill()
    dropped = time.monotonic()
    await env.wait_for(lambda: split(env, 1, 2), timeout=300, what="1P:2D after smg's restart")
    await env.wait_for(lambda: _converged(env), timeout=300, what="convergence")
    TIMINGS.add("router_killed_to_converged", time.monotonic() - dropped)
    await load.finished()


async def test_the_prefill_engine_lost_with_its_bootstrap_port(env: Stack):
    """The prefill engine dies with requests coming: its bootstrap port goes with it, while
    smg still lists it for a few seconds. Requests sent its way fail or are aborted by the
    decode engines that cannot reach the port, and every client resumes through smg. The
    pod goes NotReady and leaves smg, its agent restarts the engine (in its launch role,
    decode), the operator relabels the pod to the role the engine reports and flips an
    engine to prefill again (``roles.prefill.min`` is 1): the cluster converges, every
    request answered."""
    running = Load(env, count=2, tokens=300)
    await asyncio.sleep(2.0)
    roles = await env.roles()
    prefill = next(n for n, r in roles.items() if r == "prefill")
    runtime = env.kubelet.pods[prefill]
    assert isinstance(runtime.pod, SglangPod)
    pid = runtime.pod.engine_pid
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    lost = time.monotonic()
    arriving = Load(env, count=3, tokens=40)  # sent while the port is gone

    async def serving_again() -> bool:
        counts = await env.count_roles()
        return counts.get("prefill", 0) >= 1 and await _converged(env)

    await asyncio.sleep(READINESS_SECONDS)  # the pod leaves smg first
    await env.wait_for(serving_again, timeout=START, what="a prefill engine again")
    TIMINGS.add("prefill_lost_to_converged", time.monotonic() - lost)
    await running.finished()
    await arriving.finished()
