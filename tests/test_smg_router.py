"""The real smg router (PyPI ``smg``) in the loop: the fake kubelet runs the router
Deployment the operator renders, smg discovers the engine doubles through the API emulator,
routes every request to a prefill and a decode double (the KV handed off through the
bootstrap room), and a switch takes the pod out of smg before its engine flips.

One deployment for the module (smg starts in a few seconds and each drain takes ~6 s).
Skipped when the ``smg`` binary is not installed (``pip install smg==1.13.0``, in the
``test`` extra). Run with ``-s`` to see the measured drain timings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from prorsa_contract.labels import DRAINING, ROLE_LABEL
from prorsa_lab.doubles.kube.resources import PODS_KEY
from prorsa_lab.doubles.sglang_double import EngineCore
from prorsa_lab.doubles.smg_router import SmgRouter, smg_binary, worker_types
from prorsa_lab.doubles.stack import Stack, cluster_manifest, stack

pytestmark = [
    pytest.mark.skipif(smg_binary() is None, reason="the smg binary is not installed"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.slow,  # the real smg against the stack
]
MODEL = "/models/double"  # spec.model.path: the engines' served model name


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    logs = Path(tmp_path_factory.mktemp("smg"))
    async with stack(run_router=True, log_dir=logs) as env:
        await env.create_cluster(
            cluster_manifest(
                router={"enabled": True, "policy": "round_robin"},
                # The switch in the test below is the only one: no cooldown gets in its way,
                # and the initial split (1P:3D) holds until the test asks for more prefill.
                switching={"hysteresis": 0.05},
            )
        )
        await env.kubelet.wait_running(4, timeout=60)
        yield env


def smg(env: Stack) -> SmgRouter:
    router = env.kubelet.router
    assert router is not None, "the kubelet runs no smg for the router Deployment"
    return router


async def registered_as_labelled(env: Stack) -> dict[str, str] | None:
    """``{pod IP: worker type}`` once smg lists every engine pod with its role label."""
    pods = await env.pods()
    want = {
        p["status"]["podIP"]: p["metadata"]["labels"]["prorsa.io/role"]
        for p in pods
        if (p.get("status") or {}).get("podIP")
    }
    if len(want) != 4 or DRAINING in want.values():
        return None
    if env.kubelet.router is None:
        return None  # the kubelet starts smg once it sees the router Deployment
    workers = await smg(env).workers(httpx.AsyncClient(trust_env=False))
    got = worker_types(workers or [])
    return got if got == want else None


async def test_smg_registers_every_engine_pod_with_its_role(env: Stack) -> None:
    types = await env.wait_for(
        lambda: registered_as_labelled(env), timeout=90, what="smg listing all 4 engine pods"
    )
    assert sorted(types.values()) == ["decode", "decode", "decode", "prefill"]
    async with httpx.AsyncClient(trust_env=False) as client:
        ready = await smg(env).readiness(client)
    assert ready is not None and ready["healthy_workers"] == 4


async def test_a_request_through_smg_is_prefilled_and_decoded_on_two_engines(
    env: Stack,
) -> None:
    await env.wait_for(lambda: registered_as_labelled(env), timeout=90, what="smg workers")
    before = {n: p.engine.counters().requests_received for n, p in env.kubelet.pods.items()}
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        reply = await client.post(
            f"{smg(env).url}/generate",
            json={
                "model": MODEL,
                "rid": "smg-probe",
                "text": "w " * 500,
                "sampling_params": {"max_new_tokens": 16},
            },
        )
        refused = await client.post(f"{smg(env).url}/generate", json={"text": "w"})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["output_ids"]) == 16
    # Under discovery smg serves several models by name: a request must carry "model".
    assert refused.status_code == 400 and "model" in refused.text
    served = {
        env.kubelet.pods[n].engine.role
        for n, p in env.kubelet.pods.items()
        if p.engine.counters().requests_received > before[n]
    }
    assert served == {"prefill", "decode"}


def core(env: Stack, name: str) -> EngineCore:
    engine = env.kubelet.pods[name].engine.core
    assert engine is not None, f"the engine double of {name} is not running"
    return engine


def relabelled_at(env: Stack, name: str, role: str, *, after: float) -> float | None:
    """When the API server first stored pod ``name`` with role label ``role`` after
    ``after`` (``time.monotonic``), from its write log: a continuous record, unlike a poll."""
    for e in env.server.emulator.writes(PODS_KEY):
        meta = e.obj["metadata"]
        if meta["name"] == name and e.at > after and meta["labels"].get(ROLE_LABEL) == role:
            return e.at
    return None


async def test_draining_leaves_smg_before_the_flip_and_returns_with_the_new_type(
    env: Stack,
) -> None:
    await env.wait_for(lambda: registered_as_labelled(env), timeout=90, what="smg workers")
    router = smg(env)
    pods = {p["metadata"]["name"]: p["status"]["podIP"] for p in await env.pods()}
    # The operator moves one of these to prefill; a prefill pod it may move back to decode
    # meanwhile (the demand of the queued prompts changes as they age) is not followed.
    decode = {n for n, role in (await env.roles()).items() if role == "decode"}
    t0 = time.monotonic()
    # What smg lists at the instant each engine flips: asked by the engine itself during its
    # switch, before its role changes, so a flip while smg still lists the pod as a decode
    # worker cannot slip between two polls, however slowly a loaded machine runs them.
    at_flip: dict[str, tuple[float, dict[str, str] | None]] = {}
    probe_client = httpx.AsyncClient(trust_env=False)

    def probe(name: str) -> Callable[[str], Awaitable[None]]:
        async def listed_at_flip(new_role: str) -> None:
            workers = await router.workers(probe_client)
            types = None if workers is None else worker_types(workers)
            at_flip.setdefault(name, (time.monotonic(), types))

        return listed_at_flip

    for name in decode:
        core(env, name).before_flip = probe(name)
    seen: dict[str, dict[str, float]] = {n: {} for n in decode}  # pod: {moment: seconds}
    served_at: dict[str, list[float]] = {n: [] for n in pods}
    stop = asyncio.Event()

    async def watch() -> None:
        """smg's /workers as often as the loop allows: when the pod leaves and returns."""
        async with httpx.AsyncClient(trust_env=False) as client:
            while not stop.is_set():
                workers = await router.workers(client)
                now = time.monotonic()
                if workers is not None:  # no answer says nothing about the list
                    types = worker_types(workers)
                    for name in decode:
                        ip, marks = pods[name], seen[name]
                        if ip not in types and relabelled_at(env, name, DRAINING, after=t0):
                            marks.setdefault("left_smg", now)
                        if types.get(ip) == "prefill":
                            marks.setdefault("registered_prefill", now)
                await asyncio.sleep(0.02)

    async def load() -> None:
        """Small requests through smg all along, to see when the draining pod stops
        getting new ones (each one timed when sent: smg routes it after that)."""
        counts = {n: 0 for n in pods}
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            i = 0
            while not stop.is_set():
                i += 1
                body = {"model": MODEL, "text": "w " * 50, "sampling_params": {"max_new_tokens": 2}}
                sent = time.monotonic()
                await client.post(f"{router.url}/generate", json=body | {"rid": f"load-{i}"})
                for name in pods:
                    n = env.kubelet.pods[name].engine.counters().requests_received
                    if n > counts[name]:
                        served_at[name].append(sent)
                    counts[name] = n
                await asyncio.sleep(0.02)

    tasks = [asyncio.create_task(watch()), asyncio.create_task(load())]
    try:
        # 300k prompt tokens queued: the operator moves a decode pod to prefill (2P:2D).
        events = [
            env.event("request_queued", f"p-{i}", prompt_tokens=10_000, turn=0) for i in range(30)
        ]
        assert (await env.post(events)).status_code == 200

        async def switched() -> str | None:
            done = [n for n in sorted(decode) if n in at_flip and "registered_prefill" in seen[n]]
            return done[0] if done else None

        name = await env.wait_for(switched, timeout=90, what="a decode pod switched to prefill")
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pod in decode:
            core(env, pod).before_flip = None
        await probe_client.aclose()
    ip = pods[name]
    draining = relabelled_at(env, name, DRAINING, after=t0)
    flipped, listed = at_flip[name]
    assert draining is not None and draining < flipped
    assert listed is not None, "smg did not answer while the engine flipped"
    # The heart of it: when the engine flips, smg no longer lists the pod (as a decode worker
    # or at all), so no request of the old role reaches it afterwards.
    assert ip not in listed, f"{name} flipped to prefill while smg listed it as {listed[ip]}"
    marks = seen[name]
    # The watcher may miss a short absence on a loaded machine; the probe saw one at the flip.
    left = min(marks.get("left_smg", flipped), flipped)
    assert draining < left <= flipped <= marks["registered_prefill"], (draining, marks, flipped)
    # New requests the pod got while draining, before its flip made it a prefill worker.
    during = [t for t in served_at[name] if draining <= t < flipped]
    last_new = max(during, default=None)
    stopped_after = None if last_new is None else last_new - draining
    print(
        f"\nsmg drain of {name}: new requests until {stopped_after} s after the relabel; "
        f"left /workers {left - draining:.1f} s after it; "
        f"engine flipped {flipped - draining:.1f} s after it; "
        f"registered as prefill {marks['registered_prefill'] - flipped:.1f} s "
        "after the flip"
    )
    # smg notices a label change within its 1 s coalescing window, then drains for a
    # fixed 5 s: the pod is gone from /workers well before the operator's 30 s timeout.
    assert 4.0 <= left - draining < 20.0
    assert stopped_after is None or stopped_after < 3.0


