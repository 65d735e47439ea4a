"""What the engine states and the trajectory table say now, as a tick reads them.

Pure functions of the agents' ``/v1/state`` bodies, the trajectory table and the spec's
settings: the instances usable by role, C_KV and K_D of Eq. 1, the requests in prefill and
in decode, the decode step throughput they use, the prefix-cache floor and the share of a
turn spent decoding. Where no engine answers, the trainer's view (the table) stands in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from prorsa.core.forecast.slots import DECODE, PREFILL, READY, TOOL
from prorsa.core.forecast.table import TrajectoryTable
from prorsa.core.forecast.view import DecodeBacklog
from prorsa.core.switch_cost import PRIOR_DECODE_SHARE
from prorsa.core.types import RoleCounts
from prorsa_contract.agent_api import EngineState, Role

# C_KV when neither the spec nor any engine says (≈ an 8×H200 Qwen3-235B instance).
DEFAULT_KV_TOKENS = 1_300_000
# The share of a prefill engine's KV its prefix cache can count on: the rest holds prompts
# being prefilled, and cache-aware routing does not spread contexts perfectly evenly.
CACHE_FILL = 0.8


def role_counts(
    engines: Sequence[EngineState],
    *,
    issued: Mapping[str, Role],
    instances: int,
    assumed_prefill: int,
) -> RoleCounts:
    """Counts by role of usable instances; a switching one counts as its destination.

    ``issued`` holds the destination of every switch the Controller started or resumed
    and has not seen end; a switching instance without one is unavailable. An instance
    of ``issued`` whose agent missed this reading counts as its destination too: a
    missed ``/v1/state`` says nothing about the switch, and right after an operator
    restart the agent of a resumed switch (draining, flipping, verifying) is the one most
    likely to miss one. Counted as unavailable, it would leave its destination short and
    start a second switch toward the same split. Without engine states, the split
    assumed is ``assumed_prefill`` of the spec's ``instances``.
    """
    if not engines:
        n = instances
        p = min(assumed_prefill, n)
        assumed = tuple(f"prefill-{i}" for i in range(p))
        return RoleCounts(prefill=p, decode=n - p, unavailable=0, names=assumed)
    p = d = unavailable = 0
    names: list[str] = []
    for s in sorted(engines, key=lambda s: s.instance):
        if not s.healthy:
            unavailable += 1
            continue
        role: Role | None = s.role
        if s.switching:
            role = issued.get(s.instance)
            if role is None:
                unavailable += 1
                continue
        if role == "prefill":
            p += 1
            if not s.switching:
                names.append(s.instance)
        else:
            d += 1
    answered = {s.instance for s in engines}
    # Never more than the instances the spec owns beyond those that answered.
    missing = max(0, instances - len(engines))
    unanswered = [r for n, r in sorted(issued.items()) if n not in answered][:missing]
    p += unanswered.count("prefill")
    d += unanswered.count("decode")
    # Every switch under way takes a slot, also one this Controller does not know of.
    switching = sum(1 for s in engines if s.switching) + len(unanswered)
    # The other instances the spec owns that no agent answered for are unavailable.
    unavailable += max(0, instances - len(engines) - len(unanswered))
    return RoleCounts(
        prefill=p, decode=d, unavailable=unavailable, names=tuple(names), switching=switching
    )


def kv_capacity(engines: Sequence[EngineState], *, configured: int | None) -> int:
    """C_KV: the spec's, else the engines' reported KV capacity (decode engines first)."""
    if configured:
        return configured
    caps = [s.kv_capacity_tokens for s in engines if s.kv_capacity_tokens > 0]
    decode = [
        s.kv_capacity_tokens for s in engines if s.kv_capacity_tokens > 0 and s.role == "decode"
    ]
    pick = decode or caps
    return int(sum(pick) / len(pick)) if pick else DEFAULT_KV_TOKENS


def decode_kv(engines: Sequence[EngineState], table: TrajectoryTable) -> float:
    """K_D: the engines' decode KV in use; without engine states, the prompts in decode."""
    decode = [s for s in engines if s.role == "decode" and s.healthy]
    if decode:
        # Requests waiting for decode admission already hold their KV elsewhere and
        # need it here next: they are part of the decode footprint.
        return float(sum(s.kv_used_tokens + s.waiting_tokens for s in decode))
    n = table.hwm
    state = table.cols["state"][:n]
    return float(table.cols["x"][:n][state == DECODE].sum())


def in_prefill(engines: Sequence[EngineState]) -> int | None:
    """Requests the prefill engines hold (running or queued); None without engine states."""
    if not engines:
        return None
    return sum(s.running_requests + s.waiting_requests for s in engines if s.role == "prefill")


