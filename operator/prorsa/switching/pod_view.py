"""What the switch path reads from an engine pod, read once from its manifest.

A manifest is an untyped dict whose every key may be missing; the executor reads a
handful of them (its name, IP, labels, the intent annotation, its readiness) at several
steps of a switch. Reading them here, once, gives each one a type and a default, and a
manifest without the one field a switch cannot do without (its name) is refused with that
field's name rather than a ``KeyError`` in the middle of a switch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prorsa.engines.agents import AgentAddress, address_of, serves_tls
from prorsa.k8s import lws
from prorsa_contract.labels import (
    CLUSTER_LABEL,
    GROUP_LABEL,
    NODE_RANK_LABEL,
    ROLE_LABEL,
    SWITCH_ANNOTATION,
    RoleLabel,
    SwitchIntent,
    parse_intent,
)

ROLE_LABELS: tuple[RoleLabel, ...] = ("prefill", "decode", "draining")


@dataclass(frozen=True, slots=True, kw_only=True)
class PodView:
    """An engine pod as the switch executor sees it (labels: prorsa_contract.labels)."""

    name: str
    namespace: str
    """``default`` when the manifest names none (the API server's default)."""
    ip: str | None
    """``status.podIP``; None until the pod is scheduled and has one."""
    cluster: str | None
    """The ``prorsa.io/cluster`` label: whose router routes to it."""
    role: RoleLabel | None
    """The ``prorsa.io/role`` label; None when absent or not a role label."""
    intent: SwitchIntent | None
    """The ``prorsa.io/switch`` annotation a switch in progress left (parsed)."""
    grouped: bool
    """Leader of a multi-node group (``prorsa.io/group``): its workers switch with it."""
    lws_owned: bool
    """A LeaderWorkerSet's controller keeps its group (it recreates what is deleted)."""
    leader: bool
    """Node rank 0 (``prorsa.io/node-rank`` absent or ``0``): only leaders are routed to."""
    tls: bool
    """Its agent serves HTTPS (its spec mounts the agent certificate)."""
    phase: str | None
    """``status.phase`` (``Running`` once its containers started)."""
    ready: bool
    """Its ``Ready`` condition is ``True``."""
    deleting: bool
    """It carries a ``deletionTimestamp``."""

    @classmethod
    def from_manifest(cls, pod: dict[str, Any]) -> PodView:
        """The view of a pod manifest as the Kubernetes API returns it.

        Raises ValueError naming the field when the manifest has no ``metadata.name``.
        """
        meta = pod.get("metadata")
        if not isinstance(meta, dict):
            raise ValueError("pod manifest has no metadata (metadata.name is required)")
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"pod manifest has no metadata.name (metadata: {sorted(meta)})")
        labels: dict[str, str] = meta.get("labels") or {}
        annotations: dict[str, str] = meta.get("annotations") or {}
        status: dict[str, Any] = pod.get("status") or {}
        role = labels.get(ROLE_LABEL)
        return cls(
            name=name,
            namespace=meta.get("namespace") or "default",
            ip=status.get("podIP") or None,
            cluster=labels.get(CLUSTER_LABEL),
            role=next((r for r in ROLE_LABELS if r == role), None),
            intent=parse_intent(annotations.get(SWITCH_ANNOTATION)),
            grouped=GROUP_LABEL in labels,
            lws_owned=lws.owned(pod),
            leader=labels.get(NODE_RANK_LABEL, "0") == "0",
            tls=serves_tls(pod),
            phase=status.get("phase"),
            ready=any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or []
            ),
            deleting=bool(meta.get("deletionTimestamp")),
        )

    def agent_address(self, *, port: int, ca: str | None) -> AgentAddress | None:
        """How to reach its agent (:func:`prorsa.engines.agents.agent_address`); None without IP."""
        return address_of(
            pod=self.name,
            ip=self.ip,
            cluster=self.cluster or "",
            namespace=self.namespace,
            tls=self.tls,
            port=port,
            ca=ca,
        )

    def routable(self) -> bool:
        """Whether the router's selectors match it (objects.router_args): labelled prefill or
        decode, a leader, Running and Ready with an IP, and not being deleted."""
        return (
            self.role in ("prefill", "decode")
            and self.leader
            and not self.deleting
            and self.phase == "Running"
            and self.ready
            and bool(self.ip)
        )