async def test_a_restarted_router_is_not_ready_until_it_can_route(env: Stack) -> None:
    """Found by `prorsa bench chaos`: smg answers ``/generate`` 404 model_not_found from
    its start until its discovery has registered the engines, and the router Deployment's
    readiness probe (``/health``) passed all along, so the Service sent trainers' requests
    to a router that refused them for good (a 404 is no error to retry). The probe the
    operator renders must fail while smg cannot route (so the Service keeps it out), and
    pass once it can. (Kept last: it restarts the module's smg.)"""
    await env.wait_for(lambda: registered_as_labelled(env), timeout=90, what="smg workers")
    deployment = await env.kube.call(
        env.kube.apps.read_namespaced_deployment, "demo-router", env.namespace
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    path = container["readinessProbe"]["httpGet"]["path"]
    old = smg(env)
    assert old.process is not None
    old.process.kill()
    body = {"model": MODEL, "text": "w " * 5, "sampling_params": {"max_new_tokens": 2}}
    refused_while_ready = []
    unready = served = 0
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        deadline = time.monotonic() + 90
        while served < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            router = env.kubelet.router
            if router is None or router is old:
                continue  # the kubelet has not started the new one yet
            try:  # the probe first: smg only moves on, from not routing to routing
                ready = (await client.get(f"{router.url}{path}")).status_code == 200
                reply = await client.post(f"{router.url}/generate", json=body)
            except httpx.TransportError:
                unready += 1
                continue
            unready += not ready
            served += reply.status_code == 200
            if ready and reply.status_code == 404:
                refused_while_ready.append(reply.text[:200])
    assert served == 3, "the restarted smg never served"
    assert not refused_while_ready, f"ready per {path}, yet: {refused_while_ready[:2]}"
    assert unready, f"{path} never failed after the restart"
