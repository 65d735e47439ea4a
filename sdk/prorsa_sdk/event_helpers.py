"""One typed method per event type of the webhook contract, shared by both emitters.

The signatures repeat :mod:`prorsa_contract.events`' models, field for field, so an editor
completes them and mypy checks the calls; ``tests/test_sdk_helpers.py`` holds them to the
models (names, required-ness and types), so the two cannot drift apart.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from prorsa_contract.events import Finish, SandboxMode


class EventHelpers(ABC):
    """One method per event type of the webhook CONTRACT (None fields are omitted)."""

    @abstractmethod
    def emit(
        self,
        type: str,
        trajectory: str | None,
        *,
        ts: float | None = None,
        id: str | None = None,
        **fields: Any,
    ) -> str: ...

    def sample_dispatched(
        self,
        trajectory: str,
        *,
        group: str | None = None,
        task: str | None = None,
        prompt_tokens: int | None = None,
        ts: float | None = None,
    ) -> str:
        return self.emit(
            "sample_dispatched",
            trajectory,
            ts=ts,
            group=group,
            task=task,
            prompt_tokens=prompt_tokens,
        )

    def sandbox_started(
        self,
        trajectory: str,
        *,
        mode: SandboxMode,
        image: str | None = None,
        node_class: str | None = None,
        ts: float | None = None,
    ) -> str:
        return self.emit(
            "sandbox_started", trajectory, ts=ts, mode=mode, image=image, node_class=node_class
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
        return self.emit(
            "request_queued",
            trajectory,
            ts=ts,
            prompt_tokens=prompt_tokens,
            turn=turn,
            request=request,
        )

    def prefill_started(
        self,
        trajectory: str,
        *,
        request: str | None = None,
        instance: str | None = None,
        ts: float | None = None,
    ) -> str:
        """Only from code that sees the prefill engine start (a router or an engine-side
        hook). A client behind a PD router does not: the engine queues the request first,
        and the reply names no prefill engine. Leave it out there."""
        return self.emit("prefill_started", trajectory, ts=ts, request=request, instance=instance)

    def prefill_finished(
        self,
        trajectory: str,
        *,
        request: str | None = None,
        instance: str | None = None,
        ts: float | None = None,
    ) -> str:
        """When the first token streams back (the prefill's end plus the KV transfer), with
        ``instance`` only if the client knows it. A blocking (non-streaming) call does not
        see that moment: send no prefill event at all, rather than one when the reply
        arrives, which would show the request in prefill for its whole decode. The
        Controller then reads the prefill engines' queues instead."""
        return self.emit("prefill_finished", trajectory, ts=ts, request=request, instance=instance)

    def decode_finished(
        self,
        trajectory: str,
        *,
        output_tokens: int,
        finish: Finish,
        ts: float | None = None,
    ) -> str:
        return self.emit(
            "decode_finished", trajectory, ts=ts, output_tokens=output_tokens, finish=finish
        )

    def tool_started(
        self, trajectory: str, *, tool: str | None = None, ts: float | None = None
    ) -> str:
        return self.emit("tool_started", trajectory, ts=ts, tool=tool)

    def tool_finished(
        self, trajectory: str, *, result_tokens: int | None = None, ts: float | None = None
    ) -> str:
        return self.emit("tool_finished", trajectory, ts=ts, result_tokens=result_tokens)

    def reward_started(self, trajectory: str, *, ts: float | None = None) -> str:
        return self.emit("reward_started", trajectory, ts=ts)

    def reward_finished(self, trajectory: str, *, accepted: bool, ts: float | None = None) -> str:
        return self.emit("reward_finished", trajectory, ts=ts, accepted=accepted)

    def trajectory_dropped(
        self, trajectory: str, *, reason: str | None = None, ts: float | None = None
    ) -> str:
        return self.emit("trajectory_dropped", trajectory, ts=ts, reason=reason)

    # Cluster events: no trajectory. Emit them where the trainer changes the rollout
    # engines' weights, so the Controller sees the re-prefill burst coming.

    def weight_update_started(
        self,
        *,
        version: int,
        expected_seconds: float | None = None,
        ts: float | None = None,
        id: str | None = None,
    ) -> str:
        """Just before the engines load ``version``; ``expected_seconds``: how long it takes.

        When several processes may report the same update, pass the same ``id`` from each
        (say ``f"weights-{version}-started"``): the webhook applies it once.
        """
        return self.emit(
            "weight_update_started",
            None,
            ts=ts,
            id=id,
            version=version,
            expected_seconds=expected_seconds,
        )

    def weight_update_finished(
        self,
        *,
        version: int,
        reprefill_trajectories: int,
        ts: float | None = None,
        id: str | None = None,
    ) -> str:
        """Once ``version`` is loaded; ``reprefill_trajectories``: live trajectories whose
        context will be computed again on it (interrupted generations, tool calls in
        progress)."""
        return self.emit(
            "weight_update_finished",
            None,
            ts=ts,
            id=id,
            version=version,
            reprefill_trajectories=reprefill_trajectories,
        )
