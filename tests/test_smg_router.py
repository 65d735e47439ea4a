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
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from prorsa_contract.labels import DRAINING
from prorsa_lab.doubles.smg_router import SmgRouter, smg_binary, worker_types
from prorsa_lab.doubles.stack import Stack, cluster_manifest, stack

pytestmark = [
    pytest.mark.skipif(smg_binary() is None, reason="the smg binary is not installed"),
    pytest.mark.asyncio(loop_scope="module"),
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


async def test_draining_leaves_smg_before_the_flip_and_returns_with_the_new_type(
    env: Stack,
) -> None:
    await env.wait_for(lambda: registered_as_labelled(env), timeout=90, what="smg workers")
    router = smg(env)
    pods = {p["metadata"]["name"]: p["status"]["podIP"] for p in await env.pods()}
    seen: dict[str, dict[str, float]] = {}  # pod: {moment: seconds}
    served_at: dict[str, list[float]] = {n: [] for n in pods}
    stop = asyncio.Event()
    t0 = time.monotonic()

    async def watch() -> None:
        async with httpx.AsyncClient(trust_env=False) as client:
            while not stop.is_set():
                now = time.monotonic() - t0
                roles = await env.roles()
                types = worker_types(await router.workers(client) or [])
                for name, ip in pods.items():
                    marks = seen.setdefault(name, {})
                    engine = env.kubelet.pods[name].engine
                    if roles.get(name) == DRAINING:
                        marks.setdefault("draining", now)
                    if "draining" in marks:
                        if ip not in types:
                            marks.setdefault("left_smg", now)
                        if engine.role == "prefill":
                            marks.setdefault("flipped", now)
                        if types.get(ip) == "prefill":
                            marks.setdefault("registered_prefill", now)
                await asyncio.sleep(0.05)

    async def load() -> None:
        """Small requests through smg all along, to see when the draining pod stops
        getting new ones."""
        counts = {n: 0 for n in pods}
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            i = 0
            while not stop.is_set():
                i += 1
                body = {"model": MODEL, "text": "w " * 50, "sampling_params": {"max_new_tokens": 2}}
                await client.post(f"{router.url}/generate", json=body | {"rid": f"load-{i}"})
                for name in pods:
                    n = env.kubelet.pods[name].engine.counters().requests_received
                    if n > counts[name]:
                        served_at[name].append(time.monotonic() - t0)
                    counts[name] = n
                await asyncio.sleep(0.02)

    tasks = [asyncio.create_task(watch()), asyncio.create_task(load())]
    try:
        # 300k prompt tokens queued: the operator moves a decode pod to prefill (2P:2D).
        events = [
            env.event("request_queued", f"p-{i}", prompt_tokens=10_000, turn=0) for i in range(30)
        ]
        assert (await env.post(events)).status_code == 200

        def switched() -> str | None:
            done = [n for n, m in seen.items() if {"flipped", "registered_prefill"} <= set(m)]
            return done[0] if done else None

        async def check() -> str | None:
            return switched()

        name = await env.wait_for(check, timeout=90, what="a decode pod switched to prefill")
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    marks = seen[name]
    assert marks["draining"] < marks["left_smg"] < marks["flipped"], marks
    assert marks["flipped"] <= marks["registered_prefill"], marks
    # New requests the pod got while draining, before its flip made it a prefill worker.
    during = [t for t in served_at[name] if marks["draining"] <= t < marks["flipped"]]
    last_new = max(during, default=None)
    stopped_after = None if last_new is None else last_new - marks["draining"]
    print(
        f"\nsmg drain of {name}: new requests until {stopped_after} s after the relabel; "
        f"left /workers {marks['left_smg'] - marks['draining']:.1f} s after it; "
        f"engine flipped {marks['flipped'] - marks['draining']:.1f} s after it; "
        f"registered as prefill {marks['registered_prefill'] - marks['flipped']:.1f} s "
        "after the flip"
    )
    # smg notices a label change within its 1 s coalescing window, then drains for a
    # fixed 5 s: the pod is gone from /workers well before the operator's 30 s timeout.
    assert 4.0 <= marks["left_smg"] - marks["draining"] < 20.0
    assert stopped_after is None or stopped_after < 3.0
