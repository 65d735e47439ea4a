"""The demo's simulated agentic trainer: asyncio multi-turn agents, replace-on-reward.

``concurrency`` trajectories are live at once; each finished one is replaced by a new
sample. A trajectory: sandbox start, turns of "model call -> tool call" until its last
turn, reward. Trajectory ``n`` of a seed draws everything from its own random stream
(:func:`prorsa_lab.demo.workload.draw_trajectory`), so two runs of one seed run the same
trajectories, whatever order they finish in. Every transition is reported through the SDK
(:class:`prorsa_sdk.AsyncEventEmitter`); every model call is a real ``/generate``
through :class:`prorsa_sdk.ResumableGeneration` and the demo's PD router, so a request
aborted by a role switch is resent with its partial output and the turn still gets
exactly the tokens it asked for. Each request is checked for that: ``tokens lost`` in the
summary counts every missing or extra token.

Prompts are text of ``n`` words: the engine double counts one token per word, and its
output tokens are words too (``" t<id>"``), so resuming with ``prompt + partial text``
is token-exact. Against real engines (``token_ids=True``, ``prorsa demo --engine sglang``)
prompts are token ids instead, greedy and with ``ignore_eos``: a resume sends
``input_ids + output_ids so far``, token-exact with any tokenizer, and an answer counts
its ``output_ids``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from prorsa_lab.demo.workload import DemoTask, PhaseName, PhaseSchedule, draw_trajectory
from prorsa_lab.sim.workloads import TEMPLATE_TOKENS
from prorsa_sdk import AsyncEventEmitter, ResumableGeneration
from prorsa_sdk.resumable import ResumeExhausted

log = logging.getLogger("prorsa_lab.demo.trainer")

PROMPT_IDS = tuple(range(20, 250, 7))
"""Token ids a ``token_ids`` prompt repeats (inside any vocabulary of 256 or more)."""
HEAD_IDS = tuple(range(20, 250))
HEAD_TOKENS = 3


def prompt_ids(rid: str, context: int) -> list[int]:
    """A ``token_ids`` prompt of ``context`` tokens that no other model call shares.

    The doubles keep no prefix cache and the demo's RolloutCluster says so
    (``prefillCacheTokens: 0``); a real engine's radix cache would otherwise serve every
    prompt of the repeated pattern from the longest one it holds, and the prefill side
    would have next to nothing to compute (θ_P read 100,000 tokens/s in such a run). The
    first ``HEAD_TOKENS`` ids, drawn from the call's id, branch the radix tree at once:
    each call is prefilled whole, as a turn whose context no prefill engine still holds
    is (agentic contexts of tens of thousands of tokens outgrow an engine's cache).
    """
    code = int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "big")
    head = []
    for _ in range(min(HEAD_TOKENS, context)):
        code, pick = divmod(code, len(HEAD_IDS))
        head.append(HEAD_IDS[pick])
    return head + [PROMPT_IDS[i % len(PROMPT_IDS)] for i in range(len(head), context)]


@dataclass(slots=True)
class RequestRecord:
    """One model call: what was asked, what came back, how many resumes it took."""

    trajectory: str
    turn: int
    phase: PhaseName
    prompt_tokens: int
    asked: int
    started: float
    task: str = ""  # the webhook's task label of its trajectory
    got: int = 0
    resumes: int = 0
    finished: float | None = None
    error: str | None = None

    def wire(self) -> dict[str, Any]:
        return {
            "trajectory": self.trajectory,
            "turn": self.turn,
            "phase": self.phase,
            "task": self.task,
            "promptTokens": self.prompt_tokens,
            "asked": self.asked,
            "got": self.got,
            "resumes": self.resumes,
            "started": self.started,
            "finished": self.finished,
            "error": self.error,
        }

    @property
    def lost(self) -> int:
        """Tokens missing from (or duplicated in) the answer; 0 when it is exact."""
        return abs(self.asked - self.got) if self.finished is not None else 0


class _ResumeTap:
    """Forwards ResumableGeneration's resume reports to the emitter and remembers the
    partial outputs, so the turn's final ``decode_finished`` reports only its last piece
    (the trajectory table adds each report to the context length)."""

    def __init__(self, emitter: AsyncEventEmitter) -> None:
        self.emitter = emitter
        self.partial: dict[str, int] = {}
        self.resumes: dict[str, int] = {}

    def decode_finished(
        self,
        trajectory: str,
        *,
        output_tokens: int,
        finish: Literal["tool", "stop", "length", "abort"],
        ts: float | None = None,
    ) -> str:
        if finish == "abort":
            self.partial[trajectory] = self.partial.get(trajectory, 0) + output_tokens
            self.resumes[trajectory] = self.resumes.get(trajectory, 0) + 1
        return self.emitter.decode_finished(
            trajectory, output_tokens=output_tokens, finish=finish, ts=ts
        )

    def request_queued(
        self,
        trajectory: str,
        *,
        prompt_tokens: int,
        turn: int,
        request: str | None = None,
        ts: float | None = None,
    ) -> str:
        return self.emitter.request_queued(
            trajectory, prompt_tokens=prompt_tokens, turn=turn, request=request, ts=ts
        )

    def take(self, trajectory: str) -> tuple[int, int]:
        """(tokens reported with aborts, resumes) since the last call, for one trajectory."""
        return self.partial.pop(trajectory, 0), self.resumes.pop(trajectory, 0)


@dataclass(slots=True)
class TrainerStats:
    started: int = 0
    finished: int = 0
    accepted: int = 0
    dropped: int = 0
    requests: list[RequestRecord] = field(default_factory=list)
    # Seconds since the rollout started at which each trajectory got its reward, in order.
    finish_times: list[float] = field(default_factory=list)
    # What the resumed requests cost in prefill (prorsa_sdk.ResumePrefill.summary).
    resume_prefill: dict[str, int] = field(default_factory=dict)

    @property
    def in_flight(self) -> int:
        return sum(1 for r in self.requests if r.finished is None and r.error is None)

    @property
    def completed(self) -> int:
        return sum(1 for r in self.requests if r.finished is not None)

    @property
    def failed(self) -> int:
        return sum(1 for r in self.requests if r.error is not None)

    @property
    def resumed(self) -> int:
        return sum(1 for r in self.requests if r.resumes > 0)

    @property
    def resumes(self) -> int:
        return sum(r.resumes for r in self.requests)

    @property
    def tokens_lost(self) -> int:
        return sum(r.lost for r in self.requests)

    @property
    def tokens_generated(self) -> int:
        return sum(r.got for r in self.requests)


class DemoTrainer:
    """Runs the trajectories; :meth:`stop` ends dispatching (in-flight calls complete)."""

    def __init__(
        self,
        *,
        task: DemoTask,
        schedule: PhaseSchedule,
        emitter: AsyncEventEmitter,
        router: httpx.AsyncClient,
        concurrency: int,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        max_retries: int = 3,
        token_ids: bool = False,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.task = task
        self.schedule = schedule
        self.emitter = emitter
        self.tap = _ResumeTap(emitter)
        # max_retries: how often a request that failed outright (router or engine gone, a
        # 5xx) is sent again, with backoff; the chaos suite restarts the router.
        self.gen = ResumableGeneration(
            router, max_resumes=16, max_retries=max_retries, emitter=self.tap
        )
        self.concurrency = concurrency
        self.seed = seed
        self.token_ids = token_ids
        self.clock = clock
        self.stats = TrainerStats()
        self.t0 = clock()
        self._ids = itertools.count()
        self._stopping = asyncio.Event()
        self.stopped_at: float | None = None  # when dispatching ended

    def phase_now(self) -> PhaseName:
        return self.schedule.at(self.clock() - self.t0)

    def stop(self) -> None:
        if not self._stopping.is_set():
            self.stopped_at = self.clock()
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def run(self, *, duration: float) -> TrainerStats:
        """Dispatch for ``duration`` seconds (or until :meth:`stop`), then let the turns in
        flight finish and drop the unfinished trajectories."""
        self.t0 = self.clock()

        async def stop_later() -> None:
            await asyncio.sleep(duration)
            self.stop()

        timer = asyncio.create_task(stop_later())
        try:
            await asyncio.gather(*(self._worker() for _ in range(self.concurrency)))
        finally:
            timer.cancel()
        self.stats.resume_prefill = self.gen.resume_prefill.summary()
        return self.stats

    async def _sleep(self, seconds: float) -> bool:
        """Sleep; False if the run is ending (the sleep is cut short then)."""
        if self.stopping:
            return False
        try:
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)
        except TimeoutError:
            return True
        return False

    async def _worker(self) -> None:
        while not self.stopping:  # replace-on-reward
            await self._trajectory(next(self._ids))

    async def _trajectory(self, index: int) -> None:
        # A multi-task job dispatches the task of the phase it is in; the trajectory keeps
        # that task, and every turn its shape, to the end.
        job = self.schedule.job_task(self.clock() - self.t0)
        task, em = (self.task if job is None else job.task), self.emitter
        group = f"g{index // task.profile.group_size}"
        if job is not None:
            group = f"{task.name}-{group}"
        tid = f"traj-{index}"
        draw = draw_trajectory(task, seed=self.seed, index=index)
        self.stats.started += 1
        context = draw.prompt
        em.sample_dispatched(tid, group=group, task=task.name, prompt_tokens=context)
        em.sandbox_started(tid, mode="prewarm", image=f"demo-{task.name}:latest")
        if not await self._sleep(draw.startup_seconds):
            return self._drop(tid)
        for turn, turn_draw in enumerate(draw.turn_draws):
            phase = self.phase_now() if job is None else job.lean
            want = turn_draw.output[phase]
            last = turn == draw.turns - 1 or context + want >= task.max_context
            want = min(want, task.max_context - context)
            if want < 1:
                break
            record = await self._generate(
                tid, turn=turn, phase=phase, task=task.name, context=context, want=want, last=last
            )
            if record.error is not None:
                return self._drop(tid, reason="generation failed")
            context += record.got
            if last:
                break
            em.tool_started(tid, tool=turn_draw.tool)
            if not await self._sleep(turn_draw.tool_seconds[phase]):
                return self._drop(tid)
            result = turn_draw.result_tokens[phase]
            em.tool_finished(tid, result_tokens=result)
            context += result + TEMPLATE_TOKENS
            if self.stopping:
                return self._drop(tid)
            if context >= task.max_context:
                break
        em.reward_started(tid)
        if not await self._sleep(draw.reward_seconds):
            return self._drop(tid)
        em.reward_finished(tid, accepted=draw.accepted)
        self.stats.finished += 1
        self.stats.accepted += draw.accepted
        self.stats.finish_times.append(self.clock() - self.t0)

    def _drop(self, tid: str, reason: str = "demo ended") -> None:
        self.emitter.trajectory_dropped(tid, reason=reason)
        self.stats.dropped += 1

    async def _generate(
        self,
        tid: str,
        *,
        turn: int,
        phase: PhaseName,
        task: str,
        context: int,
        want: int,
        last: bool,
    ) -> RequestRecord:
        record = RequestRecord(
            trajectory=tid,
            turn=turn,
            phase=phase,
            task=task,
            prompt_tokens=context,
            asked=want,
            started=self.clock(),
        )
        self.stats.requests.append(record)
        rid = f"{tid}@{turn}"
        self.emitter.request_queued(tid, prompt_tokens=context, turn=turn, request=rid)
        payload: dict[str, Any] = {"rid": rid}
        if self.token_ids:
            # A real tokenizer: ids in, ids out; no early end of sequence.
            payload["input_ids"] = prompt_ids(rid, context)
            payload["sampling_params"] = {
                "max_new_tokens": want,
                "temperature": 0.0,
                "ignore_eos": True,
            }
        else:
            payload["text"] = "w " * context
            payload["sampling_params"] = {"max_new_tokens": want, "temperature": 1.0}
        try:
            out = await self.gen.generate(payload, trajectory=tid, turn=turn)
        except (httpx.HTTPError, ResumeExhausted, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            self.tap.take(tid)
            log.warning("%s turn %d failed: %s", tid, turn, record.error)
            return record
        partial, resumes = self.tap.take(tid)
        ids = out.get("output_ids") or []
        if self.token_ids:
            record.got = len(ids)
        else:
            words = len(str(out.get("text") or "").split())
            # Both views of the answer must agree with the ask: ids and text, token for token.
            record.got = len(ids) if len(ids) == words else min(len(ids), words)
        record.resumes = resumes
        record.finished = self.clock()
        self.emitter.decode_finished(
            tid, output_tokens=max(0, record.got - partial), finish="stop" if last else "tool"
        )
        return record
