"""Discrete-event simulator of agentic RL rollout on PD-disaggregated engines (virtual time).

The Prorsa policy in it is the very Controller the operator runs, fed only the webhook and
agent CONTRACT bodies the simulated trainer and engines produce. Entry points:
:func:`prorsa_lab.sim.simulator.simulate` for one run, :mod:`prorsa_lab.sim.runner` for the
benchmark grid behind ``prorsa bench rollout``.
"""
