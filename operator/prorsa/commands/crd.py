"""``prorsa crd``: print the RolloutCluster CRD generated from the spec models."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "print (or --write) the RolloutCluster CustomResourceDefinition"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--write", type=Path, metavar="FILE", help="write it to FILE instead")


def run(args: argparse.Namespace) -> int:
    from prorsa.k8s.crd_manifest import render

    text = render()
    if args.write is None:
        sys.stdout.write(text)
    else:
        args.write.write_text(text)
        print(f"wrote {args.write}", file=sys.stderr)
    return 0