def prefilling(engines: Sequence[EngineState], table: TrajectoryTable) -> float:
    """Requests waiting for or in prefill now (engines; else the trainer's view)."""
    prefill = [s for s in engines if s.role == "prefill" and s.healthy]
    if prefill:
        return float(sum(s.running_requests + s.waiting_requests for s in prefill))
    return float(table.counts[READY] + table.counts[PREFILL])


def decoding(engines: Sequence[EngineState], table: TrajectoryTable) -> float:
    """Requests decoding or waiting for decode now (engines; else the trainer's view)."""
    decode = [s for s in engines if s.role == "decode" and s.healthy]
    if decode:
        return float(sum(s.running_requests + s.waiting_requests for s in decode))
    return float(table.counts[DECODE])


def decode_backlog(engines: Sequence[EngineState], table: TrajectoryTable) -> DecodeBacklog:
    """Requests the trainer counts in prefill that a decode engine holds for KV room.

    The decode engines hold their running requests and those waiting; the trainer has seen
    decode start for some of them. The rest are still in the trainer's prefill set: a
    trainer that sees only the first token (behind a PD router) keeps a request there until
    decode admits it; one that reports each prefill's end has none there. Of those, only
    the prompts waiting for KV room (a decode engine's waiting tokens) wait on decode; the
    others wait for their prefill.
    """
    decode = [s for s in engines if s.role == "decode" and s.healthy]
    held = sum(s.running_requests + s.waiting_requests for s in decode)
    waiting = sum(s.waiting_requests for s in decode)
    unseen = held - int(table.counts[DECODE])
    requests = max(0, min(waiting, unseen, int(table.counts[PREFILL])))
    return DecodeBacklog(requests=requests, tokens=float(sum(s.waiting_tokens for s in decode)))


def decode_waiting(engines: Sequence[EngineState]) -> int:
    """Requests queued on the decode engines: prefilled prompts waiting for KV room."""
    return sum(s.waiting_requests for s in engines if s.role == "decode" and s.healthy)


def cache_floor(
    engines: Sequence[EngineState],
    table: TrajectoryTable,
    *,
    cache_tokens: int | None,
    cache_scale: float,
) -> float:
    """Prefill instances whose prefix caches hold the context of every live trajectory.

    A trajectory in a tool call or decoding comes back with its context as the prefix of
    its next prompt. When the prefill instances' caches cannot hold those contexts,
    every turn recomputes its whole context instead of its new tokens: prefill work
    grows tenfold and more, and the split falls off a cliff that demand alone does not
    show (Qwen3-235B coding, 512 trajectories of ~30k tokens in 8M-token caches: 2P:6D
    ran 7× slower than 3P:5D in the simulator). Trajectories starting or in reward hold
    no context that returns. ``cache_tokens`` is ``capacity.prefillCacheTokens``; unset,
    the prefill engines' KV capacity times ``cache_scale``.
    """
    per = cache_tokens
    if per is None:
        caps = [
            s.kv_capacity_tokens
            for s in engines
            if s.role == "prefill" and s.kv_capacity_tokens > 0
        ]
        per = int(sum(caps) / len(caps) * cache_scale) if caps else 0
    if per <= 0:
        return 0.0
    n = table.hwm
    state = table.cols["state"][:n]
    live = np.isin(state, (READY, PREFILL, DECODE, TOOL))
    return float(table.cols["x"][:n][live].sum()) / (CACHE_FILL * per)


def decode_throughput_demand(requests: float, n_decode: int, *, concurrency: int | None) -> float:
    """Decode instances' worth of step throughput that ``requests`` in decode use.

    A decode rank's step takes about t₀·(1 + n/k) at batch n, with k the half-saturation
    knee (``capacity.decodeConcurrency``); it emits n/(t₀(1 + n/k)) tokens a second, at
    most k/t₀. Requests in decode are therefore not demand in units of k: r = n/k
    requests per knee on n_D instances use the fraction u = r/(n_D + r) of their
    throughput (Little's law), so the decode side needs u·n_D = n_D·r/(n_D + r)
    instances of throughput, and a split with fewer runs past capacity. Past the knee
    decode is slower per token, not overloaded, which r itself would have said.
    """
    if not concurrency or requests <= 0:
        return 0.0
    r = requests / concurrency
    n = max(n_decode, 1)
    return n * r / (n + r)


def decode_share(table: TrajectoryTable) -> float:
    """The share of the trajectories between tool calls that are decoding (trainer's view).

    By Little's law the trajectories in a state are proportional to the time a turn
    spends in it, so this is the share of a turn's prefill and decode time spent
    decoding: about 1 for long reasoning decodes, lower for agentic turns that
    re-prefill long contexts. It weighs the decode step speed against the prefill
    side when switches are priced. Before any events: the prior.
    """
    counts = table.counts
    decodes = counts[DECODE]
    total = decodes + counts[READY] + counts[PREFILL]
    return decodes / total if total else PRIOR_DECODE_SHARE
