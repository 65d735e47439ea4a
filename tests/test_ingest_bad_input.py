"""The webhook refuses bad input with a 4xx that names the problem, never a 500.

Each case here once got a 500, a 200 for nonsense, or a 404 that told an unauthenticated
caller which clusters exist. Over real HTTP on loopback, with the real Controller.
"""

from __future__ import annotations

import asyncio
import gzip
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
from prorsa.ingest import WebhookServer

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BASE = "/v1/namespaces/rl/rolloutclusters/c"


def queued(id: str, trajectory: str, ts: float | None = None, **fields: Any) -> dict:
    return {
        "id": id,
        "type": "request_queued",
        "trajectory": trajectory,
        "ts": time.time() if ts is None else ts,
        "prompt_tokens": 1000,
        "turn": 0,
    } | fields


@dataclass
class Served:
    http: httpx.AsyncClient
    server: WebhookServer
    registry: ClusterRegistry
    handle: ClusterHandle

    async def post(self, events: list[dict], **headers: str) -> httpx.Response:
        return await self.http.post(
            f"{BASE}/events", json={"events": events}, headers={**AUTH, **headers}
        )

    async def snapshot(self, body: dict) -> httpx.Response:
        return await self.http.post(f"{BASE}/snapshot", json=body, headers=AUTH)

    def rejects(self, reason: str) -> float:
        value = self.server.metrics.registry.get_sample_value(
            "prorsa_webhook_rejects_total", {"reason": reason}
        )
        return 0.0 if value is None else value


@asynccontextmanager
async def serve(
    limits: IngestLimits | None = None, controller: Controller | None = None
) -> AsyncIterator[Served]:
    registry = ClusterRegistry(limits=limits)
    controller = controller if controller is not None else Controller(make_spec())
    handle = registry.add(namespace="rl", name="c", token=TOKEN, controller=controller)
    server = WebhookServer(registry)
    async with server.serving() as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield Served(http=http, server=server, registry=registry, handle=handle)


@pytest.fixture
async def srv() -> AsyncIterator[Served]:
    async with serve() as s:
        yield s


def fields(reply: httpx.Response) -> list[tuple[int | None, str]]:
    return [(e["index"], e["field"]) for e in reply.json()["errors"]]


# -- encodings --------------------------------------------------------------------------


