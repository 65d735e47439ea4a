"""CONTRACT: the Decision (status.target/forecast, ``GET .../forecast``, ``prorsa plan``).

Frozen and serialised with exactly the keys of docs/architecture.md ("The Decision");
``wire()`` is the JSON form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from prorsa_contract.agent_api import Role

if TYPE_CHECKING:
    from prorsa.core.diagnostics import Diagnostics


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True)


class Target(_Wire):
    prefill: int = Field(ge=0)
    decode: int = Field(ge=0)


class Components(_Wire):
    """The five prefill sources of Eq. 15, in full-prompt tokens over the horizon."""

    sampler: int = 0
    startup: int = 0
    ready: int = 0
    tool: int = 0
    inflight: int = 0


class Forecast(_Wire):
    prefill_tokens: int = Field(0, alias="prefillTokens")
    decode_admission_tokens: int = Field(0, alias="decodeAdmissionTokens")
    decode_kv_tokens: int = Field(0, alias="decodeKvTokens")
    components: Components = Components()


class Capacity(_Wire):
    prefill_tokens_per_second: float = Field(alias="prefillTokensPerSecond")
    decode_kv_tokens: int = Field(alias="decodeKvTokens")


class Switch(_Wire):
    instance: str
    from_: Role = Field(alias="from")
    to: Role


class Decision(_Wire):
    at: float
    mode: Literal["predictive", "reactive"]
    target: Target
    safety_margin: float = Field(alias="safetyMargin")
    forecast: Forecast
    capacity: Capacity
    switches: tuple[Switch, ...] = ()
    reason: str
    # Not a field: never serialised, validated or part of the contract.
    _diagnostics: Diagnostics | None = PrivateAttr(default=None)

    @property
    def diagnostics(self) -> Diagnostics | None:
        """What the Controller saw when it decided (None for a Decision read off the wire)."""
        return self._diagnostics

    def explained(self, diagnostics: Diagnostics) -> Decision:
        """This Decision carrying ``diagnostics``: a copy, since both are frozen."""
        copy = self.model_copy()
        copy._diagnostics = diagnostics
        return copy

    def wire(self) -> dict[str, object]:
        return self.model_dump(by_alias=True, mode="json")
