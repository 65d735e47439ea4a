"""Engine flags a RolloutCluster may not carry: refused when it is applied, naming the field.

An engine pod's SGLang command line is the operator's ``PRORSA_*`` flags, then
``engine.extraArgs``, then what the agent adds (``prorsa_agent.config.engine_argv``:
``--disaggregation-mode decode``, ``--enable-pd-role-switch``, ``--enable-metrics``, the
decode radix cache, HiCache, ``--admin-api-key``). A combination SGLang 0.5.23 refuses at
start-up would leave every engine pod crash-looping, and one the agent refuses the same;
a flag the operator sets itself, given again in ``extraArgs``, would silently win over the
spec (argparse keeps the last value). Each is refused here instead.

Every rule is written once, as regular expressions over ``engine.extraArgs`` joined by
newlines (a value given as ``--flag v`` or ``--flag=v`` alike) and, where it matters, a
condition on ``engine.env``. The same rule runs twice: in Python on the spec (the
operator's admission, ``prorsa plan``, the operator before it runs a cluster:
:func:`engine_problems`) and as a CEL rule of the CRD (:func:`cel_rules`, in
``prorsa.k8s.crd_manifest``), so the API server refuses it without any webhook, under the
same field. ``tests/test_crd_parity.py`` holds the two to each other;
``tests/real_engine/test_sglang_validation.py`` runs SGLang's own validation (``ServerArgs``
and its resolution hooks) on every combination the product renders and checks that these
rules refuse what SGLang refuses.

What needs arithmetic over the parsed values (``tensorParallelSize`` a multiple of the
attention-DP size) is not expressible this way and stays advice (``prorsa.core.advice``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

MAX_EXTRA_ARGS = 256
MAX_EXTRA_ARG_LENGTH = 4096
"""Bounds of ``engine.extraArgs``: the CEL rules' cost is estimated from them."""

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
        # spec.kvStore (prorsa_agent.kv_store).
        "PRORSA_KV_STORE_BACKEND",
        "PRORSA_KV_STORE_ENDPOINT",
        "PRORSA_KV_STORE_SIZE_GIB",
    }
)
"""Variables the operator sets on engine pods (``prorsa.k8s.objects``, ``groups``) or that
would replace what it launches. ``engine.env`` comes after them in the container, and the
last of two same-named variables wins: one of these there would carry flags past these
checks (``PRORSA_EXTRA_ARGS``) or contradict the spec."""

OPERATOR_FLAGS: Mapping[str, str] = {
    "--admin-api-key": "the operator sets it from the cluster's engine admin key Secret",
    "--api-key": "it would close /v1/loads and /server_info to the agent, which holds only "
    "the admin key",
    "--disaggregation-mode": "every engine is launched as decode and switched in place; an "
    "engine launched as prefill and flipped to decode is a state SGLang does not keep "
    "sound (docs/sglang-role-switch.md, 'Launched as prefill')",
    "--disaggregation-transfer-backend": "set engine.transferBackend (mooncake or mori, the "
    "two transfer backends that can switch roles)",
    "--tp-size": "set engine.tensorParallelSize",
    "--tensor-parallel-size": "set engine.tensorParallelSize",
    "--model-path": "set model.path",
    "--served-model-name": "set model.servedName",
    "--port": "the agent talks to the engine on the pod's engine port",
    "--host": "the operator binds the engine to the pod",
    "--disaggregation-bootstrap-port": "the operator gives every engine pod its bootstrap "
    "port (the router reads it from the pod)",
    "--nnodes": "set engine.nodesPerInstance",
    "--node-rank": "the operator gives each pod of a multi-node instance its rank",
    "--dist-init-addr": "the operator points the ranks of an instance at its leader pod",
    "--nccl-init-addr": "the operator points the ranks of an instance at its leader pod",
}
"""Flags the operator or the agent sets (``prorsa_agent.config.ENV_FLAGS``, ``engine_argv``),
with what to do instead. SGLang's aliases are listed with their flag
(``srt/arg_groups/fields/*.py``)."""


# -- the pieces of a rule: regular expressions over the argv joined by newlines -------------
# RE2 (CEL's ``matches``) and Python's ``re`` read these alike: no look-around, no
# back-references.


_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
_WORD = re.compile(r"[a-z0-9_]+")


def _names(*flags: str) -> str:
    assert all(_FLAG.fullmatch(f) for f in flags), flags  # nothing to escape
    return "(" + "|".join(flags) + ")"