async def test_corrupt_gzip_body_is_400_naming_the_encoding(srv: Served) -> None:
    good = gzip.compress(json.dumps({"events": [queued("a", "t")]}).encode())
    corrupt = good[:10] + bytes(b ^ 0x5A for b in good[10:])
    headers = {**AUTH, "Content-Encoding": "gzip", "Content-Type": "application/json"}
    r = await srv.http.post(f"{BASE}/events", content=corrupt, headers=headers)
    assert r.status_code == 400, r.text
    assert "gzip" in r.json()["error"]
    assert r.json()["epoch"] == srv.handle.epoch
    assert srv.rejects("unreadable") == 1
    # The same batch compressed properly is applied: the encoding itself is supported.
    r = await srv.http.post(f"{BASE}/events", content=good, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["applied"] == 1


# -- authentication before anything that reveals a cluster ------------------------------


async def test_unknown_cluster_answers_401_to_a_bad_token_and_404_only_after_auth() -> None:
    registry = ClusterRegistry()
    registry.add(namespace="rl", name="c", token=TOKEN, controller=Controller(make_spec()))
    server = WebhookServer(registry)
    async with server.serving() as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        for path in ("events", "snapshot", "forecast", "status"):
            unknown = f"/v1/namespaces/rl/rolloutclusters/nope/{path}"
            post = path in ("events", "snapshot")
            for headers in ({}, {"Authorization": "Bearer guess"}):
                r = await (
                    http.post(unknown, json={}, headers=headers)
                    if post
                    else http.get(unknown, headers=headers)
                )
                assert r.status_code == 401, (path, headers, r.text)
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
                assert "nope" not in r.text  # nothing about the cluster before auth
            r = await (
                http.post(unknown, json={}, headers=AUTH)
                if post
                else http.get(unknown, headers=AUTH)
            )
            assert r.status_code == 404, (path, r.text)
            assert "rl/nope" in r.json()["error"]
        # A known cluster with a wrong token is also 401: the two cannot be told apart.
        r = await http.get(f"{BASE}/status", headers={"Authorization": "Bearer guess"})
        assert r.status_code == 401


# -- numbers: booleans are not numbers, whole numbers are integers ----------------------


async def test_snapshot_with_booleans_for_numbers_is_422_naming_the_fields(srv: Served) -> None:
    now = time.time()
    row = {"trajectory": "t1", "state": "tool", "since": False, "context_tokens": 10}
    r = await srv.snapshot({"ts": now, "trajectories": [row]})
    assert r.status_code == 422, r.text
    assert fields(r) == [(None, "trajectories.0.since")]
    r = await srv.snapshot({"ts": True, "trajectories": []})
    assert r.status_code == 422
    assert fields(r) == [(None, "ts")]
    r = await srv.snapshot(
        {"ts": now, "trajectories": [row | {"since": now, "context_tokens": True}]}
    )
    assert r.status_code == 422
    assert fields(r) == [(None, "trajectories.0.context_tokens")]
    assert srv.handle.resync is True and srv.handle.snapshots == 0


async def test_whole_number_floats_are_integers_and_fractions_are_refused(srv: Served) -> None:
    t0 = time.time()
    whole = [
        queued("a", "t1", t0, prompt_tokens=2048.0, turn=3.0),
        queued("b", "t2", t0, prompt_tokens=1e3, turn=0),
        {"id": "w", "type": "weight_update_started", "ts": t0, "version": 7.0},
    ]
    r = await srv.post(whole)
    assert r.status_code == 200, r.text
    assert r.json()["applied"] == 3
    table = srv.handle.controller.table
    assert table.context_of("t1") == 2048 and table.context_of("t2") == 1000
    assert table.weight_update.version == 7 and type(table.weight_update.version) is int

    bad = [
        queued("c", "t3", t0, prompt_tokens=2048.5),
        queued("d", "t4", t0, turn=True),
        queued("e", "t5", t0, turn="3"),
        queued("f", "t6", t0, turn=3.0),  # fine: only the others are reported
    ]
    r = await srv.post(bad)
    assert r.status_code == 422, r.text
    assert fields(r) == [(0, "prompt_tokens"), (1, "turn"), (2, "turn")]
    assert table.context_of("t6") is None  # refused whole

    ndjson = "\n".join(json.dumps(e) for e in [queued("g", "t7", t0, turn=2.0)])
    r = await srv.http.post(
        f"{BASE}/events",
        content=ndjson.encode(),
        headers={**AUTH, "Content-Type": "application/x-ndjson"},
    )
    assert r.status_code == 200, r.text
    assert table.context_of("t7") == 1000

    row = {"trajectory": "s1", "state": "ready", "since": t0, "context_tokens": 512.0}
    r = await srv.snapshot({"ts": t0, "trajectories": [row | {"turn": 2.0}]})
    assert r.status_code == 200, r.text
    assert table.context_of("s1") == 512
    r = await srv.snapshot({"ts": t0, "trajectories": [row | {"turn": 2.5}]})
    assert r.status_code == 422
    assert fields(r) == [(None, "trajectories.0.turn")]


async def test_openapi_states_the_integer_and_clock_rules(srv: Served) -> None:
    doc = (await srv.http.get("/openapi.json")).json()
    queued_schema = doc["components"]["schemas"]["RequestQueued"]["properties"]
    assert queued_schema["turn"]["type"] == "integer"  # JSON Schema: 3.0 is an integer
    events = doc["paths"][f"{'/v1/namespaces/{namespace}/rolloutclusters/{name}'}/events"]
    text = json.dumps(events["post"])
    assert "whole number" in text and "3.5" in text
    assert "window" in text and "X-Prorsa-Sent-At" in text


# -- the trainer clock: a sane window ---------------------------------------------------


@pytest.mark.parametrize(
    "ts",
    [1e300, time.time() * 1000, time.time() + 10 * 86400, 1732.5],
    ids=["1e300", "milliseconds", "ten-days-ahead", "seconds-since-start"],
)
async def test_event_timestamps_outside_the_window_are_422_naming_the_field(
    srv: Served, ts: float
) -> None:
    r = await srv.post([queued("ok", "t0"), queued("bad", "t1", ts)])
    assert r.status_code == 422, r.text
    assert fields(r) == [(1, "ts")]
    assert "window" in r.json()["errors"][0]["message"]
    assert srv.handle.applied == 0 and srv.handle.clock.samples == 0
    decision = await srv.handle.tick()
    assert decision.at == pytest.approx(time.time(), abs=5)
    assert decision.mode == "reactive"  # nothing was applied: the forecast is not fresh


@pytest.mark.parametrize(
    "sent_at",
    ["1e15", repr(time.time() * 1000), "1e300", "0"],
    ids=["1e15", "milliseconds", "1e300", "zero"],
)
async def test_sent_at_outside_the_window_is_422_and_leaves_the_clock_alone(
    srv: Served, sent_at: str
) -> None:
    r = await srv.post([queued("a", "t")], **{"X-Prorsa-Sent-At": sent_at})
    assert r.status_code == 422, r.text
    assert fields(r) == [(None, "X-Prorsa-Sent-At")]
    assert srv.handle.clock.samples == 0 and srv.handle.applied == 0
    assert srv.rejects("invalid") == 1


async def test_snapshot_times_outside_the_window_are_422_naming_each(srv: Served) -> None:
    now = time.time()
    body = {
        "ts": now,
        "trajectories": [
            {"trajectory": "t1", "state": "tool", "since": now - 30, "context_tokens": 9},
            {"trajectory": "t2", "state": "tool", "since": 1e300, "context_tokens": 9},
        ],
        "weight_update": {"version": 3, "started_at": now * 1000},
    }
    r = await srv.snapshot(body)
    assert r.status_code == 422, r.text
    assert fields(r) == [(None, "trajectories.1.since"), (None, "weight_update.started_at")]
    r = await srv.snapshot({"ts": 1e15, "trajectories": []})
    assert fields(r) == [(None, "ts")]
    assert srv.handle.resync is True and srv.handle.clock.samples == 0


async def test_the_window_is_a_setting() -> None:
    limits = IngestLimits(max_clock_ahead_seconds=5.0, max_clock_behind_seconds=60.0)
    async with serve(limits) as srv:
        now = time.time()
        assert (await srv.post([queued("a", "t", now + 2)])).status_code == 200
        assert (await srv.post([queued("b", "t", now - 50)])).status_code == 200
        r = await srv.post([queued("c", "t", now + 60)])
        assert r.status_code == 422 and fields(r) == [(0, "ts")]
        r = await srv.post([queued("d", "t", now - 600)])
        assert r.status_code == 422 and fields(r) == [(0, "ts")]
    with pytest.raises(ValueError):
        IngestLimits(max_clock_ahead_seconds=0)


# -- the trainer clock: no single batch evicts live trajectories ------------------------


async def test_one_batch_from_a_clock_far_ahead_does_not_evict_live_trajectories() -> None:
    """A TTL of 10 minutes and a batch whose clock reads 50 minutes ahead (inside the
    window): the estimate may follow it, but eviction runs no faster than real time."""
    async with serve(controller=Controller(make_spec(), ttl_seconds=600)) as srv:
        now = time.time()
        r = await srv.post([queued(f"q{i}", f"t{i}", now) for i in range(5)])
        assert r.status_code == 200
        await srv.handle.tick()
        ahead = now + 3000
        r = await srv.post([queued("x", "tx", ahead)], **{"X-Prorsa-Sent-At": repr(ahead)})
        assert r.status_code == 200, r.text
        decision = await srv.handle.tick()
        live = srv.handle.controller.live_trajectories()
        assert live["ready"] == 6, (decision.at - now, live)
        assert srv.handle.controller.table.anomalies["evicted"] == 0


@pytest.mark.parametrize("ahead_batch", [0, 1], ids=["first", "second"])
async def test_a_clock_far_ahead_in_the_first_batches_does_not_move_the_trainer_clock(
    ahead_batch: int,
) -> None:
    """The first or the second batch stamped almost an hour ahead (inside the window): the
    estimate is not trusted on so few samples, so the tick still runs at the present and
    the live trajectories still count as ready."""
    async with serve() as srv:
        now = time.time()
        for i in range(2):
            sent = now + 3500.0 if i == ahead_batch else now
            batch = [queued(f"q{i}-{k}", f"t{i}-{k}", now) for k in range(3)]
            r = await srv.post(batch, **{"X-Prorsa-Sent-At": repr(sent)})
            assert r.status_code == 200, r.text
        decision = await srv.handle.tick()
        assert decision.at < time.time() + 60.0, decision.at - time.time()
        assert decision.forecast.components.ready == 6 * 1000
        status = (await srv.http.get(f"{BASE}/status", headers=AUTH)).json()
        assert status["clockSkewSeconds"] is None  # not estimated yet


# -- bounded memory: the live-trajectory limit -------------------------------------------


async def test_past_the_trajectory_limit_new_trajectories_get_429_and_nothing_is_dropped() -> None:
    """maxLiveTrajectories 5 with 4 live: a batch that starts three more, moves a live one
    on and ends another applies all but the two that do not fit, and answers 429 with
    Retry-After; resent once a trajectory has ended, it applies the rest."""
    spec = make_spec(trainer={"maxLiveTrajectories": 5})
    async with serve(controller=Controller(spec)) as srv:
        now = time.time()
        r = await srv.post([queued(f"q{i}", f"t{i}", now) for i in range(4)])
        assert r.status_code == 200
        batch = [
            queued("n5", "t5", now),
            queued("n6", "t6", now),
            {"id": "x0", "type": "tool_started", "trajectory": "t0", "ts": now + 1},
            queued("n6b", "t6", now + 1),  # a later event of a refused trajectory
            queued("n7", "t7", now),
            {"id": "d1", "type": "trajectory_dropped", "trajectory": "t1", "ts": now + 1},
        ]
        r = await srv.post(batch)
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert "maxLiveTrajectories (5)" in r.json()["error"]
        table = srv.handle.controller.table
        assert sorted(table._slots) == ["t0", "t2", "t3", "t5"]  # t1 ended: one slot free
        assert srv.handle.controller.live_trajectories()["tool"] == 1
        assert srv.rejects("trajectory_limit") == 1 and srv.handle.limit_hits == 1
        r = await srv.post(batch)  # the SDK resends the whole batch after Retry-After
        assert r.status_code == 429  # t6 fits now, t7 not yet
        assert sorted(table._slots) == ["t0", "t2", "t3", "t5", "t6"]
        assert table.counts[2] == 4  # ready: t2, t3, t5, t6 (t6's later event applied too)
        r = await srv.post([{"id": "d2", "type": "trajectory_dropped", "trajectory": "t2",
                             "ts": now + 2}])  # fmt: skip
        r = await srv.post(batch)
        assert r.status_code == 200, r.text
        assert r.json()["duplicates"] == 5 and r.json()["applied"] == 1
        assert sorted(table._slots) == ["t0", "t3", "t5", "t6", "t7"]


async def test_at_the_limit_the_live_trajectories_still_move_and_end() -> None:
    spec = make_spec(trainer={"maxLiveTrajectories": 3})
    async with serve(controller=Controller(spec)) as srv:
        now = time.time()
        assert (
            await srv.post([queued(f"q{i}", f"t{i}", now) for i in range(3)])
        ).status_code == 200
        moves = [
            {"id": "p0", "type": "prefill_started", "trajectory": "t0", "ts": now + 1},
            {"id": "r1", "type": "reward_finished", "trajectory": "t1", "ts": now + 1,
             "accepted": True},
        ]  # fmt: skip
        r = await srv.post(moves)
        assert r.status_code == 200 and r.json()["applied"] == 2
        assert srv.handle.limit_hits == 0


async def test_a_snapshot_past_the_limit_is_refused_without_touching_the_table() -> None:
    spec = make_spec(trainer={"maxLiveTrajectories": 3})
    async with serve(controller=Controller(spec)) as srv:
        now = time.time()
        assert (await srv.post([queued("q0", "t0", now)])).status_code == 200

        def rows(*names: str) -> list[dict]:
            return [
                {"trajectory": n, "state": "ready", "since": now, "context_tokens": 10}
                for n in names
            ]

        r = await srv.snapshot({"ts": now, "trajectories": rows("a", "b", "c", "d")})
        assert r.status_code == 422 and fields(r) == [(None, "trajectories")]
        assert list(srv.handle.controller.table._slots) == ["t0"] and srv.handle.resync
        # A named emitter's snapshot counts the other emitters' live trajectories too.
        headers = {**AUTH, "X-Prorsa-Emitter": "w1"}
        body = {"ts": now, "trajectories": rows("a", "b", "c")}
        r = await srv.http.post(f"{BASE}/snapshot", json=body, headers=headers)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        body = {"ts": now, "trajectories": rows("a", "b")}
        r = await srv.http.post(f"{BASE}/snapshot", json=body, headers=headers)
        assert r.status_code == 200
        assert sorted(srv.handle.controller.table._slots) == ["a", "b", "t0"]


async def test_snapshots_have_their_own_budget_of_bytes_in_flight() -> None:
    """A snapshot being read holds the snapshot budget until it is loaded: a second one
    waits (429 busy), while event batches still flow."""
    limits = IngestLimits(max_snapshot_bytes=20_000, max_inflight_snapshot_bytes=20_000)
    async with serve(limits) as srv:
        now = time.time()
        rows = [
            {"trajectory": f"s{i}", "state": "ready", "since": now, "context_tokens": 10}
            for i in range(150)
        ]
        body = json.dumps({"ts": now, "trajectories": rows}).encode()
        assert 10_000 < len(body) < 20_000
        url = srv.http.base_url
        _, writer = await asyncio.open_connection(url.host, url.port)
        head = (
            f"POST {BASE}/snapshot HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode() + body[: len(body) // 2])  # and then it stalls
        await writer.drain()
        try:
            while srv.server.inflight_bytes < len(body) // 2:
                await asyncio.sleep(0.01)
            r = await srv.http.post(f"{BASE}/snapshot", content=body, headers=AUTH)
            assert r.status_code == 429, r.text
            assert r.json()["error"].startswith("too many request bodies")
            assert (await srv.post([queued("e", "t", now)])).status_code == 200
        finally:
            writer.close()
