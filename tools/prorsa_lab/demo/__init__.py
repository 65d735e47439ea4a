"""``prorsa demo``: the whole system on one machine, driven by a simulated agentic trainer.

The Kubernetes API emulator, the operator (kopf, real webhook, real ``/metrics``), one
engine pod per instance (SGLang engine double + the real in-pod agent) and a trainer that
posts real lifecycle events through the SDK and sends real ``/generate`` requests, routed
by role label and resumed through :class:`prorsa_sdk.ResumableGeneration` when a role
switch aborts them. See :mod:`prorsa_lab.demo.run`.
"""
