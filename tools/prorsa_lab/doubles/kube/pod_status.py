"""A pod's ``status`` as a kubelet writes it, for the doubles that stand in for one.

``kubectl get pods`` counts READY from ``containerStatuses[].ready``, not from the Ready
condition, and takes STATUS from a container's waiting or terminated reason; smg and other
routers read the Ready condition and ``podIP``. A status with only the condition shows
``0/1`` for a pod that serves, so the emulator's ``set_pod_status`` and the fake kubelet
both write the whole status from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["PodPhase", "kubelet_pod_status"]

PodPhase = Literal["Pending", "Running", "Succeeded", "Failed", "Unknown"]


def _container_state(
    phase: PodPhase, *, now: str, started_at: str, reason: str | None, message: str | None
) -> dict[str, Any]:
    if phase == "Running":
        return {"running": {"startedAt": started_at}}
    if phase in ("Succeeded", "Failed"):
        return {
            "terminated": {
                "exitCode": 0 if phase == "Succeeded" else 1,
                "reason": reason or ("Completed" if phase == "Succeeded" else "Error"),
                "message": message or "",
                "startedAt": started_at,
                "finishedAt": now,
            }
        }
    return {"waiting": {"reason": reason or "ContainerCreating"}}


def kubelet_pod_status(
    pod: Mapping[str, Any],
    *,
    phase: PodPhase,
    now: str,
    ready: bool | None = None,
    ip: str | None = None,
    restarts: int = 0,
    reason: str | None = None,
    message: str | None = None,
) -> dict[str, Any]:
    """The whole ``status`` of ``pod`` in ``phase`` at ``now`` (RFC 3339).

    ``ready`` defaults to ``phase == "Running"``; a container is ready only while it runs.
    The pod's ``startTime`` and a running container's ``startedAt`` are kept from the
    status the pod already has, so rewriting a status does not restart its clocks.
    """
    old = pod.get("status") or {}
    ready = phase == "Running" if ready is None else ready
    running = phase == "Running"
    start_time = old.get("startTime") or now
    conditions = [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": start_time},
        {"type": "Initialized", "status": "True", "lastTransitionTime": start_time},
        {"type": "ContainersReady", "status": str(ready), "lastTransitionTime": now},
        {"type": "Ready", "status": str(ready), "lastTransitionTime": now},
    ]
    previous = {s.get("name"): s for s in old.get("containerStatuses") or []}
    containers = []
    for container in (pod.get("spec") or {}).get("containers") or []:
        name = container.get("name", "")
        earlier = ((previous.get(name) or {}).get("state") or {}).get("running") or {}
        containers.append(
            {
                "name": name,
                "image": container.get("image", ""),
                "imageID": "",
                "ready": ready and running,
                "started": running,
                "restartCount": restarts,
                "state": _container_state(
                    phase,
                    now=now,
                    started_at=earlier.get("startedAt") or now,
                    reason=reason,
                    message=message,
                ),
            }
        )
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "containerStatuses": containers,
        "hostIP": old.get("hostIP") or "10.0.0.1",
        "startTime": start_time,
        "qosClass": old.get("qosClass", "BestEffort"),
    }
    ip = ip or old.get("podIP")
    if ip:
        status["podIP"], status["podIPs"] = ip, [{"ip": ip}]
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    return status
