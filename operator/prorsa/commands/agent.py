"""``prorsa agent``: the in-pod agent of an engine pod (package ``prorsa_agent``)."""

from __future__ import annotations

import argparse

HELP = "run the in-pod agent: supervise SGLang, report its state, flip its PD role"


def configure(parser: argparse.ArgumentParser) -> None:
    from prorsa_agent.agent_cli import configure as configure_agent

    configure_agent(parser)


def run(args: argparse.Namespace) -> int:
    from prorsa_agent.agent_cli import run as run_agent

    return run_agent(args)
