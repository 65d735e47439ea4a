"""What the operator, the trainer SDK and the in-pod agent share, so each depends on this
package and nothing else of Prorsa (pydantic and the standard library are all it needs):

- :mod:`prorsa_contract.events`: the trainer webhook's body, the lifecycle events
  (docs/webhook-events.md);
- :mod:`prorsa_contract.agent_api`: the in-pod agent's API models (docs/agent-api.md);
- :mod:`prorsa_contract.labels`: the engine pods' names, labels and annotations, which the
  operator writes and routers, monitors and kubelets read;
- :mod:`prorsa_contract.serving_tls`: how the webhook and the agent serve TLS (a
  certificate re-read when renewed);
- :mod:`prorsa_contract.watched_files`: files read again when they change (a mounted
  Secret's token, a serving certificate), for the agent, the SDK and the TLS context;
- :mod:`prorsa_contract.bearer`: the token of an ``Authorization: Bearer`` header, parsed
  one way by the webhook, the agent and the lab's doubles;
- :mod:`prorsa_contract.aio`: the asyncio helpers every process shares (stopping on a
  signal, cancelling and awaiting a task).
"""

__version__ = "0.1.0"
