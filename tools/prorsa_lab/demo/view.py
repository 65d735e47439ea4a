"""The demo's terminal output: a live view (``rich``), or plain lines for CI (``--no-live``).

Both show the same numbers, refreshed about once a second: the workload phase, demand
against capacity in instances (a = W_P/(S·θ_P) and b = (K_D+K̂_D)/C_KV from the operator's
metrics) next to the pods in each role and the Controller's target, every engine pod's
label, switch intent and load (from its agent), the switches as the operator reports
them, the webhook's event rate, the forecast mode and WAPE, and the trainer's counts.
"""

from __future__ import annotations

import asyncio
import re
import time
from abc import ABC, abstractmethod
from typing import Any, TextIO

from prorsa_contract.aio import cancel_and_wait
from prorsa_lab.demo.frame import LEGEND, Frame, clock, explain, tokens, wape
from prorsa_lab.demo.frame import frame as build_frame
from prorsa_lab.demo.monitor import Monitor, SeenSwitch
from prorsa_lab.demo.pod_directory import PodDirectory
from prorsa_lab.demo.smg_client import SmgClient
from prorsa_lab.demo.trainer import DemoTrainer

OTHER_ROLE = {"prefill": "decode", "decode": "prefill"}


class _View(ABC):
    def __init__(
        self,
        *,
        options: Any,
        monitor: Monitor,
        trainer: DemoTrainer,
        router: SmgClient,
        directory: PodDirectory,
        stream: TextIO,
        interval: float = 1.0,
        run_label: str = "",
    ) -> None:
        self.options = options
        self.run_label = run_label
        self.monitor = monitor
        self.trainer = trainer
        self.router = router
        self.directory = directory
        self.stream = stream
        self.interval = interval
        self._task: asyncio.Task[None] | None = None
        self._seen_switches: set[tuple[str, str]] = set()
        self._seen_changes = 0

    def frame(self) -> Frame:
        return build_frame(
            options=self.options,
            monitor=self.monitor,
            trainer=self.trainer,
            router=self.router,
            run_label=self.run_label,
        )

    def fresh_switches(self) -> list[SeenSwitch]:
        """Switches the operator finished since the last call."""
        new = [r for k, r in self.monitor.switches.items() if k not in self._seen_switches]
        self._seen_switches.update((r.pod, r.started) for r in new)
        return sorted(new, key=lambda r: r.seen)

    def fresh_drains(self) -> list[tuple[float, str, str | None]]:
        """``(time, pod, toward)`` of every pod newly labelled ``draining``.

        The view refreshes once a second and a demo switch takes about half of one, so the
        intent annotation is often gone by the time the view reads the pod: a drain away
        from one role is toward the other. ``toward`` is None only for a pod that was
        first seen draining with no intent (an operator restarted mid-switch).
        """
        changes = self.directory.changes[self._seen_changes :]
        self._seen_changes = len(self.directory.changes)
        out = []
        for c in changes:
            if c.new == "draining":
                pod = self.directory.pods.get(c.pod)
                intent = pod.intent if pod is not None and pod.role == "draining" else None
                out.append((c.at, c.pod, intent or OTHER_ROLE.get(c.old or "")))
        return out

    @staticmethod
    def drain_text(pod: str, toward: str | None, *, arrow: str) -> str:
        return f"{pod} draining {arrow} {toward}" if toward else f"{pod} draining"

    async def __aenter__(self) -> _View:
        self.start()
        self._task = asyncio.create_task(self._loop(), name="demo-view")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_and_wait(self._task)
        self.refresh()
        self.end()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.refresh()

    def start(self) -> None:
        """A hook for views that set up a screen; the plain view has nothing to do."""
        return None

    def end(self) -> None:
        """A hook for views that restore the screen; the plain view has nothing to do."""
        return None

    @abstractmethod
    def refresh(self) -> None: ...

    @abstractmethod
    def note(self, message: str) -> None: ...


