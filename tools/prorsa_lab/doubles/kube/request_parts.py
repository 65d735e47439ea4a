"""Request helpers of the emulator: API paths parsed, headers read case-insensitively."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

import kmock


@dataclass(frozen=True, slots=True)
class ApiPath:
    group: str
    version: str
    plural: str | None
    namespace: str | None
    name: str | None
    subresource: str | None
    watch: bool


def parse_api_path(path: str) -> ApiPath | None:
    """Parse an API path, including the ``/api/v1/namespaces[/{name}[/status]]`` forms."""
    parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    watch = False
    if rest[:1] == ["watch"]:
        watch, rest = True, rest[1:]
    namespace = None
    if (
        len(rest) >= 3
        and rest[0] == "namespaces"
        and not (len(rest) == 3 and rest[2] in ("status", "finalize"))
    ):
        namespace, rest = rest[1], rest[2:]
    plural = rest[0] if rest else None
    name = rest[1] if len(rest) > 1 else None
    subresource = "/".join(rest[2:]) or None
    return ApiPath(group, version, plural, namespace, name, subresource, watch)


def request_header(request: kmock.Request, name: str) -> str | None:
    """A request header, looked up case-insensitively (kmock keeps them in a plain dict)."""
    raw = request._raw_request
    if raw is not None:
        return raw.headers.get(name)
    wanted = name.lower()
    return next((v for k, v in request.headers.items() if k.lower() == wanted), None)
