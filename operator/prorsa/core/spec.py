"""CONTRACT: the RolloutCluster custom resource (group prorsa.io, version v1alpha1).

These pydantic models are the single source of the CRD schema (``prorsa crd``), of the
admission checks and of the Controller's configuration. Wire names are camelCase.

They accept what the API server accepts for the generated CRD, no more and no less:
types are strict (``tensorParallelSize: "8"`` is refused, as the schema's ``integer``
refuses it), a whole-number float is an integer (Kubernetes' own allowance,
``kube-openapi`` ``validate/type.go``), and a null for a field that is not nullable is
dropped and the field defaulted (structural-schema pruning). ``tests/test_crd_parity.py``
runs a battery of manifests through both.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from prorsa.core import engine_flags, pod_bounds
from prorsa.core.engine_flags import flag_values
from prorsa_contract.agent_api import MAX_DRAIN_TIMEOUT_SECONDS

GROUP = "prorsa.io"
VERSION = "v1alpha1"
KIND = "RolloutCluster"
PLURAL = "rolloutclusters"

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


def _allows(annotation: Any, kind: type) -> bool:
    """Whether a field's annotation admits ``kind`` (through Optional and Annotated)."""
    if annotation is kind:
        return True
    if typing.get_origin(annotation) is Annotated:
        return _allows(typing.get_args(annotation)[0], kind)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_allows(a, kind) for a in typing.get_args(annotation))
    return False


@dataclass(frozen=True, slots=True)
class _WireField:
    name: str
    info: FieldInfo
    integer: bool
    nullable: bool


def _last_size(args: Sequence[str], *names: str) -> int:
    """The last positive integer given to any of ``names`` (argparse's rule), else 1."""
    size = 1
    for value in flag_values(args, *names):
        if value.isdigit() and int(value) >= 1:
            size = int(value)
    return size


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, strict=True)

    @classmethod
    @cache
    def _wire_fields(cls) -> dict[str, _WireField]:
        """Each field under its wire name and its Python name."""
        out = {}
        for name, info in cls.model_fields.items():
            field = _WireField(
                name=name,
                info=info,
                integer=_allows(info.annotation, int),
                nullable=_allows(info.annotation, type(None)),
            )
            out[name] = field
            out[info.alias or name] = field
        return out

    @model_validator(mode="before")
    @classmethod
    def _as_the_api_server_reads_it(cls, data: Any) -> Any:
        """A whole-number float is an integer; a null where none is allowed is absent."""
        if not isinstance(data, dict):
            return data
        fields = cls._wire_fields()
        out = {}
        for key, value in data.items():
            field = fields.get(key)
            if field is not None:
                if value is None and not field.nullable:
                    continue
                if field.integer and type(value) is float and value.is_integer():
                    value = int(value)
            out[key] = value
        return out


