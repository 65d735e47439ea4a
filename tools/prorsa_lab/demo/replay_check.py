"""The simulator held to the demo: each run's recording replayed, set beside its measure.

``prorsa demo --record DIR`` records the trainer's events of the switching run and of the
static run it is compared with. Each recording is replayed by ``prorsa replay``'s code
(:func:`prorsa_lab.replay.api.replay_recording`) with the manifest that run applied, on the
policy that run had (Prorsa, or the pinned split), and the replay's time until as many
trajectories had finished as both runs finished is the prediction of the run's measured
time to that count. docs/benchmarks.md, "How close the simulator is to the engines",
reports what it found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prorsa_lab.demo.recorded import RecordedRun
from prorsa_lab.replay.api import ReplayError, replay_recording
from prorsa_lab.replay.engine_model import KNEE_CONTEXT


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One run: what it took to finish ``count`` trajectories, measured and replayed."""

    policy: str
    count: int
    measured_seconds: float
    predicted_seconds: float | None  # None: the replay finished fewer
    inferred: str  # the dispatch the replay inferred
    error: str | None = None  # why there is no prediction

    @property
    def relative_error(self) -> float | None:
        if self.predicted_seconds is None or self.measured_seconds <= 0:
            return None
        return self.predicted_seconds / self.measured_seconds - 1.0

    def wire(self) -> dict[str, Any]:
        err = self.relative_error
        return {
            "policy": self.policy,
            "count": self.count,
            "measuredSeconds": round(self.measured_seconds, 2),
            "predictedSeconds": None
            if self.predicted_seconds is None
            else round(self.predicted_seconds, 2),
            "relativeError": None if err is None else round(err, 4),
            "inferred": self.inferred,
            "error": self.error,
        }


def check(
    run: RecordedRun,
    *,
    prefill: int | None,
    count: int,
    measured_seconds: float,
    switch_seconds: float,
    knee_context: int = KNEE_CONTEXT,
    kv_pool_tokens: int | None = None,
) -> Check:
    """Replay ``run`` on its own policy: Prorsa (``prefill`` None) or static ``prefill``P.

    ``switch_seconds``: the engine's own flip (the double's, or SGLang's on this CPU);
    ``knee_context``: the request length the manifest's decodeConcurrency was profiled at;
    ``kv_pool_tokens``: the engines' KV pool (the demo's manifest states the whole pool as
    decodeKvTokens, not the usable figure ``prorsa profile`` prints)."""
    policy = "prorsa" if prefill is None else f"static-{prefill}P"
    try:
        report = replay_recording(
            events=run.events,
            cluster=run.cluster,
            static=None if prefill is None else (prefill,),
            reference=False,
            policies=(policy,),
            switch_seconds=switch_seconds,
            knee_context=knee_context,
            kv_pool_tokens=kv_pool_tokens,
            workers=1,
        )
    except ReplayError as exc:
        return Check(
            policy=policy,
            count=count,
            measured_seconds=measured_seconds,
            predicted_seconds=None,
            inferred="",
            error=str(exc),
        )
    return Check(
        policy=policy,
        count=count,
        measured_seconds=measured_seconds,
        predicted_seconds=report.time_to_count(policy, count),
        inferred=report.dispatch.describe(),
    )


def summary(*, switching: Check, static: Check | None) -> dict[str, Any]:
    """The summary's ``replay``: both checks, and whether the sign of "switching saved"
    agrees between the measurement and the replay (``static`` None: no static run)."""
    if static is None:
        return {"static": None, "switching": switching.wire(), "savedSeconds": None,
                "signAgrees": None}  # fmt: skip
    measured = static.measured_seconds - switching.measured_seconds
    predicted = (
        None
        if static.predicted_seconds is None or switching.predicted_seconds is None
        else static.predicted_seconds - switching.predicted_seconds
    )
    return {
        "static": static.wire(),
        "switching": switching.wire(),
        "savedSeconds": {
            "measured": round(measured, 2),
            "predicted": None if predicted is None else round(predicted, 2),
        },
        "signAgrees": None if predicted is None else (measured >= 0) == (predicted >= 0),
    }


def lines(replay: dict[str, Any] | None) -> list[str]:
    """The summary's printed lines for ``replay``."""
    if replay is None:
        return []
    out = []
    for name in ("switching", "static"):
        c = replay[name]
        if c is None:
            continue
        if c["predictedSeconds"] is None:
            why = c["error"] or "the replay finished fewer trajectories"
            out.append(f"  replay        {name}: no prediction ({why.splitlines()[0]})")
            continue
        out.append(
            f"  replay        {name} ({c['policy']}): first {c['count']} trajectories in "
            f"{c['measuredSeconds']:.1f} s measured, {c['predictedSeconds']:.1f} s replayed "
            f"({c['relativeError']:+.0%})"
        )
    saved = replay["savedSeconds"]
    if saved is not None and saved["predicted"] is not None:
        agree = "agrees" if replay["signAgrees"] else "DISAGREES"
        out.append(
            f"  replay        switching saved {saved['measured']:+.1f} s measured, "
            f"{saved['predicted']:+.1f} s replayed: the sign {agree}"
        )
    return out
