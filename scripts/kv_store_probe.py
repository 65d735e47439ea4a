"""Prorsa under the shared KV store, its spec declaring ``prefillCacheTokens: 0``.

That spec value tells the Controller a flip flushes no prefix cache and sets no cache
floor (prorsa.core.switch_plan.lost_tokens, prorsa.core.measure.cache_floor): what a
cluster whose shared store keeps every context could declare. Compare the makespans with
the ``prorsa`` rows of ``prorsa bench rollout --kv-store shared`` (the spec's default).

    python scripts/kv_store_probe.py SEED MODEL/TASK/STALENESS [...]
"""

from __future__ import annotations

import sys

from prorsa_lab.sim.policies import baseline
from prorsa_lab.sim.simulator import Scenario, simulate


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    seed = int(argv[0])
    for setting in argv[1:]:
        model, task, staleness = setting.split("/")
        sc = Scenario(
            model=model,
            task=task,
            staleness=int(staleness),
            seed=seed,
            kv_store="shared",
            prefill_cache_tokens=0,
        )
        r = simulate(sc, baseline("prorsa"))
        print(
            f"seed {seed} {setting}: Prorsa with prefillCacheTokens 0 {r.makespan:.0f} s, "
            f"{r.switches} switches",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
