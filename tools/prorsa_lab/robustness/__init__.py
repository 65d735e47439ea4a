"""Robustness suites behind ``prorsa bench attack`` and ``prorsa bench chaos``: hostile
requests against the webhook and the agent (:mod:`.attack_suite`), and faults injected
into a whole deployment on the API emulator under a trainer's load (:mod:`.chaos_suite`).
Each run is seeded and bounded, prints its progress and a summary, and can write that
summary as JSON; docs/security.md publishes their figures."""
