"""The trainer webhook over real HTTP on loopback, with the real Controller behind it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from conftest import make_spec

from prorsa.clusters import ClusterHandle, ClusterRegistry, IngestLimits
from prorsa.core.controller import Controller
from prorsa.core.decision import Decision
from prorsa.ingest import WebhookServer

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BASE = "/v1/namespaces/rl/rolloutclusters/c"


def ev(id: str, type: str, trajectory: str, ts: float | None = None, **fields: Any) -> dict:
    return {"id": id, "type": type, "trajectory": trajectory, "ts": ts or time.time()} | fields


def queued(id: str, trajectory: str, ts: float | None = None, tokens: int = 1000) -> dict:
    return ev(id, "request_queued", trajectory, ts, prompt_tokens=tokens, turn=0)


@dataclass
class Served:
    url: str
    http: httpx.AsyncClient
    server: WebhookServer
    handle: ClusterHandle

    async def post(self, events: list[dict], **kw: Any) -> httpx.Response:
        headers = {**AUTH, **kw.pop("headers", {})}
        return await self.http.post(f"{BASE}/events", json={"events": events}, headers=headers)

    def metric(self, name: str, **labels: str) -> float:
        value = self.server.metrics.registry.get_sample_value(name, labels or None)
        return 0.0 if value is None else value


@asynccontextmanager
async def serve(
    limits: IngestLimits | None = None, controller: Controller | None = None
) -> AsyncIterator[Served]:
    registry = ClusterRegistry(limits=limits)
    controller = controller if controller is not None else Controller(make_spec())
    handle = registry.add(namespace="rl", name="c", token=TOKEN, controller=controller)
    server = WebhookServer(registry)
    async with server.serving() as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
        yield Served(url=url, http=http, server=server, handle=handle)


@pytest.fixture
async def srv() -> AsyncIterator[Served]:
    async with serve() as s:
        yield s


# -- accepted batches -----------------------------------------------------------------


async def test_json_batch_is_applied_and_the_reply_carries_epoch_and_counts(srv: Served) -> None:
    r = await srv.post([queued("a", "t1"), queued("b", "t2"), ev("c", "prefill_started", "t1")])
    assert r.status_code == 200
    body = r.json()
    assert body["epoch"] == srv.handle.epoch
    assert body["resync"] is True  # a fresh server may have lost state: it asks
    assert (body["accepted"], body["applied"], body["duplicates"]) == (3, 3, 0)
    live = srv.handle.controller.live_trajectories()
    assert live["ready"] == 1 and live["prefill"] == 1
    assert srv.metric("prorsa_webhook_events_total", type="request_queued") == 2
    assert srv.metric("prorsa_webhook_batch_seconds_count") == 1


async def test_ndjson_batch_is_applied(srv: Served) -> None:
    lines = "\n".join(json.dumps(e) for e in [queued("a", "t1"), queued("b", "t2")]) + "\n\n"
    r = await srv.http.post(
        f"{BASE}/events",
        content=lines.encode(),
        headers={**AUTH, "Content-Type": "application/x-ndjson"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["applied"] == 2
    assert srv.handle.controller.live_trajectories()["ready"] == 2


# -- refusals: every bad input of the contract ------------------------------------------


@pytest.mark.parametrize(
    ("body", "ctype"),
    [
        (b"not json at all", "application/json"),
        (b'{"events": [', "application/json"),
        (b"", "application/json"),
        (b"\xff\xfe\x00garbage", "application/x-ndjson"),
    ],
)
async def test_unreadable_body_is_400_and_nothing_applies(
    srv: Served, body: bytes, ctype: str
) -> None:
    r = await srv.http.post(f"{BASE}/events", content=body, headers={**AUTH, "Content-Type": ctype})
    assert r.status_code == 400
    assert r.json()["epoch"] == srv.handle.epoch
    assert srv.handle.applied == 0
    assert srv.metric("prorsa_webhook_rejects_total", reason="unreadable") == 1


async def test_bad_events_are_422_listing_index_and_field_and_the_batch_is_refused_whole(
    srv: Served,
) -> None:
    batch = [
        queued("ok-0", "t0"),
        ev("bad-1", "request_queued", "t1", prompt_tokens=-5, turn=0),  # negative tokens
        queued("ok-2", "t2"),
        ev("bad-3", "teleported", "t3"),  # unknown type
        ev("bad-4", "decode_finished", "t4", output_tokens=10),  # missing `finish`
        {"id": "bad-5", "type": "tool_started", "trajectory": "t5", "ts": "yesterday"},
    ]
    r = await srv.post(batch)
    assert r.status_code == 422
    errors = {(e["index"], e["field"]) for e in r.json()["errors"]}
    assert errors == {(1, "prompt_tokens"), (3, "type"), (4, "finish"), (5, "ts")}
    # Whole batch refused: not even the valid events were applied.
    assert sum(srv.handle.controller.live_trajectories().values()) == 0
    assert srv.metric("prorsa_webhook_rejects_total", reason="invalid") == 1


async def test_ndjson_line_that_is_not_json_is_422_naming_the_line(srv: Served) -> None:
    lines = json.dumps(queued("a", "t1")) + "\n{oops\n" + json.dumps(queued("b", "t2"))
    r = await srv.http.post(
        f"{BASE}/events", content=lines, headers={**AUTH, "Content-Type": "application/x-ndjson"}
    )
    assert r.status_code == 422
    assert [(e["index"], e["field"]) for e in r.json()["errors"]] == [(1, "line")]
    assert srv.handle.applied == 0


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}],
)
async def test_missing_or_wrong_token_is_401(srv: Served, headers: dict) -> None:
    r = await srv.http.post(f"{BASE}/events", json={"events": [queued("a", "t")]}, headers=headers)
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert srv.handle.applied == 0
    for path in ("/forecast", "/status"):
        assert (await srv.http.get(BASE + path, headers=headers)).status_code == 401


async def test_unknown_cluster_is_404(srv: Served) -> None:
    r = await srv.http.post(
        "/v1/namespaces/rl/rolloutclusters/nope/events", json={"events": []}, headers=AUTH
    )
    assert r.status_code == 404
    assert "rl/nope" in r.json()["error"]
    assert srv.metric("prorsa_webhook_rejects_total", reason="unknown_cluster") == 1


async def test_body_over_the_limit_is_413_declared_or_streamed() -> None:
    async with serve(IngestLimits(max_batch_bytes=2_000)) as srv:
        big = [queued(f"e{i}", f"t{i}") for i in range(40)]
        r = await srv.post(big)  # Content-Length says it all
        assert r.status_code == 413

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as read
            data = json.dumps({"events": big}).encode()
            for i in range(0, len(data), 500):
                yield data[i : i + 500]

        r = await srv.http.post(f"{BASE}/events", content=chunks(), headers=AUTH)
        assert r.status_code == 413
        assert srv.metric("prorsa_webhook_rejects_total", reason="too_large") == 2
        assert srv.handle.applied == 0


async def test_full_queue_is_429_with_retry_after_and_nothing_is_lost() -> None:
    async with serve(IngestLimits(max_pending_events=600)) as srv:
        first = [queued(f"a{i}", f"t{i}") for i in range(500)]
        second = [queued(f"b{i}", f"u{i}") for i in range(200)]
        async with srv.handle.exclusive():  # the Controller is busy (e.g. a long tick)
            waiting = asyncio.create_task(srv.post(first))
            while srv.handle.pending_events < 500:
                await asyncio.sleep(0.005)
            r = await srv.post(second)
            assert r.status_code == 429
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["retryAfter"] == int(r.headers["Retry-After"])
        assert (await waiting).status_code == 200  # the queued batch applied after all
        assert (await srv.post(second)).status_code == 200  # and the retry succeeds
        assert srv.handle.applied == 700
        assert srv.metric("prorsa_webhook_rejects_total", reason="queue_full") == 1


async def test_bytes_in_flight_are_bounded_server_wide() -> None:
    limits = IngestLimits(max_batch_bytes=4_000, max_inflight_bytes=6_000)
    async with serve(limits) as srv:
        release = asyncio.Event()
        body = json.dumps({"events": [queued(f"s{i}", f"s{i}") for i in range(30)]}).encode()
        assert 3_000 < len(body) < 4_000

        async def slow_body() -> AsyncIterator[bytes]:
            yield body[:-10]
            await release.wait()
            yield body[-10:]

        # Bytes count as they arrive: the slow body holds all but its last 10 bytes.
        slow = asyncio.create_task(
            srv.http.post(f"{BASE}/events", content=slow_body(), headers=AUTH)
        )
        while srv.server.inflight_bytes < len(body) - 10:
            await asyncio.sleep(0.01)
        r = await srv.post([queued(f"e{i}", f"t{i}") for i in range(30)])  # 3 kB more
        assert r.status_code == 429
        assert srv.metric("prorsa_webhook_rejects_total", reason="busy") == 1
        release.set()
        assert (await slow).status_code == 200
        assert srv.server.inflight_bytes == 0


async def test_bad_sent_at_header_is_400(srv: Served) -> None:
    r = await srv.post([queued("a", "t")], headers={"X-Prorsa-Sent-At": "tuesday"})
    assert r.status_code == 400
    assert "X-Prorsa-Sent-At" in r.json()["error"]


# -- replays and ordering ---------------------------------------------------------------


async def test_replayed_ids_are_counted_not_applied_twice(srv: Served) -> None:
    batch = [
        ev("s", "sample_dispatched", "t1"),
        ev("s", "sample_dispatched", "t1"),  # duplicate inside one batch
        queued("q", "t1"),
    ]
    first = (await srv.post(batch)).json()
    assert (first["applied"], first["duplicates"]) == (2, 1)
    again = (await srv.post(batch)).json()  # the whole batch replayed (lost reply)
    assert (again["applied"], again["duplicates"]) == (0, 3)
    assert srv.handle.controller.live_trajectories()["ready"] == 1
    assert srv.metric("prorsa_webhook_duplicates_total") == 4


async def test_out_of_order_events_do_not_move_a_trajectory_backwards(srv: Served) -> None:
    t0 = time.time()
    r1 = await srv.post([ev("p", "prefill_started", "t1", t0 + 2)])
    r2 = await srv.post([queued("q", "t1", t0 + 1)])  # older, arrives later
    assert r1.status_code == r2.status_code == 200
    assert r2.json()["anomalies"] == 1
    live = srv.handle.controller.live_trajectories()
    assert live["prefill"] == 1 and live["ready"] == 0


# -- resync, restart, epoch -------------------------------------------------------------


async def test_snapshot_clears_resync_and_supersedes_older_events(srv: Served) -> None:
    t0 = time.time()
    snapshot = {
        "ts": t0,
        "trajectories": [
            {"trajectory": "t1", "state": "tool", "since": t0 - 3, "context_tokens": 5000},
            {"trajectory": "t2", "state": "ready", "since": t0 - 1, "context_tokens": 800},
        ],
    }
    r = await srv.http.post(f"{BASE}/snapshot", json=snapshot, headers=AUTH)
    assert r.status_code == 200
    assert r.json() == {"epoch": srv.handle.epoch, "resync": False, "trajectories": 2}
    live = srv.handle.controller.live_trajectories()
    assert (live["tool"], live["ready"]) == (1, 1)
    # An event emitted before the snapshot (delivered late) is already in it.
    late = await srv.post([ev("late", "tool_finished", "t1", t0 - 0.5)])
    fresh = await srv.post([queued("fresh", "t1", t0 + 0.5)])
    assert (late.json()["superseded"], late.json()["resync"]) == (1, False)
    assert fresh.json()["applied"] == 1
    live = srv.handle.controller.live_trajectories()
    assert (live["tool"], live["ready"]) == (0, 2)


async def test_late_events_queued_behind_a_snapshot_are_filtered_by_it(srv: Served) -> None:
    t0 = time.time()
    snap = {
        "ts": t0,
        "trajectories": [
            {"trajectory": "t1", "state": "tool", "since": t0 - 1, "context_tokens": 9}
        ],
    }
    async with srv.handle.exclusive():  # the snapshot has to wait for the Controller
        posting = asyncio.create_task(srv.http.post(f"{BASE}/snapshot", json=snap, headers=AUTH))
        while srv.handle.pending_events < 1:
            await asyncio.sleep(0.005)
        late = await srv.post([queued("late", "t1", t0 - 0.5)])  # stamped before the snapshot
        assert late.json()["superseded"] == 1
    assert (await posting).status_code == 200
    assert srv.handle.controller.live_trajectories()["tool"] == 1  # not moved back to ready


async def test_invalid_snapshot_is_422_and_keeps_resync(srv: Served) -> None:
    bad = {"ts": time.time(), "trajectories": [{"trajectory": "t", "state": "flying"}]}
    r = await srv.http.post(f"{BASE}/snapshot", json=bad, headers=AUTH)
    assert r.status_code == 422
    assert {e["field"] for e in r.json()["errors"]} >= {"trajectories.0.state"}
    assert srv.handle.resync is True


def emitting(emitter: str) -> dict[str, str]:
    return {**AUTH, "X-Prorsa-Emitter": emitter}


async def test_a_workers_snapshot_replaces_only_its_own_trajectories(srv: Served) -> None:
    """verl runs one emitter per worker: worker-0 resyncs after the server restarted, and
    worker-1's trajectories stay; worker-1's replies still ask for its own snapshot, and
    worker-0's snapshot supersedes worker-0's late events alone."""
    t0 = time.time()
    for worker, ids in (("worker-0", ("a", "b")), ("worker-1", ("c", "d"))):
        batch = {"events": [queued(f"{worker}-{t}", t, t0 - 2) for t in ids]}
        r = await srv.http.post(f"{BASE}/events", json=batch, headers=emitting(worker))
        assert r.status_code == 200 and r.json()["resync"] is True
    row = {"trajectory": "a", "state": "tool", "since": t0 - 1, "context_tokens": 5000}
    r = await srv.http.post(
        f"{BASE}/snapshot", json={"ts": t0, "trajectories": [row]}, headers=emitting("worker-0")
    )
    assert r.json() == {"epoch": srv.handle.epoch, "resync": False, "trajectories": 1}
    live = srv.handle.controller.live_trajectories()
    assert (live["tool"], live["ready"]) == (1, 2)  # a (tool), c and d; b is gone
    late = [queued("late-0", "a", t0 - 0.5)]
    r0 = await srv.http.post(f"{BASE}/events", json={"events": late}, headers=emitting("worker-0"))
    assert (r0.json()["superseded"], r0.json()["resync"]) == (1, False)
    late = [queued("late-1", "c", t0 - 0.5)]
    r1 = await srv.http.post(f"{BASE}/events", json={"events": late}, headers=emitting("worker-1"))
    assert (r1.json()["applied"], r1.json()["resync"]) == (1, True)
    assert srv.handle.resync is True  # no snapshot of every trajectory yet


async def test_a_workers_snapshot_does_not_supersede_its_weight_update_events(
    srv: Served,
) -> None:
    """The end of a weight update, stamped before the emitter's own snapshot (which lists
    trajectories, not updates) and delivered after it, still ends the update."""
    t0 = time.time()
    started = {"id": "ws", "type": "weight_update_started", "ts": t0 - 2, "version": 4}
    finished = {"id": "wf", "type": "weight_update_finished", "ts": t0 - 1, "version": 4,
                "reprefill_trajectories": 0}  # fmt: skip
    trainer = emitting("verl-trainer")
    await srv.http.post(f"{BASE}/events", json={"events": [started]}, headers=trainer)
    snap = {"ts": t0, "trajectories": []}
    assert (await srv.http.post(f"{BASE}/snapshot", json=snap, headers=trainer)).is_success
    late = [finished, queued("late", "t", t0 - 1)]
    r = await srv.http.post(f"{BASE}/events", json={"events": late}, headers=trainer)
    assert (r.json()["applied"], r.json()["superseded"]) == (1, 1)
    assert srv.handle.controller.table.weight_update.pending is False


async def test_a_snapshot_without_an_emitter_still_replaces_every_trajectory(
    srv: Served,
) -> None:
    t0 = time.time()
    batch = {"events": [queued("w", "t1", t0 - 1)]}
    await srv.http.post(f"{BASE}/events", json=batch, headers=emitting("worker-0"))
    await srv.post([queued("u", "t2", t0 - 1)])
    r = await srv.http.post(f"{BASE}/snapshot", json={"ts": t0, "trajectories": []}, headers=AUTH)
    assert r.json()["resync"] is False and srv.handle.resync is False
    assert sum(srv.handle.controller.live_trajectories().values()) == 0
    batch = {"events": [queued("w2", "t3", t0 + 1)]}
    r = await srv.http.post(f"{BASE}/events", json=batch, headers=emitting("worker-0"))
    assert r.json()["resync"] is False


@pytest.mark.parametrize("emitter", ["", "-leading-dash", "a b", "x" * 129, "wörker"])
async def test_a_malformed_emitter_id_is_422_naming_the_header(srv: Served, emitter: str) -> None:
    headers = {**AUTH, "X-Prorsa-Emitter": emitter.encode()}  # bytes: UTF-8 as sent
    r = await srv.http.post(f"{BASE}/events", json={"events": [queued("a", "t")]}, headers=headers)
    assert r.status_code == 422, r.text
    assert [(e["index"], e["field"]) for e in r.json()["errors"]] == [(None, "X-Prorsa-Emitter")]
    assert srv.handle.applied == 0


async def test_restart_gets_a_new_epoch_and_asks_for_resync_again() -> None:
    port = 0
    epochs = []
    for _ in range(2):
        registry = ClusterRegistry()
        handle = registry.add(
            namespace="rl", name="c", token=TOKEN, controller=Controller(make_spec())
        )
        running = await WebhookServer(registry).start(port=port)
        port = running.port  # the second incarnation listens where the first did
        async with httpx.AsyncClient(base_url=running.url) as http:
            r = await http.post(f"{BASE}/events", json={"events": [queued("a", "t")]}, headers=AUTH)
            assert r.json()["resync"] is True
            snap = {"ts": time.time(), "trajectories": []}
            await http.post(f"{BASE}/snapshot", json=snap, headers=AUTH)
            r = await http.post(f"{BASE}/events", json={"events": [queued("b", "t")]}, headers=AUTH)
            assert r.json()["resync"] is False
            epochs.append(r.json()["epoch"])
        assert handle.epoch == epochs[-1]
        await running.stop()
    assert epochs[1] > epochs[0]


# -- forecast, status, clock ------------------------------------------------------------


async def test_forecast_is_404_before_a_tick_then_the_latest_decision(srv: Served) -> None:
    r = await srv.http.get(f"{BASE}/forecast", headers=AUTH)
    assert r.status_code == 404
    await srv.post([queued("a", "t1", tokens=4096)])
    decision = await srv.handle.tick()
    r = await srv.http.get(f"{BASE}/forecast", headers=AUTH)
    assert r.status_code == 200
    assert Decision.model_validate(r.json()).wire() == decision.wire()
    assert r.json()["forecast"]["components"]["ready"] == 4096


@pytest.mark.parametrize("skew", [-1000.0, 1000.0])
async def test_trainer_clock_offset_is_estimated_and_corrected(srv: Served, skew: float) -> None:
    """A trainer clock 1000 s off: ticks run at the trainer's present once five batches
    (the SDK sends one at least every 0.2 s while events flow) have shown it."""
    for i in range(5):
        trainer_now = time.time() + skew
        r = await srv.post(
            [queued(f"a{i}", "t1", trainer_now - 1.0, tokens=3000)],
            headers={"X-Prorsa-Sent-At": repr(trainer_now)},
        )
        assert r.status_code == 200
    status = (await srv.http.get(f"{BASE}/status", headers=AUTH)).json()
    assert status["clockSkewSeconds"] == pytest.approx(skew, abs=0.5)
    decision = await srv.handle.tick()
    assert decision.at == pytest.approx(time.time() + skew, abs=0.5)
    # Uncorrected, a trainer 1000 s behind would look silent (reactive mode, no demand).
    assert decision.mode == "predictive"
    assert decision.forecast.components.ready == 3000


async def test_clock_is_estimated_from_event_timestamps_without_the_header(srv: Served) -> None:
    skew = -250.0
    for i in range(5):
        await srv.post([queued(f"e{i}", f"t{i}", time.time() + skew)])
    assert srv.handle.clock.skew() == pytest.approx(skew, abs=0.5)


async def test_status_reports_counts_and_live_trajectories(srv: Served) -> None:
    await srv.post([queued("a", "t1"), queued("a", "t1")])
    s = (await srv.http.get(f"{BASE}/status", headers=AUTH)).json()
    assert s["epoch"] == srv.handle.epoch and s["resync"] is True
    assert s["events"] == {"applied": 1, "duplicates": 1, "superseded": 0, "anomalies": 1}
    assert s["liveTrajectories"]["ready"] == 1
    assert s["lastDecisionAt"] is None


async def test_health_metrics_and_openapi(srv: Served) -> None:
    assert (await srv.http.get("/healthz")).json() == {"status": "ok", "clusters": 1}
    await srv.post([queued("a", "t1")])
    await srv.http.post(f"{BASE}/events", json={"events": []})  # 401
    text = (await srv.http.get("/metrics")).text
    assert 'prorsa_webhook_events_total{type="request_queued"} 1.0' in text
    assert 'prorsa_webhook_rejects_total{reason="unauthorized"} 1.0' in text
    assert "prorsa_webhook_batch_seconds_bucket" in text
    assert "prorsa_webhook_duplicates_total 0.0" in text
    doc = (await srv.http.get("/openapi.json")).json()
    assert set(doc["paths"]) >= {
        f"/v1/namespaces/{{namespace}}/rolloutclusters/{{name}}/{p}"
        for p in ("events", "snapshot", "forecast", "status")
    } | {"/healthz", "/metrics", "/openapi.json"}
    responses = doc["paths"]["/v1/namespaces/{namespace}/rolloutclusters/{name}/events"]["post"]
    assert set(responses["responses"]) == {"200", "400", "401", "404", "408", "413", "422", "429"}


# -- many clusters, one listener --------------------------------------------------------


async def test_clusters_are_added_and_removed_at_runtime_with_their_own_tokens() -> None:
    registry = ClusterRegistry()
    a = registry.add(namespace="rl", name="a", token="token-a", controller=Controller(make_spec()))
    server = WebhookServer(registry)
    async with server.serving() as url, httpx.AsyncClient(base_url=url) as http:

        async def post(name: str, token: str) -> int:
            r = await http.post(
                f"/v1/namespaces/rl/rolloutclusters/{name}/events",
                json={"events": [queued(f"{name}-{token}", "t")]},
                headers={"Authorization": f"Bearer {token}"},
            )
            return r.status_code

        assert await post("b", "token-b") == 401  # no served cluster holds that token
        assert await post("b", "token-a") == 404  # a valid token learns b is not served
        b = registry.add(
            namespace="rl", name="b", token="token-b", controller=Controller(make_spec())
        )
        assert await post("b", "token-b") == 200
        assert await post("b", "token-a") == 401  # one cluster's token opens only it
        assert await post("a", "token-a") == 200
        assert a.epoch != b.epoch
        registry.remove(namespace="rl", name="a")
        assert await post("a", "token-a") == 401  # its token went with it
        assert await post("a", "token-b") == 404
        b.set_token("rotated")
        assert await post("b", "token-b") == 401
        assert await post("b", "rotated") == 200


class SlowController(Controller):
    """Applies like the real one, then holds its thread for a while (GIL released): were
    the batch applied on the event loop, nothing else could be served meanwhile."""

    def observe(self, events):  # type: ignore[no-untyped-def]
        result = super().observe(events)
        time.sleep(0.5)
        return result


async def test_a_huge_batch_does_not_stall_other_requests() -> None:
    """A 30k-event batch parses and applies in a worker thread; the loop keeps serving."""
    async with serve(IngestLimits(offload_events=1_000), SlowController(make_spec())) as srv:
        t0 = time.time()
        big = [queued(f"e{i}", f"t{i % 5000}", t0 + i * 1e-4) for i in range(30_000)]
        order: list[str] = []

        async def post_big() -> None:
            r = await srv.post(big)
            assert r.status_code == 200
            order.append("big")

        async def health_checks() -> None:
            while srv.handle.pending_events == 0 and not order:
                await asyncio.sleep(0.001)
            r = await srv.http.get("/healthz")
            assert r.status_code == 200
            order.append("health")

        await asyncio.gather(post_big(), health_checks())
        assert order == ["health", "big"]
        assert srv.handle.applied == 30_000


# -- cluster events: weight updates -----------------------------------------------------


async def test_weight_update_events_over_http_flush_caches_and_show_in_the_table(
    srv: Served,
) -> None:
    t0 = time.time()
    started = {"id": "w-3-start", "type": "weight_update_started", "ts": t0, "version": 3}
    finished = {
        "id": "w-3-done",
        "type": "weight_update_finished",
        "ts": t0 + 2,
        "version": 3,
        "reprefill_trajectories": 1,
    }
    dispatched = ev("s", "sample_dispatched", "t1", t0 - 2)
    r = await srv.post([dispatched, queued("q", "t1", t0 - 1), started | {"expected_seconds": 4.5}])
    assert r.status_code == 200, r.text
    assert (r.json()["applied"], r.json()["anomalies"]) == (3, 0)
    table = srv.handle.controller.table
    wu = table.weight_update
    assert (wu.pending, wu.version, wu.expected_seconds) == (True, 3, 4.5)
    assert table.cache_flushes == 1
    # NDJSON too, and a replay of the same ids applies nothing twice.
    line = json.dumps(finished).encode()
    for _ in range(2):
        r = await srv.http.post(
            f"{BASE}/events", content=line, headers={**AUTH, "Content-Type": "application/x-ndjson"}
        )
        assert r.status_code == 200, r.text
    assert (r.json()["applied"], r.json()["duplicates"]) == (0, 1)
    wu = table.weight_update
    assert (wu.pending, wu.finished_at, wu.reprefill_trajectories) == (False, t0 + 2, 1)
    assert srv.metric("prorsa_webhook_events_total", type="weight_update_started") == 1
    assert srv.metric("prorsa_webhook_events_total", type="weight_update_finished") == 1


async def test_weight_update_with_bad_fields_is_422_naming_each(srv: Served) -> None:
    bad = [
        {"id": "w1", "type": "weight_update_started", "ts": time.time(), "version": -2},
        {"id": "w2", "type": "weight_update_finished", "ts": time.time(), "version": 1},
        {"id": "w3", "type": "weight_update_started", "ts": time.time(), "version": 1}
        | {"trajectory": "t1"},
    ]
    r = await srv.post([queued("q", "t1"), *bad])
    assert r.status_code == 422
    fields = [(e["index"], e["field"]) for e in r.json()["errors"]]
    assert fields == [(1, "version"), (2, "reprefill_trajectories"), (3, "trajectory")]
    assert srv.handle.controller.table.weight_update.version is None  # refused whole


async def test_openapi_documents_the_weight_update_events(srv: Served) -> None:
    doc = (await srv.http.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    started = schemas["WeightUpdateStarted"]
    finished = schemas["WeightUpdateFinished"]
    assert set(started["required"]) == {"id", "ts", "type", "version"}
    assert set(finished["required"]) == {"id", "ts", "type", "version", "reprefill_trajectories"}
    assert "trajectory" not in started["properties"] | finished["properties"]
    assert started["properties"]["expected_seconds"]["anyOf"][0]["exclusiveMinimum"] == 0
    mapping = schemas["EventBatch"]["properties"]["events"]["items"]["discriminator"]["mapping"]
    assert mapping["weight_update_started"].endswith("/WeightUpdateStarted")
    assert mapping["weight_update_finished"].endswith("/WeightUpdateFinished")
    assert "weight_update" in schemas["Snapshot"]["properties"]
