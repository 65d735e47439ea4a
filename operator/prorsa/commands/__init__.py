"""One module per `prorsa` subcommand.

Each module defines ``HELP`` (one line), ``configure(parser)`` and ``run(args) -> int``, and
imports its heavy dependencies inside ``run`` so that ``prorsa --help`` stays fast.
"""
