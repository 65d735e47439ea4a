"""The operator end to end: kopf against the Kubernetes API emulator, engine pods served by
engine doubles with real agents, a trainer posting real lifecycle events to the webhook."""

from __future__ import annotations

import asyncio
import json
import math
import ssl

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prorsa_contract.labels import (
    BOOTSTRAP_ANNOTATION,
    CLUSTER_LABEL,
    DRAINING,
    MANAGED_BY,
    ROLE_LABEL,
    SWITCH_ANNOTATION,
)
from prorsa_lab.doubles.sglang_double import EngineConfig, TimingModel
from prorsa_lab.doubles.stack import NAMESPACE, PATIENCE, Stack, cluster_manifest, stack

# The operator's scenarios against the emulator and engine doubles: left out by `make test-fast`.
pytestmark = pytest.mark.slow


def prefill_heavy(env: Stack, n: int = 30, tokens: int = 10_000) -> list[dict]:
    """n requests queued with big prompts: prefill demand n·tokens / (S·θ) instances."""
    return [
        env.event("request_queued", f"p{env._ids}-{i}", prompt_tokens=tokens, turn=0)
        for i in range(n)
    ]


def decode_heavy(env: Stack, prefill_pod: str, n: int = 6, tokens: int = 10_000) -> list:
    """Requests already in prefill: they enter decode within the horizon (K̂_D), so the
    decode side needs n·tokens / C_KV instances while prefill demand stays small."""
    out = []
    for i in range(n):
        t = f"d{env._ids}-{i}"
        out.append(env.event("request_queued", t, prompt_tokens=tokens, turn=0))
        out.append(env.event("prefill_started", t, instance=prefill_pod))
    return out


async def ready_split(env: Stack, prefill: int, decode: int) -> bool:
    counts = await env.count_roles()
    return counts.get("prefill", 0) == prefill and counts.get("decode", 0) == decode


async def test_cluster_comes_up_and_follows_demand_both_ways() -> None:
    async with stack() as env:
        await comes_up_and_follows_demand_both_ways(env, cluster_manifest())


