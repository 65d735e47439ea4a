"""``prorsa bench``: the project's performance figures, each printed as ratios from one run,
and the robustness suites (``attack``, ``chaos``) whose counts docs/security.md publishes.

Each benchmark is a part of the lab registered as an entry point (:mod:`prorsa.commands.lab`)
and loaded only when it runs: ``prorsa bench NAME ARGS...`` hands ARGS to NAME's own parser,
so ``prorsa bench rollout --help`` loads the simulator and nothing else, and ``prorsa bench
--help`` names them all without loading any.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from prorsa.commands import lab

HELP = (
    "run benchmarks (controller, ingest, rollout, events, or all), the operator at scale "
    "(scale, soak) and the attack and chaos suites"
)
ALL = "all"
ALL_HELP = "every benchmark, with --quick settings (not the attack and chaos suites)"


def _group_of(name: str) -> str:
    return lab.BENCHES if name in lab.names(lab.BENCHES) else lab.SUITES


def configure(parser: argparse.ArgumentParser) -> None:
    benches, suites = lab.names(lab.BENCHES), lab.names(lab.SUITES)
    parser.epilog = (
        f"benchmarks: {', '.join(benches)}; {ALL}: {ALL_HELP}. The robustness suites and "
        f"the operator at scale: {', '.join(suites)}. 'prorsa bench BENCH --help' says what "
        "each one measures and takes."
    )
    parser.add_argument(
        "bench",
        metavar="BENCH",
        choices=[*benches, *suites, ALL],
        help="the benchmark to run",
    )
    parser.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="ARGS", help="the benchmark's arguments"
    )
    # The benchmark's own parser is of the same class (one-line errors, exit code 2).
    parser.set_defaults(_parser_class=type(parser))


def _run_all(parser_class: type[argparse.ArgumentParser], args: Sequence[str]) -> int:
    parser_class(prog=f"prorsa bench {ALL}", description=ALL_HELP).parse_args(args)
    status = 0
    for name in lab.names(lab.BENCHES):
        module = lab.load(lab.BENCHES, name)
        child = argparse.ArgumentParser(prog=f"prorsa bench {name}")
        module.configure(child)
        sub_args = child.parse_args(["--quick"] if _has_quick(child) else [])
        print(f"== prorsa bench {name} ==", flush=True)
        status = max(status, int(module.run(sub_args) or 0))
    return status


def _has_quick(parser: argparse.ArgumentParser) -> bool:
    return any("--quick" in action.option_strings for action in parser._actions)


def run(args: argparse.Namespace) -> int:
    name: str = args.bench
    try:
        if name == ALL:
            return _run_all(args._parser_class, args.args)
        module = lab.load(_group_of(name), name)
    except lab.MissingExtra as exc:
        print(f"prorsa bench {name}: error: {exc}", file=sys.stderr)
        return 2
    parser = args._parser_class(prog=f"prorsa bench {name}", description=module.HELP)
    module.configure(parser)
    return int(module.run(parser.parse_args(args.args)) or 0)
