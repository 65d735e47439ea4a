"""The control core: forecast, allocation and switch planning, with no I/O.

Everything here is a pure function of its inputs (the webhook events and the agents' engine
states of :mod:`prorsa_contract`, and a clock passed in): no network, no Kubernetes, no
metrics registry. The operator, ``prorsa plan``, the simulator and the benchmarks all run
this same code; an import-linter contract (``make lint``) keeps it free of the adapters.
"""
