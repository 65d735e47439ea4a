"""``prorsa bench rollout``: the rollout simulator's figures, from one run of the whole grid.

For each model x task x staleness it prints the makespan of every policy (PD colocation,
the best static split found by a sweep, Dynamo's reactive and throughput planners, Prorsa's
real Controller, the oracle, and the foresight reference that forks the simulator to keep
the split with the least remaining makespan), speedups over colocation and over the best
static split, colocation's GPU idle ratio from attention-DP interference, and the
Controller's forecast WAPE; then whether each goal of the project holds, with the measured
numbers. It writes a PNG of predicted vs measured prefill demand and the P/D allocation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from prorsa_lab.bench.split_value import value_json, value_table
from prorsa_lab.sim.costmodel import load_profile
from prorsa_lab.sim.grid_plot import write_png
from prorsa_lab.sim.kv_store import KV_STORES, PER_INSTANCE
from prorsa_lab.sim.runner import GridConfig, SettingRow, aggregate, jobs, run_jobs
from prorsa_lab.sim.simulator import DP_ROUTINGS
from prorsa_lab.sim.trainer import PREFILL_EVENTS
from prorsa_lab.sim.workloads import get_task

HELP = "rollout simulator: makespan per policy, speedups, forecast WAPE; writes a PNG"

AGENTIC = ("coding", "general")
# The policies that run the Controller (its defaults change what they do); the others are
# taken from a previous run by --reuse.
CONTROLLER_POLICIES = ("prorsa", "oracle")
POLICIES = (
    "colocation",
    "best-static",
    "task-static",
    "reactive",
    "throughput",
    "prorsa",
    "oracle",
    "reference",
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="reduced grid for CI and make bench: half batches, 2 steps, "
        "static splits 2..6 (about 1.5 min on 2 cores without deepseek-v3-dp16, which "
        "adds about 140 CPU-seconds)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench-out"),
        help="folder for rollout.png and rollout.json (default bench-out/)",
    )
    parser.add_argument(
        "--models",
        help="comma-separated (default: deepseek-v3-dp8, qwen3-dp8, qwen3-dp4, qwen3-dp2, "
        "deepseek-v3-dp16, qwen3-tp8, deepseek-v3-tp16; the EP references qwen3-235b and "
        "deepseek-v3 on request)",
    )
    parser.add_argument("--tasks", help="comma-separated (default math,coding,general)")
    parser.add_argument("--staleness", help="comma-separated (default 0,2,8)")
    parser.add_argument("--steps", type=int, help="training steps per run (default 3; quick 2)")
    parser.add_argument("--scale", type=float, help="batch scale (default 1; quick 0.5)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--hicache-ratio",
        type=float,
        help="HiCache host tier over each rank's GPU KV pool (default 2.0, SGLang's and the "
        "engine image's; 0: GPU-only prefix caches)",
    )
    parser.add_argument(
        "--kv-store",
        choices=KV_STORES,
        default=PER_INSTANCE,
        help="where prefix KV lives: per-instance (default; SGLang 0.5.23: a flip wipes the "
        "instance's caches) or shared (an L3 store every engine reads that survives flips, "
        "with decode-side KV offload; entries of older weight versions never hit)",
    )
    parser.add_argument(
        "--no-weight-update-events",
        action="store_true",
        help="the simulated trainer does not announce weight updates (the Controller infers "
        "them from a burst of aborts)",
    )
    parser.add_argument(
        "--weight-update-seconds",
        help="how long each weight update stops the engines: 'measured' (default: "
        "checkpoint-engine's published broadcast time for the model, 7.2 s Qwen3-235B, "
        "13.7 s DeepSeek-V3) or seconds (0: instantaneous)",
    )
    parser.add_argument(
        "--router-delays",
        choices=("none", "smg"),
        help="the router's part of each switch: smg (default; 1.13.0 as measured: the "
        "flip waits ~6 s for smg to drop the worker, which is listed again ~2 s after it) "
        "or none (a router that takes no time)",
    )
    parser.add_argument(
        "--prefill-events",
        choices=PREFILL_EVENTS,
        help="the prefill events the simulated trainer sends: full (default), first-token "
        "(a streaming client behind a PD router) or none (a blocking one); see "
        "`prorsa bench events` for the three side by side",
    )
    parser.add_argument(
        "--smoothing", type=float, help="switching.smoothingSeconds (default: the spec's)"
    )
    parser.add_argument(
        "--dp-routing",
        choices=DP_ROUTINGS,
        help="who picks an attention-DP engine's rank: dp-aware (smg --dp-aware places each "
        "request on a rank by prefix; what the operator deploys) or round-robin (smg without "
        "it: SGLang's DP controller round-robins the ranks)",
    )
    parser.add_argument(
        "--reference-cadence",
        type=float,
        help="seconds between the foresight reference's decisions (besides each weight "
        "update); default: the best static makespan / 6, at least 60 s",
    )
    parser.add_argument(
        "--reference-moves",
        help="the reference's candidate moves in prefill instances, as "
        "--reference-moves=-1,1 (default -2,-1,1,2)",
    )
    parser.add_argument(
        "--no-reference", action="store_true", help="leave out the foresight reference"
    )
    parser.add_argument(
        "--policies",
        help="comma-separated policies to run (default all: colocation, static, reactive, "
        "throughput, prorsa, oracle, reference; the reference needs static)",
    )
    parser.add_argument(
        "--reuse",
        type=Path,
        metavar="JSON",
        help="a previous --json of the same grid and seed: colocation, the static sweep, "
        "the Dynamo planners and the reference (none of which reads the Controller's "
        "settings) are taken from it, and only prorsa and the oracle run again; for tuning "
        "the Controller's defaults",
    )
    parser.add_argument("--workers", type=int, help="processes (default: one per CPU)")


def _config(args: argparse.Namespace) -> Any:

    base = GridConfig()
    kw: dict[str, Any] = {"seed": args.seed}
    if args.quick:
        kw.update(steps=2, scale=0.5, static=(2, 3, 4, 5, 6))
    if args.models:
        kw["models"] = tuple(args.models.split(","))
    if args.tasks:
        kw["tasks"] = tuple(args.tasks.split(","))
    if args.staleness:
        kw["staleness"] = tuple(int(s) for s in args.staleness.split(","))
    if args.steps:
        kw["steps"] = args.steps
    if args.scale:
        kw["scale"] = args.scale
    if args.hicache_ratio is not None:
        if not (args.hicache_ratio >= 0 and math.isfinite(args.hicache_ratio)):
            raise ValueError(f"--hicache-ratio must be >= 0, got {args.hicache_ratio}")
        kw["hicache_ratio"] = args.hicache_ratio
    kw["kv_store"] = args.kv_store
    if args.no_weight_update_events:
        kw["weight_update_events"] = False
    if args.weight_update_seconds is not None:
        kw["weight_update_seconds"] = _update_seconds(args.weight_update_seconds)
    if args.router_delays == "none":
        kw["router_seconds"] = (0.0, 0.0)
    if args.prefill_events:
        kw["prefill_events"] = args.prefill_events
    if args.smoothing is not None:
        kw["smoothing"] = args.smoothing
    if args.dp_routing:
        kw["dp_routing"] = args.dp_routing
    if args.reference_cadence is not None:
        if not (args.reference_cadence > 0 and math.isfinite(args.reference_cadence)):
            raise ValueError(f"--reference-cadence must be > 0, got {args.reference_cadence}")
        kw["reference_cadence"] = args.reference_cadence
    if args.reference_moves:
        try:
            moves = tuple(int(m) for m in args.reference_moves.split(","))
        except ValueError:
            moves = ()
        if not moves or 0 in moves:
            raise ValueError(
                f"--reference-moves must be non-zero integers, got {args.reference_moves!r}"
            )
        kw["reference_moves"] = moves
    if args.policies:
        picked = tuple(args.policies.split(","))
        unknown = [p for p in picked if p not in base.policies]
        if unknown or ("reference" in picked and "static" not in picked):
            raise ValueError(
                f"--policies must name some of {','.join(base.policies)} (reference with "
                f"static), got {args.policies!r}"
            )
        kw["policies"] = picked
    if args.no_reference:
        kw["policies"] = tuple(p for p in kw.get("policies", base.policies) if p != "reference")
    if getattr(args, "reuse", None) is not None:
        kw["policies"] = CONTROLLER_POLICIES
    cfg = GridConfig(**{**{f: getattr(base, f) for f in ("models", "tasks", "staleness")}, **kw})

    for m in cfg.models:
        load_profile(m)
    for t in cfg.tasks:
        get_task(t)
    return cfg


def _update_seconds(value: str) -> float | None:
    if value == "measured":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(
            f"--weight-update-seconds must be 'measured' or seconds >= 0, got {value!r}"
        )
    return seconds


def _deployment(model: str) -> str:

    return load_profile(model).title


def _stale(s: int) -> str:
    return "on-policy" if s == 0 else str(s)


def _num(v: float | None, fmt: str = "{:.0f}") -> str:
    if v is None:
        return "-"
    if math.isinf(v):
        return "DNF"
    return fmt.format(v)


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def table(rows: list[Any]) -> str:
    head = (
        f"{'model':<18} {'task':<8} {'stale':<9}"
        + "".join(f"{p:>12}" for p in POLICIES)
        + f"{'best split':>11}{'task split':>11}{'coloc idle':>11}{'WAPE P':>8}{'WAPE D':>8}"
        + f"{'dec KV':>7} {'regime':<14}"
    )
    lines = ["makespan (s)", head, "-" * len(head)]
    for r in rows:
        split = f"{r.best_static}P:{r.instances - r.best_static}D" if r.best_static else "-"
        tsplit = f"{r.task_static}P:{r.instances - r.task_static}D" if r.task_static else "-"
        kv = (r.details.get("best-static") or {}).get("decodeKvUtilisation")
        regime = r.regime + ("" if r.role_switch_capable else " (EP)")
        lines.append(
            f"{r.model:<18} {r.task:<8} {_stale(r.staleness):<9}"
            + "".join(f"{_num(r.makespan.get(p)):>12}" for p in POLICIES)
            + f"{split:>11}{tsplit:>11}{_num(r.colocation_idle, '{:.1%}'):>11}"
            + f"{_num(r.wape_prefill, '{:.1%}'):>8}{_num(r.wape_decode, '{:.1%}'):>8}"
            + f"{_num(kv, '{:.0%}'):>7} {regime:<14}"
        )
    lines += ["", "speedup over colocation / over best static"]
    head2 = f"{'model':<18} {'task':<8} {'stale':<9}" + "".join(f"{p:>14}" for p in POLICIES[1:])
    lines += [head2, "-" * len(head2)]
    for r in rows:
        cells = []
        for p in POLICIES[1:]:
            a = r.speedup(p, over="colocation")
            b = r.speedup(p, over="best-static")
            cells.append(f"{_num(a, '{:.2f}')}/{_num(b, '{:.2f}')}")
        lines.append(
            f"{r.model:<18} {r.task:<8} {_stale(r.staleness):<9}"
            + "".join(f"{c:>14}" for c in cells)
        )
    return "\n".join(lines)


def goals(rows: list[Any]) -> list[dict[str, Any]]:
    """The goals of the benchmark issue, with the numbers that decide them (never tuned).

    The goals hold for deployments SGLang 0.5.23 can role-switch; the first two for those
    whose attention runs data parallel (where PD pays). Each names, beside Prorsa's figure,
    the foresight reference's for the same setting (what switching could give there) and
    the forecast WAPE. ``ok`` is None when no measured row falls under a goal.
    """
    out: list[dict[str, Any]] = []

    def sp(r: SettingRow, p: str, over: str) -> float | None:
        v = r.speedup(p, over=over)
        return None if v is None else round(v, 4)

    def label(r: Any) -> str:
        return f"{r.model}/{r.task}/{_stale(r.staleness)}"

    def wape(r: SettingRow) -> dict[str, float | None]:
        return {"prefill": r.wape_prefill, "decode": r.wape_decode}

    def judged(goal: str, picked: list[SettingRow], over: str, bound: float) -> dict[str, Any]:
        mine = {label(r): sp(r, "prorsa", over) for r in picked}
        measured = {
            label(r): {
                "prorsa": mine[label(r)],
                "reference": sp(r, "reference", over),
                "wape": wape(r),
            }
            for r in picked
        }
        misses = [k for k, v in mine.items() if v is None or v < bound]
        return {
            "goal": goal,
            "ok": (not misses) if picked else None,
            "misses": misses,
            "measured": measured,
        }

    capable = [r for r in rows if r.role_switch_capable]
    dp = [r for r in capable if r.attention == "dp"]
    out.append(
        judged(
            "DP-attention rows, agentic tasks: Prorsa >= 1.10x colocation",
            [r for r in dp if r.task in AGENTIC],
            "colocation",
            1.10,
        )
    )
    out.append(
        judged(
            "DP-attention rows, coding at staleness 2 and 8: Prorsa >= 1.05x best static",
            [r for r in dp if r.task == "coding" and r.staleness in (2, 8)],
            "best-static",
            1.05,
        )
    )
    capture: dict[str, Any] = {}
    for r in capable:
        best, mine, ref = (r.makespan.get(p) for p in ("best-static", "prorsa", "reference"))
        if best is None or mine is None or ref is None:
            continue
        if not (math.isfinite(best) and math.isfinite(ref)) or ref > best / 1.05:
            continue  # the reference gains less than 5% over the best static split
        share = (best - mine) / (best - ref) if math.isfinite(mine) else -math.inf
        capture[label(r)] = {
            "referenceGain": round(best / ref - 1, 4),
            "prorsaGain": round(best / mine - 1, 4) if math.isfinite(mine) else None,
            "captured": round(share, 4) if math.isfinite(share) else None,
        }
    misses = [k for k, v in capture.items() if v["captured"] is None or v["captured"] < 0.70]
    out.append(
        {
            "goal": "where the reference gains >= 5% over the best static split, Prorsa "
            "captures >= 70% of that gain",
            "ok": (not misses) if capture else None,
            "misses": misses,
            "measured": capture,
        }
    )
    out.append(
        judged(
            "every role-switch-capable setting: Prorsa >= 0.97x best static",
            capable,
            "best-static",
            0.97,
        )
    )
    return out


def grid_of(cfg: GridConfig) -> dict[str, Any]:
    """What the figures of a run depend on besides the Controller: --reuse checks it."""
    return {
        "seed": cfg.seed,
        "steps": cfg.steps,
        "scale": cfg.scale,
        "instances": cfg.instances,
        "hicacheRatio": cfg.hicache_ratio,
        "kvStore": cfg.kv_store,
        "weightUpdateEvents": cfg.weight_update_events,
        "weightUpdateSeconds": cfg.weight_update_seconds,
        "routerSeconds": list(cfg.router_seconds),
        "prefillEvents": cfg.prefill_events,
        "static": list(cfg.static_splits()),
        "dpRouting": cfg.dp_routing,
        "referenceCadence": cfg.reference_cadence,
        "referencePoints": cfg.reference_points,
        "referenceMoves": list(cfg.reference_moves),
    }


# What --reuse takes from a previous run: every policy that does not read the Controller's
# settings (the Dynamo planners start where the spec's roles.prefill.initial says).
REUSED = ("colocation", "best-static", "task-static", "reactive", "throughput", "reference")


def read_previous(path: Path, cfg: GridConfig) -> dict[str, Any]:
    """A previous ``--json`` that ``--reuse`` can take figures from for this grid.

    It must be of the same grid (``grid`` in its JSON; a file written before that was
    recorded is checked on the seed of its reference schedules) and hold every setting.
    """
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
        settings = {(x["model"], x["task"], x["staleness"]) for x in doc["settings"]}
        doc["rollout"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"--reuse {path}: not a `prorsa bench rollout --json` output ({exc})"
        ) from exc
    mine = grid_of(cfg)
    theirs = doc.get("grid")
    if theirs is not None:
        # A run from before --kv-store existed ran per-instance caches.
        theirs = {"kvStore": PER_INSTANCE} | theirs
        differ = sorted(k for k in mine if theirs.get(k) != mine[k])
        if differ:
            raise ValueError(
                f"--reuse {path}: ran another grid ("
                + ", ".join(f"{k} {theirs.get(k)!r}, here {mine[k]!r}" for k in differ)
                + ")"
            )
    else:
        seeds = {x.get("seed") for x in doc.get("referenceSchedules") or []}
        if seeds != {cfg.seed}:
            ran = ", ".join(map(str, sorted(seeds, key=str))) or "unknown"
            raise ValueError(f"--reuse {path}: ran seed {ran}, not {cfg.seed}")
    for sc in cfg.scenarios():
        if (sc.model, sc.task, sc.staleness) not in settings:
            raise ValueError(f"--reuse {path}: has no figures for {sc.label}")
    return doc


def reuse(rows: list[SettingRow], doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Fill ``rows`` with the figures of :data:`REUSED` from a previous run's JSON
    (:func:`read_previous`); returns its reference schedules for these settings."""
    settings = {(x["model"], x["task"], x["staleness"]): x for x in doc["settings"]}
    old = {(x["model"], x["task"], x["staleness"], x["policy"]): x for x in doc["rollout"]}
    keys = set()
    for row in rows:
        key = (row.model, row.task, row.staleness)
        found = settings[key]
        keys.add(key)
        row.best_static = found["bestStatic"]["prefill"]
        row.task_static = found["taskStatic"]["prefill"]
        row.statics = {
            int(n): math.inf if ms is None else ms
            for n, ms in (found.get("staticMakespans") or {}).items()
        }
        row.colocation_idle = found["colocationIdleRatio"]
        for p in REUSED:
            x = old.get((*key, p))
            if x is None:
                continue
            ms = x["makespanSeconds"]
            row.makespan[p] = math.inf if ms is None else ms
            row.details[p] = {
                "decodeKvUtilisation": x["decodeKvUtilisation"],
                "admissionQueue": x["admissionQueue"],
                "switches": x["switches"],
                "dpRouting": found.get("dpRouting"),
            }
    return [
        x
        for x in doc.get("referenceSchedules") or []
        if (x["model"], x["task"], x["staleness"]) in keys
    ]


