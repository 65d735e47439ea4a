"""Appendix B's sources of prefill demand over the next horizon, one function each.

Each reads the table's columns (:class:`~prorsa.core.forecast.view.TableView`) and what
the statistics learned (:class:`~prorsa.core.forecast.learning.LifecycleStats`), returns
the tokens it expects and adds its future arrivals to
:class:`~prorsa.core.forecast.view.Arrivals` for the recurrence of Eq. 13.
:meth:`~prorsa.core.forecast.model.Forecaster.forecast` sums them into Eq. 15.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from prorsa.core.forecast.config import ForecastConfig
from prorsa.core.forecast.learning import LifecycleStats
from prorsa.core.forecast.slots import DECODE, PREFILL, READY, REWARD, STARTING, TOOL
from prorsa.core.forecast.stats import ClassedDistributions, EmaTable
from prorsa.core.forecast.view import (
    Arrivals,
    DecodeBacklog,
    Observed,
    Reprefill,
    SamplerDemand,
    TableView,
    prefill_work,
)

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


def _by_class(codes: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Group item positions by an integer class code: [(code, positions), ...]."""
    if not len(codes):
        return []
    uniq, inverse = np.unique(codes, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(len(uniq) + 1))
    return [(int(u), order[bounds[j] : bounds[j + 1]]) for j, u in enumerate(uniq.tolist())]


