"""``prorsa record``: record a trainer's event stream, so that ``prorsa plan`` replays it.

A local webhook for one RolloutCluster manifest (the same application, validation and
Controller as ``prorsa ingest`` and the operator) that writes every event it applies to
an NDJSON file, one event per line, in the order it applied them. Point the trainer's
emitter at it, run the job, stop with Ctrl-C; then ``prorsa plan --cluster M --events
FILE`` replays the job offline. On a cluster, the SDK's ``record=`` option tees the same
stream to a file beside the operator's webhook.
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "serve a local trainer webhook and record the events it receives (NDJSON)"


def configure(parser: argparse.ArgumentParser) -> None:
    from prorsa.commands.ingest import add_server_arguments

    add_server_arguments(parser)
    parser.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="FILE",
        help="NDJSON file to write (refused if it exists, unless --append)",
    )
    parser.add_argument("--append", action="store_true", help="append to an existing FILE")


def run(args: argparse.Namespace) -> int:
    from prorsa.commands.ingest import serve

    return serve(args, command="record", record=args.out, append=args.append)
