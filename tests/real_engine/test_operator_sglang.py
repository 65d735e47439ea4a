"""The operator end to end with the real SGLang 0.5.23 engines on this CPU.

The shared cluster (``shared_cluster.py``): the API emulator, the operator (kopf, real
webhook), the fake kubelet running each engine pod as the real agent launching the real
SGLang from the pod's ``PRORSA_*`` environment, and the router Deployment as the real smg
with Kubernetes discovery; three one-CPU instances, every engine launched as decode and one
flipped to prefill by the operator at start. A trainer's load of long greedy generations
runs through smg with :class:`prorsa_sdk.ResumableGeneration` while the trainer's lifecycle
events move demand to prefill and back: the operator switches both ways, its agents drain,
abort what is left at the deadline, flip and verify; every aborted call is resumed and
answered with its whole token budget, and an answer's tokens are the model's own (the KV
moved from a prefill engine to a decode engine).

Then the failure cases on the same engines, each from the state the one before left and
each ending converged (smg listing every pod with its role, no pod left ``draining``, no
switch in progress, every request answered with its whole budget): smg dropping its workers
(the router process dies) while the operator waits for it; an engine killed in the middle
of its flip; the prefill engine lost with its bootstrap port while requests keep coming.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from prorsa_contract.labels import DRAINING
from prorsa_lab.doubles.stack import Stack
from prorsa_lab.sglang_cpu.environment import CpuEngineEnv
from prorsa_lab.sglang_cpu.sglang_pod import SglangPod
from prorsa_sdk.resumable import ResumableGeneration

from .engine_helpers import Timings, reference_output
from .shared_cluster import (
    INSTANCES,
    PROMPT,
    SERVED,
    START,
    engine_pods,
    smg_agrees,
    split,
)

pytestmark = [pytest.mark.real_engine, pytest.mark.asyncio(loop_scope="session")]

READINESS_SECONDS = 12.0  # the pods' readinessProbe: 2 failures 5 s apart
TIMINGS = Timings("operator")


@pytest.fixture(scope="module", autouse=True)
def _write_timings() -> Iterator[None]:
    yield
    TIMINGS.write()


class Load:
    """A trainer's generations through smg, resumed across aborts; all checked at the end.

    The client is configured as a trainer would for a cluster that may have no prefill
    engine for minutes (the failure cases): retries at most 10 s apart, enough of them to
    outlast an engine's load on busy cores (41 were used over the 10 minutes it took once);
    each test bounds the whole by its own wait.
    """

    def __init__(self, env: Stack, *, count: int, tokens: int, repeat: bool = False) -> None:
        assert env.router_url is not None
        self.tokens = tokens
        self.resumes = 0
        self.retries = 0
        # With ``repeat``, each caller sends its next generation as soon as one is answered,
        # until :meth:`finished`: a switch finds generations running however fast the
        # engines decode (CI's finished 4 x 1,200 tokens before the operator's first flip).
        self._stop = asyncio.Event()
        if not repeat:
            self._stop.set()
        self.tasks = [asyncio.create_task(self._caller(env.router_url, i)) for i in range(count)]

    async def _caller(self, router: str, i: int) -> list[dict[str, Any]]:
        outs = [await self._one(router, i)]
        while not self._stop.is_set():
            outs.append(await self._one(router, i))
        return outs

    async def _one(self, router: str, i: int) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=router, timeout=900, trust_env=False) as http:
            gen = ResumableGeneration(http, max_resumes=20, max_retries=200, retry_base=0.2)
            body = {
                "model": SERVED,
                "input_ids": [*PROMPT, 50 + i],
                "sampling_params": {
                    "max_new_tokens": self.tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
            try:
                return await gen.generate(body)
            finally:
                self.resumes += gen.resumes
                self.retries += gen.retries

    async def finished(self) -> list[dict[str, Any]]:
        """Stop sending (with ``repeat``), then every answer: each with its whole budget."""
        self._stop.set()
        outs = [out for caller in await asyncio.gather(*self.tasks) for out in caller]
        for out in outs:
            assert len(out["output_ids"]) == self.tokens, "tokens lost"
            assert out["meta_info"]["finish_reason"]["type"] == "length"
        print(f"load: {len(outs)} answered, {self.resumes} resumes, {self.retries} retries")
        return list(outs)


LIVE: set[str] = set()
"""Trajectories a test's demand phases left live: the next phase drops them first."""

