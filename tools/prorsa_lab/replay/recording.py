"""A recording's trajectories as simulator scripts, and the trainer dispatch it shows.

Input: the NDJSON a trainer's events were recorded to (``prorsa record``, or the SDK's
``record=``; docs/webhook-events.md). Each trajectory becomes a
:class:`~prorsa_lab.sim.workloads.TrajectoryScript` the simulator's trainer replays on every
policy: its prompt, each turn's output tokens (aborted attempts summed), the tool and its
time, the tool result's tokens, its sandbox mode and time, its reward time and verdict.
Durations that are the trainer's own (sandbox, tool, reward) come from the recording;
everything the engines decide (queueing, prefill, decode) is left to the simulator, so a
faster split really finishes sooner.

Which times are taken:
- sandbox: dispatch to its first ``request_queued`` (the trainer's wait before it asks);
- tool: the turn's ``decode_finished`` to the next turn's ``request_queued`` (what the
  trainer adds between turns, tool and bookkeeping), else ``tool_started`` to
  ``tool_finished`` when the trajectory stops there;
- tool result tokens: the next prompt less the last prompt, the output and the simulator's
  chat-template tokens (so the replay's prompts are the recorded ones), else
  ``tool_finished.result_tokens``;
- reward: ``reward_started`` (else the last ``decode_finished``) to ``reward_finished``.

A trajectory that never finished stops where its recording does (cut); one that was dropped
is dropped there. Groups are replayed one after the other in the order their first member
was dispatched (the simulator's trainer dispatches a group's members together).
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from prorsa_contract import events as ev
from prorsa_lab.sim.trainer import INJECTIONS
from prorsa_lab.sim.workloads import TEMPLATE_TOKENS, Finish, StopPhase, TrajectoryScript, Turn

# A dispatch this soon after an accepted reward is that reward's replacement (the SDK sends
# both from the trainer's loop; the simulator's trainer sends them at the same instant).
REPLACE_WINDOW_SECONDS = 1.0
# Share of mid-step dispatches that must follow an accepted reward for replace-on-reward.
REPLACE_SHARE = 0.9
# A trainer that replaces every trajectory that ends dispatches the next one at once (the
# demo's trainer within a millisecond; the simulator's at the same instant): a dispatch this
# soon after a rejected or dropped trajectory is its replacement.
REPLACE_END_SECONDS = 0.05


class RecordingError(ValueError):
    """The recording cannot be replayed; ``problems`` names each line or trajectory."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        shown = "; ".join(self.problems[:5])
        more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        super().__init__(shown + more)


@dataclass(frozen=True, slots=True, kw_only=True)
class Dispatch:
    """The trainer's dispatch rule, as the simulator's trainer takes it."""

    group_size: int
    groups_per_step: int
    staleness: int
    injection: str
    max_concurrent: int | None  # None on-policy
    steps: int
    rate_per_second: float  # fixedRate only
    weight_update_seconds: float
    weight_update_events: bool
    prefill_events: str
    # No weight update recorded and a concurrency cap: one step over the whole recording.
    capped: bool = False

    @property
    def batch(self) -> int:
        return self.group_size * self.groups_per_step

    def describe(self) -> str:
        if self.capped:
            return (
                f"concurrency-capped, no weight update: {self.injection}, at most "
                f"{self.max_concurrent} in flight, groups of {self.group_size}"
            )
        mode = "on-policy" if self.staleness == 0 else f"asynchronous, staleness {self.staleness}"
        groups = f"{self.groups_per_step} group" + ("s" if self.groups_per_step != 1 else "")
        parts = [
            mode,
            f"batch {self.batch} ({groups} of {self.group_size})",
            f"{self.steps} steps",
        ]
        if self.staleness:
            rate = f" at {self.rate_per_second:.2f}/s" if self.injection == "fixedRate" else ""
            parts.append(f"{self.injection}{rate}, at most {self.max_concurrent} in flight")
        parts.append(f"weight updates {self.weight_update_seconds:.1f} s")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """One recorded generation: queued, its prefill's end when the trainer sent it, its
    decode's end, the tokens it produced, its mean context, and the prompt tokens its
    prefill computed (those past the trajectory's last context, which a prefix cache holds)
    on top of that cached prefix."""

    queued: float
    prefill_end: float | None
    end: float
    tokens: int
    context: float
    new_tokens: int
    prefix: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Recording:
    """A recording rebuilt: the scripts in dispatch order, the dispatch rule, what it saw."""

    path: str
    scripts: tuple[TrajectoryScript, ...]
    dispatch: Dispatch
    # How each dispatch figure was found (printed, so a user can check and override it).
    inferred: tuple[str, ...]
    span_seconds: float  # first dispatch to the last event
    completed_at: tuple[float, ...]  # recorded reward_finished times from the first dispatch
    cut: int
    dropped: int
    decode_samples: tuple[DecodeSample, ...] = field(repr=False)
    prefill_instances: int  # distinct prefill instances its events name (0: none named)

    @property
    def completed(self) -> int:
        return len(self.completed_at)


