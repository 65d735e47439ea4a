"""Why a switch waits for smg to finish removing the pod: the floor of the lag's router part.

The switch executor relabels a pod ``draining`` and waits until smg 1.13.0's ``/workers``
no longer lists it before the engine flips (operator/prorsa/switching/executor.py). smg takes
about 6 s for that: about 1 s for its Kubernetes discovery to notice the label, then its
worker-removal job marks the worker ``draining`` (it gets no new requests) and removes it
after a fixed 5 s. Telling smg directly, ``DELETE /workers/{id}``, starts the same job at
once, so it would save only the second of discovery; and any shortcut that relabels the
pod before the job ends loses the pod: the job, ending, removes the pod's new registration
under the same URL, and discovery does not register it again. This test runs that against
the real smg (PyPI ``smg==1.13.0``), so an smg that changes it fails here, and the floor in
docs/demo.md ("Lag parts") can then move. Run with ``-s`` for the timings.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from prorsa_contract.labels import ROLE_LABEL, SWITCH_ANNOTATION, switch_intent
from prorsa_lab.doubles.smg_router import SmgRouter, smg_binary, worker_types
from prorsa_lab.doubles.stack import cluster_manifest, stack

# The whole operator behind the real smg: a slow test (make test-fast leaves it out).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(smg_binary() is None, reason="the smg binary is not installed"),
]


async def test_a_removal_smg_has_begun_removes_the_pods_next_registration(
    tmp_path: Path,
) -> None:
    # switching.mode Off: the Controller moves nothing; the intent annotation keeps the
    # operator's label reconcile off the pod, as during a real switch.
    manifest = cluster_manifest(
        router={"enabled": True, "policy": "round_robin"}, switching={"mode": "Off"}
    )
    async with stack(run_router=True, log_dir=tmp_path) as env:
        await env.create_cluster(manifest)
        await env.kubelet.wait_running(4, timeout=120)

        async def router_running() -> SmgRouter | None:
            # The kubelet starts smg when it next lists the router Deployment, which can be
            # after the engine pods run.
            return env.kubelet.router

        router = await env.wait_for(router_running, timeout=60, what="smg running")
        assert isinstance(router, SmgRouter)
        async with httpx.AsyncClient(trust_env=False) as client:

            async def every_engine_listed() -> bool:
                workers = await router.workers(client)
                return bool(workers) and len(worker_types(workers or [])) == 4

            await env.wait_for(every_engine_listed, timeout=120, what="smg listing 4 engines")
            pod = next(
                p for p in await env.pods() if p["metadata"]["labels"][ROLE_LABEL] == "decode"
            )
            name, ip = pod["metadata"]["name"], pod["status"]["podIP"]

            async def entry() -> dict[str, object] | None:
                workers = await router.workers(client) or []
                return next((w for w in workers if f"//{ip}:" in str(w.get("url"))), None)

            listed = await entry()
            assert listed is not None and listed["status"] == "ready"
            intent = switch_intent(to="prefill", phase="draining", started="-", origin="decode")
            t0 = time.monotonic()
            meta = {"labels": {ROLE_LABEL: "draining"}, "annotations": {SWITCH_ANNOTATION: intent}}
            await env.kube.patch_pod(env.namespace, name, {"metadata": meta})
            reply = await client.delete(f"{router.url}/workers/{listed['id']}")
            assert reply.status_code == 202, reply.text  # queued: smg's removal job
            now = await entry()
            marked = time.monotonic() - t0
            # At once: listed as draining (smg routes it nothing new), not gone.
            assert now is not None and now["status"] == "draining", now
            await asyncio.sleep(0.5)  # a fast flip
            await env.kube.patch_pod(
                env.namespace, name, {"metadata": {"labels": {ROLE_LABEL: "prefill"}}}
            )

            async def registered() -> bool:
                e = await entry()
                return e is not None and e["worker_type"] == "prefill" and e["status"] == "ready"

            await env.wait_for(registered, timeout=20, what="smg registering the pod as prefill")
            back = time.monotonic() - t0
            # The removal job started before the relabel ends and takes the new worker too.
            gone: float | None = None
            while time.monotonic() - t0 < 15.0:
                if await entry() is None and gone is None:
                    gone = time.monotonic() - t0
                await asyncio.sleep(0.1)
            after = await entry()
    assert gone is not None
    print(
        f"\nsmg 1.13.0: DELETE marked the worker draining {marked:.2f} s after the relabel; "
        f"registered as prefill {back:.2f} s after it; removed {gone:.2f} s after it; "
        f"listed 15 s after it: {after is not None}"
    )
    assert gone is not None and gone >= 4.0, "smg no longer removes a worker after 5 s"
    assert after is None, "smg registered the pod again: relabelling early would be safe"
