"""High availability (issue 25 item 11): two operator replicas, one leading through a
Lease; the leader killed mid-switch, the standby takes over, finishes the switch it left,
and nothing is lost (docs/operations.md#high-availability).

Replica A is a process of its own (``prorsa operator --leader-elect``) so that it can be
killed the way a node crash or an OOM kill ends it: SIGKILL, no clean-up, no Lease
released. Replica B runs in this test's loop and stands by. Both listen for the webhook on
the same address, which only the leader binds (as the webhook Service routes only to the
pod labelled leader). The trainer is the real SDK, posting throughout.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from prorsa.k8s.leader import LeaderElection
from prorsa.k8s.objects import LEADER_LABEL
from prorsa_contract.labels import DRAINING, ROLE_LABEL, SWITCH_ANNOTATION
from prorsa_lab.doubles.kubelet import free_port
from prorsa_lab.doubles.sglang_double import EngineConfig, TimingModel
from prorsa_lab.doubles.stack import PATIENCE, Stack, cluster_manifest, stack
from prorsa_sdk import AsyncEventEmitter

# A `prorsa operator` process killed mid-switch, the standby takes over: left out by
# `make test-fast`.
pytestmark = pytest.mark.slow

OPERATOR_NS = "prorsa-system"
# Shorter terms than the chart's (client-go's 15/10/2 s), long enough for a replica in a
# busy process on a loaded 2-core machine to renew in time.
ELECTION = LeaderElection(lease_duration=8.0, renew_deadline=6.0, retry_period=0.5)


async def lease(env: Stack) -> dict[str, Any]:
    found = await env.kube.read_lease(OPERATOR_NS, ELECTION.lease_name)
    return dict((found or {}).get("spec") or {})


def at(stamp: Any) -> datetime.datetime:
    """A Lease's MicroTime, as the client returns it (a string or a datetime)."""
    if isinstance(stamp, datetime.datetime):
        return stamp
    return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))


async def leader_pods(env: Stack) -> list[str]:
    pods = await env.kube.list_pods(OPERATOR_NS, f"{LEADER_LABEL}=true")
    return [p["metadata"]["name"] for p in pods]


async def ready_split(env: Stack, prefill: int, decode: int) -> bool:
    counts = await env.count_roles()
    return counts.get("prefill", 0) == prefill and counts.get("decode", 0) == decode


async def live(env: Stack) -> dict[str, int]:
    async with env.http() as client:
        reply = await client.get(
            f"{env.webhook}{env.cluster_path()}/status",
            headers={"Authorization": f"Bearer {env.token}"},
            timeout=5,
        )
    return dict(reply.json()["liveTrajectories"]) if reply.status_code == 200 else {}


def queue(emitter: AsyncEventEmitter, first: int, n: int) -> None:
    """n trajectories dispatched, each with a request queued (small prompts: no demand)."""
    for i in range(first, first + n):
        emitter.emit("sample_dispatched", f"t{i}", group="g", task="code")
        emitter.emit("request_queued", f"t{i}", prompt_tokens=200, turn=0)


