"""Eq. 13–14: when will each request finish prefill, and so enter decode, in [t, t+S)?

A request-level serial approximation per prefill instance, instances in parallel
(Appendix B): b̂_j = max(u_j, v_m) + g(x_j), then v_m ← b̂_j. Requests the trainer did not
pin to an instance go to the least-loaded one (smallest v_m), which is what the router's
load-aware policies do. Future arrivals carry a weight (their probability of arriving in the
horizon) and occupy an instance for weight·g(x) of expected service.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Admissions:
    tokens: float  # Â_D: prompt tokens expected to enter decode before t + S (Eq. 14)
    kv_tokens: float  # K̂_D: their KV footprint at admission under the decode config
    requests: float = 0.0  # how many requests that is (expected count)


def predict_admissions(
    *,
    now: float,
    horizon: float,
    instances: int,
    inflight_instance: np.ndarray,
    inflight_finish: np.ndarray,
    inflight_x: np.ndarray,
    queued_x: np.ndarray,
    arrival_u: np.ndarray,
    arrival_x: np.ndarray,
    arrival_w: np.ndarray,
    seconds_per_token: float,
    kv_per_token: float = 1.0,
    queued_work: np.ndarray | None = None,
    arrival_work: np.ndarray | None = None,
    ranks: int = 1,
    resume_at: float | None = None,
) -> Admissions:
    """Run the recurrence. ``inflight_instance`` holds 0..instances-1, or -1 when unknown.

    ``queued_x`` is the ready queue in FIFO order (u_j = t); arrivals are predicted future
    requests in any order (sorted here by u). ``inflight_finish`` is the runtime estimate of
    each in-flight prefill's end, already accounting for its progress. ``queued_work`` and
    ``arrival_work``, when given, are the tokens each request computes (g = work ·
    seconds_per_token) while x still counts what it admits; by default g = x ·
    seconds_per_token.

    With ``ranks`` attention-DP ranks per instance the servers are the ranks: each serves
    one request at a time at 1/ranks of the instance's speed (``seconds_per_token`` is the
    instance's); an in-flight request holds the least-busy rank of its instance.

    ``resume_at``: the engines serve nothing before it (a weight update is loading), so the
    ready queue waits for it and every server is free no earlier.
    """
    end = now + horizon
    if instances <= 0:
        return Admissions(0.0, 0.0, 0.0)
    ranks = max(int(ranks), 1)
    servers = instances * ranks
    # In-flight work: finishes on its own estimate; sets each server's next free time.
    done = inflight_finish < end
    tokens = float(inflight_x[done].sum())
    requests = float(done.sum())
    pinned = inflight_instance >= 0
    # Each in-flight request holds the rank of its instance that frees soonest; taken in
    # finish order, an instance's ranks end up free at its `ranks` latest finishes.
    start = now if resume_at is None else max(now, resume_at)
    free = np.full((instances, ranks), start)
    where = np.minimum(inflight_instance[pinned], instances - 1)
    finishes = np.maximum(inflight_finish[pinned], start)
    for m in np.unique(where).tolist():
        latest = np.sort(finishes[where == m])[-ranks:]
        free[m, : len(latest)] = latest
    free_at = free.ravel().tolist()
    # In-flight requests with no known instance occupy the least-loaded server.
    for finish in np.sort(inflight_finish[~pinned]).tolist():
        m = min(range(servers), key=free_at.__getitem__)
        free_at[m] = max(free_at[m], finish)
    heap = [(t, m) for m, t in enumerate(free_at)]
    heapq.heapify(heap)

    # Ready queue first (already arrived, FIFO), then predicted arrivals by arrival time.
    order = np.argsort(arrival_u, kind="stable")
    u = np.concatenate((np.full(len(queued_x), start), arrival_u[order]))
    x = np.concatenate((queued_x, arrival_x[order]))
    w = np.concatenate((np.ones(len(queued_x)), arrival_w[order]))
    work = np.concatenate(
        (
            queued_x if queued_work is None else queued_work,
            arrival_x[order] if arrival_work is None else arrival_work[order],
        )
    )
    service = w * work * (seconds_per_token * ranks)
    admitted = 0.0
    pop, push = heapq.heappop, heapq.heappush
    for uj, sj, xj, wj in zip(u.tolist(), service.tolist(), x.tolist(), w.tolist(), strict=True):
        if uj >= end:
            break  # sorted by arrival: nothing later can finish in the horizon
        vm, m = pop(heap)
        if vm >= end:
            push(heap, (vm, m))
            break  # every instance is busy past the horizon
        b = max(uj, vm) + sj
        push(heap, (b, m))
        if b < end:
            admitted += wj * xj
            requests += wj
    tokens += admitted
    return Admissions(tokens=tokens, kv_tokens=tokens * kv_per_token, requests=requests)