class _BoundsError(ValueError):
    """Problems below the field that was validated, each under its own path (so that
    :func:`spec_problems` names ``engine.env.0.value``, as the API server does)."""

    def __init__(self, problems: list[pod_bounds.Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {message}" for path, message in problems))


def _refuse(problems: list[pod_bounds.Problem]) -> None:
    if problems:
        raise _BoundsError(problems)


def _volume(value: dict[str, Any]) -> dict[str, Any]:
    _refuse(pod_bounds.volume_problems(value))
    return value


def _env(value: dict[str, Any]) -> dict[str, Any]:
    _refuse(pod_bounds.env_problems(value))
    return value


def _pod_security(value: dict[str, Any]) -> dict[str, Any]:
    _refuse(pod_bounds.pod_security_problems(value))
    return value


def _container_security(value: dict[str, Any]) -> dict[str, Any]:
    _refuse(pod_bounds.container_security_problems(value))
    return value


def _pod_labels(value: dict[str, str]) -> dict[str, str]:
    _refuse(pod_bounds.metadata_problems(value, labels=True))
    return value


def _pod_annotations(value: dict[str, str]) -> dict[str, str]:
    _refuse(pod_bounds.metadata_problems(value, labels=False))
    return value


# Kubernetes objects the spec passes through to the engine pods, within the bounds of
# prorsa.core.pod_bounds; their CRD schema declares the fields the CEL rules read.
Volume = Annotated[
    dict[str, Any], AfterValidator(_volume), WithJsonSchema(pod_bounds.VOLUME_SCHEMA)
]
EnvVar = Annotated[dict[str, Any], AfterValidator(_env), WithJsonSchema(pod_bounds.ENV_SCHEMA)]
PodSecurityContext = Annotated[
    dict[str, Any],
    AfterValidator(_pod_security),
    WithJsonSchema(pod_bounds.POD_SECURITY_SCHEMA),
]
ContainerSecurityContext = Annotated[
    dict[str, Any],
    AfterValidator(_container_security),
    WithJsonSchema(pod_bounds.CONTAINER_SECURITY_SCHEMA),
]
PodLabels = Annotated[
    dict[str, str], AfterValidator(_pod_labels), WithJsonSchema(pod_bounds.POD_LABELS_SCHEMA)
]
PodAnnotations = Annotated[
    dict[str, str],
    AfterValidator(_pod_annotations),
    WithJsonSchema(pod_bounds.POD_ANNOTATIONS_SCHEMA),
]


class LocalObjectReference(_Spec):
    name: Annotated[str, Field(min_length=1, max_length=253)] = Field(description="Secret name.")


class ModelSpec(_Spec):
    path: Annotated[str, Field(min_length=1)] = Field(description="Model weights path.")
    served_name: str | None = Field(None, alias="servedName")


class EngineSpec(_Spec):
    image: Annotated[str, Field(min_length=1)] = Field(
        "prorsa/engine:0.5.23",
        description="Engine image: SGLang 0.5.23 with the Prorsa agent, built from "
        "engine_image/Dockerfile.",
    )
    gpus_per_instance: PosInt = Field(8, alias="gpusPerInstance")
    prefill_gpus_per_instance: PosInt | None = Field(
        None,
        alias="prefillGpusPerInstance",
        description="m_P when prefill instances use another size than decode (Eq. 1); "
        "defaults to gpusPerInstance.",
    )
    nodes_per_instance: Annotated[int, Field(ge=1, le=64)] = Field(
        1,
        alias="nodesPerInstance",
        description="Nodes (pods) one engine instance spans: a leader (SGLang's HTTP server "
        "and the agent) and nodesPerInstance - 1 worker ranks started with SGLang's "
        "--nnodes/--node-rank/--dist-init-addr. Each pod gets gpusPerInstance / "
        "nodesPerInstance GPUs; the group is switched, routed and restarted as one "
        "(docs/multinode.md).",
    )
    tensor_parallel_size: PosInt = Field(8, alias="tensorParallelSize")
    transfer_backend: Literal["mooncake", "mori"] = Field("mooncake", alias="transferBackend")
    extra_args: Annotated[
        list[Annotated[str, Field(max_length=engine_flags.MAX_EXTRA_ARG_LENGTH)]],
        Field(max_length=engine_flags.MAX_EXTRA_ARGS),
    ] = Field(
        default_factory=list,
        alias="extraArgs",
        description="More SGLang flags, after the operator's. The Controller reads attention "
        "DP here (`--attn-dp-size N`, or the deprecated `--enable-dp-attention` with "
        "`--dp-size N`): each request then runs on one attention-DP rank. Flags the operator "
        "sets, and combinations SGLang 0.5.23 refuses with role switching, are refused "
        "(docs/engine-flags.md).",
    )
    env: Annotated[list[EnvVar], Field(max_length=256)] = Field(
        default_factory=list,
        description="Extra environment variables of the engine container (EnvVar list), "
        "e.g. NCCL or Mooncake settings. No valueFrom.secretKeyRef (docs/security.md).",
    )
    gpu_resource_name: str = Field(
        "nvidia.com/gpu",
        alias="gpuResourceName",
        description="Extended resource requested per GPU; empty requests none (tests on "
        "clusters without GPUs).",
    )
    resources: dict[str, Any] = Field(
        default_factory=dict,
        description="Resources of the engine container (the GPUs are added). Give it host "
        "memory (requests.memory = limits.memory): every engine keeps an SGLang HiCache host "
        "tier, by default twice its GPU KV pool, sized to fit the container's memory limit "
        "(see docs/engine-flags.md).",
    )
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    tolerations: Annotated[list[dict[str, Any]], Field(max_length=64)] = Field(default_factory=list)
    affinity: dict[str, Any] | None = Field(
        None, description="The engine pods' affinity (node, pod and pod anti-affinity)."
    )
    topology_spread_constraints: Annotated[list[dict[str, Any]], Field(max_length=16)] = Field(
        default_factory=list,
        alias="topologySpreadConstraints",
        description="The engine pods' topologySpreadConstraints; select them with "
        "labelSelector matchLabels prorsa.io/cluster: <name>.",
    )
    scheduler_name: Annotated[str, Field(min_length=1, max_length=253)] | None = Field(
        None,
        alias="schedulerName",
        description="Scheduler of the engine pods (e.g. a gang scheduler); unset: the "
        "cluster's default.",
    )
    priority_class_name: Annotated[str, Field(min_length=1, max_length=253)] | None = Field(
        None, alias="priorityClassName", description="PriorityClass of the engine pods."
    )
    image_pull_secrets: Annotated[list[LocalObjectReference], Field(max_length=16)] = Field(
        default_factory=list,
        alias="imagePullSecrets",
        description="Secrets the kubelet pulls the engine image with ([{name}]): the only "
        "Secrets of the namespace a RolloutCluster can name for its pods.",
    )
    pod_labels: PodLabels = Field(
        default_factory=dict,
        alias="podLabels",
        description="More labels of the engine pods. The operator's own (prorsa.io/*, "
        "app.kubernetes.io/managed-by, name, instance, component) are refused.",
    )
    pod_annotations: PodAnnotations = Field(
        default_factory=dict,
        alias="podAnnotations",
        description="More annotations of the engine pods, e.g. Multus networks "
        "(k8s.v1.cni.cncf.io/networks) for RDMA. prorsa.io/* and "
        "sglang.ai/bootstrap-port are refused.",
    )
    volumes: Annotated[list[Volume], Field(max_length=64)] = Field(
        default_factory=list,
        description="Extra volumes of the engine pods (e.g. the model weights). No "
        "hostPath, and no Secret (secret, projected secret, csi nodePublishSecretRef).",
    )
    volume_mounts: Annotated[list[dict[str, Any]], Field(max_length=64)] = Field(
        default_factory=list, alias="volumeMounts"
    )
    pod_security_context: PodSecurityContext | None = Field(
        None,
        alias="podSecurityContext",
        description="The engine pods' securityContext (PodSecurityContext), merged over "
        "the defaults (runAsNonRoot, seccompProfile RuntimeDefault; the engine image runs "
        "as UID 10001). runAsNonRoot false and runAsUser 0 are refused (docs/security.md).",
    )
    security_context: ContainerSecurityContext | None = Field(
        None,
        alias="securityContext",
        description="The engine container's securityContext, merged over the defaults (no "
        "privilege escalation, every capability dropped but IPC_LOCK). privileged, "
        "allowPrivilegeEscalation, root and capabilities that amount to root on the node "
        "are refused (docs/security.md).",
    )

    @property
    def m_prefill(self) -> int:
        return self.prefill_gpus_per_instance or self.gpus_per_instance

    @property
    def m_decode(self) -> int:
        return self.gpus_per_instance

    def gpus_per_node(self, role: str) -> int:
        """GPUs of each pod of an instance in ``role``: the instance's m over its nodes."""
        m = self.m_prefill if role == "prefill" else self.m_decode
        return m // self.nodes_per_instance

    @property
    def prefix_cache_scale(self) -> float:
        """What a prefill instance's prefix cache holds, in multiples of its GPU KV pool.

        The engine image turns on SGLang's HiCache host tier, which by default holds twice
        the GPU pool (``--hicache-ratio`` 2.0). Its default write policy is write-through:
        the host tier keeps a copy of what the GPU caches, so the two hold max(1, ratio)
        pools of distinct prefixes, not 1 + ratio. ``--disable-radix-cache`` leaves no
        cache, ``PRORSA_DISABLE_HICACHE=1`` the GPU pool alone, and an explicit
        ``--hicache-ratio`` its own multiple.
        """
        args = self.extra_args
        if "--disable-radix-cache" in args:
            return 0.0
        if any(
            e.get("name") == "PRORSA_DISABLE_HICACHE" and e.get("value") == "1" for e in self.env
        ):
            return 1.0
        ratio = 2.0
        for value in flag_values(args, "--hicache-ratio"):
            try:
                ratio = max(float(value), 0.0)
            except ValueError:
                continue
        return max(1.0, ratio)

    @property
    def attention_dp_size(self) -> int:
        """Attention data-parallel ranks per instance, read from SGLang's ``extraArgs``.

        With attention DP each request runs on one rank, so a prefill instance is that many
        servers at that fraction of its speed rather than one fast server: a long prompt
        takes that many times longer than the instance's speed suggests. SGLang 0.5.23
        spells it ``--attn-dp-size N``, or (deprecated) ``--enable-dp-attention`` with
        ``--dp-size N``, which it resolves to the former
        (``srt/arg_groups/parallel_hook.py``, ``handle_deprecated_dp_attention``).
        """
        args = self.extra_args
        size = _last_size(args, "--attn-dp-size", "--attention-data-parallel-size")
        if size == 1 and "--enable-dp-attention" in args:
            size = _last_size(args, "--dp-size", "--dp", "--data-parallel-size")
        return size


class RoleSpec(_Spec):
    min: NonNegInt = 1
    initial: NonNegInt | None = None


class RolesSpec(_Spec):
    prefill: RoleSpec = RoleSpec()
    decode: RoleSpec = RoleSpec()


class InjectionSpec(_Spec):
    """How the trainer injects new samples (the f of Eq. 4)."""

    policy: Literal["replaceOnReward", "fixedRate", "groupReplenish", "none"] = "replaceOnReward"
    group_size: PosInt = Field(1, alias="groupSize")
    rate_per_second: NonNegFloat = Field(0.0, alias="ratePerSecond", validate_default=True)

    @field_validator("rate_per_second")
    @classmethod
    def _rate_needed(cls, rate: float, info: ValidationInfo) -> float:
        if info.data.get("policy") == "fixedRate" and rate <= 0:
            raise ValueError("must be > 0 when policy is fixedRate")
        return rate


class ForecastSpec(_Spec):
    horizon_seconds: Annotated[float, Field(gt=0, le=600)] = Field(10.0, alias="horizonSeconds")
    tool_ema_alpha: Annotated[float, Field(gt=0, le=1)] = Field(0.1, alias="toolEmaAlpha")
    bias_correction: bool = Field(True, alias="biasCorrection")
    injection: InjectionSpec = InjectionSpec()


class CapacitySpec(_Spec):
    prefill_tokens_per_second: PosFloat = Field(
        20000.0,
        alias="prefillTokensPerSecond",
        description="Profiled prefill speed of one instance in computed (uncached) prompt "
        "tokens per second. θ_P of Eq. 1 is this over (1 − the prefix-cache hit ratio the "
        "Controller measures).",
    )
    prefill_cost_doubling_tokens: PosInt | None = Field(
        None,
        alias="prefillCostDoublingTokens",
        description="Prompt position at which prefilling a token takes twice as long as at "
        "the start of a prompt (attention reads the whole prefix; profiled). When set, each "
        "request's prefill time grows with its context, and prefillTokensPerSecond is the "
        "short-prompt speed. Unset: every computed token costs the same.",
    )
    decode_kv_tokens: PosInt | None = Field(
        None,
        alias="decodeKvTokens",
        description="C_KV of Eq. 1: usable KV-cache tokens of one decode instance (profiled: "
        "the footprint past which decode steps slow down, at most the memory). Unset: the "
        "engines' reported KV capacity.",
    )
    decode_concurrency: PosInt | None = Field(
        None,
        alias="decodeConcurrency",
        description="Concurrent decoding requests per decode instance past which decode "
        "steps slow the rollout's tail (profiled). When set, decode demand is the larger of "
        "its KV footprint (Eq. 1) and its request count over this; unset: KV only.",
    )
    prefill_cache_tokens: NonNegInt | None = Field(
        None,
        alias="prefillCacheTokens",
        description="Prefix-cache capacity of one prefill instance in tokens. The prefill "
        "side is never sized below the instances whose caches hold the contexts of every "
        "live trajectory (past it each turn recomputes its whole context). Unset: the "
        "prefill engines' reported KV capacity times the cache tiers the engine runs (3 "
        "with the engine image's HiCache host tier at SGLang's default ratio 2.0); 0: no "
        "prefix cache (no floor, and a switch flushes nothing).",
    )


class SwitchingSpec(_Spec):
    mode: Literal["Auto", "Recommend", "Off"] = "Auto"
    cooldown_seconds: NonNegFloat = Field(30.0, alias="cooldownSeconds")
    max_concurrent: PosInt = Field(1, alias="maxConcurrent")
    drain_timeout_seconds: Annotated[
        float, Field(ge=0, le=MAX_DRAIN_TIMEOUT_SECONDS, allow_inf_nan=False)
    ] = Field(30.0, alias="drainTimeoutSeconds")
    hysteresis: Annotated[float, Field(ge=0, le=10)] = Field(
        0.0,
        description="Switch only when the best split's demand/capacity headroom beats the "
        "current split's by this fraction; keeps forecast noise from flapping roles.",
    )
    smoothing_seconds: Annotated[float, Field(ge=0, le=86400, allow_inf_nan=False)] = Field(
        60.0,
        alias="smoothingSeconds",
        description="The split is sized for the forecast demand averaged (exponentially) "
        "over this many seconds: a switch flushes a prefix cache and aborts decodes, so "
        "minute-scale waves are ridden out rather than chased (0: size for each horizon).",
    )
    hold_margin: Annotated[float, Field(ge=0, le=100)] = Field(
        0.0,
        alias="holdMargin",
        description="Keep the current split while it covers the forecast demand of both "
        "roles with at least this safety margin δ: a switch drains and aborts requests, so "
        "a split that is good enough is not traded for a marginally better one (0: off; "
        "the switch pricing of payoffSeconds already holds a split that serves demand).",
    )
    payoff_seconds: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] = Field(
        300.0,
        alias="payoffSeconds",
        description="A switch must pay for itself within this many seconds (or within how "
        "long demand has leaned one way, if shorter): it is made only when the wall time "
        "it saves (this tick's forecast, then the smoothed demand) exceeds what it costs "
        "(the measured switch duration, the prefix cache it flushes, the decodes it aborts "
        "and what a move back would cost).",
    )
    step_cycle: bool = Field(
        True,
        alias="stepCycle",
        description="Size the split for the training step as a whole: once the trainer's "
        "events have run for two minutes, and from each weight update on, move toward the "
        "split that would have served the last two steps best (the re-prefill burst after "
        "each weight update and the calm once prefix caches refill), rather than toward Eq. "
        "1 on the next minutes' demand, which moves instances into each burst and back. "
        "false: Eq. 1 on the smoothed demand of each horizon.",
    )


class RouterSpec(_Spec):
    enabled: bool = True
    image: str = "lightseekorg/smg:1.13.0"
    policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = "cache_aware"


class SecretKeyRef(_Spec):
    name: Annotated[str, Field(min_length=1)]
    key: Annotated[str, Field(min_length=1)] = "token"


class TrainerSpec(_Spec):
    token_secret_ref: SecretKeyRef | None = Field(None, alias="tokenSecretRef")
    max_live_trajectories: Annotated[int, Field(ge=1, le=10_000_000)] = Field(
        100_000,
        alias="maxLiveTrajectories",
        description="Live trajectories the operator holds for this cluster (each costs "
        "~0.5-1 KB of its memory). Past it, events that would start a new trajectory are "
        "refused with 429 and Retry-After (events of live ones still apply, so the trainer's "
        "retry gets in as trajectories end), and the TrajectoryLimit condition is True.",
    )


class KvStoreSpec(_Spec):
    """A KV store the cluster's engines share and role flips keep (docs/kv-store.md)."""

    backend: Literal["mooncake", "file"] = Field(
        description="mooncake: a Mooncake store (production); file: a directory every engine "
        "pod mounts (a shared volume, for tests and small clusters)."
    )
    endpoint: Annotated[str, Field(min_length=1, max_length=1024)] = Field(
        description="mooncake: the Mooncake master, host[:port] (port 50051 when omitted); "
        "file: the shared directory's absolute path in the engine pods (mount it with "
        "engine.volumes and engine.volumeMounts)."
    )
    size_gib: Annotated[int, Field(ge=1, le=1_048_576)] = Field(
        alias="sizeGiB",
        description="GiB each engine rank gives the store (Mooncake's global segment size), "
        "or caps its own pages at (file: least recently used pages go first).",
    )


class RolloutClusterSpec(_Spec):
    model: ModelSpec
    engine: EngineSpec = EngineSpec()
    gpu_budget: PosInt = Field(alias="gpuBudget")
    roles: RolesSpec = RolesSpec()
    forecast: ForecastSpec = ForecastSpec()
    capacity: CapacitySpec = CapacitySpec()
    switching: SwitchingSpec = SwitchingSpec()
    router: RouterSpec = RouterSpec()
    trainer: TrainerSpec = TrainerSpec()
    kv_store: KvStoreSpec | None = Field(
        None,
        alias="kvStore",
        description="A shared KV store (HiCache's storage tier) that role flips keep: "
        "prefixes are found across engines and a request a switch cancelled resumes from it. "
        "Trainers must send their weight version as extra_key (docs/kv-store.md).",
    )

    @property
    def instances(self) -> int:
        """Instance count when every instance has m GPUs (the in-place switching case)."""
        return self.gpu_budget // self.engine.gpus_per_instance

    @model_validator(mode="after")
    def _consistent(self) -> RolloutClusterSpec:
        problems = cross_field_problems(_ModelLookup(self))
        if problems:
            raise ValueError("; ".join(p.text() for p in problems))
        return self

    def initial_prefill(self) -> int:
        """roles.prefill.initial, or a quarter of the instances within the minimums."""
        n = self.instances
        if self.roles.prefill.initial is not None:
            return self.roles.prefill.initial
        guess = max(self.roles.prefill.min, round(n / 4))
        return min(guess, n - self.roles.decode.min)


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(min_length=1, max_length=63)]
    namespace: str = "default"


