"""Reply bodies of the trainer webhook; the single source of replies and of ``/openapi.json``.

Event and snapshot bodies are the CONTRACT models of :mod:`prorsa_contract.events`; the Decision is
:mod:`prorsa.core.decision`. Reply keys are single words or camelCase, like the CRD status.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Reply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True)

    def wire(self) -> dict[str, object]:
        return self.model_dump(by_alias=True, mode="json")


class BatchReply(_Reply):
    """``POST .../events`` accepted: what became of the batch."""

    epoch: int = Field(description="The server's epoch for this cluster; changes on restart.")
    resync: bool = Field(
        description="True while the server needs a snapshot (after a restart): POST .../snapshot."
    )
    accepted: int = Field(description="Events in the batch (all validated).")
    applied: int = Field(description="Events applied to the Controller.")
    duplicates: int = Field(description="Replayed ids: counted, not applied again.")
    superseded: int = Field(description="Events older than the last snapshot (already in it).")
    anomalies: int = Field(
        description="Applied events that did not fit a trajectory's state (see the metrics)."
    )


class SnapshotReply(_Reply):
    """``POST .../snapshot`` accepted: the trajectory table was replaced."""

    epoch: int
    resync: bool
    trajectories: int = Field(description="Live trajectories loaded from the snapshot.")


class ErrorDetail(_Reply):
    index: int | None = Field(description="Event index in the batch (line for NDJSON); null: body.")
    field: str = Field(description="Dotted field path inside the event or body.")
    message: str


class ErrorReply(_Reply):
    """Every refusal. ``errors`` lists each bad event and field on 422."""

    error: str
    reason: str | None = Field(
        None,
        description="Why, as prorsa_webhook_rejects_total counts it: unreadable, invalid, "
        "unauthorized, unknown_cluster, too_large, timeout, queue_full, busy or "
        "trajectory_limit (429: events that would start trajectories past the cluster's "
        "maxLiveTrajectories were not applied, the others were).",
    )
    epoch: int | None = None
    resync: bool | None = None
    errors: list[ErrorDetail] | None = None
    retry_after: int | None = Field(
        None, alias="retryAfter", description="Seconds to wait before retrying (429)."
    )

    def wire(self) -> dict[str, object]:
        """Unknown top-level facts are left out; an error detail's ``index`` stays null."""
        body = self.model_dump(by_alias=True, mode="json")
        return {k: v for k, v in body.items() if v is not None}


class EventCounts(_Reply):
    applied: int
    duplicates: int
    superseded: int
    anomalies: int


class ClusterStatus(_Reply):
    """``GET .../status``: what the webhook knows of one cluster."""

    namespace: str
    name: str
    epoch: int
    resync: bool
    trainer_now: float = Field(alias="trainerNow", description="The present on the trainer clock.")
    clock_skew_seconds: float | None = Field(
        alias="clockSkewSeconds",
        description="Estimated trainer clock minus server clock; null until 5 batches have "
        "shown it (the server then ticks at its own clock).",
    )
    pending_events: int = Field(alias="pendingEvents")
    batches: int
    events: EventCounts
    snapshots: int
    live_trajectories: dict[str, int] = Field(alias="liveTrajectories")
    accuracy: dict[str, float | None]
    last_decision_at: float | None = Field(alias="lastDecisionAt")


class Health(_Reply):
    status: Literal["ok"] = "ok"
    clusters: int
