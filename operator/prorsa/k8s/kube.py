"""The few Kubernetes API calls the operator makes, awaitable and never blocking the loop.

The official client is synchronous; every call runs in a worker thread so the webhook and
the control ticks sharing the operator's asyncio loop never stall behind the API server.
Objects travel as plain dicts (the manifests of :mod:`prorsa.k8s.objects`).

A 429 from the API server (its API Priority and Fairness turning a flow away) is honoured
as client-go honours it: no call of this client goes out before the ``Retry-After`` it
named, and the refused call is sent again once that time has passed, at most
:data:`THROTTLE_ATTEMPTS` times in all, then the 429 is raised to the caller (whose next
tick tries again). A refused request was never processed, so sending it again is safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from prorsa.core.spec import GROUP, PLURAL, VERSION
from prorsa.k8s.lws import GROUP as LWS_GROUP
from prorsa.k8s.lws import PLURAL as LWS_PLURAL
from prorsa.k8s.lws import VERSION as LWS_VERSION

T = TypeVar("T")

MERGE = "application/merge-patch+json"
THROTTLE_ATTEMPTS = 3
"""Sends of one call while the API server answers 429 (client-go retries up to 10)."""
DEFAULT_RETRY_AFTER = 1.0
"""Seconds to hold off after a 429 that names no Retry-After (client-go's default too)."""
MAX_RETRY_AFTER = 60.0
"""The longest hold-off honoured from one answer: a misconfigured server cannot stop the
operator for an hour with one header."""

log = logging.getLogger("prorsa.kube")


def retry_after(exc: ApiException) -> float:
    """Seconds a 429 asks the client to wait (``Retry-After`` in seconds; the HTTP-date
    form is not used by the API server)."""
    headers = exc.headers or {}
    raw = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        seconds = float(raw) if raw is not None else DEFAULT_RETRY_AFTER
    except ValueError:
        seconds = DEFAULT_RETRY_AFTER
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


class Throttle:
    """The time before which no call goes out, shared by every call of one client: one
    429 holds them all, as the API server's refusal is about the client's flow, not one
    request."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.not_before = 0.0
        self.refusals = 0  # 429 answers seen, for the operator's metrics and tests

    def hold(self, seconds: float) -> None:
        self.refusals += 1
        self.not_before = max(self.not_before, self._clock() + seconds)

    async def wait(self) -> None:
        while (delay := self.not_before - self._clock()) > 0:
            await asyncio.sleep(delay)


class Kube:
    """Async facade over ``kubernetes.client`` for pods, services, secrets, LeaderWorkerSets
    and the CR."""

    def __init__(self, api: client.ApiClient | None = None) -> None:
        self.api = api or client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.rbac = client.RbacAuthorizationV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        # LeaderWorkerSets only, on an attribute of their own: the chart's RBAC test finds the
        # operator's API calls by attribute, and these are granted apart (rbac.yaml).
        self.lws = client.CustomObjectsApi(self.api)
        self.coordination = client.CoordinationV1Api(self.api)  # the leader's Lease
        self.throttle = Throttle()

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        for attempt in range(1, THROTTLE_ATTEMPTS + 1):
            await self.throttle.wait()
            try:
                return await asyncio.to_thread(fn, *args, **kwargs)
            except ApiException as exc:
                if exc.status != 429:
                    raise
                seconds = retry_after(exc)
                self.throttle.hold(seconds)
                log.warning(
                    "the API server throttled %s (429, attempt %d of %d): no call for %.1fs",
                    getattr(fn, "__name__", "a call"), attempt, THROTTLE_ATTEMPTS, seconds,
                )  # fmt: skip
                if attempt == THROTTLE_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")  # the loop returns or raises

    def _plain(self, obj: Any) -> dict[str, Any]:
        return obj if isinstance(obj, dict) else self.api.sanitize_for_serialization(obj)

    async def call(self, fn: Callable[..., object], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Any other call of this client's APIs (``core``, ``apps``, ``custom``, ...), in a
        worker thread; the object it answers as plain JSON data.

        For the callers that share the client but are not the operator: the lab's fakes of
        other Kubernetes components (kubelet, LeaderWorkerSet controller), the demo and
        tests. The operator's own calls are the methods below, where the chart's RBAC test
        finds them.
        """
        return self._plain(await self._call(fn, *args, **kwargs))

    # -- pods ---------------------------------------------------------------------------------

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        result = await self._call(self.core.list_namespaced_pod, namespace, label_selector=selector)
        return [self._plain(p) for p in result.items]

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._plain(await self._call(self.core.read_namespaced_pod, name, namespace))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self._call(self.core.patch_namespaced_pod, name, namespace, patch)

    async def delete_pod(self, namespace: str, name: str) -> None:
        try:
            await self._call(self.core.delete_namespaced_pod, name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    # -- generic create-if-missing ---------------------------------------------------------------

    async def ensure(self, obj: dict[str, Any]) -> bool:
        """Create ``obj`` unless an object of that kind and name exists; True if created."""
        create, read = self._verbs(obj)
        ns, name = obj["metadata"].get("namespace"), obj["metadata"]["name"]
        try:
            await self._call(read, name, ns)
            return False
        except ApiException as exc:
            if exc.status != 404:
                raise
        try:
            await self._call(create, ns, obj)
        except ApiException as exc:
            if exc.status != 409:  # created meanwhile by someone else: fine
                raise
            return False
        return True

    def _verbs(self, obj: dict[str, Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
        kind = obj["kind"]
        table: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
            "Pod": (self.core.create_namespaced_pod, self.core.read_namespaced_pod),
            "Service": (self.core.create_namespaced_service, self.core.read_namespaced_service),
            "Secret": (self.core.create_namespaced_secret, self.core.read_namespaced_secret),
            "ConfigMap": (
                self.core.create_namespaced_config_map,
                self.core.read_namespaced_config_map,
            ),
            "ServiceAccount": (
                self.core.create_namespaced_service_account,
                self.core.read_namespaced_service_account,
            ),
            "Deployment": (
                self.apps.create_namespaced_deployment,
                self.apps.read_namespaced_deployment,
            ),
            "Role": (self.rbac.create_namespaced_role, self.rbac.read_namespaced_role),
            "RoleBinding": (
                self.rbac.create_namespaced_role_binding,
                self.rbac.read_namespaced_role_binding,
            ),
        }
        try:
            return table[kind]
        except KeyError:
            raise ValueError(f"unsupported kind {kind}") from None

    # -- secrets and config maps -------------------------------------------------------------------

    async def read_secret_key(self, namespace: str, name: str, key: str) -> str | None:
        import base64

        try:
            secret = await self._call(self.core.read_namespaced_secret, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        data = (secret.data or {}).get(key)
        if data is not None:
            return base64.b64decode(data).decode()
        string_data = getattr(secret, "string_data", None) or {}
        return string_data.get(key)

    async def read_config_map(self, namespace: str, name: str) -> dict[str, str] | None:
        try:
            cm = await self._call(self.core.read_namespaced_config_map, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(cm.data or {})

    async def write_config_map(
        self, namespace: str, name: str, data: dict[str, str], *, labels: dict[str, str]
    ) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "data": data,
        }
        try:
            await self._call(self.core.patch_namespaced_config_map, name, namespace, body)
        except ApiException as exc:
            if exc.status != 404:
                raise
            await self._call(self.core.create_namespaced_config_map, namespace, body)

    # -- LeaderWorkerSets (prorsa.k8s.lws) --------------------------------------------------------

    async def list_leader_worker_sets(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        found = await self._call(
            self.lws.list_namespaced_custom_object,
            LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, label_selector=selector,
        )  # fmt: skip
        return list(self._plain(found).get("items") or [])

    async def create_leader_worker_set(self, namespace: str, body: dict[str, Any]) -> bool:
        """Create the set; False when one of that name exists already."""
        try:
            await self._call(
                self.lws.create_namespaced_custom_object,
                LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, body,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 409:
                raise
            return False
        return True

    async def delete_leader_worker_set(self, namespace: str, name: str) -> None:
        try:
            await self._call(
                self.lws.delete_namespaced_custom_object,
                LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, name,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 404:
                raise

    # -- the leader's Lease (prorsa.k8s.leader) ---------------------------------------------------

    async def read_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            found = await self._call(self.coordination.read_namespaced_lease, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self._plain(found)

    async def create_lease(self, namespace: str, body: dict[str, Any]) -> bool:
        """Create the Lease; False when one of that name exists already (someone was first)."""
        try:
            await self._call(self.coordination.create_namespaced_lease, namespace, body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            return False
        return True

    async def replace_lease(self, namespace: str, body: dict[str, Any]) -> bool:
        """Write the Lease if nobody wrote it since ``body``'s resourceVersion; else False."""
        try:
            await self._call(
                self.coordination.replace_namespaced_lease,
                body["metadata"]["name"], namespace, body,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 409:
                raise
            return False
        return True

    # -- the custom resource -----------------------------------------------------------------------

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await self._call(
            self.custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"status": status},
        )
