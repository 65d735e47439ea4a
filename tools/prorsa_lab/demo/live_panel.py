"""The rich panel of the demo's live view, laid out for the terminal it is drawn on.

The panel has to stay readable in an 80×24 terminal. rich cuts a table cell at its right
end and ``Live`` crops what does not fit at the bottom, so the layout is decided here, not
left to rich: pod names lose their shared prefix (``demo-engine-0`` … ``-3`` would all
read ``demo-en…``), every line that could wrap is cut to one line, the trainer panel with
"tokens lost" comes before the switch log, and the switch log gets the rows that are left.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from prorsa_lab.demo.frame import LEGEND, Frame, bar, clock, explain, fit, tokens, wape
from prorsa_lab.demo.monitor import PodState

__all__ = ["distinct_names", "legend_lines", "render_live"]

MIN_SWITCH_LINES = 2
REASON_LINES = 2  # the Decision's reason: its point, then its details


def distinct_names(names: Sequence[str]) -> tuple[str, list[str]]:
    """The prefix all ``names`` share up to a ``-``, and what is left of each name.

    With one name, or nothing shared, the names stay whole. The remainder keeps the part
    before its last ``-`` when there is one (``engine-0`` rather than ``0``), so it still
    reads as a pod name.
    """
    if len(names) < 2:
        return "", list(names)
    first = names[0]
    shared = next(
        (i for i in range(len(first)) if any(len(n) <= i or n[i] != first[i] for n in names)),
        len(first),
    )
    prefix = first[:shared]
    prefix = prefix[: prefix.rfind("-") + 1]
    if not prefix or any(n == prefix for n in names):
        return "", list(names)
    head = prefix[:-1]
    cut = head.rfind("-") + 1  # keep the last word of the shared prefix
    return prefix[:cut], [n[cut:] for n in names]


def _line(text: str, style: str = "") -> Text:
    return Text(text, style=style, no_wrap=True, overflow="ellipsis")


def _head(f: Frame, *, task: str, instances: int) -> Text:
    label = f" ({f.run_label})" if f.run_label else ""
    head = Text.assemble(
        ("Prorsa demo ", "bold"),
        f"{task}{label}, {instances}×8 GPUs  ",
        (f"{clock(min(f.elapsed, f.duration))}/{clock(f.duration)}", "bold"),
        "  ",
        (f.phase, "bold magenta" if "prefill-heavy" in f.phase else "bold cyan"),
        "  ",
        (f.mode, "green" if f.mode == "predictive" else "yellow"),
    )
    head.no_wrap, head.overflow = True, "ellipsis"
    return head


def legend_lines(width: int) -> list[str]:
    """:data:`LEGEND` packed into lines of ``width`` columns, ``·`` between entries."""
    lines: list[str] = []
    for entry in LEGEND:
        if lines and len(lines[-1]) + 3 + len(entry) <= width:
            lines[-1] += " · " + entry
        else:
            lines.append(entry if len(entry) <= width else entry[: width - 1] + "…")
    return lines


def _demand(f: Frame, *, instances: int, width: int, detail: bool) -> Panel:
    table = Table.grid(padding=(0, 1))
    for _ in range(4):
        table.add_column(no_wrap=True)
    bar_width = max(6, min(24, width - 54))
    for i, role in enumerate(("prefill", "decode")):
        need = f.demand[i] if f.demand else 0.0
        want = f.target[i] if f.target else None
        colour = "magenta" if role == "prefill" else "cyan"
        table.add_row(
            Text(f"{role:<7}", style=f"bold {colour}"),
            Text(f"demand {need:5.2f}"),
            Text(bar(need, scale=float(instances), width=bar_width), style=colour),
            Text(f"pods {f.labels.get(role, 0)} target {'-' if want is None else want}"),
        )
    parts: list[RenderableType] = [table]
    if detail:
        comp = f.forecast.get("components") or {}
        margin = "-" if f.margin is None else f"{f.margin:+.2f}"
        parts.append(
            _line(
                f"W_P {tokens(f.forecast.get('prefillTokens'))} tok "
                f"(ready {tokens(comp.get('ready'))}, in-flight {tokens(comp.get('inflight'))}, "
                f"tool {tokens(comp.get('tool'))}, sampler {tokens(comp.get('sampler'))}, "
                f"startup {tokens(comp.get('startup'))})",
                "dim",
            )
        )
        parts.append(
            _line(
                f"K_D+K̂_D {tokens(f.forecast.get('decodeKvTokens'))} tok  "
                f"θ_P {tokens(f.capacity.get('prefillTokensPerSecond'))} tok/s  "
                f"C_KV {tokens(f.capacity.get('decodeKvTokens'))} tok  margin δ {margin}",
                "dim",
            )
        )
        parts.extend(_line(line, "dim") for line in legend_lines(width - 4))
    reason = fit(explain(f.reason, target=f.target), width=width - 4, lines=REASON_LINES)
    parts.append(_line(reason[0], "italic"))
    parts.extend(_line(line, "dim italic") for line in reason[1:])
    return Panel(Group(*parts), title="demand vs capacity (instances)")


def _pods(pods: Sequence[PodState]) -> Panel:
    prefix, names = distinct_names([p.name for p in pods])
    table = Table(expand=False, box=None, padding=(0, 1), pad_edge=False)
    for column in ("pod", "label", "to", "engine", "run", "wait", "KV used / queue"):
        table.add_column(
            column, justify="right" if column in ("run", "wait") else "left", no_wrap=True
        )
    for p, name in zip(pods, names, strict=True):
        colour = {"prefill": "magenta", "decode": "cyan"}.get(p.role, "yellow")
        if p.engine_role == "decode":
            fill = bar(p.kv_used, scale=p.kv_capacity or 1, width=8)
            load = f"{tokens(p.kv_used)}/{tokens(p.kv_capacity)} {fill}"
        else:
            load = f"queue {tokens(p.waiting_tokens)} tok"
        table.add_row(
            name,
            Text(p.role, style=colour),
            p.intent or "",
            p.engine_role or "?",
            str(p.running),
            str(p.waiting),
            load,
        )
    title = f"engine pods {prefix}…" if prefix else "engine pods"
    return Panel(table, title=f"{title} (label: API server, load: agent)")


def _trainer(f: Frame, *, switches: int) -> Panel:
    table = Table.grid(padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(no_wrap=True, overflow="ellipsis")
    table.add_row(
        "requests",
        f"{f.sent} sent, {f.completed} done, {f.in_flight} in flight   "
        f"[bold]tokens lost {f.lost}[/]",
    )
    table.add_row("aborts", f"{f.resumed} resumed ({f.resumes} resends)   switches {switches}")
    table.add_row(
        "events",
        f"{f.events_per_second:.0f}/s, {f.live} live trajectories   "
        f"WAPE P {wape(f.wape[0])} D {wape(f.wape[1])}",
    )
    return Panel(table, title="trainer")


def render_live(
    f: Frame,
    *,
    task: str,
    instances: int,
    pods: Sequence[PodState],
    log: Sequence[str],
    switches: int,
    width: int,
    height: int,
) -> RenderableType:
    """The whole panel in at most ``height - 1`` rows (the last row holds the cursor) when
    the pods fit: the switch log shrinks to the rows left, and the forecast detail line
    shows only when there is room for it and a few switch lines."""
    pods_rows = len(pods) + 3
    demand_rows = 2 + 2 + REASON_LINES  # borders, the two roles, the reason
    fixed = 1 + demand_rows + pods_rows + 5 + 2  # head, demand, pods, trainer, switch borders
    room = height - 1 - fixed
    # The forecast's symbols come with their legend, or not at all.
    detail_rows = 2 + len(legend_lines(width - 4))
    detail = room - detail_rows >= MIN_SWITCH_LINES + 2
    lines = max(MIN_SWITCH_LINES, room - (detail_rows if detail else 0))
    shown = log[-lines:]
    switch_text = Text.from_markup("\n".join(shown)) if shown else Text("none yet", style="dim")
    switch_text.no_wrap, switch_text.overflow = True, "ellipsis"
    return Group(
        _head(f, task=task, instances=instances),
        _demand(f, instances=instances, width=width, detail=detail),
        _pods(pods),
        _trainer(f, switches=switches),
        Panel(switch_text, title="switches (newest last)", height=len(shown or [""]) + 2),
    )
