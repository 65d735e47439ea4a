"""The emulator's pod lifecycle: no kubelet, so tests and the demo move pods along.

With ``pod_startup_seconds`` a new pod is scheduled, gets an IP and turns Running by
itself; :meth:`PodLifecycle.set_pod_status` sets any phase and condition by hand.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from prorsa_lab.doubles.kube.errors import ApiError
from prorsa_lab.doubles.kube.objects import ObjectApi
from prorsa_lab.doubles.kube.resources import (
    PODS_KEY,
)
from prorsa_lab.doubles.kube.store import (
    metadata_of,
    timestamp_now,
)


@attrs.define(kw_only=True)
class PodLifecycle(ObjectApi):
    """Pod phases, IPs and conditions, set by hand or after ``pod_startup_seconds``."""

    def _schedule_pod_start(self, pod: Mapping[str, Any]) -> None:
        delay, loop = self.pod_startup_seconds, self._loop
        if delay is None or loop is None or loop.is_closed():
            return
        meta = metadata_of(pod)
        args = (meta["namespace"], meta["name"], meta["uid"])

        def later() -> None:
            loop.call_later(delay, self._auto_start, *args)

        if threading.get_ident() == self._loop_thread:
            later()
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(later)

    def _auto_start(self, namespace: str, name: str, uid: str) -> None:
        with self._state:
            pod = self._current(self._specs[PODS_KEY], namespace, name)
            if (
                pod is None
                or metadata_of(pod).get("uid") != uid
                or metadata_of(pod).get("deletionTimestamp")
            ):
                return
            if (pod.get("status") or {}).get("phase") != "Pending":
                return
            self.set_pod_status(namespace, name, phase="Running")

    def set_pod_status(
        self,
        namespace: str,
        name: str,
        *,
        phase: Literal["Pending", "Running", "Succeeded", "Failed", "Unknown"] = "Running",
        ready: bool | None = None,
        pod_ip: str | None = None,
        restarts: int = 0,
        reason: str | None = None,
        message: str | None = None,
    ) -> dict[str, Any]:
        """Write a pod's status as a kubelet would (conditions, container statuses, IP).

        ``ready`` defaults to ``phase == 'Running'``. The pod keeps its IP across calls
        unless ``pod_ip`` is given; a fresh one comes from 10.244.0.0/16.
        """
        spec = self._specs[PODS_KEY]
        with self._state:
            pod = self._current(spec, namespace, name)
            if pod is None:
                raise ApiError.not_found(spec, name)
            old_status = pod.get("status") or {}
            ready = phase == "Running" if ready is None else ready
            now = timestamp_now()
            ip = pod_ip or old_status.get("podIP")
            if ip is None and phase != "Pending":
                n = next(self._ips)
                ip = f"10.244.{n // 250}.{n % 250 + 1}"
            running = phase == "Running"
            conditions = [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": str(ready), "lastTransitionTime": now},
                {"type": "Ready", "status": str(ready), "lastTransitionTime": now},
            ]
            containers = []
            for container in (pod.get("spec") or {}).get("containers") or []:
                if running:
                    state: dict[str, Any] = {"running": {"startedAt": now}}
                elif phase in ("Succeeded", "Failed"):
                    state = {
                        "terminated": {
                            "exitCode": 0 if phase == "Succeeded" else 1,
                            "reason": reason or ("Completed" if phase == "Succeeded" else "Error"),
                            "message": message or "",
                            "startedAt": now,
                            "finishedAt": now,
                        }
                    }
                else:
                    state = {"waiting": {"reason": reason or "ContainerCreating"}}
                containers.append(
                    {
                        "name": container.get("name", ""),
                        "image": container.get("image", ""),
                        "imageID": "",
                        "ready": ready and running,
                        "started": running,
                        "restartCount": restarts,
                        "state": state,
                    }
                )
            status: dict[str, Any] = {
                "phase": phase,
                "conditions": conditions,
                "containerStatuses": containers,
                "hostIP": "10.0.0.1",
                "startTime": old_status.get("startTime") or now,
                "qosClass": old_status.get("qosClass", "BestEffort"),
            }
            if ip:
                status["podIP"], status["podIPs"] = ip, [{"ip": ip}]
            if reason:
                status["reason"] = reason
            if message:
                status["message"] = message
            body = {**pod, "status": status}
            return self.replace_object(spec, name, body, namespace=namespace, subresource="status")
