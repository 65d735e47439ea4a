"""Engine flags a RolloutCluster may not carry: admission refuses them, naming the field.

An engine pod's SGLang command line is the operator's ``PRORSA_*`` flags, then
``engine.extraArgs``, then what the agent adds (``prorsa_agent.config.engine_argv``:
``--disaggregation-mode decode``, ``--enable-pd-role-switch``, ``--enable-metrics``, the
decode radix cache, HiCache, ``--admin-api-key``). A combination SGLang 0.5.23 refuses at
start-up would leave every engine pod crash-looping; one the agent refuses, the same. They
are refused here instead, when the RolloutCluster is applied. Each rule names its source;
``tests/real_engine/test_sglang_validation.py`` runs SGLang's own validation (``ServerArgs``
and its resolution hooks) on every combination the product renders and checks that this
module refuses exactly what SGLang refuses, and why it refuses the rest.

Kept apart from the spec models (``prorsa.core.spec``) so that each stays readable; the
spec calls :func:`extra_args_errors` and :func:`engine_env_errors`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLE_SWITCH_SIZES = (
    ("expert parallelism", ("--ep-size", "--ep", "--expert-parallel-size")),
    ("pipeline parallelism", ("--pp-size", "--pipeline-parallel-size")),
    ("decode context parallelism", ("--dcp-size", "--decode-context-parallel-size")),
)
"""Sizes above 1 that ``--enable-pd-role-switch`` refuses (``srt/arg_groups/
pd_disaggregation_hook.py`` ``handle_pd_disaggregation``: role-specific state of these is
not rebuilt on a flip)."""

OPERATOR_FLAGS = {
    "--admin-api-key": "the operator sets it from the cluster's engine admin key Secret",
    "--api-key": "it would close /v1/loads and /server_info to the agent, which holds only "
    "the admin key (prorsa_agent.config.admin_key_args)",
    "--disaggregation-mode": "every engine is launched as decode and switched in place; an "
    "engine launched as prefill and flipped to decode is a different SGLang state "
    "(docs/sglang-role-switch.md, 'Launched as prefill')",
    "--disaggregation-transfer-backend": "set engine.transferBackend (mooncake or mori, the "
    "two transfer backends that can switch roles)",
    "--port": "the agent talks to the engine on the pod's engine port",
}
"""Flags the operator or the agent sets; in ``extraArgs`` they would contradict it."""

ALLOW_HICACHE_STORAGE_ENV = "PRORSA_ALLOW_HICACHE_STORAGE"

OPERATOR_ENV = frozenset(
    {
        "POD_NAME",
        "PRORSA_INSTANCE",
        "PRORSA_LAUNCH",
        "PRORSA_MODEL_PATH",
        "PRORSA_SERVED_MODEL_NAME",
        "PRORSA_TP_SIZE",
        "PRORSA_TRANSFER_BACKEND",
        "PRORSA_BOOTSTRAP_PORT",
        "PRORSA_ENGINE_PORT",
        "PRORSA_ENGINE_HOST",
        "PRORSA_AGENT_LISTEN",
        "PRORSA_AGENT_TOKEN_FILE",
        "PRORSA_ENGINE_API_KEY_FILE",
        "PRORSA_AGENT_TLS_CERT_FILE",
        "PRORSA_AGENT_TLS_KEY_FILE",
        "PRORSA_EXTRA_ARGS",
        "PRORSA_NNODES",
        "PRORSA_NODE_RANK",
        "PRORSA_DIST_INIT_ADDR",
        # What the agent launches and where it finds it: the pod runs the engine image's.
        "PRORSA_ENGINE_COMMAND",
        "PRORSA_ENGINE_URL",
    }
)
"""Variables the operator sets on engine pods (``prorsa.k8s.objects``, ``groups``) or that
would replace what it launches. ``engine.env`` comes after them in the container, and the
last of two same-named variables wins: one of these there would carry flags past this
module's checks (``PRORSA_EXTRA_ARGS``) or contradict the spec."""


def flag_values(args: Sequence[str], *names: str) -> list[str]:
    """Every value given to any of ``names`` (``--flag v`` or ``--flag=v``)."""
    out = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in names:
            out.append(value if eq else (args[i + 1] if i + 1 < len(args) else ""))
    return out


def _given(args: Sequence[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def _number(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def role_switch_refusals(args: Sequence[str]) -> list[str]:
    """What ``--enable-pd-role-switch`` refuses at start-up, as ``flag value (why)``."""
    bad = []
    for what, names in ROLE_SWITCH_SIZES:
        for name in names:
            for value in flag_values(args, name):
                number = _number(value)
                if number is not None and number > 1:
                    bad.append(f"{name} {value} ({what})")
    for value in flag_values(args, "--moe-a2a-backend"):
        if value != "none":
            bad.append(f"--moe-a2a-backend {value} (MoE all-to-all)")
    for value in flag_values(args, "--speculative-algorithm"):
        bad.append(f"--speculative-algorithm {value} (speculative decoding)")
    if _given(args, "--enable-dp-attention") and _given(
        args, "--enable-dp-attention-local-control-broadcast"
    ):
        bad.append("--enable-dp-attention-local-control-broadcast (with DP attention)")
    for value in flag_values(args, "--disaggregation-decode-host-receive-threshold"):
        number = _number(value)
        if number is not None and number < 1:
            bad.append(f"--disaggregation-decode-host-receive-threshold {value} (decode host KV)")
    return bad


def extra_args_errors(args: Sequence[str]) -> list[str]:
    """Why ``engine.extraArgs`` cannot run, one message per problem (empty: it can)."""
    errors = []
    refused = role_switch_refusals(args)
    if refused:
        errors.append(
            "SGLang 0.5.23 refuses to start an engine with --enable-pd-role-switch and "
            + ", ".join(refused)
            + " (srt/arg_groups/pd_disaggregation_hook.py); use MoE tensor parallelism "
            "(EP 1), no pipeline or decode context parallelism, no speculative decoding"
        )
    for flag, why in OPERATOR_FLAGS.items():
        if _given(args, flag):
            errors.append(f"{flag} is not allowed: {why}")
    return errors


def engine_env_errors(args: Sequence[str], env: Sequence[Mapping[str, Any]]) -> list[str]:
    """Problems of ``engine.env``, and of ``extraArgs`` that depend on it."""
    errors = [
        f"env {e.get('name')} is set by the operator (engine.extraArgs and the other engine "
        "fields set it)"
        for e in env
        if e.get("name") in OPERATOR_ENV
    ]
    allowed = any(
        e.get("name") == ALLOW_HICACHE_STORAGE_ENV and e.get("value") in ("1", "true") for e in env
    )
    backends = flag_values(args, "--hicache-storage-backend")
    if backends and not allowed:
        errors += [
            f"extraArgs --hicache-storage-backend {backends[-1]} is refused by the engine's "
            "agent: every role flip clears the whole HiCache storage backend (SGLang "
            "srt/disaggregation/role_switch.py), wiping what other engines stored there; "
            f"set {ALLOW_HICACHE_STORAGE_ENV}=1 in engine.env if this store is the engine's own"
        ]
    return errors