async def test_the_leader_killed_mid_switch_the_standby_finishes_it_nothing_lost(
    tmp_path: Path,
) -> None:
    slow = TimingModel(switch_seconds=6.0)  # the bootstrap flip outlasts the kill
    async with stack(
        engine_config=lambda _n: EngineConfig(timing=slow),
        operator_namespace=OPERATOR_NS,
        leader_election=ELECTION,
        start_operator=False,
    ) as env:
        for name in ("prorsa-a", "prorsa-b"):
            await env.create_operator_pod(name)
        argv = env.operator_argv(
            pod_name="prorsa-a", metrics_port=free_port(), liveness_port=free_port()
        )
        log = (tmp_path / "replica-a.log").open("w")
        a = await asyncio.create_subprocess_exec(
            *argv, stdout=log, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        emitter: AsyncEventEmitter | None = None
        try:

            async def a_serves() -> bool:
                # Leading as trainers see it: A holds the Lease, its webhook answers, and its
                # pod carries the leader label the webhook Service selects (set once the
                # webhook serves, so it comes last).
                holder = (await lease(env)).get("holderIdentity") or ""
                return (
                    holder.startswith("prorsa-a_")
                    and await env._webhook_up()
                    and await leader_pods(env) == ["prorsa-a"]
                )

            # A new process on a busy machine: its imports alone can take a while.
            await env.wait_for(
                a_serves, timeout=2 * PATIENCE, what=f"replica A leading ({tmp_path}/replica-a.log)"
            )
            b = await env.start_operator(pod_name="prorsa-b", metrics_port=free_port())
            assert b.role == "standby" and not b.serving.is_set()
            assert await leader_pods(env) == ["prorsa-a"]  # a standby takes no label

            emitter = AsyncEventEmitter(
                url=env.webhook, namespace=env.namespace, name="demo", token=env.token,
                track=True, flush_interval=0.05, give_up_after=3 * PATIENCE,
            )  # fmt: skip
            await emitter.start()
            await env.create_cluster(cluster_manifest())
            queue(emitter, 0, 20)
            assert await emitter.flush(timeout=PATIENCE)

            async def draining() -> str | None:
                for pod in await env.pods():
                    meta = pod["metadata"]
                    if meta["labels"].get(ROLE_LABEL) == DRAINING:
                        return str(meta["name"])
                return None

            # The bootstrap flip to 1P:3D takes 6 s: A is killed while it runs.
            victim = await env.wait_for(draining, timeout=2 * PATIENCE, what="a pod draining")
            pod = next(p for p in await env.pods() if p["metadata"]["name"] == victim)
            intent = json.loads(pod["metadata"]["annotations"][SWITCH_ANNOTATION])
            assert intent["to"] == "prefill"
            assert (await lease(env))["holderIdentity"].startswith("prorsa-a_")  # still leads
            a.send_signal(signal.SIGKILL)
            assert await a.wait() == -signal.SIGKILL
            await asyncio.sleep(0.2)  # a renewal A sent as it died lands meanwhile
            last = await lease(env)
            assert last["holderIdentity"].startswith("prorsa-a_")
            # The trainer keeps going while nobody serves: its SDK buffers and retries.
            queue(emitter, 20, 20)

            await env.wait_for(b.serving.wait, timeout=2 * PATIENCE, what="B taking over")
            spec = await lease(env)
            assert spec["holderIdentity"] == b.identity and spec["leaseTransitions"] == 1
            # A never released the Lease: B took it a lease duration after A's last renewal
            # (both times from this machine's clock).
            waited = at(spec["acquireTime"]) - at(last["renewTime"])
            assert waited >= datetime.timedelta(seconds=ELECTION.lease_duration), waited
            # The webhook Service now selects B's pod, and only it.
            assert await leader_pods(env) == ["prorsa-b"]

            async def converged() -> bool:
                pods = await env.pods()
                return all(
                    p["metadata"]["labels"][ROLE_LABEL] != DRAINING
                    and SWITCH_ANNOTATION not in (p["metadata"].get("annotations") or {})
                    for p in pods
                ) and await ready_split(env, 1, 3)

            await env.wait_for(converged, timeout=2 * PATIENCE, what="the switch finished")
            # The victim flipped to prefill, as A meant: finished, not rolled back.
            assert (await env.roles())[victim] == "prefill"
            assert env.kubelet.pods[victim].engine.role == "prefill"

            # Nothing lost: every event delivered (retried across the gap), the new
            # leader asked for a resync, and its table holds every live trajectory.
            assert await emitter.flush(timeout=PATIENCE)
            stats = emitter.stats
            assert stats.dropped == 0 and stats.pending == 0, stats
            assert stats.sent == stats.emitted == 80
            assert stats.resyncs >= 1

            async def all_live() -> dict[str, int] | None:
                counts = await live(env)
                return counts if sum(counts.values()) == 40 else None

            counts = await env.wait_for(all_live, what="the 40 trajectories on B")
            assert counts.get("ready", 0) == 40, counts

            async def recorded() -> bool:
                # The status of the tick after the switch ended lists it.
                status = (await env.get_cluster()).get("status") or {}
                return any(
                    h["pod"] == victim and h["result"] == "succeeded"
                    for h in status.get("switchHistory") or []
                )

            await env.wait_for(recorded, what="the finished switch in B's status")
        finally:
            if emitter is not None:
                await emitter.aclose(timeout=5)
            if a.returncode is None:
                a.send_signal(signal.SIGKILL)
                await a.wait()
            log.close()


async def test_a_standby_is_live_and_ready_and_says_it_stands_by() -> None:
    """What the chart's probes and ServiceMonitor ask a standby (charts/prorsa): liveness at
    --liveness, readiness at /readyz (ready, so a rollout proceeds), and /metrics with
    prorsa_operator_leader 0; it serves no webhook and carries no leader label."""
    import httpx

    from prorsa.k8s.leader import micro_time
    from prorsa.shell.process import OperatorProcess

    async with stack(
        operator_namespace=OPERATOR_NS, leader_election=ELECTION, start_operator=False
    ) as env:
        await env.create_operator_pod("prorsa-b")
        # Someone else leads, and keeps renewing (as far as the standby can tell).
        await env.kube.create_lease(OPERATOR_NS, {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": ELECTION.lease_name},
            "spec": {"holderIdentity": "prorsa-a_1", "leaseDurationSeconds": 3600,
                     "renewTime": micro_time(datetime.datetime.now(datetime.UTC))},
        })  # fmt: skip
        probes = free_port()
        config = env.operator_config(pod_name="prorsa-b")
        config.liveness = f"http://127.0.0.1:{probes}/healthz"
        process = OperatorProcess(config=config)
        stop = asyncio.Event()
        running = asyncio.create_task(process.run(stop=stop))
        try:
            await asyncio.wait_for(process.standing_by.wait(), PATIENCE)
            async with httpx.AsyncClient(timeout=5) as client:
                live = await client.get(f"http://127.0.0.1:{probes}/healthz")
                ready = await client.get(f"http://127.0.0.1:{probes}/readyz")
                metrics = await client.get(env.metrics_url)
            assert live.status_code == 200 and live.json()["role"] == "standby"
            assert ready.status_code == 200 and ready.json()["role"] == "standby"
            assert "prorsa_operator_leader 0.0" in metrics.text
            assert not await env._webhook_up()
            assert await leader_pods(env) == []
        finally:
            stop.set()
            await asyncio.wait_for(running, PATIENCE)