KEEPALIVE_SECONDS = 5.0


@pytest_asyncio.fixture(scope="module", loop_scope="session", autouse=True)
async def _the_trainer_keeps_talking(cluster: Stack) -> AsyncIterator[None]:
    """The rest of a trainer's job goes on while a test waits for a switch.

    A demand phase is posted once; a trainer silent for three horizons sends the Controller
    to its reactive mode, where these phases (prompts no real engine holds) are no demand.
    On a loaded machine a switch can take longer than that (CI once waited 300 s for a
    flip back, reactive from 30 s on), so one small trajectory keeps cycling through a
    one-token turn and a tool call, as a live job's events do: a few tokens of demand.
    """

    async def cycle() -> None:
        turn = 0
        while True:
            t = "keepalive"
            events = [] if turn == 0 else [cluster.event("tool_finished", t, result_tokens=1)]
            events += [
                cluster.event("request_queued", t, prompt_tokens=8 + 2 * turn, turn=turn),
                cluster.event("prefill_started", t),
                cluster.event("prefill_finished", t),
                cluster.event("decode_finished", t, output_tokens=1, finish="tool"),
                cluster.event("tool_started", t, tool="wait"),
            ]
            with contextlib.suppress(httpx.HTTPError):
                await cluster.post(events)
            turn += 1
            await asyncio.sleep(KEEPALIVE_SECONDS)

    task = asyncio.create_task(cycle())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def demand(env: Stack, events: list[dict[str, Any]]) -> None:
    """Post a demand phase in place of the one before (its trajectories dropped)."""
    gone = [env.event("trajectory_dropped", t) for t in sorted(LIVE)]
    LIVE.clear()
    if gone:
        assert (await env.post(gone)).status_code == 200
    LIVE.update(e["trajectory"] for e in events)
    assert (await env.post(events)).status_code == 200


# Demand large enough that a switch pays for what it costs (the Controller prices a switch by
# its measured duration, here that of the real engines' flips through smg).
def prefill_heavy(env: Stack, n: int = 120, tokens: int = 20_000) -> list[dict[str, Any]]:
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


async def toward_the_other_split(env: Stack) -> tuple[int, int]:
    """Post the demand that wants the split this cluster is not in: the split it wants."""
    roles = await env.roles()
    prefill = sorted(n for n, r in roles.items() if r == "prefill")
    if len(prefill) == 1:
        await demand(env, prefill_heavy(env))
        return 2, 1
    await demand(env, decode_heavy(env, prefill[0]))
    return 1, 2


async def agent_counts(env: Stack, series: str) -> float:
    """The sum of one counter over every engine pod's agent; a series no agent exports is
    an error (a renamed metric), not a zero."""
    values: list[float] = []
    async with httpx.AsyncClient(verify=False, timeout=10, trust_env=False) as client:
        for pod in engine_pods(env).values():
            text = (await client.get(f"{pod.agent_url}/metrics")).text
            values += [
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith(series + " ") or line.startswith(series + "{")
            ]
    assert values, f"no agent exports {series}"
    return sum(values)


async def _agent_switch_seconds(env: Stack) -> tuple[float, ...]:
    """Over every agent: seconds in role calls, seconds draining, and how many of each."""
    series = ("switch_duration_seconds_sum", "drain_duration_seconds_sum")
    series += ("switch_duration_seconds_count", "drain_duration_seconds_count")
    return tuple([await agent_counts(env, f"prorsa_agent_{s}") for s in series])


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


