"""When a RolloutCluster is Ready: every engine answers and the cluster serves a request.

Serving takes a prefill and a decode engine: smg 1.13.0 in PD mode answers ``/generate``
with HTTP 503 ``no_available_workers`` ("No prefill workers available") at once, and its
``/readiness`` (the router Deployment's readiness probe) with 503 "insufficient healthy
workers", while it lists decode workers only (``tests/test_smg_router_no_prefill.py``
keeps that against the real binary). Every engine pod starts as decode
(:mod:`prorsa.core.engine_flags`), so a fresh cluster whose engines all answer still
serves nothing until the bootstrap (:mod:`prorsa.core.actions`) has flipped a prefill
engine. A trainer that starts then gets its requests refused, and the SDK's few quick
retries (``prorsa_sdk.resumable``: 3 by default, under 1.5 s in all) do not outlast a
bootstrap. So Ready waits for a serving pair, with reason ``Bootstrapping`` meanwhile,
and users wait for it (``kubectl wait --for=condition=Ready``). The operator's status and
the simulator's trainer (which models such a user) read the same rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from prorsa_contract.agent_api import EngineState

ReadyReason = Literal[
    "EnginesReady",
    "EnginesStarting",
    "EnginesUnavailable",
    "Bootstrapping",
    "NoPrefillEngine",
    "NoDecodeEngine",
]


@dataclass(frozen=True, kw_only=True)
class Readiness:
    """The Ready condition of one tick."""

    ready: bool
    reason: ReadyReason
    message: str


def readiness(
    *,
    expected: int,
    prefill: int,
    decode: int,
    switching: int,
    degraded: bool,
    served_before: bool = False,
) -> Readiness:
    """Ready from one tick's engine counts: ``prefill`` and ``decode`` engines serving (healthy,
    not switching), ``switching`` ones between roles, ``expected`` the spec's instances;
    ``degraded``: an engine that answered before has stopped (else the missing ones are
    still starting); ``served_before``: the cluster was Ready earlier, so no prefill engine
    now is no bootstrap (``roles.prefill.min: 0``) but a cluster that stopped serving."""
    answering = prefill + decode + switching
    counts = f"{answering}/{expected} engines answering"
    if answering < expected:
        reason: ReadyReason = "EnginesUnavailable" if degraded else "EnginesStarting"
        return Readiness(ready=False, reason=reason, message=counts)
    if prefill == 0 and served_before:
        return Readiness(
            ready=False,
            reason="NoPrefillEngine",
            message=f"{counts}, none serving prefill: the router refuses requests",
        )
    if prefill == 0:
        return Readiness(
            ready=False,
            reason="Bootstrapping",
            message=(
                f"{counts}, none serving prefill yet: every engine starts as decode and the "
                "bootstrap flips roles.prefill.initial of them; the router refuses requests "
                "until one serves"
            ),
        )
    if decode == 0:
        return Readiness(
            ready=False,
            reason="NoDecodeEngine",
            message=f"{counts}, none serving decode: the router refuses requests",
        )
    return Readiness(
        ready=True,
        reason="EnginesReady",
        message=f"{counts}; serving with {prefill} prefill and {decode} decode",
    )


def role_counts(states: Iterable[EngineState | None]) -> dict[str, int]:
    """Engines by what they do this tick: ``prefill`` and ``decode`` serving, ``switching``
    between roles, ``unavailable`` (no answer, or an unhealthy engine)."""
    roles = {"prefill": 0, "decode": 0, "switching": 0, "unavailable": 0}
    for state in states:
        if state is None or not state.healthy:
            roles["unavailable"] += 1
        elif state.switching:
            roles["switching"] += 1
        else:
            roles[state.role] += 1
    return roles
