"""The emulator's admission webhooks: validating and mutating, by ``clientConfig.url``.

Webhook configurations stored in the emulator are matched against each HTTP write
(operations, resources, namespace selector) and called as an API server calls them.
"""

from __future__ import annotations

import base64
import copy
import json
import ssl
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
import aiohttp.web
import attrs
import kmock

from prorsa_lab.doubles.kube.errors import ApiError
from prorsa_lab.doubles.kube.label_selectors import LabelSelector
from prorsa_lab.doubles.kube.patch import PatchError, json_patch
from prorsa_lab.doubles.kube.pods import PodLifecycle
from prorsa_lab.doubles.kube.resources import (
    NAMESPACES_KEY,
    WEBHOOK_KEYS,
)
from prorsa_lab.doubles.kube.store import (
    Pending,
    metadata_of,
)


def _glob_in(value: str, allowed: Iterable[str] | None) -> bool:
    allowed = list(allowed or [])
    return "*" in allowed or value in allowed


@attrs.define(kw_only=True)
class Admission(PodLifecycle):
    """Validating and mutating admission webhooks, called for HTTP writes."""

    def _webhooks(self, kind: str) -> list[dict[str, Any]]:
        if self._hooks is None:
            hooks: dict[str, list[dict[str, Any]]] = {"mutating": [], "validating": []}
            for key, flavour in WEBHOOK_KEYS.items():
                for _, config in self._iter(self._specs[key]):
                    hooks[flavour] += [copy.deepcopy(w) for w in config.get("webhooks") or []]
            self._hooks = hooks
        return self._hooks[kind]

    def _hook_matches(self, hook: Mapping[str, Any], pending: Pending) -> bool:
        spec = pending.spec
        for rule in hook.get("rules") or []:
            ops = rule.get("operations") or []
            if "*" not in ops and pending.operation not in ops:
                continue
            if not _glob_in(spec.group, rule.get("apiGroups")):
                continue
            if not _glob_in(spec.version, rule.get("apiVersions")):
                continue
            wanted = spec.plural + (f"/{pending.subresource}" if pending.subresource else "")
            resources = rule.get("resources") or []
            if not any(
                r in ("*", "*/*", wanted) or (r == f"{spec.plural}/*" and pending.subresource)
                for r in resources
            ):
                continue
            scope = rule.get("scope", "*")
            if scope == "Namespaced" and not spec.namespaced:
                continue
            if scope == "Cluster" and spec.namespaced:
                continue
            break
        else:
            return False
        selector = hook.get("objectSelector")
        if selector and not LabelSelector.from_dict(selector).matches(pending.new):
            return False
        selector = hook.get("namespaceSelector")
        if selector and spec.namespaced and pending.namespace:
            ns = self._current(self._specs[NAMESPACES_KEY], None, pending.namespace) or {}
            if not LabelSelector.from_dict(selector).matches(ns):
                return False
        return True

    async def _admit(self, pending: Pending, request: kmock.Request, *, dry_run: bool) -> None:
        """Call the mutating, then the validating webhooks (``clientConfig.url`` only)."""
        for flavour in ("mutating", "validating"):
            with self._state:
                hooks = [h for h in self._webhooks(flavour) if self._hook_matches(h, pending)]
            for hook in hooks:
                await self._call_webhook(hook, pending, flavour, dry_run=dry_run)

    async def _call_webhook(
        self, hook: Mapping[str, Any], pending: Pending, flavour: str, *, dry_run: bool
    ) -> None:
        spec = pending.spec
        client_config = hook.get("clientConfig") or {}
        url = client_config.get("url")
        fail_closed = hook.get("failurePolicy", "Fail") == "Fail"
        review_uid = str(uuid.uuid4())
        gvk = {"group": spec.group, "version": spec.version, "kind": spec.kind}
        gvr = {"group": spec.group, "version": spec.version, "resource": spec.plural}
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": review_uid,
                "kind": gvk,
                "resource": gvr,
                "requestKind": gvk,
                "requestResource": gvr,
                "subResource": pending.subresource,
                "name": pending.name,
                "namespace": pending.namespace,
                "operation": pending.operation,
                "userInfo": {"username": "emulator-user", "groups": ["system:authenticated"]},
                "object": pending.new,
                "oldObject": pending.old,
                "dryRun": dry_run,
                "options": {
                    "kind": f"{pending.operation.title()}Options",
                    "apiVersion": "meta.k8s.io/v1",
                },
            },
        }
        denial = f'admission webhook "{hook.get("name")}" denied the request'
        try:
            if not url:
                raise ValueError("only clientConfig.url webhooks can be reached from the emulator")
            ssl_context: ssl.SSLContext | bool = False
            if url.startswith("https://"):
                ca = client_config.get("caBundle")
                ssl_context = ssl.create_default_context(
                    cadata=base64.b64decode(ca).decode() if ca else None
                )
            timeout = aiohttp.ClientTimeout(total=float(hook.get("timeoutSeconds", 10)))
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(url, json=review, ssl=ssl_context) as reply,
            ):
                reply.raise_for_status()
                answer = (await reply.json()).get("response") or {}
        except (aiohttp.ClientError, TimeoutError, ValueError, ssl.SSLError) as exc:
            if not fail_closed:
                return
            raise ApiError(
                500,
                "InternalError",
                f'Internal error occurred: failed calling webhook "{hook.get("name")}": {exc}',
            ) from None
        if not answer.get("allowed"):
            status = answer.get("status") or {}
            message = status.get("message") or "denied"
            raise ApiError(
                int(status.get("code") or 400),
                status.get("reason") or "BadRequest",
                f"{denial}: {message}",
            )
        patch = answer.get("patch")
        if flavour == "mutating" and patch:
            try:
                ops = json.loads(base64.b64decode(patch))
                mutated = json_patch(pending.new, ops)
            except (ValueError, PatchError) as exc:
                raise ApiError(
                    500, "InternalError", f'webhook "{hook.get("name")}" sent a bad patch: {exc}'
                ) from None
            with self._state:
                if pending.old is None:
                    replanned = mutated
                    replanned["metadata"] = {**pending.new["metadata"], **metadata_of(mutated)}
                    self._check_metadata(spec, replanned)
                    pending.new = self._apply_schema(spec, replanned)
                else:
                    redo = self._merge_update(
                        spec,
                        pending.namespace,
                        pending.name,
                        pending.old,
                        mutated,
                        pending.subresource,
                        require_rv=False,
                    )
                    pending.new, pending.noop = redo.new, redo.noop