async def test_the_operator_switches_both_ways_under_load(
    cluster: Stack, engine_env: CpuEngineEnv
) -> None:
    """Demand moves to prefill and back under a trainer's load of long generations: the
    operator switches each way, its agents abort what a drain leaves and the trainer's
    client resumes every one: nothing lost, and the KV moves between engines."""
    env = cluster
    assert await split(env, 1, 2)
    aborted_before = await agent_counts(env, "prorsa_agent_aborted_requests_total")
    agent_before = await _agent_switch_seconds(env)
    # Each generation longer than smg's drain (about 6 s) and the agents' (2 s) at this CPU's
    # 40-90 tokens/s (22 s and more), and sent again until both flips are done, eight at a
    # time: the operator drains the decode engine running the fewest, and it still runs
    # several, most with more than the drains' 8 s to go, so the flip aborts some (with four
    # of 1,200 tokens an idle machine's flip once found none). No longer: on busy cores the
    # engines decode at a tenth of that, and the test waits for the last one's tokens; eight
    # of 2,000 fit each engine's 16,384-token KV pool.
    load = Load(env, count=8, tokens=2000, repeat=True)
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
    aborted = await agent_counts(env, "prorsa_agent_aborted_requests_total") - aborted_before
    assert aborted >= 1, "no switch found a generation to abort: the load was too short"
    assert load.resumes >= 1, (aborted, load.resumes)
    TIMINGS.add("operator_switch_aborted_requests", aborted)
    # The agents' part of the two switches: drain (abort at its deadline), flip, verify.
    agent_after = await _agent_switch_seconds(env)
    calls, drains = (agent_after[i] - agent_before[i] for i in (2, 3))
    assert calls >= 2 and drains >= 2, (agent_before, agent_after)
    TIMINGS.add("agent_busy_flip_mean", (agent_after[0] - agent_before[0]) / calls)
    TIMINGS.add("agent_drain_mean", (agent_after[1] - agent_before[1]) / drains)
    TIMINGS.add("operator_switch_client_resumes", float(load.resumes))
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
    assert reply.json()["output_ids"] == await reference_output(engine_env, PROMPT, 12)


async def test_smg_dropping_its_workers_mid_switch(cluster: Stack) -> None:
    """smg dies while the operator waits for it to drop a draining pod: the kubelet starts
    it again, it rediscovers the pods from the API server (answering 404 model_not_found
    until then, which the trainer's client retries), and the switch completes."""
    env = cluster
    load = Load(env, count=3, tokens=400)
    wanted = await toward_the_other_split(env)
    await env.wait_for(lambda: _draining_pod(env), timeout=300, what="a draining pod")
    router = env.kubelet.router
    assert router is not None and router.process is not None
    router.process.kill()
    dropped = time.monotonic()
    await env.wait_for(lambda: split(env, *wanted), timeout=300, what=f"{wanted} after smg")
    await env.wait_for(lambda: _converged(env), timeout=300, what="convergence")
    TIMINGS.add("router_killed_to_converged", time.monotonic() - dropped)
    await load.finished()


async def test_an_engine_killed_in_the_middle_of_its_flip(cluster: Stack) -> None:
    """The engine dies while its agent flips it: the agent reports an unsafe failure, the
    operator replaces the pod, a fresh engine comes up as decode, the cluster converges, and
    the load that was on it is resumed elsewhere."""
    env = cluster
    load = Load(env, count=3, tokens=400)
    before = {n: r.uid for n, r in env.kubelet.pods.items()}
    await toward_the_other_split(env)
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
    # The fresh engine launches as decode, whatever its pod was flipping to; the operator
    # may then flip an engine again for the demand, and converges either way.
    await env.wait_for(lambda: _converged(env), timeout=START, what="convergence")
    TIMINGS.add("killed_mid_flip_to_converged", time.monotonic() - killed)
    await load.finished()
    history = (await env.get_cluster())["status"]["switchHistory"]
    assert any(h["pod"] == victim and h["result"] == "replaced" for h in history), history
    assert len(engine_pods(env)) == INSTANCES


async def _replaced(env: Stack, name: str, uid: str) -> bool:
    runtime = env.kubelet.pods.get(name)
    return runtime is not None and runtime.uid != uid


async def test_the_prefill_engine_lost_with_its_bootstrap_port(cluster: Stack) -> None:
    """The prefill engine dies with requests coming: its bootstrap port goes with it, while
    smg still lists it for a few seconds. Requests sent its way fail or are aborted by the
    decode engines that cannot reach the port, and every client resumes through smg. The
    pod goes NotReady and leaves smg, its agent restarts the engine (in its launch role,
    decode), the operator relabels the pod to the role the engine reports and flips an
    engine to prefill again (``roles.prefill.min`` is 1): the cluster converges, every
    request answered."""
    env = cluster
    await env.wait_for(lambda: _converged(env), timeout=300, what="a converged start")
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