def given(*flags: str) -> str:
    """Any of ``flags`` is given (``--flag``, ``--flag v`` or ``--flag=v``)."""
    return rf"(^|\n){_names(*flags)}([\n=]|$)"


def valued(flags: Sequence[str], value: str) -> str:
    """Any of ``flags`` is given a value matching ``value`` (the whole value)."""
    return rf"(^|\n){_names(*flags)}[\n=]({value})(\n|$)"


def other_than(word: str) -> str:
    """A value (as in :func:`valued`) that is not ``word``: RE2 has no look-ahead, so each
    way of differing from it is spelled out (a prefix of it, or a first different
    character)."""
    assert _WORD.fullmatch(word), word  # nothing to escape
    ways = [f"{word[:i]}[^{word[i]}\\n][^\\n]*" for i in range(len(word))]
    ways.append(f"{word}[^\\n]+")
    ways.append("(" + "|".join(word[:i] for i in range(len(word))) + ")")
    return "|".join(ways)


ABOVE_ONE = r"\+?0*([2-9]|[1-9][0-9]+)"
"""An integer above 1, as argparse's ``int`` reads it."""

_TRUE = r"(?i:true|1|yes|y)"
"""SGLang's EnvBool true (``srt/environ.py``), any case."""

ATTENTION_DP = (
    valued(("--attn-dp-size", "--attention-data-parallel-size"), ABOVE_ONE),
    given("--enable-dp-attention"),
    valued(("--dwdp-size",), ABOVE_ONE),
)
"""Ways to turn on attention data parallelism (``--enable-dp-attention`` with ``--dp-size``
is the deprecated spelling; DWDP sets its attention-DP size, ``parallel_hook.py``)."""


@dataclass(frozen=True, slots=True)
class EnvCondition:
    """An ``engine.env`` entry named ``name`` whose value matches ``value`` (or its absence,
    with ``present=False``)."""

    name: str
    value: str
    present: bool = True

    def holds(self, env: Sequence[Mapping[str, Any]]) -> bool:
        found = any(
            e.get("name") == self.name
            and isinstance(e.get("value"), str)
            and re.fullmatch(self.value, e["value"]) is not None
            for e in env
        )
        return found == self.present

    def cel(self) -> str:
        test = (
            f"has(self.engine.env) && self.engine.env.exists(e, e.name == {_cel_str(self.name)}"
            f" && has(e.value) && e.value.matches({_cel_str('^(' + self.value + ')$')}))"
        )
        return f"({test})" if self.present else f"!({test})"


@dataclass(frozen=True, slots=True)
class Rule:
    """A refusal: every pattern in ``args`` matches the joined ``extraArgs`` (one of
    ``any_args``, if given; none of ``no_args``) and ``env`` holds. ``message`` is what the
    API server says."""

    field: Literal["extraArgs", "env"]
    message: str
    args: tuple[str, ...] = ()
    any_args: tuple[str, ...] = ()
    no_args: tuple[str, ...] = ()
    env: EnvCondition | None = None

    def refuses(self, joined: str, env: Sequence[Mapping[str, Any]]) -> bool:
        return (
            all(re.search(p, joined) for p in self.args)
            and (not self.any_args or any(re.search(p, joined) for p in self.any_args))
            and not any(re.search(p, joined) for p in self.no_args)
            and (self.env is None or self.env.holds(env))
        )

    def cel(self) -> str:
        if not (self.args or self.any_args or self.no_args):
            assert self.env is not None
            return f"!{self.env.cel()}" if self.env.present else self.env.cel()[1:]
        argv = "self.engine.extraArgs.join('\\n')"
        terms = ["has(self.engine.extraArgs)"]  # absent unless given (no schema default)
        terms += [f"{argv}.matches({_cel_str(p)})" for p in self.args]
        if self.any_args:
            terms.append(
                "(" + " || ".join(f"{argv}.matches({_cel_str(p)})" for p in self.any_args) + ")"
            )
        terms += [f"!{argv}.matches({_cel_str(p)})" for p in self.no_args]
        if self.env is not None:
            terms.append(self.env.cel())
        return "!(" + " && ".join(terms) + ")"


def _cel_str(text: str) -> str:
    """A CEL string literal (JSON's escapes are CEL's)."""
    return json.dumps(text)


_ROLE_SWITCH = (
    "SGLang 0.5.23 refuses to start an engine with --enable-pd-role-switch and {} "
    "(srt/arg_groups/pd_disaggregation_hook.py)"
)

