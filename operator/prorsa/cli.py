"""The ``prorsa`` command: a thin dispatcher over :mod:`prorsa.commands`."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from typing import NoReturn

from prorsa import __version__
from prorsa.commands.lab import MissingExtra, missing_extra

# Subcommand name -> module under prorsa.commands. Keep alphabetical.
COMMANDS: dict[str, str] = {
    "agent": "agent",
    "bench": "bench",
    "crd": "crd",
    "demo": "demo",
    "engine-double": "engine_double",
    "ingest": "ingest",
    "operator": "operator",
    "plan": "plan",
    "profile": "profile",
    "record": "record",
    "replay": "replay",
}

# Subcommands that run the lab (package prorsa_lab, tools/ in the repository): the
# simulator, the benchmarks, the demo and the test doubles. The operator and engine images
# leave the lab out, so these commands load it only when they run.
LAB_COMMANDS = frozenset({"bench", "demo", "engine-double", "replay"})
LAB_NEEDED = "needs the Prorsa lab (package prorsa_lab, tools/ in the repository)"
LAB_MISSING = (
    f"{LAB_NEEDED}, which is not installed here; install a clone of the repository "
    "(pip install -e . or make demo)"
)


def lab_installed() -> bool:
    try:
        return importlib.util.find_spec("prorsa_lab") is not None
    except ImportError:  # an import hook that hides it: as good as absent
        return False


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2), as a shell user expects."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with ``only`` the arguments of that one subcommand.

    Each subcommand's ``configure`` may import its modules (``prorsa bench`` imports the
    control core and the simulator); configuring only the command being run keeps
    ``prorsa --help`` and every other command from paying for them.
    """
    parser = _Parser(
        prog="prorsa",
        description="Forecast-driven prefill/decode role switching for agentic RL rollout.",
    )
    parser.add_argument("--version", action="version", version=f"prorsa {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    lab = lab_installed()
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"prorsa.commands.{module_name}")
        if name in LAB_COMMANDS and not lab:
            sub.add_parser(name, help=f"{module.HELP} [prorsa_lab not installed]")
            continue
        child = sub.add_parser(name, help=module.HELP, description=module.HELP)
        if only is None or only == name:
            module.configure(child)
        child.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in LAB_COMMANDS and not lab_installed():
        print(f"prorsa {argv[0]}: error: {LAB_MISSING}", file=sys.stderr)
        return 2
    try:
        parser = build_parser(only=argv[0] if argv else "")
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        return int(args._run(args) or 0)
    except MissingExtra as exc:  # a part of the lab needs a library of an extra
        print(f"prorsa {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # the command itself needs one (`prorsa operator`)
        missing = missing_extra(exc)
        if missing is None:
            raise
        print(f"prorsa {argv[0]}: error: {missing}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
