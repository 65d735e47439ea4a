"""Appendix B's forecast: Eq. 15 over the sources of prefill demand, and Eq. 13–14.

:class:`Forecaster` learns from lifecycle facts the table reports (it is the table's
observer, :class:`~prorsa.core.forecast.learning.LifecycleStats`) and, at a tick, reads the
table's columns to produce one :class:`ForecastResult`: each source of demand is a function
of :mod:`~prorsa.core.forecast.sources`, summed here into Eq. 15, and the admissions of
Eq. 13–14 are predicted from them. Nothing here reads a clock: the tick's ``now`` is an
argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prorsa.core.forecast import sources
from prorsa.core.forecast.admission import Admissions, predict_admissions
from prorsa.core.forecast.learning import LifecycleStats
from prorsa.core.forecast.table import TrajectoryTable
from prorsa.core.forecast.view import (
    Arrivals,
    DecodeBacklog,
    Observed,
    Reprefill,
    TableView,
    prefill_work,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillSite:
    """The prefill instances the recurrence of Eq. 13 schedules onto, and g(x).

    With ``per_computed_token`` g charges each request for the tokens it is expected to
    compute (prompt minus the prefix cached from its previous turn), else for its full
    prompt x / θ_P as in the paper: a resend after a weight update, which recomputes a
    30k-token context, then takes as long as a 1k-token tool turn would on average.
    """

    names: tuple[str, ...]
    seconds_per_token: float  # g = tokens · seconds_per_token
    per_computed_token: bool = False
    # Prompt position at which a computed token costs twice one at the start of a prompt
    # (``capacity.prefillCostDoublingTokens``); None: every computed token costs the same.
    doubling_tokens: float | None = None
    # Attention-DP ranks per instance: a request runs on one, at 1/ranks of the speed.
    ranks: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ForecastResult:
    sampler: float  # Eq. 5
    startup: float  # Eq. 7
    ready: float  # Eq. 8
    tool: float  # Eq. 11
    inflight: float  # Eq. 12, less the prompts waiting for decode's KV room
    # Prompts in Q^P that a decode engine holds, waiting for KV room: their prefill waits on
    # decode (SGLang prefills a PD request once decode has preallocated its KV). They are
    # decode demand, in K_D already (the decode engines' waiting tokens), not prefill demand.
    awaiting_decode: float
    # Live contexts that re-prefill once a pending weight update ends (paper §3.1); a
    # term of Eq. 15 beyond the paper, observed like the ready queue (not bias-corrected).
    reprefill: float
    prefill: float  # Eq. 15 (bias-corrected)
    prefill_seconds: float  # instance-seconds to prefill W_P at g (W_P / θ_P of Eq. 1)
    # Parts of prefill_seconds that do not recur every horizon as arrivals do: prompts
    # already sent to a prefill engine (queued or in flight), which only that engine will
    # serve, and the re-prefills a pending weight update will send at once.
    queued_seconds: float
    reprefill_seconds: float
    admission: float  # Â_D, Eq. 14 (bias-corrected)
    admission_kv: float  # K̂_D
    admission_requests: float  # how many requests Â_D is
    raw_arrivals: float  # sampler + startup + tool before correction
    raw_admission: float
    arrival_factor: float
    admission_factor: float
    sampler_launches: float  # N̂_samp over the shortened horizon (Eq. 4)
    launch_horizon: float  # S_pw
    # The share of the horizon an admitted prompt keeps its decode KV (sources.decode_residence).
    decode_residence: float = 1.0


class Forecaster(LifecycleStats):
    """The statistics learned (its base) plus the per-tick forecast over a
    :class:`TrajectoryTable`."""

    def forecast(
        self,
        table: TrajectoryTable,
        *,
        now: float,
        site: PrefillSite,
        backlog: DecodeBacklog = DecodeBacklog(),
    ) -> ForecastResult:
        """Eq. 15 and Eq. 13–14 for the horizon after ``now``, one demand source at a time.

        ``backlog``: the requests the trainer counts in prefill that the decode engines
        hold, waiting for KV room.
        """
        c = self.config
        view = TableView.of(table, now=now, horizon=c.horizon, doubling=site.doubling_tokens)
        arrivals = Arrivals()
        sampler = sources.sampler_demand(self, view, arrivals, config=c)
        w_start = sources.startup_demand(self, view, arrivals)
        ready = sources.ready_demand(view)
        inflight, awaiting = sources.inflight_demand(view, backlog=backlog)
        w_tool = sources.tool_demand(self, view, arrivals)
        update = table.weight_update
        updating = update.in_progress(now)
        w_tool += sources.decode_chain_demand(
            self, view, arrivals, on=c.decode_chain, updating=updating
        )
        resume_at = update.expected_end(now) if updating else None
        reprefill = sources.reprefill_demand(view, arrivals, resume_at=resume_at)

        raw_arrivals = sampler.tokens + w_start + w_tool
        corrected = c.bias_correction
        a_factor = self.accuracy.arrival_factor if corrected else 1.0
        d_factor = self.accuracy.admission_factor if corrected else 1.0
        prefill = ready.tokens + inflight.tokens + reprefill.tokens + a_factor * raw_arrivals

        adm = self._admissions(
            view,
            site,
            arrivals=arrivals,
            ready=ready,
            inflight=inflight,
            reprefill=reprefill,
            resume_at=resume_at,
        )
        # W_P / θ_P of Eq. 1, counted over the same requests as W_P with the same g.
        if site.per_computed_token:
            queued = ready.work.sum() + inflight.work.sum()
            burst = reprefill.work.sum()
            work = queued + burst + a_factor * np.dot(*arrivals.weights_and_work())
        else:
            work = prefill
            queued, burst = ready.tokens + inflight.tokens, reprefill.tokens
        return ForecastResult(
            sampler=a_factor * sampler.tokens,
            startup=a_factor * w_start,
            ready=ready.tokens,
            tool=a_factor * w_tool,
            inflight=inflight.tokens,
            awaiting_decode=awaiting.tokens,
            reprefill=reprefill.tokens,
            prefill=prefill,
            prefill_seconds=float(work) * site.seconds_per_token,
            queued_seconds=float(queued) * site.seconds_per_token,
            reprefill_seconds=float(burst) * site.seconds_per_token,
            admission=d_factor * adm.tokens,
            admission_kv=d_factor * adm.kv_tokens,
            admission_requests=d_factor * adm.requests,
            raw_arrivals=raw_arrivals,
            raw_admission=adm.tokens,
            arrival_factor=a_factor,
            admission_factor=d_factor,
            sampler_launches=sampler.launches,
            launch_horizon=sampler.launch_horizon,
            decode_residence=sources.decode_residence(self, view),
        )

    def _admissions(
        self,
        v: TableView,
        site: PrefillSite,
        *,
        arrivals: Arrivals,
        ready: Observed,
        inflight: Observed,
        reprefill: Reprefill,
        resume_at: float | None,
    ) -> Admissions:
        """Decode admissions, Eq. 13–14, on the current prefill instances."""
        pre = inflight.idx
        inst_codes = v.at("instance", pre)
        inst_map = np.full(len(v.table.instances.names) + 1, -1, dtype=np.int64)
        for i, name in enumerate(site.names):
            code = v.table.instances.get(name)
            if code is not None:
                inst_map[code] = i
        pinned = np.where(inst_codes >= 0, inst_map[np.maximum(inst_codes, 0)], -1)
        per_computed = site.per_computed_token
        per_rank = site.seconds_per_token * site.ranks
        x_pre = v.x[pre]
        finish = np.maximum(
            v.since[pre] + (inflight.work if per_computed else x_pre) * per_rank, v.now
        )
        if resume_at is not None:
            # Interrupted prefills start over on the new weights.
            full = prefill_work(x_pre, 0.0, v.doubling) if per_computed else x_pre
            finish = resume_at + full * per_rank
        arrival_w, arrival_work = arrivals.weights_and_work()
        return predict_admissions(
            now=v.now,
            horizon=v.horizon,
            instances=len(site.names),
            inflight_instance=pinned,
            inflight_finish=finish,
            inflight_x=x_pre,
            queued_x=v.x[ready.idx],
            arrival_u=np.concatenate([*arrivals.u, reprefill.u]),
            arrival_x=np.concatenate([*arrivals.x, reprefill.x]),
            arrival_w=np.concatenate([arrival_w, np.ones(len(reprefill.x))]),
            queued_work=ready.work if per_computed else None,
            arrival_work=np.concatenate([arrival_work, reprefill.work]) if per_computed else None,
            resume_at=resume_at,
            seconds_per_token=site.seconds_per_token,
            kv_per_token=self.config.kv_per_token,
            ranks=site.ranks,
        )