def read_events(path: Path) -> tuple[list[ev.Event], list[int]]:
    """The events of an NDJSON file and their line numbers; :class:`RecordingError` names
    every line that is not an event."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise RecordingError([f"{path}: {exc.strerror}"]) from None
    except UnicodeDecodeError:
        raise RecordingError([f"{path}: not NDJSON (not UTF-8 text)"]) from None
    numbered = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    if not numbered:
        raise RecordingError([f"{path}: no events (an empty file)"])
    try:
        events = ev.parse_lines([line for _, line in numbered])
    except ev.BatchError as exc:
        problems = []
        for err in exc.errors:
            line = numbered[err.index][0] if err.index is not None else 0
            problems.append(f"{path}:{line}: {err.field}: {err.message}")
        raise RecordingError(problems) from None
    return events, [n for n, _ in numbered]


@dataclass
class _Attempt:
    prompt: int
    queued: float
    cached: int  # the trajectory's context when it was queued
    prefill_end: float | None = None


@dataclass
class _Traj:
    """What one trajectory's events said, in order."""

    tid: str
    first_line: int
    dispatched: float | None = None
    version: int = 0
    group: str | None = None
    prompt_hint: int = 0
    mode: str | None = None
    turns: list[Turn] = field(default_factory=list)
    prompts: list[int] = field(default_factory=list)  # first prompt of each turn
    queued: list[float] = field(default_factory=list)  # first request_queued of each turn
    decode_end: list[float] = field(default_factory=list)
    open: _Attempt | None = None  # the request in flight
    context: int = 0  # prompt + output of its last generation
    open_turn: int | None = None
    produced: int = 0  # tokens of the open turn from aborted attempts
    awaiting_next: bool = False  # last turn ended in a tool call
    tool_started: float | None = None
    tool_seconds: float | None = None
    tool_result: int | None = None
    reward_started: float | None = None
    reward_seconds: float | None = None
    accepted: bool = False
    finished_at: float | None = None
    dropped: str | None = None
    dropped_at: float | None = None
    terminal_version: int | None = None


def _fail(tid: str, what: str, line: int) -> str:
    return f"trajectory {tid}: {what} (line {line})"


def rebuild(path: Path) -> Recording:
    """Read and rebuild a recording (see the module docstring); :class:`RecordingError`
    names every trajectory that cannot be replayed and what it misses."""
    events, lines = read_events(path)
    return rebuild_events(events, lines, source=str(path))


