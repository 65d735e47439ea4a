"""The benchmark's picture: predicted vs measured prefill demand, and P/D allocation over time.

One column per setting; the top row compares the Controller's prefill forecast for each
10 s window with the demand measured in the simulator (and the oracle's true demand), the
bottom row shows how many instances held the prefill role under Prorsa, the oracle and the
best static split.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prorsa_lab.sim.runner import SettingRow


def _label(row: SettingRow) -> str:
    s = "on-policy" if row.staleness == 0 else f"staleness {row.staleness}"
    return f"{row.model} · {row.task} · {s}"


def _steps(timeline: Sequence[Sequence[float]], end: float) -> tuple[list[float], list[float]]:
    xs: list[float] = []
    ys: list[float] = []
    for t, p, _d, _s in timeline:
        xs.append(t / 60)
        ys.append(p)
    if xs:
        xs.append(end / 60)
        ys.append(ys[-1])
    return xs, ys


def write_png(rows: Sequence[SettingRow], path: Path) -> Path:
    """Draw the selected settings (each needs Prorsa details) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [r for r in rows if "prorsa" in r.details and r.details["prorsa"].get("windows")]
    if not chosen:
        raise ValueError("no setting has Prorsa forecast windows to draw")
    fig, axes = plt.subplots(
        2, len(chosen), figsize=(6.2 * len(chosen), 6.4), squeeze=False, sharex="col"
    )
    for col, row in enumerate(chosen):
        pr: dict[str, Any] = row.details["prorsa"]
        top, bottom = axes[0][col], axes[1][col]
        win = pr["windows"]
        t = [w[0] / 60 for w in win]
        top.plot(t, [w[2] / 1e6 for w in win], color="black", lw=1.4, label="measured")
        top.plot(t, [w[1] / 1e6 for w in win], color="tab:blue", lw=1.0, label="Prorsa forecast")
        top.set_title(_label(row), fontsize=10)
        top.set_ylabel("prefill demand per 10 s window (M tokens)")
        wp, wd = row.wape_prefill, row.wape_decode
        if wp is not None and wd is not None:
            top.text(
                0.01,
                0.97,
                f"WAPE prefill {wp:.1%}, decode admissions {wd:.1%}",
                transform=top.transAxes,
                va="top",
                fontsize=8,
            )
        top.legend(fontsize=8, loc="upper right")
        end = pr["makespan"]
        xs, ys = _steps(pr["timeline"], end)
        bottom.step(xs, ys, where="post", color="tab:blue", label="Prorsa")
        oracle = row.details.get("oracle")
        if oracle and oracle.get("timeline"):
            ox, oy = _steps(oracle["timeline"], oracle["makespan"])
            bottom.step(ox, oy, where="post", color="tab:green", alpha=0.7, label="oracle")
        if row.best_static:
            bottom.axhline(
                row.best_static,
                color="gray",
                ls="--",
                lw=1,
                label=f"best static {row.best_static}P:{row.instances - row.best_static}D",
            )
        bottom.set_ylim(0, row.instances)
        bottom.set_ylabel(f"prefill instances (of {row.instances})")
        bottom.set_xlabel("time (minutes)")
        bottom.legend(fontsize=8, loc="upper right")
    fig.suptitle("prorsa bench rollout: forecast vs measured prefill demand, and P/D allocation")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
