"""What switching gains over the best static split in `prorsa bench rollout` JSONs.

Issue 33's decision rule for the shared KV store: go on if, with the store, the foresight
reference or Prorsa gains at least 3% over the best static split on some agentic row.
For each rollout.json given (one per seed) this prints every agentic row's best static
split, the reference's and Prorsa's makespan over it, their switches and what the store
served, then the rows that pass the rule and the geometric means over every row.

    python scripts/kv_store_gain.py bench-out/shared-s1/rollout.json [...]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

AGENTIC = ("coding", "general")
BAR = 1.03


def _rows(doc: dict[str, Any]) -> dict[tuple[str, str, int], dict[str, dict[str, Any]]]:
    rows: dict[tuple[str, str, int], dict[str, dict[str, Any]]] = {}
    for r in doc["rollout"]:
        rows.setdefault((r["model"], r["task"], r["staleness"]), {})[r["policy"]] = r
    return rows


def _gain(best: float | None, mine: float | None) -> float | None:
    return None if not best or not mine else best / mine


def report(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    grid = doc.get("grid") or {}
    splits = {(s["model"], s["task"], s["staleness"]): s for s in doc["settings"]}
    print(f"{path}: seed {grid.get('seed')}, KV store {grid.get('kvStore', 'per-instance')}")
    print(
        f"{'setting':<36}{'best static':>16}{'reference':>11}{'Prorsa':>8}"
        f"{'switches P/R':>14}{'loaded M':>10}{'store peak M':>14}"
    )
    passed: list[str] = []
    logs: dict[str, list[float]] = {"reference": [], "prorsa": []}
    for key, by in _rows(doc).items():
        best = by.get("best-static", {}).get("makespanSeconds")
        gains = {p: _gain(best, by.get(p, {}).get("makespanSeconds")) for p in logs}
        for p, g in gains.items():
            if g is not None:
                logs[p].append(math.log(g))
        if key[1] not in AGENTIC:
            continue
        label = f"{key[0]}/{key[1]}/{key[2] or 'on-policy'}"
        store = by.get("best-static", {}).get("kvStore") or {}
        split = splits[key]["bestStatic"]["prefill"]
        sw = "/".join(str(by.get(p, {}).get("switches", "-")) for p in ("prorsa", "reference"))
        cells = "".join(
            f"{'-' if g is None else f'{g:.3f}':>{w}}"
            for g, w in ((gains["reference"], 11), (gains["prorsa"], 8))
        )
        print(
            f"{label:<36}{best:>11.0f} ({split}P)" + cells + f"{sw:>14}"
            f"{store.get('loadedTokens', 0) / 1e6:>10.1f}{store.get('peakTokens', 0) / 1e6:>14.1f}"
        )
        passed += [f"{label} {p} {g:.3f}" for p, g in gains.items() if g is not None and g >= BAR]
    for p, xs in logs.items():
        if xs:
            print(
                f"geometric mean over {len(xs)} settings, {p} / best static: "
                f"{math.exp(sum(xs) / len(xs)):.3f}"
            )
    print(f"agentic rows at >= {BAR:.2f}x the best static split: " + (", ".join(passed) or "none"))
    return passed


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for arg in argv:
        report(Path(arg))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