def rebuild_events(
    events: Sequence[ev.Event], lines: Sequence[int], *, source: str = "<events>"
) -> Recording:
    trajs: dict[str, _Traj] = {}
    problems: list[str] = []
    updates: list[tuple[int, float, float | None]] = []  # (version, started ts, seconds)
    update_start: dict[int, float] = {}
    version = 0
    prefill_started = prefill_finished = False
    instances: set[str] = set()
    samples: list[DecodeSample] = []
    # (ts, kind) in file order, for the dispatch inference
    timeline: list[tuple[float, str, str]] = []
    last_ts = -math.inf
    for e, line in zip(events, lines, strict=True):
        last_ts = max(last_ts, e.ts)
        if isinstance(e, ev.WeightUpdateStarted):
            version = max(version, e.version)
            update_start[e.version] = e.ts
            updates.append((e.version, e.ts, e.expected_seconds))
            timeline.append((e.ts, "update", ""))
            continue
        if isinstance(e, ev.WeightUpdateFinished):
            start = update_start.get(e.version)
            if start is not None:
                updates = [
                    (v, t, s if s is not None or v != e.version else e.ts - start)
                    for v, t, s in updates
                ]
            continue
        t = trajs.get(e.trajectory)
        if t is None:
            t = trajs[e.trajectory] = _Traj(tid=e.trajectory, first_line=line)
        if isinstance(e, ev.SampleDispatched):
            t.dispatched = e.ts
            t.version = version
            t.group = e.group
            t.prompt_hint = e.prompt_tokens or 0
            timeline.append((e.ts, "dispatch", t.tid))
        elif t.dispatched is None:
            if t.first_line == line:
                problems.append(
                    _fail(
                        t.tid,
                        f"{e.type} before its sample_dispatched: the recording "
                        "must start before its trajectories do",
                        line,
                    )
                )
            continue
        elif isinstance(e, ev.SandboxStarted):
            t.mode = e.mode
        elif isinstance(e, ev.RequestQueued):
            if t.open_turn is None or e.turn != t.open_turn:
                if t.open is not None:
                    problems.append(
                        _fail(
                            t.tid,
                            "request_queued for a new turn while "
                            "the last request has no decode_finished",
                            line,
                        )
                    )
                    continue
                t.open_turn = e.turn
                t.produced = 0
                t.prompts.append(e.prompt_tokens)
                t.queued.append(e.ts)
                t.awaiting_next = False
            t.open = _Attempt(
                prompt=e.prompt_tokens, queued=e.ts, cached=min(t.context, e.prompt_tokens)
            )
        elif isinstance(e, ev.PrefillStarted | ev.PrefillFinished):
            prefill_started |= isinstance(e, ev.PrefillStarted)
            prefill_finished |= isinstance(e, ev.PrefillFinished)
            if e.instance:
                instances.add(e.instance)
            if isinstance(e, ev.PrefillFinished) and t.open is not None:
                t.open.prefill_end = e.ts
        elif isinstance(e, ev.DecodeFinished):
            if t.open is None:
                problems.append(_fail(t.tid, "decode_finished without its request_queued", line))
                continue
            attempt, t.open = t.open, None
            t.context = attempt.prompt + e.output_tokens
            if e.output_tokens >= 16:
                samples.append(
                    DecodeSample(
                        queued=attempt.queued,
                        prefill_end=attempt.prefill_end,
                        end=e.ts,
                        tokens=e.output_tokens,
                        context=attempt.prompt + e.output_tokens / 2,
                        new_tokens=max(1, attempt.prompt - attempt.cached),
                        prefix=attempt.cached,
                    )
                )
            if e.finish == "abort":
                t.produced += e.output_tokens
                continue
            finish: Finish = e.finish
            t.turns.append(Turn(output=max(1, t.produced + e.output_tokens), finish=finish))
            t.decode_end.append(e.ts)
            t.open_turn = None
            t.awaiting_next = finish == "tool"
        elif isinstance(e, ev.ToolStarted):
            if not t.turns or not t.awaiting_next:
                problems.append(_fail(t.tid, "tool_started without a decode_finished", line))
                continue
            last = t.turns[-1]
            t.turns[-1] = Turn(output=last.output, finish="tool", tool=e.tool)
            t.tool_started = e.ts
            t.tool_seconds = t.tool_result = None
        elif isinstance(e, ev.ToolFinished):
            if t.tool_started is not None:
                t.tool_seconds = e.ts - t.tool_started
            t.tool_result = e.result_tokens
        elif isinstance(e, ev.RewardStarted):
            if not t.turns or t.open is not None:
                problems.append(_fail(t.tid, "reward_started without a decode_finished", line))
                continue
            t.reward_started = e.ts
        elif isinstance(e, ev.RewardFinished):
            if not t.turns or t.open is not None:
                problems.append(_fail(t.tid, "reward_finished without a decode_finished", line))
                continue
            start = t.reward_started if t.reward_started is not None else t.decode_end[-1]
            t.reward_seconds = max(0.0, e.ts - start)
            t.accepted = e.accepted
            t.finished_at = e.ts
            t.terminal_version = version
            timeline.append((e.ts, "accepted" if e.accepted else "rejected", t.tid))
        elif isinstance(e, ev.TrajectoryDropped):
            t.dropped = e.reason or "dropped"
            t.dropped_at = e.ts
            t.terminal_version = version
            timeline.append((e.ts, "dropped", t.tid))
    if problems:
        raise RecordingError(problems)
    dispatched = [t for t in trajs.values() if t.dispatched is not None]
    if not dispatched:
        raise RecordingError([f"{source}: no sample_dispatched event: nothing to replay"])
    start = min(t.dispatched for t in dispatched if t.dispatched is not None)
    # Groups in the order of their first dispatch; members in dispatch order.
    order = {t.tid: i for i, t in enumerate(dispatched)}
    first: dict[str, int] = {}
    for t in dispatched:
        first.setdefault(t.group or f"\0{t.tid}", len(first))
    dispatched.sort(key=lambda t: (first[t.group or f"\0{t.tid}"], order[t.tid]))
    scripts = tuple(
        _script(t, index=i, group=first[t.group or f"\0{t.tid}"], start=start)
        for i, t in enumerate(dispatched)
    )
    # Renumber groups 0.. in script order (the trainer opens them in that order).
    renumber: dict[int, int] = {}
    scripts = tuple(_with_group(s, renumber.setdefault(s.group, len(renumber))) for s in scripts)
    dispatch, inferred = _infer(
        dispatched,
        scripts,
        timeline,
        updates,
        prefill_events="full"
        if prefill_started
        else ("first-token" if prefill_finished else "none"),
    )
    completed_at = sorted(t.finished_at - start for t in dispatched if t.finished_at is not None)
    return Recording(
        path=source,
        scripts=scripts,
        dispatch=dispatch,
        inferred=tuple(inferred),
        span_seconds=last_ts - start,
        completed_at=tuple(completed_at),
        cut=sum(s.stop is not None and s.drop_reason is None for s in scripts),
        dropped=sum(s.drop_reason is not None for s in scripts),
        decode_samples=tuple(samples),
        prefill_instances=len(instances),
    )


