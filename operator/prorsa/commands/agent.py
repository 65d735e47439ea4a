"""``prorsa agent``: the in-pod agent of an engine pod (package ``prorsa_agent``).

Engine pods run ``prorsa-agent``, the light distribution's command with the same flags;
this subcommand keeps the agent one command away in a checkout and in images that carry
the whole ``prorsa`` distribution.
"""

from __future__ import annotations

import argparse

HELP = "run the in-pod agent: supervise SGLang, report its state, flip its PD role"


def configure(parser: argparse.ArgumentParser) -> None:
    from prorsa_agent.agent_cli import configure as configure_agent

    configure_agent(parser)


def run(args: argparse.Namespace) -> int:
    from prorsa_agent.agent_cli import run as run_agent

    return run_agent(args)
