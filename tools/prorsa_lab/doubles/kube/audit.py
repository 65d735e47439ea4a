"""The emulator's audit log: every API request as the (user, verb, resource, namespace) an
RBAC authorizer would judge, so a test can hold a client's real calls against a role.

Users are told apart by bearer token (``KubeEmulator.users``); verbs follow the API server's
mapping of HTTP methods (``get`` and ``list`` by whether a name is given, ``watch`` for
``?watch=true`` and ``/watch/`` paths, ``deletecollection`` for a DELETE without a name).
Discovery and other non-resource paths (``/api``, ``/apis``, ``/version``) are not logged:
RBAC grants them to every authenticated user.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from prorsa_contract.bearer import bearer_token

UNKNOWN_USER = "unknown"


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiCall:
    user: str
    verb: str
    group: str  # "" for the core group
    resource: str  # the plural, with "/<subresource>" when there is one
    namespace: str | None  # None: cluster-scoped, or across all namespaces


def verb_of(method: str, *, named: bool, watch: bool) -> str | None:
    """The RBAC verb of one resource request; None for methods RBAC does not name."""
    method = method.upper()
    if method == "GET":
        return "watch" if watch else ("get" if named else "list")
    if method == "DELETE":
        return "delete" if named else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method)


def user_of(authorization: str | None, users: Mapping[str, str]) -> str:
    token = bearer_token(authorization)
    return UNKNOWN_USER if token is None else users.get(token, UNKNOWN_USER)


def api_call(
    *, method: str, path: str, query: Mapping[str, str], authorization: str | None,
    users: Mapping[str, str],
) -> ApiCall | None:  # fmt: skip
    """The audit record of one request, or None for a non-resource path."""
    parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
    if len(parts) >= 3 and parts[0] == "api":
        group, rest = "", parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        return None
    watch = query.get("watch") in ("true", "1")
    if rest[:1] == ["watch"]:
        watch, rest = True, rest[1:]
    namespace = None
    # /api/v1/namespaces/{name}[/status|/finalize] is the Namespace itself, not a scope.
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    if not rest:
        return None
    resource = rest[0] + ("/" + "/".join(rest[2:]) if len(rest) > 2 else "")
    verb = verb_of(method, named=len(rest) > 1, watch=watch)
    if verb is None:
        return None
    return ApiCall(
        user=user_of(authorization, users),
        verb=verb,
        group=group,
        resource=resource,
        namespace=namespace,
    )