def _conditional(
    dists: ClassedDistributions,
    codes: np.ndarray,
    key_of: Callable[[int], tuple[object, ...]],
    elapsed: np.ndarray,
    horizon: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Conditional q and residual for many items, one vectorised query per class."""
    q = np.zeros(len(codes))
    res = np.zeros(len(codes))
    for code, idx in _by_class(codes):
        q[idx], res[idx] = dists.conditional(key_of(code), elapsed[idx], horizon)
    return q, res


def _ema(
    table: EmaTable, codes: np.ndarray, key_of: Callable[[int], tuple[object, ...]]
) -> np.ndarray:
    out = np.empty(len(codes))
    for code, idx in _by_class(codes):
        out[idx] = table.get(key_of(code))
    return out


def _first_prompts(stats: LifecycleStats, tasks: np.ndarray) -> np.ndarray:
    out = np.empty(len(tasks))
    for code, idx in _by_class(tasks):
        out[idx] = stats.first_prompt_tokens(code)
    return out


def sampler_demand(
    stats: LifecycleStats, v: TableView, arrivals: Arrivals, *, config: ForecastConfig
) -> SamplerDemand:
    """Data sampler, Eq. 2–5, over the launch horizon S_pw = max(0, S − d̂)."""
    c = config
    d_hat = max(stats.dispatch_delay.value, 0.0)
    s_pw = max(0.0, v.horizon - d_hat)
    nothing = SamplerDemand(tokens=0.0, launches=0.0, launch_horizon=s_pw)
    if s_pw <= 0 or c.policy == "none":
        return nothing
    now, doubling = v.now, v.doubling
    if c.policy == "fixedRate":
        launches = c.rate_per_second * s_pw
        first = stats.first_prompt_tokens(-2)
        k = max(1, math.ceil(launches))
        prompts = np.full(k, first)
        arrivals.add(
            u=now + d_hat + (np.arange(k) + 0.5) * s_pw / k,
            x=prompts,
            w=np.full(k, launches / k),
            work=prefill_work(prompts, 0.0, doubling),
        )
        return SamplerDemand(tokens=launches * first, launches=launches, launch_horizon=s_pw)
    rew = np.flatnonzero(v.state == REWARD)
    if not len(rew):
        return nothing
    tasks = v.task[rew].astype(np.int64)
    q, res = _conditional(stats.reward, tasks, lambda t: (t,), now - v.since[rew], s_pw)
    xhat = _first_prompts(stats, tasks)
    if c.policy == "replaceOnReward":
        w = stats.admit_rate.value * q  # Eq. 3; f(N) = N (Eq. 4)
        arrivals.add(u=now + res + d_hat, x=xhat, w=w, work=prefill_work(xhat, 0.0, doubling))
        return SamplerDemand(
            tokens=float(np.dot(w, xhat)), launches=float(w.sum()), launch_horizon=s_pw
        )
    # groupReplenish: a group of groupSize per group whose members all end
    launches, tokens = _group_replenish(
        v, rew, q, res, xhat, group_size=c.group_size, d_hat=d_hat, arrivals=arrivals
    )
    return SamplerDemand(tokens=tokens, launches=launches, launch_horizon=s_pw)


def _group_replenish(
    v: TableView,
    rew: np.ndarray,
    q: np.ndarray,
    res: np.ndarray,
    xhat: np.ndarray,
    *,
    group_size: int,
    d_hat: float,
    arrivals: Arrivals,
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
    k = group_size
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


def startup_demand(stats: LifecycleStats, v: TableView, arrivals: Arrivals) -> float:
    """Sandbox startup, Eq. 6–7: trajectories launched whose first request has not come."""
    st = np.flatnonzero(v.state == STARTING)
    if not len(st):
        return 0.0
    launched = v.at("launched", st)
    dispatched = v.at("dispatched", st)
    has_launch = ~np.isnan(launched)
    origin = np.where(has_launch, launched, np.where(np.isnan(dispatched), v.since[st], dispatched))
    codes = np.where(
        has_launch,
        pack(v.at("mode", st), v.at("image", st) + 1, v.at("node", st) + 1),
        -1,
    )
    q, res = _conditional(stats.startup, codes, _startup_key, v.now - origin, v.horizon)
    fp = v.at("first_prompt", st)
    xs = np.where(np.isnan(fp), _first_prompts(stats, v.task[st].astype(np.int64)), fp)
    arrivals.add(u=v.now + res, x=xs, w=q, work=prefill_work(xs, 0.0, v.doubling))
    return float(np.dot(q, xs))


def ready_demand(v: TableView) -> Observed:
    """Ready queue, Eq. 8: observed full prompts, in the order they were queued."""
    idx = np.flatnonzero(v.state == READY)
    idx = idx[np.argsort(v.since[idx], kind="stable")]
    return Observed.of(v, idx)


def inflight_demand(v: TableView, *, backlog: DecodeBacklog) -> tuple[Observed, Observed]:
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
        return Observed.of(v, idx), Observed.of(v, idx[:0])
    idx = idx[np.argsort(v.since[idx], kind="stable")]
    covered = int(np.searchsorted(np.cumsum(v.x[idx]), backlog.tokens, side="right"))
    held = min(covered, backlog.requests)
    return Observed.of(v, idx[held:]), Observed.of(v, idx[:held])


def tool_demand(stats: LifecycleStats, v: TableView, arrivals: Arrivals) -> float:
    """Tool execution, Eq. 9–11: r_i = max(0, τ_i − e_i); count those with r_i < S."""
    tl = np.flatnonzero(v.state == TOOL)
    if not len(tl):
        return 0.0
    done = v.at("tool_done", tl)
    t_task = v.task[tl].astype(np.int64) + 1
    t_tool = v.at("tool", tl).astype(np.int64) + 1
    load = v.at("tool_load", tl)
    tau = _ema(stats.tool, pack(t_task, t_tool, v.turn_buckets(tl), load), _tool_key)
    r = np.where(done, 0.0, np.maximum(0.0, tau - (v.now - v.since[tl])))
    soon = r < v.horizon
    result = v.at("result", tl)
    known = result >= 0
    pair = pack(t_task, t_tool)
    grow = np.where(
        known,
        _ema(stats.template, pair, _pair_key),
        _ema(stats.growth, pair, _pair_key),
    )
    xhat = v.x[tl] + np.where(known, result, 0.0) + grow
    arrivals.add(
        u=v.now + r[soon],
        x=xhat[soon],
        w=np.ones(int(soon.sum())),
        work=prefill_work(xhat[soon], v.cached[tl][soon], v.doubling),
    )
    return float(xhat[soon].sum())


def decode_chain_demand(
    stats: LifecycleStats, v: TableView, arrivals: Arrivals, *, on: bool, updating: bool
) -> float:
    """Still decoding, then a tool, then back within the horizon: Eq. 11 one step back.

    q = P(T_dec < e + S − τ̂ and ends in a tool call | T_dec > e); x̂ = x + ô + growth.
    The decodes running now are the censored observations of that survival estimate, so
    they are fed to it even when the term is off (``on`` False). Not while a weight update
    is pending: it interrupts those decodes instead.
    """
    dc = np.flatnonzero(v.state == DECODE) if on else np.empty(0, dtype=np.int64)
    d_task = v.task[dc].astype(np.int64)
    elapsed = v.now - v.since[dc]
    groups = [
        ((t_code - 1, turn), idx)
        for code, idx in _by_class(pack(d_task + 1, v.turn_buckets(dc)))
        for t_code, turn in (_unpack(code, 2),)
    ]
    stats.decode_time.observe_running(v.now, {key: elapsed[idx] for key, idx in groups})
    tokens = 0.0
    for (t, turn), idx in groups if not updating else ():
        tau = stats.tool.get((t,))
        window = v.horizon - tau
        if window <= 0:
            continue
        # Conditioned on the outcome as well as on e: the longer a decode has run,
        # the likelier it is a final answer rather than a tool call.
        w, res = stats.decode_time.conditional((t, turn), elapsed[idx], window, marked=True)
        _, out = stats.outcome_of(t)
        xhat = v.x[dc[idx]] + out + stats.growth.get((t, -1))
        tokens += float(np.dot(w, xhat))
        comp = prefill_work(xhat, v.cached[dc[idx]], v.doubling)
        keep = w > 0
        arrivals.add(u=v.now + res[keep] + tau, x=xhat[keep], w=w[keep], work=comp[keep])
    return tokens


def reprefill_demand(v: TableView, arrivals: Arrivals, *, resume_at: float | None) -> Reprefill:
    """A pending weight update: nothing prefills before it ends, and then every request
    still decoding has been interrupted and re-prefills its whole context."""
    empty = np.empty(0)
    if resume_at is None:
        return Reprefill(u=empty, x=empty, work=empty)
    arrivals.hold_until(resume_at)
    if resume_at >= v.now + v.horizon:
        return Reprefill(u=empty, x=empty, work=empty)
    re_x = v.x[np.flatnonzero(v.state == DECODE)]
    return Reprefill(
        u=np.full(len(re_x), resume_at), x=re_x, work=prefill_work(re_x, 0.0, v.doubling)
    )


def decode_residence(stats: LifecycleStats, v: TableView) -> float:
    """The share of the horizon a prompt admitted to decode next keeps its KV there.

    Eq. 13–14 count every prompt admitted within the horizon S as decode KV for the whole
    of it, which is right for long reasoning decodes and far too much for a tool call's
    few tokens: a 10-token decode holds its KV for well under a second (issue 34). A
    prompt that decodes next (ready, in prefill, or in a tool call) holds it for about
    E[min(T_dec, S)], T_dec its class's decode duration (the survival estimate the decode
    chain reads, elapsed 0; its tokens times the step time the engines ran at). The mean
    over those prompts, weighted by their contexts (what their KV is), over S; 1 with none.
    Switch pricing counts the horizon's admissions at this share (``Demand.resident``);
    Eq. 1's b is left as the paper has it.
    """
    S = v.horizon
    idx = np.flatnonzero((v.state == READY) | (v.state == PREFILL) | (v.state == TOOL))
    if S <= 0 or not len(idx):
        return 1.0
    weight = np.maximum(v.x[idx], 1.0)
    held = np.empty(len(idx))
    task = v.task[idx].astype(np.int64)
    for code, part in _by_class(pack(task + 1, v.turn_buckets(idx))):
        t_code, turn = _unpack(code, 2)
        q, res = stats.decode_time.conditional((t_code - 1, turn), np.zeros(1), S)
        held[part] = float(q[0] * res[0] + (1.0 - q[0]) * S)
    share = float(np.dot(weight, held) / (weight.sum() * S))
    return min(max(share, 0.0), 1.0)