def _with_group(s: TrajectoryScript, group: int) -> TrajectoryScript:
    return replace(s, group=group)


def _script(t: _Traj, *, index: int, group: int, start: float) -> TrajectoryScript:
    """The trajectory's script (module docstring: which times are taken)."""
    assert t.dispatched is not None
    turns = list(t.turns)
    stop: StopPhase | None = None
    if t.open is not None or (t.open_turn is not None and len(t.prompts) > len(turns)):
        # In a generation when the recording ends: replay what it produced, then stop.
        turns.append(Turn(output=max(1, t.produced), finish="stop"))
        stop = "decode"
    elif not turns:
        stop = "sandbox"
    elif t.finished_at is None:
        reached_reward = t.reward_started is not None or turns[-1].finish != "tool"
        stop = "reward" if reached_reward else "tool"
    built: list[Turn] = []
    for k, turn in enumerate(turns):
        if turn.finish != "tool" or (k == len(turns) - 1 and stop == "decode"):
            built.append(turn)
            continue
        if k + 1 < len(t.prompts):  # the next turn's request shows the result and the gap
            seconds = max(0.0, t.queued[k + 1] - t.decode_end[k])
            result = max(0, t.prompts[k + 1] - t.prompts[k] - turn.output - TEMPLATE_TOKENS)
        else:
            seconds = t.tool_seconds or 0.0
            result = t.tool_result or 0
        built.append(
            Turn(
                output=turn.output,
                finish="tool",
                tool=turn.tool,
                tool_seconds=seconds,
                result_tokens=result,
            )
        )
    sandbox = (t.queued[0] if t.queued else t.dispatched) - t.dispatched
    mode: Literal["prewarm", "cold"] = "prewarm" if t.mode == "prewarm" else "cold"
    return TrajectoryScript(
        task="replay",
        index=index,
        group=group,
        prompt=t.prompts[0] if t.prompts else t.prompt_hint,
        turns=tuple(built),
        prewarm_seconds=sandbox,
        cold_seconds=sandbox,
        reward_seconds=t.reward_seconds or 0.0,
        accepted=t.accepted,
        sandbox=mode,
        stop=stop,
        drop_reason=t.dropped,
    )


