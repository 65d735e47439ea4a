"""``GET /openapi.json``: the webhook's OpenAPI 3.1 document, generated from the models.

Schemas come from the same pydantic models that validate requests and build replies, so
the document cannot drift from the server (the schemathesis test holds it to that).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic.json_schema import models_json_schema

from prorsa import __version__
from prorsa.clusters.limits import IngestLimits
from prorsa.core.decision import Decision
from prorsa.ingest.wire import BatchReply, ClusterStatus, ErrorReply, Health, SnapshotReply
from prorsa_contract.events import EMITTER_HEADER, EMITTER_PATTERN, EventBatch, Snapshot

CLUSTER_PATH = "/v1/namespaces/{namespace}/rolloutclusters/{name}"
SENT_AT_HEADER = "X-Prorsa-Sent-At"
NDJSON_TYPES = ("application/x-ndjson", "application/jsonl", "application/x-jsonlines")
_REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _error(description: str, **headers: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": _ref("ErrorReply")}},
    }
    if headers:
        out["headers"] = headers
    return out


_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying.",
        "schema": {"type": "integer", "minimum": 1},
    }
}
_WWW_AUTH = {"WWW-Authenticate": {"schema": {"type": "string"}}}

_CLUSTER_PARAMS = [
    {
        "name": "namespace",
        "in": "path",
        "required": True,
        "description": "The RolloutCluster's namespace.",
        "schema": {"type": "string", "minLength": 1},
    },
    {
        "name": "name",
        "in": "path",
        "required": True,
        "description": "The RolloutCluster's name.",
        "schema": {"type": "string", "minLength": 1},
    },
]

_DEFAULTS = IngestLimits()
WINDOW_RULE = (
    "Times (`ts`, a snapshot's `since` and `started_at`, and the `X-Prorsa-Sent-At` "
    "header) are unix seconds within the server's window of plausible times, by default "
    f"from {_DEFAULTS.max_clock_behind_seconds:g} s behind to "
    f"{_DEFAULTS.max_clock_ahead_seconds:g} s ahead of its own clock (settings "
    "`max_clock_behind_seconds`, `max_clock_ahead_seconds`); a time outside it (milliseconds, "
    "seconds since the trainer started, a broken clock) is refused with 422 naming the field."
)
INTEGER_RULE = (
    "Numbers are not coerced: a string or a boolean is never a number. An integer field "
    "takes a whole number written as a float (`3.0`, `1e3`) as that integer, as JSON "
    "Schema's `integer` does; a fraction (`3.5`) is refused with 422."
)

_SENT_AT_PARAM = {
    "name": SENT_AT_HEADER,
    "in": "header",
    "required": False,
    "description": "The client's clock (unix seconds) when it sent the request; sharpens the "
    "server's estimate of the trainer clock offset. Without it the newest event ts is used. "
    "Outside the window of plausible times (see the operation): 422 naming "
    f"`{SENT_AT_HEADER}`; not a number: 400.",
    "schema": {"type": "number", "minimum": 0},
}

_EMITTER_PARAM = {
    "name": EMITTER_HEADER,
    "in": "header",
    "required": False,
    "description": "Which of the trainer's emitters sends this (one per worker, for "
    "trainers that run several): a stable id, such as the worker's rank. Each trajectory "
    "belongs to the emitter that reported it last; a snapshot with this header replaces "
    "that emitter's trajectories alone, and `resync` in a reply concerns the emitter that "
    "asked. Without it nothing changes: a snapshot replaces every trajectory. At most "
    "4096 distinct ids per cluster; malformed, or one too many: 422 naming "
    f"`{EMITTER_HEADER}`.",
    "schema": {"type": "string", "pattern": f"^{EMITTER_PATTERN}$"},
}

_UNAUTHORIZED = _error(
    "Missing or wrong bearer token. A token that no served cluster holds gets 401 whether "
    "or not the cluster exists.",
    **_WWW_AUTH,
)

_BODY_ERRORS = {
    "400": _error(
        "Unreadable: not JSON (or NDJSON), not UTF-8, a body its Content-Encoding cannot "
        "decode, or a malformed header."
    ),
    "401": _UNAUTHORIZED,
    "404": _error("No such RolloutCluster is served here (told only to a valid token)."),
    "408": _error(
        "The body did not arrive within the server's body deadline "
        f"({_DEFAULTS.body_timeout_seconds:g} s by default); the connection is closed."
    ),
    "413": _error("The body is over the size limit."),
    "422": _error(
        "Some events do not validate, or a time is outside the window of plausible times; "
        "`errors` names the index (null: the body or a header) and field of each."
    ),
    "429": _error(
        "The cluster's queue is full, or the server holds too many request bodies; or the "
        "cluster holds spec.trainer.maxLiveTrajectories live trajectories: the events that "
        "would start new ones (and their trajectories' later events) were not applied, the "
        "others were. Retry (the whole batch: event ids make it safe) after Retry-After "
        "seconds.",
        **_RETRY_AFTER,
    ),
}

_READ_ERRORS = {
    "401": _UNAUTHORIZED,
    "404": _error("No such RolloutCluster (or, for forecast, no Decision yet)."),
}


@cache
def openapi_document() -> dict[str, Any]:
    """The whole document (cached: it depends on the models only)."""
    _, defs = models_json_schema(
        [
            (EventBatch, "validation"),
            (Snapshot, "validation"),
            (BatchReply, "serialization"),
            (SnapshotReply, "serialization"),
            (ErrorReply, "serialization"),
            (ClusterStatus, "serialization"),
            (Decision, "serialization"),
            (Health, "serialization"),
        ],
        ref_template=_REF,
    )
    secured: list[dict[str, list[str]]] = [{"bearerAuth": []}]
    events_op = {
        "operationId": "postEvents",
        "summary": "Post a batch of trajectory lifecycle events.",
        "description": "The batch is validated whole and applied whole, or refused whole "
        "(except at the cluster's live-trajectory limit: see 429). "
        'Send JSON `{"events": [...]}` or one event per line (NDJSON). Event ids are '
        "idempotency keys: a replayed id is counted in `duplicates` and not applied again. "
        "When the reply says `resync: true`, POST a snapshot before more events. "
        "Trajectory events name their `trajectory`; the cluster events "
        "`weight_update_started` and `weight_update_finished` name none (they concern every "
        "live trajectory: a weight update flushes every prefix cache, and the live contexts "
        f"re-prefill once it ends). {INTEGER_RULE} {WINDOW_RULE}",
        "security": secured,
        "parameters": [_SENT_AT_PARAM, _EMITTER_PARAM],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": _ref("EventBatch")},
                "application/x-ndjson": {
                    "schema": {
                        **defs["$defs"]["EventBatch"]["properties"]["events"],
                        "description": "The events, serialized one JSON object per line "
                        "(newline-delimited), not as a JSON array.",
                    }
                },
            },
        },
        "responses": {
            "200": {
                "description": "Accepted and applied.",
                "content": {"application/json": {"schema": _ref("BatchReply")}},
            },
            **_BODY_ERRORS,
        },
    }
    snapshot_op = {
        "operationId": "postSnapshot",
        "summary": "Replace the server's view with every live trajectory (resync).",
        "description": "Events stamped before the snapshot's `ts` that arrive later are "
        "counted as `superseded` and not applied: the snapshot already reflects them. With "
        f"`{EMITTER_HEADER}`, the snapshot lists that emitter's live trajectories and "
        "replaces only the ones it reported last (and supersedes only its own earlier "
        "trajectory events); a weight update it does not mention stays as known. "
        f"{INTEGER_RULE} {WINDOW_RULE}",
        "security": secured,
        "parameters": [_SENT_AT_PARAM, _EMITTER_PARAM],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref("Snapshot")}},
        },
        "responses": {
            "200": {
                "description": "Loaded; `resync` is now false (for that emitter, with "
                f"`{EMITTER_HEADER}`).",
                "content": {"application/json": {"schema": _ref("SnapshotReply")}},
            },
            **_BODY_ERRORS,
        },
    }
    forecast_op = {
        "operationId": "getForecast",
        "summary": "The latest Decision of the cluster's Controller.",
        "security": secured,
        "responses": {
            "200": {
                "description": "The latest Decision.",
                "content": {"application/json": {"schema": _ref("Decision")}},
            },
            **_READ_ERRORS,
        },
    }
    status_op = {
        "operationId": "getStatus",
        "summary": "Epoch, resync flag, clock skew, counts and live trajectories.",
        "security": secured,
        "responses": {
            "200": {
                "description": "The cluster as the webhook sees it.",
                "content": {"application/json": {"schema": _ref("ClusterStatus")}},
            },
            **_READ_ERRORS,
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Prorsa trainer webhook",
            "version": __version__,
            "description": "Trajectory lifecycle events from an RL trainer to the Prorsa "
            "controller (the webhook contract; see docs/webhook-events.md).",
        },
        "paths": {
            f"{CLUSTER_PATH}/events": {"parameters": _CLUSTER_PARAMS, "post": events_op},
            f"{CLUSTER_PATH}/snapshot": {"parameters": _CLUSTER_PARAMS, "post": snapshot_op},
            f"{CLUSTER_PATH}/forecast": {"parameters": _CLUSTER_PARAMS, "get": forecast_op},
            f"{CLUSTER_PATH}/status": {"parameters": _CLUSTER_PARAMS, "get": status_op},
            "/healthz": {
                "get": {
                    "operationId": "getHealth",
                    "summary": "Liveness.",
                    "responses": {
                        "200": {
                            "description": "Serving.",
                            "content": {"application/json": {"schema": _ref("Health")}},
                        }
                    },
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "getMetrics",
                    "summary": "Prometheus metrics (prorsa_webhook_*); `prorsa ingest` only: "
                    "the operator serves them on a port of its own (8788).",
                    "responses": {
                        "200": {
                            "description": "Prometheus text exposition format.",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "operationId": "getOpenApi",
                    "summary": "This document.",
                    "responses": {
                        "200": {
                            "description": "OpenAPI 3.1.",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": defs["$defs"],
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }
