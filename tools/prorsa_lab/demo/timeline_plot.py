"""The demo's timeline PNG (matplotlib, Agg): what was forecast, what happened, what moved.

Three panels over the run, the workload's tools phases shaded:

1. Prefill demand over the horizon: the Controller's forecast W_P at each tick against
   the measured value for the same window, backlog at its start plus the prompt tokens
   that arrived within it (the definition the Controller's WAPE scores).
2. Decode KV: the forecast K_D + K̂_D against the KV in use on decode engines (agents)
   and the decode capacity of the pods labelled decode.
3. Engine pods by role label (prefill, draining, decode) with the Controller's target
   prefill count, Eq. 1's best prefill count (before the hold rules and switch pricing),
   and a marker at the end of every switch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prorsa_lab.demo.monitor import Monitor
from prorsa_lab.demo.pod_directory import PodDirectory
from prorsa_lab.demo.smg_client import PrefillJob, SmgClient
from prorsa_lab.demo.trainer import TrainerStats

PREFILL_COLOUR = "#b0479a"
DECODE_COLOUR = "#2b8cbe"
DRAIN_COLOUR = "#f0a630"
# Legends sit above each panel, right of its title, so they never hide the curves.
_LEGEND: dict[str, Any] = {
    "loc": "lower right",
    "bbox_to_anchor": (1.0, 1.0),
    "ncol": 3,
    "fontsize": 8,
    "frameon": False,
    "borderaxespad": 0.1,
}


def measured_prefill(jobs: list[PrefillJob], *, start: float, horizon: float) -> float:
    """Backlog at ``start`` plus the prompt tokens queued in ``[start, start + horizon)``."""
    end = start + horizon
    total = 0.0
    for job in jobs:
        if job.queued < start:
            if job.done is None or job.done > start:
                total += job.tokens
        elif job.queued < end:
            total += job.tokens
    return total


def role_steps(directory: PodDirectory, *, t0: float, until: float) -> dict[str, list[float]]:
    """Pods per role label at every label change: ``{"t": [...], "prefill": [...], ...}``."""
    roles: dict[str, str] = {}
    out: dict[str, list[float]] = {"t": [], "prefill": [], "decode": [], "draining": []}

    def push(at: float) -> None:
        out["t"].append(at)
        for role in ("prefill", "decode", "draining"):
            out[role].append(sum(1 for r in roles.values() if r == role))

    for change in directory.changes:
        if change.new is None:
            roles.pop(change.pod, None)
        else:
            roles[change.pod] = change.new
        push(max(change.at - t0, 0.0))
    push(until)
    return out


def plot_timeline(
    path: Path,
    *,
    options: Any,
    t0: float,
    stopped: float,
    monitor: Monitor,
    trainer: TrainerStats,
    router: SmgClient,
    directory: PodDirectory,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    horizon = options.model.horizon_seconds
    kv_capacity = options.model.kv_tokens
    until = max([s.t - t0 for s in monitor.samples] + [stopped])
    decisions = [d for d in monitor.decisions if d.get("mode") and d["at"] >= t0 - 1]

    fig, axes = plt.subplots(
        3, 1, figsize=(12, 9.5), sharex=True, gridspec_kw={"height_ratios": [1.1, 1.0, 1.0]}
    )
    ax_p, ax_kv, ax_roles = axes
    for ax in axes:
        for start, end, phase in options.phases.spans(min(until, stopped)):
            if phase == "tools":
                ax.axvspan(start, end, color="#f3e6f0", zorder=0, lw=0)
        if until > stopped:  # in-flight requests finish; nothing new is sent
            ax.axvspan(stopped, until, color="#eeeeee", zorder=0, lw=0)
        ax.grid(True, alpha=0.3)
        ax.set_xlim(0, until)

    # 1. Prefill demand: forecast vs measured, same window definition.
    xs = [d["at"] - t0 for d in decisions]
    predicted = [d["forecast"]["prefillTokens"] / 1e3 for d in decisions]
    measured = [
        measured_prefill(router.jobs, start=d["at"], horizon=horizon) / 1e3 for d in decisions
    ]
    ax_p.plot(xs, measured, color="black", lw=1.6, label="measured (backlog + arrivals)")
    ax_p.plot(xs, predicted, color=PREFILL_COLOUR, lw=1.4, ls="--", label="forecast W_P")
    ax_p.set_ylabel(f"prefill demand\n(k tokens / {horizon:g} s)")
    wape = monitor.accuracy_at(t0 + stopped).get("prefillWape")
    ax_p.set_title(
        "prefill demand over the horizon"
        + (f" — Controller WAPE {wape:.2f}" if wape is not None else ""),
        loc="left",
        fontsize=10,
    )
    ax_p.legend(**_LEGEND)
    ax_p.set_ylim(bottom=0)

    # 2. Decode KV.
    ax_kv.plot(
        xs,
        [d["forecast"]["decodeKvTokens"] / 1e3 for d in decisions],
        color=DECODE_COLOUR,
        lw=1.4,
        ls="--",
        label="forecast K_D + K̂_D",
    )
    st = [s.t - t0 for s in monitor.samples]
    ax_kv.plot(
        st,
        [s.kv_used_decode / 1e3 for s in monitor.samples],
        color="black",
        lw=1.6,
        label="KV in use on decode engines",
    )
    ax_kv.step(
        st,
        [s.labels.get("decode", 0) * kv_capacity / 1e3 for s in monitor.samples],
        where="post",
        color=DECODE_COLOUR,
        lw=1.0,
        alpha=0.6,
        label="decode capacity (pods × C_KV)",
    )
    ax_kv.set_ylabel("decode KV\n(k tokens)")
    ax_kv.set_title("decode KV: forecast, in use, capacity", loc="left", fontsize=10)
    ax_kv.legend(**_LEGEND)
    ax_kv.set_ylim(bottom=0)

    # 3. Pods by role label, target, switches.
    steps = role_steps(directory, t0=t0, until=until)
    p, dr, d = steps["prefill"], steps["draining"], steps["decode"]
    ax_roles.stackplot(
        steps["t"],
        p,
        dr,
        d,
        step="post",
        colors=[PREFILL_COLOUR, DRAIN_COLOUR, DECODE_COLOUR],
        alpha=0.75,
        labels=["prefill pods", "draining", "decode pods"],
    )
    ax_roles.step(
        xs,
        [dd["target"]["prefill"] for dd in decisions],
        where="post",
        color="black",
        lw=1.4,
        ls="--",
        label="target prefill (Controller)",
    )
    best = [(x.t - t0, x.best[0]) for x in monitor.samples if x.best is not None]
    if best:
        ax_roles.step(
            [t for t, _ in best],
            [b for _, b in best],
            where="post",
            color="white",
            lw=1.2,
            ls=":",
            label="Eq. 1's best prefill",
        )
    for change in directory.changes:
        if change.old == "draining" and change.new in ("prefill", "decode"):
            x = change.at - t0
            up = change.new == "prefill"
            for ax in axes:
                ax.axvline(x, color="grey", lw=0.6, alpha=0.5, zorder=1)
            ax_roles.plot(
                [x],
                [options.instances + 0.25],
                marker="^" if up else "v",
                color=PREFILL_COLOUR if up else DECODE_COLOUR,
                ms=8,
                clip_on=False,
            )
    ax_roles.set_ylim(0, options.instances + 0.6)
    ax_roles.set_yticks(range(options.instances + 1))
    ax_roles.set_ylabel("engine pods")
    ax_roles.set_xlabel(
        "seconds since the trainer started (pink: tools phases, the job's general agent; "
        "grey: no new requests, the last ones finish)"
    )
    ax_roles.set_title(
        "pods by role label; ▲ switch to prefill, ▼ switch to decode", loc="left", fontsize=10
    )
    ax_roles.legend(**{**_LEGEND, "ncol": 5})

    counts = monitor.switch_counts()
    resumed = sum(1 for r in trainer.requests if r.resumes)
    lost = sum(r.lost for r in trainer.requests)
    fig.suptitle(
        f"prorsa demo — task {options.task_name}, {options.instances} instances: "
        f"{int(sum(counts.values()))} switches, {len(trainer.requests)} requests, "
        f"{resumed} resumed after aborts, {lost} tokens lost",
        fontsize=12,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
