"""``python -m prorsa_agent ...`` is ``prorsa agent ...``, without the other subcommands.

A fallback entry point for the engine image: it loads nothing but the agent.
"""

import argparse
import sys

from prorsa_agent.agent_cli import HELP, configure, run

parser = argparse.ArgumentParser(prog="prorsa agent", description=HELP)
configure(parser)
sys.exit(run(parser.parse_args()))
