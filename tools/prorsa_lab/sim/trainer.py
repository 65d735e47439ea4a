"""The simulated RL trainer: GRPO groups, sandboxes, tools, rewards, and its webhook events.

It drives every trajectory through the lifecycle of the paper's Figure 4 (dispatch, sandbox
start from the prewarm pool or cold, ready queue, prefill, KV transfer, decode, tool, back to
ready, reward) and emits exactly the webhook CONTRACT events for it (docs/webhook-events.md),
as pydantic models from :mod:`prorsa_contract.events` (validated on construction). The Prorsa policy
sees nothing else of the trainer. Each weight update is announced with the cluster events
``weight_update_started`` / ``weight_update_finished`` unless ``weight_update_events`` is
off, which leaves the Controller to infer updates from the burst of aborts. An update takes
``weight_update_seconds`` (0: none): the engines sit idle, the trainer holds every request
until it ends (AReaL's ``pause()`` / ``resume()``), and the start event says how long.

Which prefill events it sends is ``prefill_events``, for what a trainer can see:
- ``full``: ``prefill_started`` and ``prefill_finished`` with the prefill instance, as a
  trainer that routes its own requests (or a router that reports) would;
- ``first-token``: a streaming client behind a PD router: only ``prefill_finished``, with no
  instance, when the first token comes back (the prefill's end plus the KV transfer);
- ``none``: a blocking client behind a PD router: ``request_queued``, then
  ``decode_finished`` (the verl and AReaL clients today).

Rollout modes:
- on-policy (staleness 0): a step dispatches ``groups_per_step`` groups and waits for all of
  them; the next step starts on the new weights.
- asynchronous with staleness s (AReaL's StalenessManager rule): at most ``max_concurrent``
  trajectories are in flight (AReaL's ``max_concurrent_rollouts``; here two batches by
  default, the over-dispatch of paper §5.4) and at most ``(version + s + 1) x batch`` are
  ever dispatched; a step ends as soon
  as ``groups_per_step`` more groups are complete; the weights then change, in-flight
  generations are interrupted and resent (carried-over trajectories re-prefill), trajectories
  dispatched more than s versions ago are dropped, and free slots are refilled. Within a
  step new samples come by one of four injection policies: replace-on-reward (one per
  trajectory that passes training admission), fixed-rate refresh, group replenishment (a
  whole group when a group completes), or replace-on-end (one per trajectory that ends,
  whatever its reward: a trainer that only caps concurrency; replays infer it).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from prorsa_contract import events as ev
from prorsa_lab.sim.engine import SimCluster, SimRequest
from prorsa_lab.sim.loop import Loop
from prorsa_lab.sim.workloads import TEMPLATE_TOKENS, TaskProfile, TrajectoryScript

# replaceOnEnd: a fixed number in flight, a new trajectory whenever one ends (accepted,
# rejected or dropped): a trainer that only caps concurrency, as AReaL's capacity does
# between weight updates, and the demo's trainer (prorsa_lab.demo.trainer). Not a CRD
# injection policy (the Controller forecasts it as replaceOnReward); replays infer it.
Injection = Literal["replaceOnReward", "fixedRate", "groupReplenish", "replaceOnEnd"]
INJECTIONS: tuple[str, ...] = ("replaceOnReward", "fixedRate", "groupReplenish", "replaceOnEnd")
PrefillEvents = Literal["full", "first-token", "none"]
PREFILL_EVENTS: tuple[str, ...] = ("full", "first-token", "none")
# Asynchronous rollout keeps this many batches in flight by default ("sample over-dispatch",
# paper §5.4); AReaL's own default, one batch, is max_concurrent=batch.
OVER_DISPATCH = 2
# Live trajectories whose context comes back to prefill on new weights: the interrupted
# generations (resent as ready) and tool calls in progress (paper §3.1).
_REPREFILL = frozenset({"ready", "prefill", "decode", "tool"})


@dataclass(slots=True)
class Group:
    gid: int
    name: str
    size: int
    dispatched: int = 0
    terminal: int = 0
    accepted: int = 0


@dataclass(slots=True, eq=False)
class Trajectory:
    tid: str
    script: TrajectoryScript
    group: Group
    version: int
    dispatched_at: float
    state: str = "starting"
    turn: int = 0
    context: int = 0
    produced: int = 0  # tokens of the current turn produced by aborted attempts
    req: SimRequest | None = None
    attempt: int = 0
    events: int = 0
    finished: bool = False
    # Ground truth of the next prefill arrival, for the oracle only: (time, prompt tokens).
    next_arrival: tuple[float, int] | None = None
    reward_end: float | None = None


@dataclass
class TrainerStats:
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # request_queued (t, x)
    admissions: list[tuple[float, int]] = field(default_factory=list)  # prefill done (t, x)
    completions: list[float] = field(default_factory=list)  # trajectory durations
    dropped: int = 0
    dispatched: int = 0
    cold_starts: int = 0
    events: int = 0
    steps: list[float] = field(default_factory=list)  # time each training step completed
    outputs: list[tuple[float, int]] = field(default_factory=list)  # decode done (t, tokens)
    completed_at: list[float] = field(default_factory=list)  # reward_finished times
    cut: int = 0  # replayed trajectories that stopped where their recording ended
    # A replay that stopped before its last step: every trajectory still live had reached
    # the end of its recording and nothing more could be dispatched.
    ran_out: bool = False


class Trainer:
    """Owns the trajectories; the engines report to it as the trainer SDK would see."""

    def __init__(
        self,
        *,
        loop: Loop,
        cluster: SimCluster,
        task: TaskProfile,
        seed: int,
        staleness: int,
        steps: int,
        injection: Injection = "replaceOnReward",
        rate_per_second: float = 0.0,
        groups_per_step: int | None = None,
        max_concurrent: int | None = None,
        max_context: int = 131072,
        emit: bool = False,
        weight_update_events: bool = True,
        prefill_events: PrefillEvents = "full",
        weight_update_seconds: float = 0.0,
        scripts: Sequence[TrajectoryScript] | None = None,
    ) -> None:
        """``scripts``: replay these trajectories (``prorsa replay``), in dispatch order and
        grouped by their ``group`` (consecutive, numbered from 0), instead of drawing them
        from ``task``; dispatching stops when they run out."""
        if prefill_events not in PREFILL_EVENTS:
            raise ValueError(f"unknown prefill events {prefill_events!r}: one of {PREFILL_EVENTS}")
        if staleness < 0 or steps < 1:
            raise ValueError("staleness must be >= 0 and steps >= 1")
        if injection not in INJECTIONS:
            raise ValueError(f"unknown injection policy {injection!r}")
        if injection == "fixedRate" and staleness > 0 and rate_per_second <= 0:
            raise ValueError("fixedRate injection needs rate_per_second > 0")
        self.loop = loop
        self.cluster = cluster
        self.task = task
        self.seed = seed
        self.staleness = staleness
        self.steps = steps
        self.injection = injection
        self.rate = rate_per_second
        self.groups_per_step = groups_per_step or task.groups_per_step
        self.batch = self.groups_per_step * task.group_size
        self.max_concurrent = max_concurrent or OVER_DISPATCH * self.batch
        self.max_context = max_context
        self.emit_events = emit
        self.weight_update_events = weight_update_events
        self.prefill_events = prefill_events
        if weight_update_seconds < 0:
            raise ValueError("weight_update_seconds must be >= 0")
        self.weight_update_seconds = weight_update_seconds
        self.scripts = tuple(scripts) if scripts is not None else None
        self._group_sizes = Counter(x.group for x in self.scripts or ())
        # Requests sent while the engines load new weights: the client is paused and sends
        # them when the update ends (AReaL's pause()/resume(); None when not paused).
        self._held: list[SimRequest] | None = None
        # Called with the time when a weight update starts (the Prorsa policy ticks then,
        # as the operator wakes on the event).
        self.on_update_started: list[Callable[[float], object]] = []
        # Called with the time of every weight update, paused or instantaneous, once the
        # in-flight generations are aborted (the foresight reference decides then).
        self.on_new_weights: list[Callable[[float], object]] = []
        self.outbox: list[ev.Event] = []
        self.version = 0
        self.live: dict[str, Trajectory] = {}
        self.groups_complete = 0
        self.step_groups: list[Group] = []
        self.open_group: Group | None = None
        self.deferred_groups = 0
        self.next_index = 0
        self.next_group = 0
        self.pool = task.prewarm_pool
        self._pool_rng = random.Random(f"{seed}:{task.name}:pool")
        self.stats = TrainerStats()
        self.finished_at: float | None = None
        cluster.listener = self
        cluster.on_prefill_complete = self._on_admission

    # -- public ------------------------------------------------------------------------------

    @property
    def on_policy(self) -> bool:
        return self.staleness == 0

    def start(self) -> None:
        if self.on_policy:
            self._dispatch_step()
            return
        self._top_up()
        if self.injection == "fixedRate":
            self.loop.every(1.0 / self.rate, self._rate_tick, start=self.loop.now + 1.0 / self.rate)

    def _top_up(self) -> None:
        """Fill the free slots (at start and after each weight update)."""
        if self.injection == "groupReplenish":
            g = self.task.group_size
            while len(self.live) + g <= self.max_concurrent and self._allowed(g):
                self._dispatch_group()
            return
        while self._allowed():
            self._dispatch_member()

    def drain_outbox(self) -> list[ev.Event]:
        out, self.outbox = self.outbox, []
        return out

    # -- dispatch ----------------------------------------------------------------------------

    def _allowed(self, n: int = 1) -> bool:
        if self.scripts is not None and self.next_index + n > len(self.scripts):
            return False
        if self.on_policy:
            return True
        if len(self.live) + n > self.max_concurrent:
            return False
        return self.stats.dispatched + n <= (self.version + self.staleness + 1) * self.batch

    def _new_group(self) -> Group:
        gid = self.next_group
        self.next_group += 1
        size = self._group_sizes.get(gid, 0) if self.scripts is not None else 0
        return Group(gid=gid, name=f"g{gid}", size=size or self.task.group_size)

    def _dispatch_step(self) -> None:
        self.step_groups = []
        for _ in range(self.groups_per_step):
            if not self._allowed():  # a replay's trajectories ran out
                break
            self.step_groups.append(self._dispatch_group())

    def _dispatch_group(self) -> Group:
        group = self._new_group()
        for _ in range(group.size):
            self._dispatch(group)
        return group

    def _dispatch_member(self) -> None:
        g = self.open_group
        if g is None or g.dispatched >= g.size:
            g = self.open_group = self._new_group()
        self._dispatch(g)

    def _rate_tick(self, now: float) -> None:
        if self.finished_at is None and self._allowed():
            self._dispatch_member()

    def peek_prompt(self) -> int:
        """The first prompt of the next trajectory to be dispatched (oracle only)."""
        g = self.open_group
        group = g.gid if g is not None and g.dispatched < g.size else self.next_group
        return self._script(self.next_index, group).prompt

    def _script(self, index: int, group: int) -> TrajectoryScript:
        if self.scripts is not None:
            return self.scripts[index]
        return self.task.script(
            seed=self.seed, index=index, group=group, max_context=self.max_context
        )

    def _dispatch(self, group: Group) -> None:
        now = self.loop.now
        index = self.next_index
        self.next_index += 1
        script = self._script(index, group.gid)
        t = Trajectory(
            tid=f"{self.task.name}-{index}",
            script=script,
            group=group,
            version=self.version,
            dispatched_at=now,
            context=script.prompt,
        )
        group.dispatched += 1
        self.live[t.tid] = t
        self.stats.dispatched += 1
        self._emit(
            ev.SampleDispatched,
            t,
            type="sample_dispatched",
            group=group.name,
            task=self.task.name,
            prompt_tokens=script.prompt,
        )
        if script.sandbox is not None:  # replayed: as recorded
            mode = script.sandbox
            delay = script.prewarm_seconds if mode == "prewarm" else script.cold_seconds
            self.stats.cold_starts += mode == "cold"
        elif self.pool > 0:
            self.pool -= 1
            mode, delay = "prewarm", script.prewarm_seconds
            self.loop.after(self.task.cold.draw(self._pool_rng), self._refill_pool)
        else:
            mode, delay = "cold", script.cold_seconds
            self.stats.cold_starts += 1
        self._emit(ev.SandboxStarted, t, type="sandbox_started", mode=mode, image=self.task.name)
        t.next_arrival = (now + delay, script.prompt)
        self.loop.after(delay, self._sandbox_ready, t)

    def _refill_pool(self) -> None:
        self.pool += 1

    # -- lifecycle ---------------------------------------------------------------------------

    def _sandbox_ready(self, t: Trajectory) -> None:
        if t.finished:
            return
        if not t.script.turns:  # replayed: its recording ends in the sandbox start
            self._stop(t)
            return
        self._queue(t)

    def _queue(self, t: Trajectory, *, new_tokens: int | None = None) -> None:
        turn = t.script.turns[t.turn]
        t.attempt += 1
        req = SimRequest(
            rid=f"{t.tid}.{t.turn}.{t.attempt}",
            traj=t.tid,
            turn=t.turn,
            prompt=t.context,
            new_tokens=new_tokens if new_tokens is not None else turn.output,
            owner=t,
        )
        t.req = req
        t.state = "ready"
        t.next_arrival = None
        now = self.loop.now
        self.stats.arrivals.append((now, req.prompt))
        self._emit(
            ev.RequestQueued,
            t,
            type="request_queued",
            prompt_tokens=req.prompt,
            turn=t.turn,
            request=req.rid,
        )
        if self._held is not None:
            self._held.append(req)
        else:
            self.cluster.submit(req)

    def on_prefill_started(self, req: SimRequest, instance: str, now: float) -> None:
        t: Trajectory = req.owner  # type: ignore[assignment]
        t.state = "prefill"
        if self.prefill_events == "full":
            self._emit(
                ev.PrefillStarted, t, type="prefill_started", request=req.rid, instance=instance
            )

    def on_prefill_finished(self, req: SimRequest, instance: str, now: float) -> None:
        t: Trajectory = req.owner  # type: ignore[assignment]
        t.state = "decode"
        if self.prefill_events == "full":
            self._emit(
                ev.PrefillFinished, t, type="prefill_finished", request=req.rid, instance=instance
            )
        elif self.prefill_events == "first-token":
            # Streamed back once the KV reached a decode engine (its NIC queue left out).
            transfer = self.cluster.profile.transfer_seconds(req.prompt)
            self.loop.after(transfer, self._first_token, t, req)

    def _first_token(self, t: Trajectory, req: SimRequest) -> None:
        if t.finished or t.req is not req:
            return  # aborted in transfer: the resend is a new request
        self._emit(ev.PrefillFinished, t, type="prefill_finished", request=req.rid)

    def _on_admission(self, req: SimRequest, now: float) -> None:
        self.stats.admissions.append((now, req.prompt))

    def on_aborted(self, req: SimRequest, now: float) -> None:
        """Cancel-and-resend: the SDK resubmits prompt + partial output."""
        t: Trajectory = req.owner  # type: ignore[assignment]
        if t.finished or t.req is not req:
            return
        produced = req.generated
        self._emit(
            ev.DecodeFinished, t, type="decode_finished", output_tokens=produced, finish="abort"
        )
        t.produced += produced
        t.context = req.prompt + produced
        remaining = t.script.turns[t.turn].output - t.produced
        self._queue(t, new_tokens=max(1, remaining))

    def on_decode_finished(self, req: SimRequest, now: float) -> None:
        t: Trajectory = req.owner  # type: ignore[assignment]
        if t.finished or t.req is not req:
            return
        turn = t.script.turns[t.turn]
        out = req.generated
        self.stats.outputs.append((now, out))
        t.req = None
        t.context = req.prompt + out
        t.produced = 0
        stop = t.script.stop if t.turn == len(t.script.turns) - 1 else None
        if stop == "decode":  # replayed: its recording ends in this generation
            self._stop(t)
            return
        self._emit(
            ev.DecodeFinished, t, type="decode_finished", output_tokens=out, finish=turn.finish
        )
        if turn.finish == "tool":
            t.state = "tool"
            self._emit(ev.ToolStarted, t, type="tool_started", tool=turn.tool)
            if stop == "tool":
                self._stop(t)
                return
            if t.turn + 1 < len(t.script.turns):  # the result is the next turn's prompt
                nxt = t.context + turn.result_tokens + TEMPLATE_TOKENS
                t.next_arrival = (now + turn.tool_seconds, nxt)
            self.loop.after(turn.tool_seconds, self._tool_done, t, t.turn)
        else:
            self._reward(t, now)

    def _reward(self, t: Trajectory, now: float) -> None:
        t.state = "reward"
        self._emit(ev.RewardStarted, t, type="reward_started")
        if t.turn == len(t.script.turns) - 1 and t.script.stop == "reward":
            self._stop(t)
            return
        t.reward_end = now + t.script.reward_seconds
        self.loop.after(t.script.reward_seconds, self._reward_done, t)

    def _tool_done(self, t: Trajectory, turn: int) -> None:
        if t.finished or t.turn != turn:
            return
        result = t.script.turns[turn].result_tokens
        self._emit(ev.ToolFinished, t, type="tool_finished", result_tokens=result)
        t.context += result + TEMPLATE_TOKENS
        if turn == len(t.script.turns) - 1:
            # Replayed: the trainer ended it after a tool call (its context was full).
            self._reward(t, self.loop.now)
            return
        t.turn += 1
        self._queue(t)

    def _reward_done(self, t: Trajectory) -> None:
        if t.finished:
            return
        accepted = t.script.accepted
        self._emit(ev.RewardFinished, t, type="reward_finished", accepted=accepted)
        now = self.loop.now
        self.stats.completions.append(now - t.dispatched_at)
        self.stats.completed_at.append(now)
        self._retire(t)
        if accepted:
            t.group.accepted += 1
        self._terminal(t.group)
        if (
            self.finished_at is None
            and not self.on_policy
            and self.injection == "replaceOnReward"
            and accepted
            and self._allowed()
        ):
            self._dispatch_member()
        self._check_ran_out()

    def _stop(self, t: Trajectory) -> None:
        """A replayed trajectory reached the end of its recording: dropped there if it was
        dropped in the recording, else it stays as it is (cut by the recording's end)."""
        t.req = None
        t.next_arrival = None
        t.reward_end = None
        if t.script.drop_reason is not None:
            self._drop(t, t.script.drop_reason)
        else:
            t.state = "cut"
            self.stats.cut += 1
        self._check_ran_out()

    def _check_ran_out(self) -> None:
        """End a replay that cannot go on: every live trajectory is cut and nothing can be
        dispatched (only a fixed-rate injector dispatches without an event to wake it)."""
        if self.scripts is None or self.finished_at is not None:
            return
        if any(t.state != "cut" for t in self.live.values()):
            return
        if self.injection == "fixedRate" and not self.on_policy and self._allowed():
            return
        self.finished_at = self.loop.now
        self.stats.ran_out = True
        self.loop.stop()

    def _retire(self, t: Trajectory) -> None:
        t.finished = True
        t.state = "done"
        t.next_arrival = None
        t.reward_end = None
        self.live.pop(t.tid, None)

    def _drop(self, t: Trajectory, reason: str) -> None:
        if t.req is not None:
            self.cluster.cancel(t.req)
            t.req = None
        self._emit(ev.TrajectoryDropped, t, type="trajectory_dropped", reason=reason)
        self._retire(t)
        self.stats.dropped += 1
        self._terminal(t.group)

    # -- groups, steps and versions ---------------------------------------------------------

    def _terminal(self, g: Group) -> None:
        g.terminal += 1
        if (
            self.injection == "replaceOnEnd"
            and self.finished_at is None
            and not self.on_policy
            and self._allowed()
        ):
            self._dispatch_member()
        if g.terminal < g.size or g.dispatched < g.size:
            return
        if g.accepted > 0:
            self.groups_complete += 1
        if self.finished_at is not None:
            return
        if self.on_policy:
            if all(x.terminal >= x.size for x in self.step_groups):
                self._step_done()
            return
        while self.finished_at is None and self.groups_complete >= (
            (self.version + 1) * self.groups_per_step
        ):
            self._step_done()
        if self.finished_at is None and self.injection == "groupReplenish":
            self.deferred_groups += 1
            self._replenish()

    def _replenish(self) -> None:
        while self.deferred_groups and self._allowed(self.task.group_size):
            self.deferred_groups -= 1
            self._dispatch_group()

    def _step_done(self) -> None:
        now = self.loop.now
        self.version += 1
        self.stats.steps.append(now)
        if self.version >= self.steps:
            self.finished_at = now
            self.loop.stop()
            return
        if not self.on_policy:
            stale = [t for t in self.live.values() if t.version < self.version - self.staleness]
            for t in stale:
                self._drop(t, "staleness")
        fields: dict[str, Any] = {}
        if self.weight_update_seconds > 0:
            fields["expected_seconds"] = self.weight_update_seconds
            if self._held is None:  # two steps ending in one pause keep what it holds
                self._held = []
        self._announce(
            ev.WeightUpdateStarted, type="weight_update_started", version=self.version, **fields
        )
        reprefill = sum(t.state in _REPREFILL for t in self.live.values())
        self.cluster.new_weights()
        for hook in self.on_new_weights:
            hook(now)
        if self._held is not None:
            for hook in self.on_update_started:
                hook(now)
            self.loop.after(self.weight_update_seconds, self._resume, reprefill)
        else:
            self._announce_finished(reprefill)
        if self.on_policy:
            self._dispatch_step()
        elif self.injection == "groupReplenish":
            self._replenish()
            self._top_up()
        else:
            self._top_up()
        self._check_ran_out()

    @property
    def held(self) -> tuple[SimRequest, ...]:
        """Requests the paused client holds until the weight update ends."""
        return tuple(self._held or ())

    def _resume(self, reprefill: int) -> None:
        """The update is over: the paused client sends what it held, in order."""
        held, self._held = self._held or [], None
        self._announce_finished(reprefill)
        for req in held:
            if not req.owner.finished and req.owner.req is req:  # type: ignore[attr-defined]
                self.cluster.submit(req)

    def _announce_finished(self, reprefill: int) -> None:
        self._announce(
            ev.WeightUpdateFinished,
            type="weight_update_finished",
            version=self.version,
            reprefill_trajectories=reprefill,
        )

    # -- events ------------------------------------------------------------------------------

    def _announce(self, cls: type[Any], **fields: Any) -> None:
        """A cluster event: the weights change for every trajectory at once."""
        if not self.weight_update_events:
            return
        self.stats.events += 1
        if self.emit_events:
            kind = fields["type"]
            self.outbox.append(cls(id=f"weights#{self.version}#{kind}", ts=self.loop.now, **fields))

    def _emit(self, cls: type[Any], t: Trajectory, **fields: Any) -> None:
        self.stats.events += 1
        if not self.emit_events:
            return
        t.events += 1
        self.outbox.append(
            cls(id=f"{t.tid}#{t.events}", ts=self.loop.now, trajectory=t.tid, **fields)
        )