def _infer(
    trajs: list[_Traj],
    scripts: tuple[TrajectoryScript, ...],
    timeline: list[tuple[float, str, str]],
    updates: list[tuple[int, float, float | None]],
    *,
    prefill_events: str,
) -> tuple[Dispatch, list[str]]:
    """The trainer's dispatch rule from what the recording shows (each finding explained)."""
    notes: list[str] = []
    sizes = Counter(s.group for s in scripts)
    group_size = Counter(sizes.values()).most_common(1)[0][0]
    notes.append(f"group size {group_size}: the most common trajectories per group")
    steps = len(updates) + 1
    notes.append(f"{steps} steps: {len(updates)} weight updates recorded, then the last step")
    by_tid = {t.tid: t for t in trajs}
    group_of = {s_t.tid: s.group for s_t, s in zip(trajs, scripts, strict=True)}
    # Dispatches inside a step (not at the start or at a weight update): an on-policy
    # trainer dispatches a whole step at once, an asynchronous one refills as it goes.
    update_times = {round(ts, 6) for _v, ts, _s in updates}
    t0 = min(t.dispatched for t in trajs if t.dispatched is not None)
    mid = [
        (ts, tid)
        for ts, kind, tid in timeline
        if kind == "dispatch" and ts > t0 and round(ts, 6) not in update_times
    ]
    outlived = any(
        t.terminal_version is not None and t.terminal_version > t.version for t in trajs
    ) or any(t.terminal_version is None and t.version < len(updates) for t in trajs)
    spans = outlived or bool(mid)
    # Groups complete at the first update (or by the end): a step's worth.
    first_update = updates[0][1] if updates else math.inf
    members: dict[int, list[_Traj]] = {}
    for tid, g in group_of.items():
        members.setdefault(g, []).append(by_tid[tid])

    def complete_by(ts: float, g: int) -> bool:
        ms = members[g]
        ends = [m.finished_at if m.finished_at is not None else m.dropped_at for m in ms]
        if any(end is None or end > ts for end in ends):
            return False
        return not spans or any(m.accepted for m in ms)

    if updates:
        complete = [g for g in members if complete_by(first_update, g)]
        groups_per_step = max(1, len(complete))
        notes.append(
            f"{groups_per_step} groups per step: groups complete at the first weight update"
        )
    else:
        groups_per_step = len(members)
        notes.append(
            f"{groups_per_step} groups per step: no weight update recorded, so one step of "
            "every group (the replay ends when the recorded trajectories do)"
        )
    live = peak = 0
    for _ts, kind, _tid in timeline:
        if kind == "dispatch":
            live += 1
            peak = max(peak, live)
        elif kind in ("accepted", "rejected", "dropped"):
            live -= 1
    if not updates and peak < len(trajs):
        return _capped(trajs, timeline, group_size, peak, notes, prefill_events=prefill_events)
    if not spans:
        notes.append("on-policy: every dispatch at a step's start, none outlived an update")
        dispatch = Dispatch(
            group_size=group_size,
            groups_per_step=groups_per_step,
            staleness=0,
            injection="replaceOnReward",
            max_concurrent=None,
            steps=steps,
            rate_per_second=0.0,
            weight_update_seconds=_update_seconds(updates),
            weight_update_events=bool(updates),
            prefill_events=prefill_events,
        )
        return dispatch, notes
    # Staleness: the most versions a trajectory lived through (the trainer drops those
    # older than it), and the dispatch cap (version + s + 1) x batch it stayed under.
    final = len(updates)
    lags = []
    for t in trajs:
        end = t.terminal_version if t.terminal_version is not None else final
        if t.dropped == "staleness":
            end -= 1
        lags.append(end - t.version)
    staleness = max(1, max(lags))
    batch = group_size * groups_per_step
    count = 0
    seen = 0
    for _ts, kind, _tid in timeline:
        if kind == "update":
            seen += 1
        elif kind == "dispatch":
            count += 1
            staleness = max(staleness, math.ceil(count / batch) - seen - 1)
    why = (
        "the most weight versions a trajectory lived through"
        if outlived
        else "trajectories dispatched inside a step"
    )
    notes.append(f"staleness {staleness}: {why} (at least; a longer recording can show more)")
    notes.append(f"at most {peak} in flight: the most live trajectories recorded")
    accepted_at = sorted(ts for ts, kind, _ in timeline if kind == "accepted")
    injection, rate = "replaceOnReward", 0.0
    if mid:
        whole = _whole_groups(mid, group_of, sizes)
        after_reward = sum(1 for ts, _ in mid if _follows(accepted_at, ts))
        if whole:
            injection = "groupReplenish"
            notes.append("groupReplenish: mid-step dispatches come a whole group at a time")
        elif after_reward >= REPLACE_SHARE * len(mid):
            notes.append(
                f"replaceOnReward: {after_reward} of {len(mid)} mid-step dispatches "
                f"follow an accepted reward within {REPLACE_WINDOW_SECONDS:.0f} s"
            )
        else:
            span = max(ts for ts, _ in mid) - t0
            injection, rate = "fixedRate", len(mid) / span if span > 0 else 1.0
            notes.append(
                f"fixedRate {rate:.3f}/s: {len(mid)} mid-step dispatches, "
                f"only {after_reward} after an accepted reward"
            )
    else:
        notes.append("replaceOnReward: no mid-step dispatch to tell (the default)")
    assert injection in INJECTIONS
    dispatch = Dispatch(
        group_size=group_size,
        groups_per_step=groups_per_step,
        staleness=staleness,
        injection=injection,
        max_concurrent=peak,
        steps=steps,
        rate_per_second=rate,
        weight_update_seconds=_update_seconds(updates),
        weight_update_events=bool(updates),
        prefill_events=prefill_events,
    )
    return dispatch, notes


