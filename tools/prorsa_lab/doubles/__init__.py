"""Test doubles that ship with Prorsa, for its own tests, the demo and users' CI.

:mod:`prorsa_lab.doubles.sglang_double` is an HTTP server that speaks SGLang 0.5.23's wire
format (the endpoints an in-pod agent, a router and a trainer use) with a timing model, so that the
operator, the agent and the demo can run end to end on a machine without a GPU.
"""
