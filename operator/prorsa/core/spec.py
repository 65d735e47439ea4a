"""CONTRACT: the RolloutCluster custom resource (group prorsa.io, version v1alpha1).

These pydantic models are the single source of the CRD schema (``prorsa crd``), of the
admission checks and of the Controller's configuration. Wire names are camelCase.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from prorsa.core.engine_flags import engine_env_errors, extra_args_errors, flag_values

GROUP = "prorsa.io"
VERSION = "v1alpha1"
KIND = "RolloutCluster"
PLURAL = "rolloutclusters"

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True)


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
    extra_args: list[str] = Field(default_factory=list, alias="extraArgs")
    env: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Extra environment variables of the engine container (EnvVar list), "
        "e.g. NCCL or Mooncake settings.",
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
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list, alias="volumeMounts")
    pod_security_context: dict[str, Any] | None = Field(
        None,
        alias="podSecurityContext",
        description="The engine pods' securityContext (PodSecurityContext). Unset: "
        "runAsNonRoot and seccompProfile RuntimeDefault (the engine image runs as UID "
        "10001). Given: used as it is, e.g. {runAsUser: 0} for an RDMA setup that needs "
        "root (docs/security.md).",
    )
    security_context: dict[str, Any] | None = Field(
        None,
        alias="securityContext",
        description="The engine container's securityContext. Unset: no privilege "
        "escalation, every capability dropped but IPC_LOCK (RDMA memory registration). "
        "Given: used as it is (docs/security.md).",
    )

    # Engine flags SGLang (or the agent) would refuse: prorsa.core.engine_flags.
    @field_validator("extra_args")
    @classmethod
    def _runnable_flags(cls, args: list[str]) -> list[str]:
        errors = extra_args_errors(args)
        if errors:
            raise ValueError("; ".join(errors))
        return args

    @model_validator(mode="after")
    def _runnable_with_env(self) -> EngineSpec:
        errors = engine_env_errors(self.extra_args, self.env)
        if errors:
            raise ValueError("; ".join(errors))
        return self

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

        With ``--enable-dp-attention`` each request runs on one rank, so a prefill instance
        is ``--dp-size`` servers at that fraction of its speed rather than one fast server:
        a long prompt takes that many times longer than the instance's speed suggests.
        """
        args = self.extra_args
        if "--enable-dp-attention" not in args:
            return 1
        size = 1
        for value in flag_values(args, "--dp-size", "--dp", "--data-parallel-size"):
            if value.isdigit() and int(value) >= 1:
                size = int(value)
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
    rate_per_second: NonNegFloat = Field(0.0, alias="ratePerSecond")

    @model_validator(mode="after")
    def _rate_needed(self) -> InjectionSpec:
        if self.policy == "fixedRate" and self.rate_per_second <= 0:
            raise ValueError("ratePerSecond must be > 0 when policy is fixedRate")
        return self


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
    drain_timeout_seconds: NonNegFloat = Field(30.0, alias="drainTimeoutSeconds")
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


class RouterSpec(_Spec):
    enabled: bool = True
    image: str = "lightseekorg/smg:1.13.0"
    policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = "cache_aware"


class SecretKeyRef(_Spec):
    name: Annotated[str, Field(min_length=1)]
    key: Annotated[str, Field(min_length=1)] = "token"


class TrainerSpec(_Spec):
    token_secret_ref: SecretKeyRef | None = Field(None, alias="tokenSecretRef")


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

    @property
    def instances(self) -> int:
        """Instance count when every instance has m GPUs (the in-place switching case)."""
        return self.gpu_budget // self.engine.gpus_per_instance

    @model_validator(mode="after")
    def _consistent(self) -> RolloutClusterSpec:
        m = self.engine.gpus_per_instance
        if self.gpu_budget % m:
            raise ValueError(
                f"gpuBudget ({self.gpu_budget}) must be a multiple of engine.gpusPerInstance ({m})"
            )
        nodes = self.engine.nodes_per_instance
        for field, gpus in (
            ("gpusPerInstance", m),
            ("prefillGpusPerInstance", self.engine.prefill_gpus_per_instance),
        ):
            if gpus is not None and gpus % nodes:
                raise ValueError(
                    f"engine.nodesPerInstance ({nodes}) must divide engine.{field} ({gpus}): "
                    "every node of an instance holds the same number of GPUs"
                )
        if self.engine.tensor_parallel_size > m:
            raise ValueError(
                f"engine.tensorParallelSize ({self.engine.tensor_parallel_size}) exceeds "
                f"engine.gpusPerInstance ({m})"
            )
        need = self.roles.prefill.min * self.engine.m_prefill + self.roles.decode.min * m
        if need > self.gpu_budget:
            raise ValueError(
                f"roles.prefill.min and roles.decode.min need {need} GPUs, more than "
                f"gpuBudget ({self.gpu_budget})"
            )
        initial = self.roles.prefill.initial
        if initial is not None:
            n = self.instances
            if initial < self.roles.prefill.min or n - initial < self.roles.decode.min:
                raise ValueError(
                    f"roles.prefill.initial ({initial}) must leave both roles at their "
                    f"minimums among {n} instances"
                )
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


class SpecError(ValueError):
    """A RolloutCluster that does not validate; the message names each bad field."""


def format_validation_error(exc: ValidationError, *, root: str = "") -> str:
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        where = ".".join(p for p in (root, loc) if p) or root or "manifest"
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


def parse_cluster(data: dict[str, Any]) -> RolloutCluster:
    try:
        return RolloutCluster.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc)) from None


def load_cluster(path: str | Path) -> RolloutCluster:
    """Read a RolloutCluster manifest (YAML or JSON); the first RolloutCluster document wins."""
    text = Path(path).read_text()
    try:
        docs = [d for d in yaml.safe_load_all(text) if d]
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == KIND:
            return parse_cluster(doc)
    raise SpecError(f"{path}: no document of kind {KIND}")


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
    type: Literal["Ready", "ForecastFresh", "Switching", "Degraded"]
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