RULES: tuple[Rule, ...] = (
    Rule(
        "extraArgs",
        _ROLE_SWITCH.format("expert parallelism: use MoE tensor parallelism (EP 1)"),
        args=(valued(("--ep-size", "--ep", "--expert-parallel-size"), ABOVE_ONE),),
    ),
    Rule(
        "extraArgs",
        _ROLE_SWITCH.format("pipeline parallelism"),
        args=(valued(("--pp-size", "--pipeline-parallel-size"), ABOVE_ONE),),
    ),
    Rule(
        "extraArgs",
        _ROLE_SWITCH.format("decode context parallelism"),
        args=(valued(("--dcp-size", "--decode-context-parallel-size"), ABOVE_ONE),),
    ),
    Rule(
        "extraArgs",
        _ROLE_SWITCH.format("an MoE all-to-all backend (--moe-a2a-backend other than none)"),
        args=(valued(("--moe-a2a-backend",), other_than("none")),),
    ),
    Rule(
        "extraArgs",
        _ROLE_SWITCH.format("speculative decoding (--speculative-algorithm)"),
        args=(given("--speculative-algorithm"),),
    ),
    Rule(
        "extraArgs",
        _ROLE_SWITCH.format(
            "DP attention's local control broadcast (--enable-dp-attention-local-control-"
            "broadcast, or DWDP, with attention DP)"
        ),
        any_args=(
            valued(("--dwdp-size",), ABOVE_ONE),
            given("--enable-dp-attention-local-control-broadcast"),
        ),
        args=("|".join(f"({p})" for p in ATTENTION_DP),),
    ),
    Rule(
        "extraArgs",
        "SGLang 0.5.23 refuses --dp-size above 1 next to --attn-dp-size above 1 (data-parallel "
        "replicas with attention DP; srt/arg_groups/parallel_hook.py): an instance is one "
        "replica",
        args=(
            valued(("--dp-size", "--dp", "--data-parallel-size"), ABOVE_ONE),
            valued(("--attn-dp-size", "--attention-data-parallel-size"), ABOVE_ONE),
        ),
        # With --enable-dp-attention, --dp-size is the deprecated spelling of the attention-
        # DP size (parallel_hook.py, handle_deprecated_dp_attention), not replicas.
        no_args=(given("--enable-dp-attention"),),
    ),
    Rule(
        "extraArgs",
        "SGLang 0.5.23 refuses --disaggregation-decode-host-receive-threshold other than 1 "
        "with --enable-pd-role-switch (decode host KV buffering; "
        "srt/arg_groups/pd_disaggregation_hook.py)",
        args=(valued(("--disaggregation-decode-host-receive-threshold",), other_than("1")),),
    ),
    Rule(
        "env",
        "SGLANG_RUST_SERVER with attention DP turns on DP attention's local control "
        "broadcast, which SGLang 0.5.23 refuses with --enable-pd-role-switch "
        "(srt/arg_groups/parallel_hook.py); unset it",
        args=("|".join(f"({p})" for p in ATTENTION_DP),),
        env=EnvCondition("SGLANG_RUST_SERVER", _TRUE),
    ),
    Rule(
        "extraArgs",
        "--hicache-storage-backend is refused by the engine's agent: every role flip clears "
        "the whole HiCache storage backend (SGLang srt/disaggregation/role_switch.py), wiping "
        f"what other engines stored there; set {ALLOW_HICACHE_STORAGE_ENV}=1 in engine.env "
        "if this store is the engine's own",
        args=(given("--hicache-storage-backend"),),
        env=EnvCondition(ALLOW_HICACHE_STORAGE_ENV, "1|true", present=False),
    ),
)
"""The refusals of SGLang (and of the agent) a RolloutCluster's engine flags can run into."""

MOONCAKE_ENDPOINT = r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?"
"""``spec.kvStore.endpoint`` of a Mooncake store: the master's host[:port]."""

