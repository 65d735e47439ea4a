"""CONTRACT: the names, labels and annotations of engine pods (docs/agent-api.md).

The operator writes them; a router, a monitor or a kubelet reads them to tell which pod
serves which role without asking the operator. Engine pods are ``<cluster>-engine-<i>``,
labelled ``app.kubernetes.io/managed-by: prorsa``, ``prorsa.io/cluster`` and
``prorsa.io/role`` (prefill | decode | draining); every engine pod carries the
``sglang.ai/bootstrap-port`` annotation (any pod may become prefill), and a switch in
progress carries the ``prorsa.io/switch`` intent annotation, so an operator that restarts
mid-switch can finish it.

An instance that spans several nodes (``engine.nodesPerInstance`` > 1) is a group of pods:
the leader ``<cluster>-engine-<i>`` (node rank 0, SGLang's HTTP server and the agent) and
the workers ``<cluster>-engine-<i>-node-<r>``. Every pod of a group carries
``prorsa.io/group`` (the leader's name), ``prorsa.io/node-rank``, ``prorsa.io/nodes`` and the
group's role label; only the leader carries the bootstrap and the intent annotations, and
only leaders are router workers. When the cluster serves the LeaderWorkerSet API an instance
is a LeaderWorkerSet ``<cluster>-engine-<i>``: LWS names the leader ``<cluster>-engine-<i>-0``
and the workers ``<cluster>-engine-<i>-0-<r>``, and a worker's rank is its
``leaderworkerset.sigs.k8s.io/worker-index`` label (one template serves every worker).
"""

from __future__ import annotations

import json
from typing import Final, Literal, NotRequired, TypedDict

from prorsa_contract.agent_api import Role, as_role

MANAGED_BY = "app.kubernetes.io/managed-by"
CLUSTER_LABEL = "prorsa.io/cluster"
ROLE_LABEL = "prorsa.io/role"
COMPONENT_LABEL = "app.kubernetes.io/component"
INDEX_LABEL = "prorsa.io/index"
BOOTSTRAP_ANNOTATION = "sglang.ai/bootstrap-port"
SWITCH_ANNOTATION = "prorsa.io/switch"
DRAINING: Final = "draining"
RoleLabel = Role | Literal["draining"]
"""The values of ``prorsa.io/role``: an engine role, or out of the router mid-switch."""
GROUP_LABEL = "prorsa.io/group"
NODE_RANK_LABEL = "prorsa.io/node-rank"
NODES_LABEL = "prorsa.io/nodes"

ENGINE_PORT = 30000
BOOTSTRAP_PORT = 8998
AGENT_PORT = 8080
DIST_INIT_PORT = 5000
"""SGLang's ``--dist-init-addr`` port on a multi-node leader (torch.distributed rendezvous)."""
AGENT_COMMAND = "prorsa-agent"
"""The command of every engine pod (``--worker`` added on a worker rank): the engine image's
entry point, which the ``prorsa-agent`` distribution installs (engine_image/pyproject.toml)."""


def engine_name(cluster: str, index: int) -> str:
    return f"{cluster}-engine-{index}"


def worker_name(cluster: str, index: int, rank: int) -> str:
    """A multi-node instance's pod of node rank ``rank`` >= 1."""
    return f"{engine_name(cluster, index)}-node-{rank}"


def agent_secret_name(cluster: str) -> str:
    return f"{cluster}-agent-token"


def engine_key_secret_name(cluster: str) -> str:
    return f"{cluster}-engine-admin-key"


def agent_tls_secret_name(cluster: str) -> str:
    """The agents' serving certificate (``tls.crt``, ``tls.key``, ``ca.crt``)."""
    return f"{cluster}-agent-tls"


IntentPhase = Literal["draining", "switching"]
"""The ``phase`` of a ``prorsa.io/switch`` intent: the pod is leaving the router
(``draining``), or its agent has been asked to flip (``switching``)."""
INTENT_PHASES: tuple[IntentPhase, ...] = ("draining", "switching")

SwitchIntent = TypedDict(
    "SwitchIntent",
    {
        "to": Role,
        "from": NotRequired[Role],
        "phase": NotRequired[IntentPhase],
        "started": NotRequired[str],
    },
)
"""The ``prorsa.io/switch`` annotation, parsed: the switch's target role, the role it left
(absent on an intent written before it was recorded), its phase and its start time."""


def switch_intent(*, to: Role, phase: IntentPhase, started: str, origin: Role) -> str:
    """The ``prorsa.io/switch`` annotation value (JSON), read back after a restart."""
    return json.dumps({"to": to, "from": origin, "phase": phase, "started": started})


def parse_intent(value: str | None) -> SwitchIntent | None:
    """The intent an annotation holds; None when it names no target role.

    A ``from`` that is not a role, or a ``phase`` that is not an intent phase, is dropped
    (the switch is still finished: its target is known), and so are keys this version does
    not know.
    """
    if not value:
        return None
    try:
        data = json.loads(value)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    to = as_role(data.get("to"))
    if to is None:
        return None
    intent: SwitchIntent = {"to": to}
    origin = as_role(data.get("from"))
    if origin is not None:
        intent["from"] = origin
    phase = next((p for p in INTENT_PHASES if p == data.get("phase")), None)
    if phase is not None:
        intent["phase"] = phase
    if "started" in data:
        intent["started"] = str(data["started"])
    return intent
