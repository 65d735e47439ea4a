"""The demo's terminal output: a live view (``rich``), or plain lines for CI (``--no-live``).

Both show the same numbers, refreshed about once a second: the workload phase, demand
against capacity in instances (a = W_P/(S·θ_P) and b = (K_D+K̂_D)/C_KV from the operator's
metrics) next to the pods in each role and the Controller's target, every engine pod's
label, switch intent and load (from its agent), the switches as the operator reports
them, the webhook's event rate, the forecast mode and WAPE, and the trainer's counts.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, TextIO

from prorsa_contract.aio import cancel_and_wait
from prorsa_lab.demo.demo_trainer import DemoTrainer
from prorsa_lab.demo.monitor import Monitor, SwitchRecord
from prorsa_lab.demo.pod_directory import PodDirectory
from prorsa_lab.demo.smg_client import SmgClient

PHASE_TEXT = {"tools": "tools (prefill-heavy)", "reasoning": "reasoning (decode-heavy)"}


def _k(tokens: float | int | None) -> str:
    if tokens is None:
        return "-"
    if abs(tokens) >= 1e6:
        return f"{tokens / 1e6:.2f}M"
    if abs(tokens) >= 1e3:
        return f"{tokens / 1e3:.1f}k"
    return f"{tokens:.0f}"


def _bar(value: float, *, scale: float, width: int = 24) -> str:
    """A horizontal bar of ``value`` on a 0..``scale`` axis, in eighths of a cell."""
    if scale <= 0:
        return ""
    cells = max(0.0, min(value / scale, 1.0)) * width
    full, part = int(cells), int((cells - int(cells)) * 8)
    tail = " ▏▎▍▌▋▊▉"[part] if part else ""
    return ("█" * full + tail).ljust(width)[:width] + ("▶" if value > scale else " ")


@dataclass(frozen=True, slots=True)
class Frame:
    """The numbers of one refresh, shared by both views."""

    elapsed: float
    duration: float
    phase: str
    mode: str
    labels: dict[str, int]
    target: tuple[int, int] | None
    demand: tuple[float, float] | None
    forecast: dict[str, Any]
    capacity: dict[str, Any]
    margin: float | None
    reason: str
    wape: tuple[float | None, float | None]
    sent: int
    completed: int
    in_flight: int
    resumed: int
    resumes: int
    lost: int
    live: int
    events_per_second: float


def frame(*, options: Any, monitor: Monitor, trainer: DemoTrainer, router: SmgClient) -> Frame:
    d = monitor.decision or {}
    target = (d["target"]["prefill"], d["target"]["decode"]) if d.get("target") else None
    acc = monitor.status.get("accuracy") or {}
    stats = trainer.stats
    live = sum(
        int(v)
        for labels, v in monitor.metrics.get("prorsa_live_trajectories", [])
        if labels.get("cluster") == monitor.cluster
    )
    return Frame(
        elapsed=max(0.0, time.time() - trainer.t0),
        duration=options.duration,
        phase=(
            f"over, in flight: {stats.in_flight}"
            if trainer.stopping
            else PHASE_TEXT[trainer.phase_now()]
        ),
        mode=str(d.get("mode") or "waiting for the first tick"),
        labels=monitor.directory.counts(),
        target=target,
        demand=monitor.demand(),
        forecast=d.get("forecast") or {},
        capacity=d.get("capacity") or {},
        margin=d.get("safetyMargin"),
        reason=str(d.get("reason") or ""),
        wape=(acc.get("prefillWape"), acc.get("decodeWape")),
        sent=len(stats.requests),
        completed=stats.completed,
        in_flight=stats.in_flight,
        resumed=stats.resumed,
        resumes=stats.resumes,
        lost=stats.tokens_lost,
        live=live,
        events_per_second=monitor.event_rate,
    )


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60:02d}:{int(seconds) % 60:02d}"


def _wape(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


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
    ) -> None:
        self.options = options
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
        return frame(
            options=self.options, monitor=self.monitor, trainer=self.trainer, router=self.router
        )

    def fresh_switches(self) -> list[SwitchRecord]:
        """Switches the operator finished since the last call."""
        new = [r for k, r in self.monitor.switches.items() if k not in self._seen_switches]
        self._seen_switches.update((r.pod, r.started) for r in new)
        return sorted(new, key=lambda r: r.seen)

    def fresh_drains(self) -> list[tuple[float, str, str | None]]:
        """``(time, pod, toward)`` of every pod newly labelled ``draining``."""
        changes = self.directory.changes[self._seen_changes :]
        self._seen_changes = len(self.directory.changes)
        out = []
        for c in changes:
            if c.new == "draining":
                pod = self.directory.pods.get(c.pod)
                out.append((c.at, c.pod, pod.intent if pod else None))
        return out

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

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def note(self, message: str) -> None:
        self._print(f"[{_clock(time.time() - self.trainer.t0)}] {message}")

    def refresh(self) -> None:
        t0 = self.trainer.t0
        for at, pod, toward in self.fresh_drains():
            self._print(f"[{_clock(at - t0)}] {pod} draining -> {toward or '?'}")
        for r in self.fresh_switches():
            self._print(
                f"[{_clock(r.seen - t0)}] switch {r.pod} {r.origin} -> {r.to} {r.result} "
                f"in {r.seconds:.2f}s"
            )
        now = time.monotonic()
        if now - self._last_line < self.every:
            return
        self._last_line = now
        self._print(self.line(self.frame()))

    @staticmethod
    def line(f: Frame) -> str:
        target = f"{f.target[0]}P:{f.target[1]}D" if f.target else "-"
        demand = f"P {f.demand[0]:.2f} D {f.demand[1]:.2f}" if f.demand else "-"
        labels = f.labels
        return (
            f"[{_clock(f.elapsed)}] {f.phase:<24} | {f.mode} | pods "
            f"{labels.get('prefill', 0)}P:{labels.get('decode', 0)}D"
            f"{'+' + str(labels['draining']) + ' draining' if labels.get('draining') else ''}"
            f" target {target} | demand {demand} inst | W_P {_k(f.forecast.get('prefillTokens'))}"
            f" | req {f.sent} done {f.completed} resumed {f.resumed} lost {f.lost}"
            f" | webhook {f.events_per_second:.0f} ev/s | WAPE P {_wape(f.wape[0])}"
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
        self._log.append(f"{_clock(time.time() - self.trainer.t0)} {message}")
        self.refresh()

    def refresh(self) -> None:
        t0 = self.trainer.t0
        for at, pod, toward in self.fresh_drains():
            self._log.append(f"{_clock(at - t0)} {pod} draining → {toward or '?'}")
        for r in self.fresh_switches():
            colour = "green" if r.result == "succeeded" else "red"
            self._log.append(
                f"{_clock(r.seen - t0)} {r.pod} {r.origin} → {r.to} "
                f"[{colour}]{r.result}[/] in {r.seconds:.2f} s"
            )
        if self._live is not None:
            self._live.update(self.render(), refresh=True)

    def render(self) -> Any:
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        f = self.frame()
        head = Text.assemble(
            ("Prorsa demo ", "bold"),
            f"task {self.options.task}, {self.options.instances} × 8 GPUs   ",
            (f"{_clock(min(f.elapsed, f.duration))} / {_clock(f.duration)}", "bold"),
            "   phase ",
            (f.phase, "bold magenta" if f.phase.startswith("tools") else "bold cyan"),
            "   forecast ",
            (f.mode, "green" if f.mode == "predictive" else "yellow"),
        )

        # Demand against capacity, in instances.
        demand = Table.grid(padding=(0, 1))
        for _ in range(4):
            demand.add_column()
        labels = f.labels
        scale = float(self.options.instances)
        rows = (
            ("prefill", f.demand[0] if f.demand else 0.0, labels.get("prefill", 0), 0),
            ("decode", f.demand[1] if f.demand else 0.0, labels.get("decode", 0), 1),
        )
        for role, need, have, i in rows:
            want = f.target[i] if f.target else None
            colour = "magenta" if role == "prefill" else "cyan"
            demand.add_row(
                Text(f"{role:<8}", style=f"bold {colour}"),
                Text(f"demand {need:5.2f} inst"),
                Text(_bar(need, scale=scale), style=colour),
                Text(f"pods {have}  target {want if want is not None else '-'}"),
            )
        comp = f.forecast.get("components") or {}
        theta = f.capacity.get("prefillTokensPerSecond")
        kv = f.capacity.get("decodeKvTokens")
        detail = Text(
            f"W_P {_k(f.forecast.get('prefillTokens'))} tok over the horizon "
            f"(ready {_k(comp.get('ready'))}, in-flight {_k(comp.get('inflight'))}, "
            f"tool {_k(comp.get('tool'))}, sampler {_k(comp.get('sampler'))}, "
            f"startup {_k(comp.get('startup'))})   K_D+K̂_D {_k(f.forecast.get('decodeKvTokens'))}"
            f"   θ_P {_k(theta)} tok/s   C_KV {_k(kv)}   margin "
            f"{'-' if f.margin is None else f'{f.margin:+.2f}'}",
            style="dim",
        )
        reason = Text(f.reason, style="dim italic")

        pods = Table(expand=False, box=None, padding=(0, 1))
        for name in ("pod", "label", "switching to", "engine", "running", "waiting", "KV used"):
            pods.add_column(name, justify="right" if name in ("running", "waiting") else "left")
        for p in self.monitor.pods:
            colour = {"prefill": "magenta", "decode": "cyan"}.get(p.role, "yellow")
            if p.engine_role == "decode":
                fill = _bar(p.kv_used, scale=p.kv_capacity or 1, width=10)
                kv_text = f"{_k(p.kv_used)}/{_k(p.kv_capacity)} {fill}"
            else:
                kv_text = f"queue {_k(p.waiting_tokens)} tok"
            pods.add_row(
                p.name,
                Text(p.role, style=colour),
                p.intent or "",
                p.engine_role or "?",
                str(p.running),
                str(p.waiting),
                kv_text,
            )

        switches = Text("\n".join(self._log[-6:]) or "none yet", style="")
        if self._log:
            switches = Text.from_markup("\n".join(self._log[-6:]))

        counts = self.monitor.switch_counts()
        trainer = Text(
            f"requests {f.sent} sent, {f.completed} done, {f.in_flight} in flight; "
            f"{f.resumed} resumed after aborts ({f.resumes} resumes); tokens lost {f.lost}\n"
            f"trajectories live {f.live}   webhook {f.events_per_second:.0f} events/s   "
            f"switches {int(sum(counts.values()))}   WAPE prefill {_wape(f.wape[0])} "
            f"decode {_wape(f.wape[1])}"
        )
        return Group(
            head,
            Panel(Group(demand, detail, reason), title="demand vs capacity (instances)"),
            Panel(pods, title="engine pods (label from the API server, load from the agent)"),
            Panel(switches, title="switches"),
            Panel(trainer, title="trainer"),
        )