def _capped(
    trajs: list[_Traj],
    timeline: list[tuple[float, str, str]],
    group_size: int,
    peak: int,
    notes: list[str],
    *,
    prefill_events: str,
) -> tuple[Dispatch, list[str]]:
    """No weight update, and never every trajectory in flight at once: the trainer capped
    its concurrency. Replace-on-end when the trajectories that ended without an accepted
    reward were replaced too (a dispatch right after most of them); else replace-on-reward
    under the cap."""
    dispatches = sorted(ts for ts, kind, _ in timeline if kind == "dispatch")
    last = dispatches[-1] if dispatches else -math.inf
    # Ends without an accepted reward while the trainer still dispatched (the drops of a
    # run's end come after its last dispatch).
    unrewarded = [ts for ts, kind, _ in timeline if kind in ("rejected", "dropped") and ts <= last]
    replaced = sum(
        1
        for ts in unrewarded
        if (i := bisect_left(dispatches, ts)) < len(dispatches)
        and dispatches[i] - ts <= REPLACE_END_SECONDS
    )
    notes.append(
        f"no weight update recorded and at most {peak} of {len(trajs)} in flight: "
        "a concurrency-capped trainer, replayed as one step (staleness does not apply)"
    )
    if unrewarded and replaced >= REPLACE_SHARE * len(unrewarded):
        injection = "replaceOnEnd"
        notes.append(
            f"replaceOnEnd: {replaced} of the {len(unrewarded)} trajectories that ended "
            f"without an accepted reward were replaced within {REPLACE_END_SECONDS:.2f} s"
        )
    else:
        injection = "replaceOnReward"
        why = (
            f"{replaced} of the {len(unrewarded)} trajectories that ended without an "
            "accepted reward were replaced"
            if unrewarded
            else "no trajectory ended without an accepted reward before the last dispatch"
        )
        notes.append(f"replaceOnReward: {why}")
    # One step over the whole recording: the dispatch cap (version + s + 1) x batch then
    # never binds before the in-flight cap does.
    dispatch = Dispatch(
        group_size=group_size,
        groups_per_step=max(1, len({t.group for t in trajs})),
        staleness=1,
        injection=injection,
        max_concurrent=peak,
        steps=1,
        rate_per_second=0.0,
        weight_update_seconds=0.0,
        weight_update_events=False,
        prefill_events=prefill_events,
        capped=True,
    )
    return dispatch, notes


def _follows(accepted_at: list[float], ts: float) -> bool:
    i = bisect_right(accepted_at, ts)
    return i > 0 and ts - accepted_at[i - 1] <= REPLACE_WINDOW_SECONDS


def _whole_groups(
    mid: list[tuple[float, str]], group_of: dict[str, int], sizes: Counter[int]
) -> bool:
    """Whether every mid-step dispatch came with its whole group at one instant."""
    at: dict[int, set[float]] = {}
    count: Counter[int] = Counter()
    for ts, tid in mid:
        g = group_of[tid]
        at.setdefault(g, set()).add(round(ts, 6))
        count[g] += 1
    return (
        all(len(v) == 1 and count[g] == sizes[g] for g, v in at.items())
        and sizes[group_of[mid[0][1]]] > 1
    )


def _update_seconds(updates: list[tuple[int, float, float | None]]) -> float:
    known = [s for _v, _t, s in updates if s is not None]
    return statistics.median(known) if known else 0.0
