"""``prorsa bench``: the project's performance figures, each printed as ratios from one run,
and the robustness suites (``attack``, ``chaos``) whose counts docs/security.md publishes."""

from __future__ import annotations

import argparse
import importlib

HELP = (
    "run benchmarks (controller, ingest, rollout, events, or all), the operator at scale "
    "(scale, soak) and the attack and chaos suites"
)

# Benchmark name -> module exposing configure(parser) and run(args) -> int.
BENCHES: dict[str, str] = {
    "controller": "prorsa_lab.bench.controller_bench",
    "ingest": "prorsa_lab.bench.ingest_bench",
    "rollout": "prorsa_lab.bench.rollout_bench",
    "events": "prorsa_lab.bench.events_bench",
}
# Robustness suites (docs/security.md): counts of what broke, not performance figures, and
# minutes long, so `prorsa bench all` (make bench) leaves them out.
SUITES: dict[str, str] = {
    "attack": "prorsa_lab.robustness.attack_suite",
    "chaos": "prorsa_lab.robustness.chaos_suite",
    # The whole operator at a training cluster's size (docs/benchmarks.md): minutes to an
    # hour of two replicas, the emulator and a hundred engine pods, so not in `all` either.
    "scale": "prorsa_lab.bench.scale_bench",
    "soak": "prorsa_lab.bench.soak_bench",
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, module_name in (BENCHES | SUITES).items():
        module = importlib.import_module(module_name)
        child = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.configure(child)
        child.set_defaults(_bench_run=module.run)
    everything = sub.add_parser(
        "all", help="every benchmark, with --quick settings (not the attack and chaos suites)"
    )
    everything.set_defaults(_bench_run=_run_all)


def _run_all(args: argparse.Namespace) -> int:
    status = 0
    for name, module_name in BENCHES.items():
        module = importlib.import_module(module_name)
        child = argparse.ArgumentParser(prog=f"prorsa bench {name}")
        module.configure(child)
        sub_args = child.parse_args(["--quick"] if _has_quick(child) else [])
        print(f"== prorsa bench {name} ==", flush=True)
        status = max(status, int(module.run(sub_args) or 0))
    return status


def _has_quick(parser: argparse.ArgumentParser) -> bool:
    return any("--quick" in action.option_strings for action in parser._actions)


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)
