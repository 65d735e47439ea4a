"""Benchmarks behind `prorsa bench`: one module per benchmark, each with ``HELP``,
``configure(parser)`` and ``run(args)``. They import the code they measure at the top; the
`prorsa` command loads them only when ``prorsa bench`` runs."""