KV_STORE_RULES: tuple[Rule, ...] = (
    Rule(
        "extraArgs",
        "spec.kvStore sets the engine's HiCache storage flags itself (--hicache-storage-backend "
        "dynamic with the engine image's backend, --hicache-storage-backend-extra-config, "
        "--disaggregation-decode-enable-offload-kvcache): remove them from engine.extraArgs",
        args=(
            given(
                "--hicache-storage-backend",
                "--hicache-storage-backend-extra-config",
                "--disaggregation-decode-enable-offload-kvcache",
            ),
        ),
    ),
    Rule(
        "extraArgs",
        "spec.kvStore is HiCache's storage tier, and HiCache needs the radix cache: remove "
        "--disable-radix-cache",
        args=(given("--disable-radix-cache"),),
    ),
    Rule(
        "env",
        "spec.kvStore is HiCache's storage tier: unset PRORSA_DISABLE_HICACHE",
        env=EnvCondition("PRORSA_DISABLE_HICACHE", "1|true"),
    ),
)
"""What contradicts ``spec.kvStore``: refused only when the cluster has one."""


def kv_store_problems(
    args: Sequence[str], env: Sequence[Mapping[str, Any]]
) -> list[tuple[str, str]]:
    """``(field, message)`` for each of :data:`KV_STORE_RULES` a cluster with a store breaks."""
    joined = "\n".join(args)
    return [(rule.field, rule.message) for rule in KV_STORE_RULES if rule.refuses(joined, env)]


_OPERATOR_FLAGS_RULE = Rule(
    "extraArgs",
    "engine.extraArgs may not set a flag the operator sets itself ("
    + ", ".join(OPERATOR_FLAGS)
    + "): use the spec's field for it (docs/engine-flags.md)",
    args=(given(*OPERATOR_FLAGS),),
)


def flag_values(args: Sequence[str], *names: str) -> list[str]:
    """Every value given to any of ``names`` (``--flag v`` or ``--flag=v``)."""
    out = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in names:
            out.append(value if eq else (args[i + 1] if i + 1 < len(args) else ""))
    return out


def _shown(pattern: str, joined: str) -> str:
    """What of the argv a pattern matched, as the user wrote it (``--ep-size 8``)."""
    found = re.search(pattern, joined)
    return found.group(0).strip("\n").replace("\n", " ") if found else ""


def engine_problems(args: Sequence[str], env: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """``(field, message)`` for every rule ``engine.extraArgs`` and ``engine.env`` break
    (empty: SGLang and the agent run them); ``field`` below ``engine``."""
    joined = "\n".join(args)
    out: list[tuple[str, str]] = []
    for rule in RULES:
        if rule.refuses(joined, env):
            found = [_shown(p, joined) for p in (*rule.args, *rule.any_args)]
            shown = [f for f in dict.fromkeys(found) if f and f not in rule.message]
            flags = "; ".join(shown)
            out.append((rule.field, f"{flags}: {rule.message}" if flags else rule.message))
    for flag, why in OPERATOR_FLAGS.items():
        if re.search(given(flag), joined):
            out.append(("extraArgs", f"{flag} is not allowed: {why}"))
    out += [
        ("env", f"{e.get('name')} is set by the operator (the engine fields set it)")
        for e in env
        if e.get("name") in OPERATOR_ENV
    ]
    return out


def cel_rules() -> list[dict[str, str]]:
    """The same rules as CEL validations of the RolloutCluster spec (top level)."""
    rules = [
        {
            "rule": rule.cel(),
            "message": rule.message,
            "fieldPath": f".engine.{rule.field}",
            "reason": "FieldValueForbidden",
        }
        for rule in (*RULES, _OPERATOR_FLAGS_RULE)
    ]
    for rule in KV_STORE_RULES:
        rules.append(
            {
                "rule": f"!has(self.kvStore) || {rule.cel()}",
                "message": rule.message,
                "fieldPath": f".engine.{rule.field}",
                "reason": "FieldValueForbidden",
            }
        )
    rules.append(
        {
            "rule": "!has(self.kvStore) || (self.kvStore.backend == 'file' ? "
            "self.kvStore.endpoint.startsWith('/') : "
            f"self.kvStore.endpoint.matches({_cel_str('^' + MOONCAKE_ENDPOINT + '$')}))",
            "message": "kvStore.endpoint must be an absolute path (file) or host[:port] (mooncake)",
            "fieldPath": ".kvStore.endpoint",
            "reason": "FieldValueInvalid",
        }
    )
    names = ", ".join(_cel_str(n) for n in sorted(OPERATOR_ENV))
    rules.append(
        {
            "rule": f"!has(self.engine.env) || self.engine.env.all(e, !(e.name in [{names}]))",
            "message": "engine.env may not set a variable the operator sets (PRORSA_* of the "
            "engine pods, POD_NAME): use the spec's fields",
            "fieldPath": ".engine.env",
            "reason": "FieldValueForbidden",
        }
    )
    return rules
