"""The few Kubernetes API calls the operator makes, awaitable and never blocking the loop.

The official client is synchronous; every call runs in a worker thread so the webhook and
the control ticks sharing the operator's asyncio loop never stall behind the API server.
Objects travel as plain dicts (the manifests of :mod:`prorsa.k8s.objects`).
"""

from __future__ import annotations

import asyncio
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

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

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