async def comes_up_and_follows_demand_both_ways(env: Stack, manifest: dict) -> None:
    """The main scenario (also run by tests/test_chart.py to record the operator's API
    calls): four engines come up, the split follows prefill- then decode-heavy demand."""
    await env.create_cluster(manifest)
    # Four engine pods (32 GPUs / 8), the agents' Secret and the engines' Service.
    await env.wait_for(lambda: _count(env.pods(), 4), what="4 engine pods")
    pods = await env.pods()
    for pod in pods:
        meta = pod["metadata"]
        assert meta["labels"][MANAGED_BY] == "prorsa"
        assert meta["labels"][CLUSTER_LABEL] == "demo"
        assert meta["annotations"][BOOTSTRAP_ANNOTATION] == "8998"
        assert meta["ownerReferences"][0]["kind"] == "RolloutCluster"
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "8"
    assert await env.kube.read_secret_key(NAMESPACE, "demo-agent-token", "token")
    # Every engine runs with the cluster's admin key (the agent gave it SGLang's
    # --admin-api-key): the admin endpoints refuse anyone without it, so every switch
    # below also proves that the agents send it.
    admin_key = await env.kube.read_secret_key(NAMESPACE, "demo-engine-admin-key", "key")
    assert admin_key and len(admin_key) >= 32
    await env.kubelet.wait_running(4)
    async with httpx.AsyncClient(timeout=5) as client:
        for name, running in env.kubelet.pods.items():
            assert running.engine.config.admin_api_key == admin_key, name
            flip = await client.post(
                f"{running.pod.engine_url}/pd_role_switch", json={"new_role": "prefill"}
            )
            assert flip.status_code == 401
    await agents_serve_tls_the_operator_verifies(env)
    # Every engine starts as decode; the operator brings roles.prefill.initial = 1.
    await env.wait_for(lambda: ready_split(env, 1, 3), what="the initial 1P:3D split")

    # Prefill-heavy demand: 300k tokens queued -> a = 3, b = 5 at 1P -> best 2P:2D.
    phase_a = prefill_heavy(env)
    reply = await env.post(phase_a)
    assert reply.status_code == 200, reply.text
    await env.wait_for(lambda: ready_split(env, 2, 2), what="a flip to 2P:2D")
    flipped = [n for n, h in env.label_history.items() if "draining" in h]
    assert flipped, env.label_history

    # Decode-heavy: the queue is gone; 60k tokens in prefill finish within the horizon:
    # a = 0.6, b = 3 -> best 1P:3D.
    roles = await env.roles()
    prefill_pod = next(n for n, r in roles.items() if r == "prefill")
    gone = [env.event("trajectory_dropped", e["trajectory"]) for e in phase_a]
    assert (await env.post(gone)).status_code == 200
    assert (await env.post(decode_heavy(env, prefill_pod))).status_code == 200
    await env.wait_for(lambda: ready_split(env, 1, 3), what="a flip back to 1P:3D")

    async def settled() -> dict | None:
        # The status of a tick after the last relabel (one before it counts a switching pod).
        status = (await env.get_cluster()).get("status") or {}
        serving = status.get("instances", {})
        return status if serving.get("prefill", 0) + serving.get("decode", 0) == 4 else None

    status = await env.wait_for(settled, what="a status with all 4 instances serving")
    assert status["target"]["split"] in ("1P:3D", "2P:2D")
    assert any(h["result"] == "succeeded" for h in status["switchHistory"])
    kinds = {c["type"]: c["status"] for c in status["conditions"]}
    assert kinds["Ready"] == "True" and kinds["ForecastFresh"] == "True"
    reasons = {e.get("reason") for e in await env.events()}
    assert {"SwitchStarted", "SwitchSucceeded"} <= reasons
    text = await env.metrics()
    assert "prorsa_switches_total{" in text and 'result="succeeded"' in text
    # Failure counters exist at 0 from the start: the alerts' increase() sees a first one.
    failures = {
        (s.labels["from_role"], s.labels["to_role"], s.labels["result"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "prorsa_switches_total" and s.labels["cluster"] == "demo"
    }
    assert failures[("prefill", "decode", "lost")] == 0
    assert failures[("decode", "prefill", "replaced")] == 0
    # The Controller's own account of the switches it made: each priced, gain over cost.
    gain = _samples(text, "prorsa_switch_expected_gain_seconds_total", switching_mode="Auto")
    cost = _samples(text, "prorsa_switch_expected_cost_seconds_total", switching_mode="Auto")
    assert gain[("decode", "prefill")] > cost[("decode", "prefill")] >= 0
    assert gain[("prefill", "decode")] > cost[("prefill", "decode")] >= 0
    assert _samples(text, "prorsa_switch_expected_gain_seconds_total", switching_mode="Recommend")
    durations = _samples(text, "prorsa_switch_duration_seconds_count")
    assert durations[("decode", "prefill")] >= 1 and durations[("prefill", "decode")] >= 1
    # Where each switch's time went: the router's drop and the agent's call for each one.
    parts = {
        s.labels["part"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "prorsa_switch_part_duration_seconds_count" and s.labels["cluster"] == "demo"
    }
    made = sum(durations.values())
    assert made >= parts["router"] >= parts["engine"] >= 2, (parts, durations)
    best = {
        s.labels["role"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "prorsa_best_split_instances" and s.labels["cluster"] == "demo"
    }
    assert best["prefill"] + best["decode"] == 4
    assert "prorsa_webhook_events_total" in text
    # The trainers' port does not serve them: no token, no cluster names.
    async with env.http() as client:
        unauthenticated = await client.get(f"{env.webhook}/metrics", timeout=5)
    assert unauthenticated.status_code == 404
    assert 'cluster="demo"' not in unauthenticated.text and "prorsa_" not in unauthenticated.text


def _samples(text: str, name: str, **match: str) -> dict[tuple[str, str], float]:
    """``name``'s samples of cluster demo matching ``match``, by (from_role, to_role)."""
    return {
        (s.labels["from_role"], s.labels["to_role"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
        and s.labels["cluster"] == "demo"
        and all(s.labels.get(k) == v for k, v in match.items())
    }


async def _count(pods_coro, n: int) -> bool:
    return len(await pods_coro) == n


async def agents_serve_tls_the_operator_verifies(env: Stack) -> None:
    """Each agent serves HTTPS with the certificate of the cluster's Secret, which the
    fake kubelet mounted as a kubelet would; only that Secret's CA verifies it, under the
    pod's DNS name. (The split that follows is the operator's own switch over TLS.)"""
    ca = await env.kube.read_secret_key(NAMESPACE, "demo-agent-tls", "ca.crt")
    assert ca and "PRIVATE KEY" not in ca
    trusted = ssl.create_default_context(cadata=ca)
    for name, running in env.kubelet.pods.items():
        url = running.pod.agent_url
        assert url.startswith(f"https://{running.ip}:"), url
        sni = {"sni_hostname": f"{name}.demo-engines.{NAMESPACE}.svc"}
        async with httpx.AsyncClient(verify=trusted, timeout=5) as client:
            state = await client.get(f"{url}/v1/state", extensions=sni)
        assert state.status_code == 200 and state.json()["instance"] == name
        async with httpx.AsyncClient(timeout=5) as client:  # the system trust store
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await client.get(f"{url}/v1/state", extensions=sni)


@pytest.mark.parametrize("mode", ["Recommend", "Off"])
async def test_recommend_and_off_bring_the_cluster_up_then_hold(mode: str) -> None:
    # Fresh engines start as decode; PD without a prefill engine serves nothing. Both modes
    # bring the cluster to roles.prefill.initial once (deploying, not deciding), then only
    # Recommend says what Auto would do, in the status and an Event, moving nothing.
    async with stack() as env:
        manifest = cluster_manifest(
            switching={"mode": mode},
            roles={"prefill": {"min": 1, "initial": 1}, "decode": {"min": 1}},
        )
        await env.create_cluster(manifest)
        await env.wait_for(lambda: _count(env.pods(), 4), what="4 engine pods")
        await env.kubelet.wait_running(4)

        async def initial_split() -> bool:
            roles = list((await env.roles()).values())
            return sorted(roles) == ["decode", "decode", "decode", "prefill"]

        await env.wait_for(initial_split, what="roles.prefill.initial: 1P:3D")
        before = await env.roles()
        history = {name: len(h) for name, h in env.label_history.items()}
        await env.post(prefill_heavy(env, n=60))

        async def recommends_more_prefill() -> bool:
            status = (await env.get_cluster()).get("status", {})
            target = status.get("target", {})
            return target.get("prefill", 0) > before_prefill(before)

        await env.wait_for(recommends_more_prefill, what="a target of more prefill")
        await asyncio.sleep(1.5)  # several ticks: nothing may move
        assert await env.roles() == before
        assert {name: len(h) for name, h in env.label_history.items()} == history
        if mode == "Off":
            assert "SwitchRecommended" not in [e.get("reason") for e in await env.events()]
            return
        reasons = await env.wait_for_event("SwitchRecommended")
        assert "SwitchStarted" in reasons  # the one bootstrap flip to roles.prefill.initial
        text = await env.metrics()
        # Nothing priced was made (the bootstrap flip is not priced); what Recommend would
        # have made is counted under its own label, finite.
        for name in ("gain", "cost"):
            metric = f"prorsa_switch_expected_{name}_seconds_total"
            made = _samples(text, metric, switching_mode="Auto")
            recommended = _samples(text, metric, switching_mode="Recommend")
            assert made and not any(made.values()), made
            assert recommended and all(math.isfinite(v) for v in recommended.values())
            assert any(recommended.values()), recommended


def before_prefill(roles: dict[str, str]) -> int:
    return sum(1 for r in roles.values() if r == "prefill")


async def test_restart_mid_switch_converges_with_nothing_left_draining() -> None:
    # The flip outlasts the operator's shutdown even on a loaded machine, so the new process
    # really finds the pod mid-switch.
    slow = TimingModel(switch_seconds=6.0)
    async with stack(engine_config=lambda _n: EngineConfig(timing=slow)) as env:
        await env.create_cluster(cluster_manifest())
        await env.wait_for(lambda: _count(env.pods(), 4), what="4 engine pods")

        async def someone_draining() -> str | None:
            for name, role in (await env.roles()).items():
                if role == DRAINING:
                    return name
            return None

        # The bootstrap flip to 1P:3D is slow (6 s): stop the operator while it runs.
        name = await env.wait_for(someone_draining, timeout=2 * PATIENCE, what="a pod draining")
        pod = next(p for p in await env.pods() if p["metadata"]["name"] == name)
        intent = json.loads(pod["metadata"]["annotations"][SWITCH_ANNOTATION])
        assert intent["to"] == "prefill"
        await env.stop_operator()
        assert (await env.roles())[name] == DRAINING  # left mid-switch
        saved = await env.kube.read_config_map(NAMESPACE, "demo-prorsa-state")
        assert saved is not None and json.loads(saved["learned.json"])["format"] == 1
        await env.start_operator()

        # The new process lost the trajectories: its replies ask the trainer to resync.
        async def served() -> object:
            reply = await env.post([env.event("request_queued", "t", prompt_tokens=1, turn=0)])
            # Until the cluster is registered no served cluster holds the token: 401.
            return reply if reply.status_code not in (401, 404) else None

        reply = await env.wait_for(served, what="the cluster on the new webhook")
        assert reply.status_code == 200 and reply.json()["resync"] is True

        async def converged() -> bool:
            pods = await env.pods()
            return all(
                p["metadata"]["labels"][ROLE_LABEL] != DRAINING
                and SWITCH_ANNOTATION not in (p["metadata"].get("annotations") or {})
                for p in pods
            ) and await ready_split(env, 1, 3)

        await env.wait_for(converged, timeout=2 * PATIENCE, what="convergence after the restart")


async def test_pod_deleted_mid_switch_is_recreated() -> None:
    slow = TimingModel(switch_seconds=2.0)
    async with stack(engine_config=lambda _n: EngineConfig(timing=slow)) as env:
        await env.create_cluster(cluster_manifest())

        async def someone_draining() -> str | None:
            for name, role in (await env.roles()).items():
                if role == DRAINING:
                    return name
            return None

        name = await env.wait_for(someone_draining, timeout=2 * PATIENCE, what="a pod draining")
        await env.kube.delete_pod(NAMESPACE, name)

        async def replaced() -> bool:
            pods = {p["metadata"]["name"]: p for p in await env.pods()}
            return name in pods and pods[name]["metadata"]["labels"][ROLE_LABEL] != "draining"

        await env.wait_for(replaced, timeout=2 * PATIENCE, what="the pod recreated")
        await env.wait_for(lambda: ready_split(env, 1, 3), timeout=2 * PATIENCE, what="1P:3D again")


async def test_unsafe_switch_failure_replaces_the_pod() -> None:
    async with stack() as env:
        await env.create_cluster(cluster_manifest())
        await env.wait_for(lambda: _count(env.pods(), 4), what="4 engine pods")
        await env.kubelet.wait_running(4)
        await env.wait_for(lambda: ready_split(env, 1, 3), what="the initial 1P:3D split")
        # From now on every engine's next switch fails for good (safe_to_restore false).
        uids = {}
        for name, pod in env.kubelet.pods.items():
            pod.engine.faults.switch_failure = "unsafe"
            uids[name] = pod.uid
        assert (await env.post(prefill_heavy(env))).status_code == 200

        async def some_pod_replaced() -> bool:
            for pod in await env.pods():
                name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
                if name in uids and uid != uids[name]:
                    return True
            return False

        await env.wait_for(some_pod_replaced, timeout=2 * PATIENCE, what="a failed pod replaced")
        reasons = {e.get("reason") for e in await env.events()}
        assert "SwitchReplaced" in reasons


async def test_bad_rollout_clusters_are_refused_naming_the_field() -> None:
    import kubernetes

    async with stack() as env:
        bad = cluster_manifest(gpuBudget=30)
        with pytest.raises(kubernetes.client.exceptions.ApiException) as info:
            await env.create_cluster(bad)
        assert info.value.status == 422
        assert "gpuBudget" in info.value.body
        worse = cluster_manifest(engine={"transferBackend": "nixl"})
        with pytest.raises(kubernetes.client.exceptions.ApiException) as info:
            await env.create_cluster(worse)
        assert "transferBackend" in info.value.body


async def test_gpu_budget_change_scales_the_instances() -> None:
    async with stack() as env:
        await env.create_cluster(cluster_manifest())
        await env.wait_for(lambda: _count(env.pods(), 4), what="4 engine pods")
        await env.patch_cluster("demo", {"spec": {"gpuBudget": 48}})
        await env.wait_for(lambda: _count(env.pods(), 6), what="6 engine pods")
        await env.patch_cluster("demo", {"spec": {"gpuBudget": 24}})
        await env.wait_for(lambda: _count(env.pods(), 3), what="3 engine pods")
