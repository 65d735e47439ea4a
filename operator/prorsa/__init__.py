"""Prorsa: forecast-driven prefill/decode role switching for agentic RL rollout engines."""

__version__ = "0.1.0"
