"""``prorsa engine-double``: an SGLang 0.5.23 HTTP double for tests, CI and the demo."""

from __future__ import annotations

import argparse
import sys

from prorsa.commands import lab

HELP = "run an HTTP double of an SGLang 0.5.23 engine (role switching, loads, aborts)"


def configure(parser: argparse.ArgumentParser) -> None:
    lab.load(lab.LAB, "engine-double").configure(parser)


def run(args: argparse.Namespace) -> int:
    return int(lab.load(lab.LAB, "engine-double").run(args, sys.argv[2:]))
