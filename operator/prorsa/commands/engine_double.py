"""``prorsa engine-double``: an SGLang 0.5.23 HTTP double for tests, CI and the demo."""

from __future__ import annotations

import argparse
import sys

HELP = "run an HTTP double of an SGLang 0.5.23 engine (role switching, loads, aborts)"


def configure(parser: argparse.ArgumentParser) -> None:
    from prorsa_lab.doubles.engine.cli import configure as configure_engine

    configure_engine(parser)


def run(args: argparse.Namespace) -> int:
    from prorsa_lab.doubles.engine.cli import run as run_engine

    return run_engine(args, sys.argv[2:])