def as_json(
    rows: list[Any],
    png: Path | None,
    *,
    gl: list[dict[str, Any]],
    grid: dict[str, Any] | None = None,
    schedules: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The JSON of ``--json``; ``schedules``: the reference's, when taken from a previous run."""
    rollout = []
    wape = []
    settings = []
    reused = schedules is not None
    schedules = list(schedules or [])
    for r in rows:
        for p in POLICIES:
            if p not in r.makespan:
                continue
            detail = r.details.get(p) or {}
            rollout.append(
                {
                    "model": r.model,
                    "deployment": _deployment(r.model),
                    "attention": r.attention,
                    "dpSize": r.dp_size,
                    "roleSwitchCapable": r.role_switch_capable,
                    "regime": r.regime,
                    "task": r.task,
                    "staleness": r.staleness,
                    "policy": p,
                    "makespanSeconds": _finite(r.makespan[p]),
                    "speedupVsColocation": r.speedup(p, over="colocation"),
                    "speedupVsBestStatic": r.speedup(p, over="best-static"),
                    "speedupVsTaskStatic": r.speedup(p, over="task-static"),
                    "decodeKvUtilisation": detail.get("decodeKvUtilisation"),
                    "admissionQueue": detail.get("admissionQueue"),
                    "switches": detail.get("switches"),
                    "kvStore": (detail.get("extra") or {}).get("kvStore"),
                }
            )
        wape.append(
            {
                "model": r.model,
                "deployment": _deployment(r.model),
                "task": r.task,
                "staleness": r.staleness,
                "prefill": r.wape_prefill,
                "decode": r.wape_decode,
            }
        )
        settings.append(
            {
                "model": r.model,
                "task": r.task,
                "staleness": r.staleness,
                "deployment": _deployment(r.model),
                "roleSwitchCapable": r.role_switch_capable,
                "regime": r.regime,
                "bestStatic": {"prefill": r.best_static, "decode": r.instances - r.best_static},
                "taskStatic": {"prefill": r.task_static, "decode": r.instances - r.task_static},
                "staticMakespans": {str(n): _finite(ms) for n, ms in r.statics.items()},
                "colocationIdleRatio": r.colocation_idle,
                "dpRouting": (r.details.get("best-static") or {}).get("dpRouting"),
            }
        )
        ref = r.details.get("reference")
        if ref is not None and not reused:
            extra = ref.get("extra") or {}
            schedules.append(
                {
                    "model": r.model,
                    "task": r.task,
                    "staleness": r.staleness,
                    "seed": ref.get("seed"),
                    "start": r.best_static,
                    "makespanSeconds": _finite(ref["makespan"]),
                    "bestStaticSeconds": _finite(r.makespan.get("best-static")),
                    "cadenceSeconds": extra.get("cadenceSeconds"),
                    "moves": extra.get("moves"),
                    "forks": extra.get("forks"),
                    "forkSeconds": extra.get("forkSeconds"),
                    "timeline": ref.get("timeline"),
                    "decisions": extra.get("schedule"),
                }
            )
    return {
        "grid": grid,
        "rollout": rollout,
        "wape": wape,
        "settings": settings,
        "goals": gl,
        "value": value_json(rows),
        "referenceSchedules": schedules,
        "png": str(png) if png else None,
    }


def run(args: argparse.Namespace) -> int:

    try:
        cfg = _config(args)
    except ValueError as exc:
        print(f"prorsa bench rollout: {exc}", file=sys.stderr)
        return 2
    previous = None
    if args.reuse is not None:
        try:
            previous = read_previous(args.reuse, cfg)
        except ValueError as exc:
            print(f"prorsa bench rollout: {exc}", file=sys.stderr)
            return 2
    todo = jobs(cfg)
    started = time.monotonic()
    done = 0

    def progress(r: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        print(
            f"\r[{done}/{len(todo)}] {time.monotonic() - started:5.0f}s "
            f"{r['model']} {r['task']} {_stale(r['staleness'])} {r['policy']}".ljust(78),
            end="",
            file=sys.stderr,
            flush=True,
        )

    results = run_jobs(todo, workers=args.workers, progress=progress, config=cfg)
    print(file=sys.stderr)
    rows = aggregate(results, instances=cfg.instances)
    # The grid's order: role-switch-capable deployments first, EP references after.
    rows.sort(key=lambda r: cfg.models.index(r.model))
    schedules = None if previous is None else reuse(rows, previous)
    png: Path | None = None
    pick = [r for r in rows if r.task in AGENTIC and r.staleness == max(cfg.staleness)]
    pick = [r for r in pick if r.model == rows[0].model] or rows[:1]
    if pick and any("prorsa" in r.details for r in pick):
        png = write_png(pick, args.out / "rollout.png")
    gl = goals(rows)
    elapsed = time.monotonic() - started
    doc = as_json(rows, png, gl=gl, grid=grid_of(cfg), schedules=schedules)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rollout.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(
        f"prorsa bench rollout: {len(cfg.models)} models x {len(cfg.tasks)} tasks x "
        f"{len(cfg.staleness)} staleness, {cfg.steps} steps, batch scale {cfg.scale}, "
        f"{cfg.instances} instances, KV store {cfg.kv_store}; {len(todo)} simulations in "
        f"{elapsed:.0f} s"
    )
    print(table(rows))
    print("\n" + value_table(rows))
    print("\ngoals")
    for g in gl:
        mark = {True: "ok  ", False: "MISS", None: "----"}[g["ok"]]
        if g["ok"] is None:
            detail = "no measured setting falls under it"
        else:
            judged = len(g.get("measured") or {})
            missed = g.get("misses") or []
            detail = f"{judged - len(missed)} of {judged} met" + (
                f"; missed: {', '.join(missed)}" if missed else ""
            )
        print(f"  [{mark}] {g['goal']}: {detail}")
    written = [str(path) for path in (png, args.out / "rollout.json") if path]
    print("\nwrote " + ", ".join(written))
    return 0
