"""The wire contracts shared by the operator, the trainer SDK and the in-pod agent.

:mod:`prorsa_contract.events` is the trainer webhook's body (docs/webhook-events.md),
:mod:`prorsa_contract.agent_api` the in-pod agent's (docs/agent-api.md);
:mod:`prorsa_contract.serving_tls` is how both servers present their certificates. Only
pydantic (and the standard library) is needed to import them, so every side can depend on
this package and nothing else of Prorsa.
"""

__version__ = "0.1.0"
