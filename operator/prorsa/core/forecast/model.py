"""Appendix B: the six sources of prefill demand and the decode-admission forecast.

:class:`Forecaster` learns from lifecycle facts the table reports (it is the table's
observer) and, at a tick, reads the table's columns to produce one :class:`ForecastResult`.
Nothing here reads a clock: the tick's ``now`` is an argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from prorsa.core.forecast.accuracy import AccuracyTracker
from prorsa.core.forecast.admission import Admissions, predict_admissions
from prorsa.core.forecast.slots import DECODE, PREFILL, READY, REWARD, STARTING, TOOL
from prorsa.core.forecast.stats import ClassedDistributions, EmaTable, Prior, WindowMean
from prorsa.core.forecast.survival import ClassedSurvival
from prorsa.core.forecast.table import TrajectoryTable

Policy = Literal["replaceOnReward", "fixedRate", "groupReplenish", "none"]

# EMA weight of decode outcomes (share ending in a tool call, their output length): about
# the last 50 decodes of a task.
_OUTCOME_ALPHA = 0.02

# Class codes pack small non-negative label codes into one int64 so that classes can be
# grouped with np.unique; the radix bounds every label code (see Interner's caps).
_RADIX = 1 << 14


def pack(*parts: np.ndarray) -> np.ndarray:
    code = np.zeros(len(parts[0]), dtype=np.int64)
    for p in parts:
        code = code * _RADIX + np.asarray(p, dtype=np.int64)
    return code


def _unpack(code: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        code, part = divmod(code, _RADIX)
        out.append(part)
    return out[::-1]


def _startup_key(code: int) -> tuple[object, ...]:
    """Eq. 6 class (mode, image, node class); -1 marks "dispatched, not launched yet"."""
    if code < 0:
        return ("dispatch",)
    mode, image, node = _unpack(code, 3)
    return (mode, image - 1, node - 1)


def _tool_key(code: int) -> tuple[object, ...]:
    """Eq. 9 class (task, tool, turn bucket, concurrent tool load)."""
    task, tool, turn, load = _unpack(code, 4)
    return (task - 1, tool - 1, turn, load)


def _pair_key(code: int) -> tuple[object, ...]:
    task, tool = _unpack(code, 2)
    return (task - 1, tool - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class ForecastConfig:
    horizon: float = 10.0
    tool_alpha: float = 0.1  # Eq. 10
    bias_correction: bool = True
    policy: Policy = "replaceOnReward"
    group_size: int = 1
    rate_per_second: float = 0.0
    window: int = 2048  # samples kept per duration class
    min_samples: int = 16  # before a finer class is trusted over its parent
    tool_min_samples: int = 4
    prior_reward_seconds: float = 30.0
    prior_startup_seconds: float = 5.0
    prior_tool_seconds: float = 5.0
    prior_decode_seconds: float = 20.0
    prior_first_prompt_tokens: float = 2048.0
    kv_per_token: float = 1.0  # κ_D(x) = kv_per_token · x, in KV token slots
    decode_chain: bool = True  # count decode -> tool -> ready returns within the horizon


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeBacklog:
    """Prompts the decode engines hold for KV room that the trainer still counts in
    prefill: at most ``requests`` of them, ``tokens`` in all (``measure.decode_backlog``)."""

    requests: int = 0
    tokens: float = 0.0


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


def prefill_work(x: np.ndarray, cached: np.ndarray | float, doubling: float | None) -> np.ndarray:
    """Computed tokens of each prompt, weighted by what attention makes them cost.

    Token p of a prompt attends to the p before it, so its cost grows about linearly:
    1 + p/L with L = ``doubling``. Computing positions c..x then costs
    (x − c)·(1 + (x + c)/(2L)) start-of-prompt tokens: a resend that recomputes a 60k
    context is ~2.5× its token count, a 1k tool turn on a cached 60k prefix ~2.5× too.
    """
    comp: np.ndarray = np.maximum(x - cached, 1.0)
    if not doubling:
        return comp
    weighted: np.ndarray = comp * (1.0 + (x + np.minimum(cached, x)) / (2.0 * doubling))
    return weighted


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


class Forecaster:
    """Duration statistics plus the per-tick forecast over a :class:`TrajectoryTable`."""

    def __init__(self, config: ForecastConfig) -> None:
        c = self.config = config
        self.reward = ClassedDistributions(
            window=c.window, min_samples=c.min_samples, prior=Prior(c.prior_reward_seconds)
        )
        self.startup = ClassedDistributions(
            window=c.window, min_samples=c.min_samples, prior=Prior(c.prior_startup_seconds)
        )
        self.tool = EmaTable(
            alpha=c.tool_alpha, min_samples=c.tool_min_samples, prior=c.prior_tool_seconds
        )
        self.growth = EmaTable(alpha=c.tool_alpha, min_samples=c.tool_min_samples, prior=0.0)
        self.template = EmaTable(alpha=c.tool_alpha, min_samples=c.tool_min_samples, prior=0.0)
        # Decode durations and outcomes, for trajectories that will decode, call a tool and
        # come back within the horizon (an extension of Eq. 11 one step back). A survival
        # estimate: the decodes still running count as censored durations, else long
        # decodes (math final answers) would be under-represented.
        self.decode_time = ClassedSurvival(
            window=c.window, min_samples=c.min_samples, prior=Prior(c.prior_decode_seconds)
        )
        self.decode_outcome: dict[int, list[float]] = {}
        self.admit_rate = WindowMean(window=1024, default=1.0)  # p̂
        self.dispatch_delay = WindowMean(window=1024, default=0.0)  # d̂
        self.first_prompt: dict[int, WindowMean] = {}
        self.accuracy = AccuracyTracker()
        self.intervals: list[tuple[float, float]] = []  # completed prefill busy intervals
        # Full-prompt tokens whose prefill finished, cumulative: the Controller sets them
        # against the tokens the engines computed to measure the prefix-cache hit ratio.
        self.prefilled_tokens = 0.0
        self.prefilled_computed = 0.0  # the table's estimate of those not served from cache

    # -- Observer: facts from the table ----------------------------------------------------

    def on_startup(self, *, key: tuple[object, ...], seconds: float) -> None:
        self.startup.add(key, seconds)

    def on_dispatch_delay(self, *, seconds: float) -> None:
        self.dispatch_delay.add(seconds)

    def first_prompt_for(self, task: int) -> WindowMean | None:
        """First-prompt sizes of a task (-2: every task together), created on first use."""
        mean = self.first_prompt.get(task)
        if mean is None and len(self.first_prompt) < 4096:
            mean = self.first_prompt[task] = WindowMean(window=256, default=math.nan)
        return mean

    def on_first_prompt(self, *, task: int, tokens: float) -> None:
        for k in (task, -2):
            mean = self.first_prompt_for(k)
            if mean is not None:
                mean.add(tokens)

    def on_growth(self, key: tuple[object, ...], tokens: float, result_known: bool) -> None:
        # With the result size known, only the chat template's overhead is unknown.
        (self.template if result_known else self.growth).update(key, max(tokens, 0.0))

    def on_tool(self, key: tuple[object, ...], seconds: float) -> None:
        self.tool.update(key, seconds)

    def on_decode(self, task: int, turn: int, seconds: float, output: float, tool: bool) -> None:
        self.decode_time.add((task, turn), seconds, marked=tool)
        share = 1.0 if tool else 0.0
        a = _OUTCOME_ALPHA
        for k in (task, -2):  # -2: every task together
            s = self.decode_outcome.get(k) or self._outcome_stats(k)
            if s is None:
                continue
            # [P(tool) EMA, decodes seen, output-tokens EMA of tool calls, tool calls seen]
            s[0] = share if not s[1] else s[0] + a * (share - s[0])
            s[1] += 1
            if tool:
                s[2] = output if not s[3] else s[2] + a * (output - s[2])
                s[3] += 1

    def _outcome_stats(self, key: int) -> list[float] | None:
        if len(self.decode_outcome) >= 4096:
            return None
        stats = self.decode_outcome[key] = [0.5, 0, 0.0, 0]
        return stats

    def on_reward(self, *, task: int, seconds: float, accepted: bool) -> None:
        self.reward.add((task,), seconds)
        self.admit_rate.add(1.0 if accepted else 0.0)

    def on_arrival(self, ts: float, tokens: float) -> None:
        if self.accuracy.pending:
            self.accuracy.on_arrival(ts, tokens)

    def on_admission(self, ts: float, tokens: float, computed: float) -> None:
        self.prefilled_tokens += tokens
        self.prefilled_computed += computed
        if self.accuracy.pending:
            self.accuracy.on_admission(ts, tokens)

    def on_prefill_interval(self, *, tokens: float, seconds: float) -> None:
        self.intervals.append((tokens, seconds))

    # -- helpers ---------------------------------------------------------------------------

    def _first_prompts(self, tasks: np.ndarray) -> np.ndarray:
        out = np.empty(len(tasks))
        for code, idx in self._by_class(tasks):
            out[idx] = self.first_prompt_tokens(code)
        return out

    def _decode_outcome(self, task: int) -> tuple[float, float]:
        """P(a decode ends in a tool call) and the mean output tokens of those, for a task."""
        p_tool, out = 0.5, 0.0
        for k in (task, -2):
            s = self.decode_outcome.get(k)
            if s is not None and s[1]:
                p_tool = s[0]
                break
        for k in (task, -2):
            s = self.decode_outcome.get(k)
            if s is not None and s[3]:
                out = s[2]
                break
        return p_tool, out

    def first_prompt_tokens(self, task: int) -> float:
        for k in (task, -2):
            mean = self.first_prompt.get(k)
            if mean is not None and len(mean):
                return mean.value
        return self.config.prior_first_prompt_tokens

    @staticmethod
    def _by_class(codes: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Group item positions by an integer class code: [(code, positions), ...]."""
        if not len(codes):
            return []
        uniq, inverse = np.unique(codes, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        bounds = np.searchsorted(inverse[order], np.arange(len(uniq) + 1))
        return [(int(u), order[bounds[j] : bounds[j + 1]]) for j, u in enumerate(uniq.tolist())]

    def _conditional(
        self,
        dists: ClassedDistributions,
        codes: np.ndarray,
        key_of: Callable[[int], tuple[object, ...]],
        elapsed: np.ndarray,
        horizon: float,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Conditional q and residual for many items, one vectorised query per class."""
        q = np.zeros(len(codes))
        res = np.zeros(len(codes))
        for code, idx in self._by_class(codes):
            q[idx], res[idx] = dists.conditional(key_of(code), elapsed[idx], horizon)
        return q, res

    def _ema(
        self, table: EmaTable, codes: np.ndarray, key_of: Callable[[int], tuple[object, ...]]
    ) -> np.ndarray:
        out = np.empty(len(codes))
        for code, idx in self._by_class(codes):
            out[idx] = table.get(key_of(code))
        return out

    # -- the forecast ------------------------------------------------------------------------

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
        view = _TableView.of(table, now=now, horizon=c.horizon, doubling=site.doubling_tokens)
        arrivals = _Arrivals()
        sampler = self._sampler_demand(view, arrivals)
        w_start = self._startup_demand(view, arrivals)
        ready = self._ready_demand(view)
        inflight, awaiting = self._inflight_demand(view, backlog=backlog)
        w_tool = self._tool_demand(view, arrivals)
        update = table.weight_update
        updating = update.in_progress(now)
        w_tool += self._decode_chain_demand(view, arrivals, updating=updating)
        resume_at = update.expected_end(now) if updating else None
        reprefill = self._reprefill_demand(view, arrivals, resume_at=resume_at)

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
        )

    def _sampler_demand(self, v: _TableView, arrivals: _Arrivals) -> _SamplerDemand:
        """Data sampler, Eq. 2–5, over the launch horizon S_pw = max(0, S − d̂)."""
        c = self.config
        d_hat = max(self.dispatch_delay.value, 0.0)
        s_pw = max(0.0, v.horizon - d_hat)
        nothing = _SamplerDemand(tokens=0.0, launches=0.0, launch_horizon=s_pw)
        if s_pw <= 0 or c.policy == "none":
            return nothing
        now, doubling = v.now, v.doubling
        if c.policy == "fixedRate":
            launches = c.rate_per_second * s_pw
            first = self.first_prompt_tokens(-2)
            k = max(1, math.ceil(launches))
            prompts = np.full(k, first)
            arrivals.add(
                u=now + d_hat + (np.arange(k) + 0.5) * s_pw / k,
                x=prompts,
                w=np.full(k, launches / k),
                work=prefill_work(prompts, 0.0, doubling),
            )
            return _SamplerDemand(tokens=launches * first, launches=launches, launch_horizon=s_pw)
        rew = np.flatnonzero(v.state == REWARD)
        if not len(rew):
            return nothing
        tasks = v.task[rew].astype(np.int64)
        q, res = self._conditional(self.reward, tasks, lambda t: (t,), now - v.since[rew], s_pw)
        xhat = self._first_prompts(tasks)
        if c.policy == "replaceOnReward":
            w = self.admit_rate.value * q  # Eq. 3; f(N) = N (Eq. 4)
            arrivals.add(u=now + res + d_hat, x=xhat, w=w, work=prefill_work(xhat, 0.0, doubling))
            return _SamplerDemand(
                tokens=float(np.dot(w, xhat)), launches=float(w.sum()), launch_horizon=s_pw
            )
        # groupReplenish: a group of groupSize per group whose members all end
        launches, tokens = self._group_replenish(
            v, rew, q, res, xhat, d_hat=d_hat, arrivals=arrivals
        )
        return _SamplerDemand(tokens=tokens, launches=launches, launch_horizon=s_pw)

    def _startup_demand(self, v: _TableView, arrivals: _Arrivals) -> float:
        """Sandbox startup, Eq. 6–7: trajectories launched whose first request has not come."""
        st = np.flatnonzero(v.state == STARTING)
        if not len(st):
            return 0.0
        launched = v.at("launched", st)
        dispatched = v.at("dispatched", st)
        has_launch = ~np.isnan(launched)
        origin = np.where(
            has_launch, launched, np.where(np.isnan(dispatched), v.since[st], dispatched)
        )
        codes = np.where(
            has_launch,
            pack(v.at("mode", st), v.at("image", st) + 1, v.at("node", st) + 1),
            -1,
        )
        q, res = self._conditional(self.startup, codes, _startup_key, v.now - origin, v.horizon)
        fp = v.at("first_prompt", st)
        xs = np.where(np.isnan(fp), self._first_prompts(v.task[st].astype(np.int64)), fp)
        arrivals.add(u=v.now + res, x=xs, w=q, work=prefill_work(xs, 0.0, v.doubling))
        return float(np.dot(q, xs))

    @staticmethod
    def _ready_demand(v: _TableView) -> _Observed:
        """Ready queue, Eq. 8: observed full prompts, in the order they were queued."""
        idx = np.flatnonzero(v.state == READY)
        idx = idx[np.argsort(v.since[idx], kind="stable")]
        return _Observed.of(v, idx)

    @staticmethod
    def _inflight_demand(v: _TableView, *, backlog: DecodeBacklog) -> tuple[_Observed, _Observed]:
        """In-flight prefill, Eq. 12: observed full prompts; and those waiting for decode.

        Eq. 12 counts every prompt in Q^P on the assumption that a prefill is short next to
        the horizon. A trainer that sees only the first token (a streaming client behind a
        PD router) keeps a request in Q^P until decode admits it; with the decode side full
        those requests stay for many horizons and Eq. 12 would count them again in each,
        as prefill demand that more prefill instances cannot serve. The decode engines say
        how many prompt tokens wait for their KV room: the longest-waiting prompts of Q^P,
        as many as those tokens cover, are those.
        """
        idx = np.flatnonzero(v.state == PREFILL)
        if backlog.requests <= 0 or backlog.tokens <= 0 or not len(idx):
            return _Observed.of(v, idx), _Observed.of(v, idx[:0])
        idx = idx[np.argsort(v.since[idx], kind="stable")]
        covered = int(np.searchsorted(np.cumsum(v.x[idx]), backlog.tokens, side="right"))
        held = min(covered, backlog.requests)
        return _Observed.of(v, idx[held:]), _Observed.of(v, idx[:held])

    def _tool_demand(self, v: _TableView, arrivals: _Arrivals) -> float:
        """Tool execution, Eq. 9–11: r_i = max(0, τ_i − e_i); count those with r_i < S."""
        tl = np.flatnonzero(v.state == TOOL)
        if not len(tl):
            return 0.0
        done = v.at("tool_done", tl)
        t_task = v.task[tl].astype(np.int64) + 1
        t_tool = v.at("tool", tl).astype(np.int64) + 1
        load = v.at("tool_load", tl)
        tau = self._ema(self.tool, pack(t_task, t_tool, _turn_bucket(v, tl), load), _tool_key)
        r = np.where(done, 0.0, np.maximum(0.0, tau - (v.now - v.since[tl])))
        soon = r < v.horizon
        result = v.at("result", tl)
        known = result >= 0
        pair = pack(t_task, t_tool)
        grow = np.where(
            known,
            self._ema(self.template, pair, _pair_key),
            self._ema(self.growth, pair, _pair_key),
        )
        xhat = v.x[tl] + np.where(known, result, 0.0) + grow
        arrivals.add(
            u=v.now + r[soon],
            x=xhat[soon],
            w=np.ones(int(soon.sum())),
            work=prefill_work(xhat[soon], v.cached[tl][soon], v.doubling),
        )
        return float(xhat[soon].sum())

    def _decode_chain_demand(self, v: _TableView, arrivals: _Arrivals, *, updating: bool) -> float:
        """Still decoding, then a tool, then back within the horizon: Eq. 11 one step back.

        q = P(T_dec < e + S − τ̂ and ends in a tool call | T_dec > e); x̂ = x + ô + growth.
        The decodes running now are the censored observations of that survival estimate, so
        they are fed to it even when the term is off. Not while a weight update is pending:
        it interrupts those decodes instead.
        """
        on = self.config.decode_chain
        dc = np.flatnonzero(v.state == DECODE) if on else np.empty(0, dtype=np.int64)
        d_task = v.task[dc].astype(np.int64)
        elapsed = v.now - v.since[dc]
        groups = [
            ((t_code - 1, turn), idx)
            for code, idx in self._by_class(pack(d_task + 1, _turn_bucket(v, dc)))
            for t_code, turn in (_unpack(code, 2),)
        ]
        self.decode_time.observe_running(v.now, {key: elapsed[idx] for key, idx in groups})
        tokens = 0.0
        for (t, turn), idx in groups if not updating else ():
            tau = self.tool.get((t,))
            window = v.horizon - tau
            if window <= 0:
                continue
            # Conditioned on the outcome as well as on e: the longer a decode has run,
            # the likelier it is a final answer rather than a tool call.
            w, res = self.decode_time.conditional((t, turn), elapsed[idx], window, marked=True)
            _, out = self._decode_outcome(t)
            xhat = v.x[dc[idx]] + out + self.growth.get((t, -1))
            tokens += float(np.dot(w, xhat))
            comp = prefill_work(xhat, v.cached[dc[idx]], v.doubling)
            keep = w > 0
            arrivals.add(u=v.now + res[keep] + tau, x=xhat[keep], w=w[keep], work=comp[keep])
        return tokens

    @staticmethod
    def _reprefill_demand(
        v: _TableView, arrivals: _Arrivals, *, resume_at: float | None
    ) -> _Reprefill:
        """A pending weight update: nothing prefills before it ends, and then every request
        still decoding has been interrupted and re-prefills its whole context."""
        empty = np.empty(0)
        if resume_at is None:
            return _Reprefill(u=empty, x=empty, work=empty)
        arrivals.hold_until(resume_at)
        if resume_at >= v.now + v.horizon:
            return _Reprefill(u=empty, x=empty, work=empty)
        re_x = v.x[np.flatnonzero(v.state == DECODE)]
        return _Reprefill(
            u=np.full(len(re_x), resume_at), x=re_x, work=prefill_work(re_x, 0.0, v.doubling)
        )

    def _admissions(
        self,
        v: _TableView,
        site: PrefillSite,
        *,
        arrivals: _Arrivals,
        ready: _Observed,
        inflight: _Observed,
        reprefill: _Reprefill,
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

    def _group_replenish(
        self,
        v: _TableView,
        rew: np.ndarray,
        q: np.ndarray,
        res: np.ndarray,
        xhat: np.ndarray,
        *,
        d_hat: float,
        arrivals: _Arrivals,
    ) -> tuple[float, float]:
        """Eq. 4 with f = group replenishment: a group whose live members are all in reward
        ends within the horizon with probability Π q_i (members independent; known group
        state held fixed), and then brings groupSize new samples."""
        groups = v.at("group", rew)
        member = groups >= 0
        if not member.any():
            return 0.0, 0.0
        g = groups[member]
        live = v.table.group_live_counts()
        size = len(live)
        in_reward = np.bincount(g, minlength=size)
        logq = np.bincount(g, weights=np.log(np.maximum(q[member], 1e-300)), minlength=size)
        last = np.zeros(size)
        np.maximum.at(last, g, res[member])
        xsum = np.bincount(g, weights=xhat[member], minlength=size)
        complete = (in_reward > 0) & (in_reward == live)
        p_group = np.where(complete, np.exp(logq), 0.0)
        k = self.config.group_size
        launches = float(k * p_group.sum())
        xbar = np.where(in_reward > 0, xsum / np.maximum(in_reward, 1), 0.0)
        tokens = float(k * np.dot(p_group, xbar))
        sel = np.flatnonzero(p_group > 0)
        # New samples: nothing of theirs is cached yet.
        arrivals.add(
            u=v.now + last[sel] + d_hat,
            x=xbar[sel],
            w=k * p_group[sel],
            work=prefill_work(xbar[sel], 0.0, v.doubling),
        )
        return launches, tokens


def _turn_bucket(v: _TableView, idx: np.ndarray) -> np.ndarray:
    """Vectorised :func:`turn_bucket` of the trajectories at ``idx``."""
    turns = v.at("turn", idx)
    buckets: np.ndarray = np.minimum(np.floor(np.log2(np.maximum(turns, 1))) + (turns > 0), 8)
    return buckets


@dataclass(frozen=True, slots=True, kw_only=True)
class _TableView:
    """The columns one forecast reads, cut to the used slots, and the tick's constants."""

    table: TrajectoryTable
    col: dict[str, np.ndarray]
    n: int
    now: float
    horizon: float  # S
    doubling: float | None
    state: np.ndarray
    since: np.ndarray
    x: np.ndarray
    task: np.ndarray
    cached: np.ndarray

    def at(self, column: str, idx: np.ndarray) -> np.ndarray:
        """The values of ``column`` at the used slots ``idx``."""
        values: np.ndarray = self.col[column][: self.n][idx]
        return values

    @classmethod
    def of(
        cls, table: TrajectoryTable, *, now: float, horizon: float, doubling: float | None
    ) -> _TableView:
        n = table.hwm
        col = table.cols
        return cls(
            table=table,
            col=col,
            n=n,
            now=now,
            horizon=horizon,
            doubling=doubling,
            state=col["state"][:n],
            since=col["since"][:n],
            x=col["x"][:n],
            task=col["task"][:n],
            # Tokens a request computes: its prompt minus the prefix the engines still hold
            # from its previous turn. New samples and resends compute their whole prompt.
            cached=col["cached"][:n],
        )


@dataclass(frozen=True, slots=True)
class _Arrivals:
    """Future arrivals for Eq. 13, per source: time, prompt tokens, weight, computed work."""

    u: list[np.ndarray] = field(default_factory=list)
    x: list[np.ndarray] = field(default_factory=list)
    w: list[np.ndarray] = field(default_factory=list)
    work: list[np.ndarray] = field(default_factory=list)

    def add(self, *, u: np.ndarray, x: np.ndarray, w: np.ndarray, work: np.ndarray) -> None:
        self.u.append(u)
        self.x.append(x)
        self.w.append(w)
        self.work.append(work)

    def hold_until(self, t: float) -> None:
        """Nothing arrives at a prefill engine before ``t`` (a weight update ends)."""
        self.u[:] = [np.maximum(u, t) for u in self.u]

    def weights_and_work(self) -> tuple[np.ndarray, np.ndarray]:
        w = np.concatenate(self.w) if self.w else np.empty(0)
        work = np.concatenate(self.work) if self.work else np.empty(0)
        return w, work


@dataclass(frozen=True, slots=True, kw_only=True)
class _SamplerDemand:
    tokens: float  # W_samp, Eq. 5
    launches: float  # N̂_samp, Eq. 4
    launch_horizon: float  # S_pw


@dataclass(frozen=True, slots=True, kw_only=True)
class _Observed:
    """Requests already at a prefill engine (queued or in flight): observed, not predicted."""

    idx: np.ndarray
    tokens: float
    work: np.ndarray

    @classmethod
    def of(cls, v: _TableView, idx: np.ndarray) -> _Observed:
        return cls(
            idx=idx,
            tokens=float(v.x[idx].sum()),
            work=prefill_work(v.x[idx], v.cached[idx], v.doubling),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Reprefill:
    u: np.ndarray
    x: np.ndarray
    work: np.ndarray

    @property
    def tokens(self) -> float:
        return float(self.x.sum())