class RolloutCluster(BaseModel):
    """A whole manifest, as ``kubectl apply`` would take it."""

    model_config = ConfigDict(extra="allow", validate_by_name=True)

    api_version: Literal["prorsa.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["RolloutCluster"]
    metadata: Metadata
    spec: RolloutClusterSpec


# -- validation: every problem of a manifest at once ------------------------------------


@dataclass(frozen=True, slots=True)
class Problem:
    """One refused field: its dotted wire path and what is wrong with it."""

    field: str
    message: str

    def text(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class SpecError(ValueError):
    """A RolloutCluster that does not validate; ``problems`` names each bad field."""

    def __init__(self, problems: Sequence[Problem] | str, *, source: str = "") -> None:
        self.problems = [Problem("", problems)] if isinstance(problems, str) else list(problems)
        self.source = source
        text = "; ".join(p.text() for p in self.problems)
        super().__init__(f"{source}: {text}" if source else text)


class _Unknown(Exception):
    """A value a cross-field rule needs is missing or invalid: the rule cannot be judged."""


class _ModelLookup:
    """Wire paths (``engine.gpusPerInstance``) of a validated spec."""

    def __init__(self, spec: RolloutClusterSpec) -> None:
        self._spec = spec

    def __call__(self, path: str) -> Any:
        node: Any = self._spec
        for key in path.split("."):
            node = getattr(node, type(node)._wire_fields()[key].name)
        return node


@cache
def _field_adapter(path: str) -> tuple[FieldInfo, TypeAdapter[Any]]:
    model: type[_Spec] = RolloutClusterSpec
    *parents, leaf = path.split(".")
    for key in parents:
        annotation = model._wire_fields()[key].info.annotation
        assert isinstance(annotation, type) and issubclass(annotation, _Spec), path
        model = annotation
    info = model._wire_fields()[leaf].info
    typ: Any = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
    return info, TypeAdapter(typ)


class _RawLookup:
    """Wire paths of a spec that may not validate: each value validated on its own, as
    its field would validate it, absent ones defaulted; :class:`_Unknown` when invalid."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self._raw = raw

    def __call__(self, path: str) -> Any:
        info, adapter = _field_adapter(path)
        *parents, leaf = path.split(".")
        node: Any = self._raw
        for key in parents:
            node = node.get(key) if isinstance(node, Mapping) else None
            node = {} if node is None else node
        if not isinstance(node, Mapping):
            raise _Unknown(path)
        value = node.get(leaf)
        if value is None:
            if info.is_required():
                raise _Unknown(path)
            return info.get_default(call_default_factory=True)
        if type(value) is float and value.is_integer() and _allows(info.annotation, int):
            value = int(value)
        try:
            return adapter.validate_python(value, strict=True)
        except ValidationError:
            raise _Unknown(path) from None


def cross_field_problems(get: Callable[[str], Any]) -> list[Problem]:
    """The rules that span fields; each mirrors a CEL rule of the CRD
    (``prorsa.k8s.crd_manifest.SPEC_RULES``) and names the field that rule names.

    ``get`` reads a field by its wire path. A rule whose fields are missing or invalid is
    not judged: the field's own error already says what is wrong.
    """
    problems: list[Problem] = []

    def budget() -> Problem | None:
        g, m = get("gpuBudget"), get("engine.gpusPerInstance")
        if g % m:
            return Problem("gpuBudget", f"{g} is not a multiple of engine.gpusPerInstance ({m})")
        return None

    def nodes() -> Problem | None:
        n = get("engine.nodesPerInstance")
        for field in ("gpusPerInstance", "prefillGpusPerInstance"):
            gpus = get(f"engine.{field}")
            if gpus is not None and gpus % n:
                return Problem(
                    "engine.nodesPerInstance",
                    f"{n} does not divide engine.{field} ({gpus}): every node of an instance "
                    "holds the same number of GPUs",
                )
        return None

    def tensor_parallel() -> Problem | None:
        tp, m = get("engine.tensorParallelSize"), get("engine.gpusPerInstance")
        if tp > m:
            return Problem(
                "engine.tensorParallelSize", f"{tp} exceeds engine.gpusPerInstance ({m})"
            )
        return None

    def minimums() -> Problem | None:
        g, m = get("gpuBudget"), get("engine.gpusPerInstance")
        m_prefill = get("engine.prefillGpusPerInstance") or m
        need = get("roles.prefill.min") * m_prefill + get("roles.decode.min") * m
        if need > g:
            return Problem(
                "roles",
                f"roles.prefill.min and roles.decode.min need {need} GPUs, more than "
                f"gpuBudget ({g})",
            )
        return None

    def initial() -> Problem | None:
        first = get("roles.prefill.initial")
        if first is None:
            return None
        n = get("gpuBudget") // get("engine.gpusPerInstance")
        if first < get("roles.prefill.min") or n - first < get("roles.decode.min"):
            return Problem(
                "roles.prefill.initial",
                f"{first} must leave both roles at their minimums among {n} instances",
            )
        return None

    def kv_store_endpoint() -> Problem | None:
        store = get("kvStore")
        if store is None:
            return None
        if store.backend == "file" and not store.endpoint.startswith("/"):
            return Problem("kvStore.endpoint", f"{store.endpoint!r} is not an absolute path")
        if store.backend == "mooncake" and not re.fullmatch(
            engine_flags.MOONCAKE_ENDPOINT, store.endpoint
        ):
            return Problem("kvStore.endpoint", f"{store.endpoint!r} is not host[:port]")
        return None

    for rule in (budget, nodes, tensor_parallel, minimums, initial, kv_store_endpoint):
        try:
            problem = rule()
        except (_Unknown, ZeroDivisionError):
            continue
        if problem is not None:
            problems.append(problem)
    # Engine flags SGLang or the agent refuse, or the operator sets (prorsa.core.engine_flags).
    try:
        args, env = get("engine.extraArgs"), get("engine.env")
    except _Unknown:
        return problems
    problems += [
        Problem(f"engine.{field}", message)
        for field, message in engine_flags.engine_problems(args, env)
    ]
    try:
        store = get("kvStore")
    except _Unknown:
        return problems
    if store is not None:
        problems += [
            Problem(f"engine.{field}", message)
            for field, message in engine_flags.kv_store_problems(args, env)
        ]
    return problems


def _wire_path(loc: Sequence[int | str], model: type[_Spec]) -> str:
    """pydantic's error location in wire names: a defaulted field's error carries its
    Python name (``rate_per_second``), a given one's the key it was given under."""
    parts = []
    node: type[_Spec] | None = model
    for part in loc:
        field = (
            node._wire_fields().get(part) if node is not None and isinstance(part, str) else None
        )
        if field is None:
            parts.append(str(part))
            node = None
            continue
        parts.append(field.info.alias or field.name)
        annotation = field.info.annotation
        node = (
            annotation if isinstance(annotation, type) and issubclass(annotation, _Spec) else None
        )
    return ".".join(parts)


def _pydantic_problems(
    errors: Sequence[ErrorDetails], *, root: str, model: type[_Spec] | None = None
) -> list[Problem]:
    out = []
    for err in errors:
        loc = _wire_path(err["loc"], model or RolloutClusterSpec)
        if err["type"] == "extra_forbidden":  # the key as it was given
            loc = ".".join([*loc.split(".")[:-1], str(err["loc"][-1])])
        field = ".".join(p for p in (root, loc) if p)
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, _BoundsError):
            out += [
                Problem(".".join(p for p in (field, path) if p), m) for path, m in cause.problems
            ]
            continue
        out.append(Problem(field, _message(err["msg"])))
    return out


def _message(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def spec_problems(raw: Any, *, root: str = "spec") -> list[Problem]:
    """Every problem of a RolloutCluster spec, field errors and cross-field rules alike,
    in one pass (pydantic alone stops before the cross-field rules once a field fails)."""
    try:
        RolloutClusterSpec.model_validate(raw, by_alias=True, by_name=False)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    else:
        return []
    # The spec's own model validator stops at the cross-field rules of a spec whose fields
    # all validate; the rules are judged below, with their fields named.
    fields = [e for e in errors if not (e["loc"] == () and e["type"] == "value_error")]
    problems = _pydantic_problems(fields, root=root)
    if isinstance(raw, Mapping):
        problems += [
            Problem(".".join(p for p in (root, c.field) if p), c.message)
            for c in cross_field_problems(_RawLookup(raw))
        ]
    return problems


def validate_spec(raw: Any, *, root: str = "spec") -> RolloutClusterSpec:
    """The validated spec, or :class:`SpecError` listing every problem."""
    try:
        return RolloutClusterSpec.model_validate(raw, by_alias=True, by_name=False)
    except ValidationError:
        raise SpecError(spec_problems(raw, root=root)) from None


def format_validation_error(exc: ValidationError, *, root: str = "") -> str:
    return "; ".join(p.text() for p in _pydantic_problems(exc.errors(), root=root))


def parse_cluster(data: dict[str, Any], *, source: str = "") -> RolloutCluster:
    """A whole manifest, or :class:`SpecError` naming every problem in it."""
    try:
        return RolloutCluster.model_validate(data, by_alias=True, by_name=False)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    outside = [e for e in errors if not e["loc"] or e["loc"][0] != "spec"]
    problems = [
        Problem(".".join(str(p) for p in e["loc"]) or "manifest", _message(e["msg"]))
        for e in outside
    ]
    if len(outside) < len(errors):
        problems += spec_problems(data.get("spec"), root="spec")
    raise SpecError(problems, source=source) from None


# -- status (written by the operator; the CRD's status subresource) ------------------------


class _Status(BaseModel):
    model_config = ConfigDict(extra="ignore", validate_by_name=True)


class InstanceCounts(_Status):
    prefill: int = 0
    decode: int = 0
    switching: int = 0
    unavailable: int = 0


class StatusTarget(_Status):
    prefill: int = 0
    decode: int = 0
    split: str = Field("", description="The target as text, e.g. 3P:5D (printer column).")
    safety_margin: float = Field(0.0, alias="safetyMargin")
    reason: str = ""
    at: str = ""
    mode: str = ""


class StatusForecast(_Status):
    prefill_tokens: int = Field(0, alias="prefillTokens")
    decode_admission_tokens: int = Field(0, alias="decodeAdmissionTokens")
    decode_kv_tokens: int = Field(0, alias="decodeKvTokens")
    components: dict[str, int] = Field(default_factory=dict)


class StatusCapacity(_Status):
    prefill_tokens_per_second: float = Field(0.0, alias="prefillTokensPerSecond")
    decode_kv_tokens: int = Field(0, alias="decodeKvTokens")


class StatusAccuracy(_Status):
    prefill_wape: float | None = Field(None, alias="prefillWape")
    decode_wape: float | None = Field(None, alias="decodeWape")


class SwitchRecord(_Status):
    pod: str
    from_: str = Field(alias="from")
    to: str
    started: str
    seconds: float = 0.0
    result: str = ""


class Condition(_Status):
    type: Literal["Ready", "ForecastFresh", "Switching", "Degraded", "TrajectoryLimit"]
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str = Field("", alias="lastTransitionTime")


class StatusGroups(_Status):
    nodes_per_instance: int = Field(1, alias="nodesPerInstance")
    pods: int = Field(0, description="Engine pods, workers of multi-node instances included.")
    managed_by: str = Field(
        "",
        alias="managedBy",
        description=(
            "Who keeps multi-node groups whole: LeaderWorkerSet (the API was found at the "
            "operator's start-up and nodesPerInstance > 1) or Operator."
        ),
    )


class RolloutClusterStatus(_Status):
    phase: Literal["Pending", "Running", "Degraded"] = "Pending"
    observed_generation: int = Field(0, alias="observedGeneration")
    instances: InstanceCounts = InstanceCounts()
    target: StatusTarget = StatusTarget()
    forecast: StatusForecast = StatusForecast()
    capacity: StatusCapacity = StatusCapacity()
    accuracy: StatusAccuracy = StatusAccuracy()
    switch_history: list[SwitchRecord] = Field(default_factory=list, alias="switchHistory")
    conditions: list[Condition] = Field(default_factory=list)
    epoch: str = Field("", description="The webhook epoch trainers see (changes on restart).")
    groups: StatusGroups = StatusGroups()
