"""CONTRACT: the in-pod agent's wire bodies (docs/agent-api.md).

``GET /v1/state`` bodies are also the engine-state input of ``prorsa plan --engines`` and of
:meth:`prorsa.core.controller.Controller.observe_engines`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


def as_role(value: object) -> Role | None:
    """``value`` as a Role; None when it is none (SGLang's mode of an engine outside PD
    disaggregation, a hand-edited annotation)."""
    return next((role for role in ROLES if role == value), None)


NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
MAX_DRAIN_TIMEOUT_SECONDS = 3600.0
"""The longest drain a role request may ask for (``spec.switching.drainTimeoutSeconds``)."""


class EngineState(BaseModel):
    """One engine instance as its agent reports it (sums over the engine's DP ranks)."""

    model_config = ConfigDict(extra="ignore", frozen=True, validate_by_name=True)

    instance: Annotated[str, Field(min_length=1, max_length=253)]
    role: Role
    switching: bool = False
    healthy: bool = True
    running_requests: NonNegInt = Field(0, alias="runningRequests")
    waiting_requests: NonNegInt = Field(0, alias="waitingRequests")
    waiting_tokens: NonNegInt = Field(0, alias="waitingTokens")
    kv_used_tokens: NonNegInt = Field(0, alias="kvUsedTokens")
    kv_capacity_tokens: NonNegInt = Field(0, alias="kvCapacityTokens")
    prefill_busy_seconds: NonNegFloat = Field(
        0.0, alias="prefillBusySeconds", description="Cumulative seconds with prefill work."
    )
    prefill_tokens: NonNegInt = Field(
        0, alias="prefillTokens", description="Cumulative prompt tokens prefilled."
    )

    def wire(self) -> dict[str, object]:
        return self.model_dump(by_alias=True)


class RoleRequest(BaseModel):
    """``POST /v1/role`` body."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True)

    role: Role
    drain_timeout_seconds: Annotated[
        float, Field(ge=0, le=MAX_DRAIN_TIMEOUT_SECONDS, allow_inf_nan=False)
    ] = Field(30.0, alias="drainTimeoutSeconds")


class RoleResult(BaseModel):
    """``POST /v1/role`` reply."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True)

    ok: bool
    old_role: Role | None = Field(None, alias="oldRole")
    new_role: Role | None = Field(None, alias="newRole")
    safe_to_restore: bool = Field(True, alias="safeToRestore")
    aborted_requests: NonNegInt = Field(0, alias="abortedRequests")
    seconds: NonNegFloat = 0.0
    message: str = ""

    def wire(self) -> dict[str, object]:
        return self.model_dump(by_alias=True)


ENGINE_STATES = TypeAdapter(list[EngineState])