class PlainView(_View):
    """One status line every few seconds, one line per switch event (CI, logs, pipes)."""

    every = 5.0

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._last_line = 0.0
        self._last_why = ""

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start(self) -> None:
        self._print("  legend: " + "; ".join(LEGEND))

    def note(self, message: str) -> None:
        self._print(f"[{clock(time.time() - self.trainer.t0)}] {message}")

    def refresh(self) -> None:
        t0 = self.trainer.t0
        for at, pod, toward in self.fresh_drains():
            self._print(f"[{clock(at - t0)}] {self.drain_text(pod, toward, arrow='->')}")
        for r in self.fresh_switches():
            self._print(
                f"[{clock(r.seen - t0)}] switch {r.pod} {r.origin} -> {r.to} {r.result} "
                f"in {r.seconds:.2f}s"
            )
        now = time.monotonic()
        if now - self._last_line < self.every:
            return
        self._last_line = now
        f = self.frame()
        self._print(self.line(f))
        # Why the split goes where it goes, once per change of the point (not of its
        # figures, which move every tick).
        why = explain(f.reason, target=f.target).forms[0]
        point = re.sub(r"-?\d+(\.\d+)?(?= s\b|%|k tokens)", "#", why)
        if point != self._last_why:
            self._last_why = point
            self._print(f"        why: {why}")

    @staticmethod
    def line(f: Frame) -> str:
        target = f"{f.target[0]}P:{f.target[1]}D" if f.target else "-"
        demand = f"P {f.demand[0]:.2f} D {f.demand[1]:.2f}" if f.demand else "-"
        labels = f.labels
        label = f"{f.run_label} | " if f.run_label else ""
        return (
            f"[{clock(f.elapsed)}] {label}{f.phase:<24} | {f.mode} | pods "
            f"{labels.get('prefill', 0)}P:{labels.get('decode', 0)}D"
            f"{'+' + str(labels['draining']) + ' draining' if labels.get('draining') else ''}"
            f" target {target} | demand {demand} inst"
            f" | W_P {tokens(f.forecast.get('prefillTokens'))}"
            f" | req {f.sent} done {f.completed} resumed {f.resumed} lost {f.lost}"
            f" | webhook {f.events_per_second:.0f} ev/s | WAPE P {wape(f.wape[0])}"
        )


class LiveView(_View):
    """A full-screen-free live panel, redrawn in place about once a second (``rich``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from rich.console import Console

        self.console = Console(file=self.stream)
        self._live: Any = None
        self._log: list[str] = []

    def start(self) -> None:
        from rich.live import Live

        self._live = Live(self.render(), console=self.console, auto_refresh=False, transient=False)
        self._live.start()

    def end(self) -> None:
        if self._live is not None:
            self._live.stop()

    def note(self, message: str) -> None:
        self._log.append(f"{clock(time.time() - self.trainer.t0)} {message}")
        self.refresh()

    def refresh(self) -> None:
        t0 = self.trainer.t0
        for at, pod, toward in self.fresh_drains():
            self._log.append(f"{clock(at - t0)} {self.drain_text(pod, toward, arrow='→')}")
        for r in self.fresh_switches():
            colour = "green" if r.result == "succeeded" else "red"
            self._log.append(
                f"{clock(r.seen - t0)} {r.pod} {r.origin} → {r.to} "
                f"[{colour}]{r.result}[/] in {r.seconds:.2f} s"
            )
        if self._live is not None:
            self._live.update(self.render(), refresh=True)

    def render(self) -> Any:
        from prorsa_lab.demo.live_panel import render_live

        return render_live(
            self.frame(),
            task=self.options.task_name,
            instances=self.options.instances,
            pods=self.monitor.pods,
            log=self._log,
            switches=int(sum(self.monitor.switch_counts().values())),
            width=self.console.width,
            height=self.console.height,
        )
