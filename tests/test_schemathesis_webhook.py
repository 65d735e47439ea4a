"""Property-based fuzzing of the live webhook from its own ``/openapi.json`` (schemathesis).

The server runs on loopback in a background thread, with the real Controller. Every
operation in the document gets a bounded number of generated requests, valid and invalid
(negative testing), with the right token and the served cluster's path most of the time,
so the generated bodies reach validation and the Controller. The checks: no 5xx ever, and
every response conforms to the document (status code, content type, body schema).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
from conftest import make_spec
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from prorsa.clusters import ClusterRegistry, WebhookCluster
from prorsa.core.controller import Controller
from prorsa.ingest import WebhookServer
from prorsa.ingest.openapi import SENT_AT_HEADER

TOKEN = "fuzz-token"
MAX_EXAMPLES = 25  # per operation and mode: ~500 requests in all


@schemathesis.serializer("application/x-ndjson")
def _ndjson(ctx: Any, value: Any) -> bytes:
    """Generated NDJSON bodies: strings as they are, anything else one JSON value per line."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    items = value if isinstance(value, list) else [value]
    return "\n".join(json.dumps(v) for v in items).encode()


@dataclass
class Live:
    url: str
    handle: WebhookCluster


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    loop = asyncio.new_event_loop()
    registry = ClusterRegistry()
    handle = registry.add(namespace="rl", name="c", token=TOKEN, controller=Controller(make_spec()))
    server = WebhookServer(registry)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    running = asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    asyncio.run_coroutine_threadsafe(handle.tick(now=time.time()), loop).result(10)
    yield Live(url=running.url, handle=handle)
    asyncio.run_coroutine_threadsafe(running.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


_TIMES = frozenset({"ts", "since", "started_at"})


def _into_the_window(value: Any, now: float) -> Any:
    """Schema-valid times made plausible: within the hour before ``now``.

    The webhook refuses times outside a window around its own clock (422), which no JSON
    Schema keyword can state; a generated ``ts`` of 0 or 1e300 is valid to the document
    and refused by the server, so positive cases are moved into the window first. Every
    other value is sent as generated: whole-number floats for integer fields included,
    which the server must accept as JSON Schema does.
    """
    if isinstance(value, list):
        return [_into_the_window(v, now) for v in value]
    if isinstance(value, dict):
        return {
            k: now - float(v) % 3600.0
            if k in _TIMES and type(v) in (int, float)
            else _into_the_window(v, now)
            for k, v in value.items()
        }
    return value


def _operations(live: Live) -> list[Any]:
    """The operations of the document the live server serves (not a local copy)."""
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize(
    ("mode", "aimed"),
    [
        (GenerationMode.POSITIVE, True),
        (GenerationMode.NEGATIVE, True),
        (GenerationMode.POSITIVE, False),
    ],
    ids=["valid-data", "invalid-data", "random-paths"],
)
def test_webhook_never_answers_5xx_and_matches_its_document(
    live: Live, mode: GenerationMode, aimed: bool
) -> None:
    operations = _operations(live)
    cluster = "/v1/namespaces/{namespace}/rolloutclusters/{name}"
    assert {o.label for o in operations} >= {
        f"POST {cluster}/events",
        f"POST {cluster}/snapshot",
        f"GET {cluster}/forecast",
        f"GET {cluster}/status",
        "GET /healthz",
        "GET /metrics",
    }
    auth = {"Authorization": f"Bearer {TOKEN}"}
    fuzzed: set[str] = set()
    for operation in operations:
        params = {}
        if aimed and "{namespace}" in operation.path:
            params = {"namespace": "rl", "name": "c"}
        strategy = operation.as_strategy(mode, path_parameters=params or None)

        @given(case=strategy)
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case: Any) -> None:
            if mode is GenerationMode.POSITIVE:
                now = time.time()
                case.body = _into_the_window(case.body, now)
                if case.headers and SENT_AT_HEADER in case.headers:
                    case.headers[SENT_AT_HEADER] = repr(now)
            # Explicit credentials: schemathesis also probes without and with a wrong token
            # and expects 401 (its ignored_auth check), besides all its default checks.
            response = case.call_and_validate(base_url=live.url, headers=auth, timeout=10)
            assert response.status_code < 500
            fuzzed.add(case.operation.label)

        try:
            fuzz()
        except Unsatisfiable:
            # Nothing invalid can be written for it (no body, fixed path): nothing to send.
            assert mode is GenerationMode.NEGATIVE
    assert {f"POST {cluster}/events", f"POST {cluster}/snapshot"} <= fuzzed


def test_the_fuzzer_reached_the_controller(live: Live) -> None:
    """Guard against a fuzz run that only ever hit 401/404: some batches must apply."""
    assert live.handle.batches > 0
