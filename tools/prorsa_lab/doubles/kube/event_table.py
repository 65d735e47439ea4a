"""The columns ``kubectl get events`` prints, rendered as the real API server renders them.

kubectl asks the server for a ``meta.k8s.io/v1`` Table and prints its cells as they come,
so an emulator that answered with the generic Name/Age table would show a user nothing of
what happened. The real server's event printer (Kubernetes ``pkg/printers/internalversion``)
fills every column, the wide ones included, and kubectl hides those of priority 1 unless
``-o wide`` is asked for; this module follows the same rules: the age columns fall back from
``lastTimestamp`` to ``firstTimestamp`` to ``eventTime``, a missing ``count`` reads as 1,
and the source falls back to ``reportingController``/``reportingComponent``.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

__all__ = ["EVENTS_KEY", "event_columns", "event_row", "human_age"]

EVENTS_KEY = ("", "v1", "events")


def _column(name: str, kind: str = "string", *, priority: int = 0, fmt: str = "") -> dict[str, Any]:
    return {"name": name, "type": kind, "format": fmt, "priority": priority, "description": ""}


def event_columns() -> list[dict[str, Any]]:
    """LAST SEEN, TYPE, REASON, OBJECT, MESSAGE; SUBOBJECT, SOURCE, FIRST SEEN, COUNT and NAME
    with ``-o wide``."""
    return [
        _column("Last Seen"),
        _column("Type"),
        _column("Reason"),
        _column("Object"),
        _column("Subobject", priority=1),
        _column("Source", priority=1),
        _column("Message"),
        _column("First Seen", priority=1),
        _column("Count", "integer", priority=1),
        _column("Name", priority=1, fmt="name"),
    ]


def _parse(timestamp: object) -> datetime.datetime | None:
    """RFC 3339 with or without fractions and with ``Z`` or an offset, as kopf and client-go
    write them; None for anything else."""
    if not isinstance(timestamp, str) or not timestamp:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(timestamp)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)


def human_age(timestamp: object, now: datetime.datetime) -> str:
    """Kubernetes' ``HumanDuration`` of ``now - timestamp`` (``45s``, ``3m12s``, ``2h``)."""
    then = _parse(timestamp)
    if then is None:
        return "<unknown>"
    seconds = int((now - then).total_seconds())
    if seconds < -1:
        return "<invalid>"
    seconds = max(seconds, 0)
    minutes, hours = seconds // 60, seconds // 3600
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    return f"{hours // 24}d"


def _source(event: Mapping[str, Any]) -> str:
    source = event.get("source") or {}
    component = source.get("component") or ""
    if component:
        host = source.get("host") or ""
        return f"{component}, {host}" if host else component
    controller = event.get("reportingController") or event.get("reportingComponent") or ""
    instance = event.get("reportingInstance") or ""
    return f"{controller}, {instance}" if controller and instance else controller


def event_row(event: Mapping[str, Any], now: datetime.datetime) -> list[Any]:
    """One row in the order of :func:`event_columns`."""
    first = event.get("firstTimestamp") or event.get("eventTime")
    first_seen = human_age(first, now)
    series = event.get("series") or {}
    if series:
        last_seen = human_age(series.get("lastObservedTime"), now)
        count = int(series.get("count") or 1)
    else:
        last = event.get("lastTimestamp")
        last_seen = human_age(last, now) if last else first_seen
        count = int(event.get("count") or 1)
    involved = event.get("involvedObject") or {}
    kind = str(involved.get("kind") or "").lower()
    target = f"{kind}/{involved['name']}" if involved.get("name") else kind
    return [
        last_seen,
        event.get("type") or "",
        event.get("reason") or "",
        target,
        involved.get("fieldPath") or "",
        _source(event),
        str(event.get("message") or "").strip(),
        first_seen,
        count,
        (event.get("metadata") or {}).get("name", ""),
    ]
