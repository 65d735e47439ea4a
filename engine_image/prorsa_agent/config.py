"""The agent's configuration and how the SGLang command line is assembled.

The operator configures an engine pod through environment variables (the image's entrypoint
is ``prorsa-agent --launch``), so that one image serves every model and size. The engine's
flags come from ``PRORSA_*`` variables, then from the arguments after ``--``, then the flags
every Prorsa engine needs are added when missing: it starts as ``decode`` (so that decode
CUDA graphs are captured at start-up and any flip back to decode finds them), with role
switching and metrics on, on the port the agent talks to, and with a prefix cache that
survives the launch role (a radix cache and a per-instance host-memory tier; see
``prefix_cache_flags`` and docs/engine-flags.md).
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit

from prorsa_agent.kv_store import FLAGS as KV_STORE_FLAGS
from prorsa_agent.kv_store import KV_STORE_ENV, KvStoreConfig
from prorsa_agent.redact import redact_argv

SGLANG_COMMAND: tuple[str, ...] = (sys.executable, "-m", "sglang.launch_server")
"""The default engine command: SGLang from the agent's own interpreter."""

ENV_FLAGS: tuple[tuple[str, str], ...] = (
    ("PRORSA_MODEL_PATH", "--model-path"),
    ("PRORSA_SERVED_MODEL_NAME", "--served-model-name"),
    ("PRORSA_TP_SIZE", "--tp-size"),
    ("PRORSA_TRANSFER_BACKEND", "--disaggregation-transfer-backend"),
    ("PRORSA_BOOTSTRAP_PORT", "--disaggregation-bootstrap-port"),
    ("PRORSA_IB_DEVICE", "--disaggregation-ib-device"),
    ("PRORSA_ENGINE_HOST", "--host"),
    # A multi-node instance: every pod of the group gets the same flags but its node rank.
    ("PRORSA_NNODES", "--nnodes"),
    ("PRORSA_NODE_RANK", "--node-rank"),
    ("PRORSA_DIST_INIT_ADDR", "--dist-init-addr"),
)
"""Environment variable -> SGLang flag, for ``--launch`` (the operator sets these)."""

EXTRA_ARGS_ENV = "PRORSA_EXTRA_ARGS"
"""More SGLang flags: a JSON list of strings (preferred) or a shell-quoted string."""

AGENT_ENV = frozenset(
    {
        "PRORSA_ENGINE_URL",
        "PRORSA_ENGINE_PORT",
        "PRORSA_AGENT_LISTEN",
        "PRORSA_AGENT_TOKEN_FILE",
        "PRORSA_INSTANCE",
        "PRORSA_ENGINE_API_KEY_FILE",
        "PRORSA_AGENT_TLS_CERT_FILE",
        "PRORSA_AGENT_TLS_KEY_FILE",
        "PRORSA_DECODE_CUDA_GRAPH_MEMORY_GB",
        "PRORSA_LAUNCH",
        "PRORSA_ENGINE_COMMAND",
        "PRORSA_LOG_LEVEL",
    }
)
"""The agent's own settings (``prorsa-agent`` flag defaults)."""

ALLOW_HICACHE_STORAGE_ENV = "PRORSA_ALLOW_HICACHE_STORAGE"
"""``1``: accept ``--hicache-storage-backend`` although every role flip clears that store."""

DISABLE_HICACHE_ENV = "PRORSA_DISABLE_HICACHE"
"""``1``: do not add ``--enable-hierarchical-cache`` (keeps the GPU radix cache)."""

CACHE_ENV = frozenset({ALLOW_HICACHE_STORAGE_ENV, DISABLE_HICACHE_ENV})
"""Settings of the prefix-cache flags ``engine_argv`` adds (read by ``cli.build_config``)."""

ENV_VARS = AGENT_ENV | CACHE_ENV | KV_STORE_ENV | {name for name, _ in ENV_FLAGS} | {EXTRA_ARGS_ENV}
"""Every ``PRORSA_*`` variable an engine pod may set; the engine image is checked against it."""


class ConfigError(ValueError):
    """A configuration the agent cannot run with; the message names the setting."""


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Seconds. The defaults suit a real engine; tests shrink them."""

    request: float = 5.0
    """Ordinary engine calls: ``/v1/loads``, ``/server_info``, ``/abort_request``."""
    switch: float = 600.0
    """``/pd_role_switch``: a flip to decode may capture CUDA graphs."""
    verify: float = 120.0
    """To see the engine generate after a flip: ``/health_generate`` is asked again after
    each 503 (SGLang's own check gives up after 20 s) until this is spent."""
    abort_settle: float = 30.0
    """After ``abort_all``, for aborted requests to leave the engine."""
    retry_drain: float = 5.0
    """Drain window before aborting again when the engine answered "not idle"."""
    poll: float = 0.25
    """Drain polling period."""
    health_interval: float = 5.0
    health_probe: float = 30.0
    """One ``/health`` probe (it runs a one-token generation)."""
    state: float = 1.5
    """How long ``GET /v1/state`` waits for the engine's ``/v1/loads`` before it answers
    with the last read (the operator gives an agent 2 s)."""
    state_max_age: float = 30.0
    """The oldest ``/v1/loads`` read ``GET /v1/state`` answers with; past it, the engine is
    reported unhealthy."""
    client_headers: float = 30.0
    """A client's request line and headers, from its connect (or its previous reply on a
    kept-alive connection); then the agent closes the connection."""
    client_body: float = 10.0
    """A ``POST /v1/role`` body, from its headers (it is a few dozen bytes); then 408."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"timeout {f.name} must be a finite number > 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class RestartBackoff:
    """Restart delays after engine crashes: initial, times factor, capped; reset when stable."""

    initial: float = 1.0
    factor: float = 2.0
    maximum: float = 60.0
    stable_after: float = 120.0
    """A run at least this long resets the delay to ``initial``."""

    def __post_init__(self) -> None:
        if not (0 < self.initial <= self.maximum) or self.factor < 1 or self.stable_after < 0:
            raise ConfigError("backoff needs 0 < initial <= maximum, factor >= 1")

    def next(self, delay: float) -> float:
        return min(self.maximum, delay * self.factor)


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """How the agent runs the engine when it supervises it (``--launch``)."""

    argv: tuple[str, ...]
    secrets: tuple[str, ...] = field(default=(), repr=False)
    """Values in ``argv`` never to print (the engine admin key): see prorsa_agent.redact."""
    backoff: RestartBackoff = field(default_factory=RestartBackoff)
    stop_grace: float = 30.0
    """SIGTERM, then this long, then SIGKILL (to the engine's whole process group)."""

    def __repr__(self) -> str:
        argv = tuple(redact_argv(self.argv, self.secrets))
        return (
            f"LaunchSpec(argv={argv!r}, backoff={self.backoff!r}, stop_grace={self.stop_grace!r})"
        )


BOOTSTRAP_FLAG = "--disaggregation-bootstrap-port"
SGLANG_BOOTSTRAP_PORT = 8998
"""SGLang's default for ``--disaggregation-bootstrap-port`` (``arg_groups/fields/disagg.py``)."""
ENGINE_BOOTSTRAP_OFFSET = 1000
"""SGLang's own bootstrap server listens this far above the port the agent serves: fixed,
so that every pod of a multi-node group registers with its head on the same port."""


@dataclass(frozen=True, kw_only=True)
class BootstrapGateConfig:
    """The PD bootstrap port the agent serves in front of SGLang's (prorsa_agent.bootstrap_gate)."""

    port: int
    """The port the pod announces (``sglang.ai/bootstrap-port``); decode engines ask it."""
    engine_port: int
    """SGLang's own bootstrap server (``--disaggregation-bootstrap-port``, set by the agent)."""
    hold: float
    """Seconds closed before the gate opens after a flip to prefill."""

    def __post_init__(self) -> None:
        for name in ("port", "engine_port"):
            value = getattr(self, name)
            if not 0 < value < 65536:
                raise ConfigError(f"bootstrap {name} out of range: {value}")
        if self.port == self.engine_port:
            raise ConfigError(f"the bootstrap gate and SGLang's server share port {self.port}")
        if not math.isfinite(self.hold) or self.hold < 0:
            raise ConfigError(f"bootstrap gate hold must be >= 0 seconds, got {self.hold}")


def bootstrap_gate_for(
    args: Sequence[str], *, hold: float, engine_port: int | None = None
) -> BootstrapGateConfig:
    """The gate for an engine launched with ``args``: it serves their bootstrap port (SGLang's
    default when none is given), SGLang's server moves to ``engine_port`` (by default
    :data:`ENGINE_BOOTSTRAP_OFFSET` above it)."""
    given = flag_value(args, BOOTSTRAP_FLAG)
    try:
        port = int(given) if given is not None else SGLANG_BOOTSTRAP_PORT
    except ValueError as exc:
        raise ConfigError(f"{BOOTSTRAP_FLAG} must be a port number, got {given!r}") from exc
    if engine_port is None:
        engine_port = port + ENGINE_BOOTSTRAP_OFFSET
        if engine_port > 65535:
            engine_port = port - ENGINE_BOOTSTRAP_OFFSET
    return BootstrapGateConfig(port=port, engine_port=engine_port, hold=hold)


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    engine_url: str
    token_file: Path
    instance: str
    listen_host: str = "0.0.0.0"
    listen_port: int = 8080
    engine_api_key_file: Path | None = None
    tls_cert_file: Path | None = None
    """With ``tls_key_file``: serve HTTPS (engine pods always do; docs/security.md)."""
    tls_key_file: Path | None = None
    decode_cuda_graph_memory_gb: float | None = None
    """Passed on a flip to decode when the engine has no decode CUDA graphs captured."""
    max_switch_attempts: int = 3
    health_failures: int = 3
    """Consecutive failed probes before a healthy engine is reported unhealthy."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    launch: LaunchSpec | None = None
    bootstrap_gate: BootstrapGateConfig | None = None
    """With ``launch``: serve the engine's bootstrap port (``engine_argv`` moves SGLang's)."""
    kv_store: KvStoreConfig | None = None
    """The cluster's shared KV store (``PRORSA_KV_STORE_*``): a flip is refused while it
    does not answer (prorsa_agent.switch)."""

    def __post_init__(self) -> None:
        parts = urlsplit(self.engine_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"--engine-url must be an http(s) URL, got {self.engine_url!r}")
        if not self.instance:
            raise ConfigError("the instance name is empty (set --instance or POD_NAME)")
        if not 0 <= self.listen_port < 65536:
            raise ConfigError(f"listen port out of range: {self.listen_port}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("--tls-cert-file and --tls-key-file go together")
        if self.max_switch_attempts < 1 or self.health_failures < 1:
            raise ConfigError("max_switch_attempts and health_failures must be >= 1")
        gb = self.decode_cuda_graph_memory_gb
        if gb is not None and (not math.isfinite(gb) or gb < 0):
            raise ConfigError("--decode-cuda-graph-memory-gb must be >= 0")
        if self.bootstrap_gate is not None and self.launch is None:
            raise ConfigError("the bootstrap gate needs --launch (the agent sets SGLang's port)")


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6); port 0 binds an ephemeral port."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--listen must be HOST:PORT, got {value!r}")
    host = host.strip("[]") or "0.0.0.0"
    number = int(port)
    if number > 65535:
        raise ConfigError(f"--listen port out of range: {number}")
    return host, number


def args_from_env(env: Mapping[str, str]) -> list[str]:
    """SGLang flags from the ``PRORSA_*`` variables the operator sets on the pod."""
    args: list[str] = []
    for name, flag in ENV_FLAGS:
        value = env.get(name, "").strip()
        if value:
            args += [flag, value]
    extra = env.get(EXTRA_ARGS_ENV, "").strip()
    if extra:
        if extra.startswith("["):
            try:
                parsed = json.loads(extra)
            except ValueError as exc:
                raise ConfigError(f"{EXTRA_ARGS_ENV} is not a JSON list: {exc}") from exc
            if not isinstance(parsed, list) or not all(isinstance(a, str) for a in parsed):
                raise ConfigError(f"{EXTRA_ARGS_ENV} must be a JSON list of strings")
            args += parsed
        else:
            args += shlex.split(extra)
    return args


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value given to ``flag`` (``--flag v`` or ``--flag=v``), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def without_flag(args: Sequence[str], flag: str) -> list[str]:
    """``args`` less every ``--flag v`` and ``--flag=v``."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


DECODE_RADIX_CACHE = "--disaggregation-decode-enable-radix-cache"
HIERARCHICAL_CACHE = ("--enable-hierarchical-cache", "--enable-hicache")
"""SGLang's flag and its alias (``srt/arg_groups/fields/memory.py``)."""

DECODE_RADIX_SPECULATIVE = frozenset({"EAGLE", "EAGLE3", "NEXTN", "DSPARK"})
"""Speculative algorithms SGLang accepts with the decode radix cache (NEXTN aliases EAGLE;
``srt/arg_groups/speculative_hook.py``)."""

HICACHE_REFUSED_WITH = (
    "--enable-lmcache",
    "--enable-unified-cache-external-linker",
    "--enable-int8-mamba-checkpoint",
    "--enable-hisparse",
)
"""User flags SGLang refuses next to ``--enable-hierarchical-cache`` (``kv_cache_hook.py``
``handle_cache_compatibility``, ``hicache_hook.py`` ``handle_hicache``, ``mamba_hook.py``
``handle_int8_mamba_checkpoint``; HiSparse needs ``--disable-radix-cache`` anyway)."""


def _speculative(args: Sequence[str]) -> str | None:
    value = flag_value(args, "--speculative-algorithm")
    return value.upper() if value else None


def _int_flag(args: Sequence[str], *names: str) -> int:
    for name in names:
        value = flag_value(args, name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return 0  # SGLang's own parser reports it
    return 1


def check_hicache_storage(args: Sequence[str], *, allow: bool) -> None:
    """Refuse an L3 HiCache storage backend unless the user opted in.

    A role flip calls the tree cache's ``clear_storage_backend()``
    (``srt/disaggregation/role_switch.py`` ``_release_prefix_cache_for_role_switch``), which
    clears the WHOLE store (Mooncake's ``remove_all()``, every file of the ``file`` backend's
    directory): with a store shared by several engines, one engine's flip wipes every other
    engine's cached prefixes. Only a per-instance store is safe, which the agent cannot tell.
    """
    backend = flag_value(args, "--hicache-storage-backend")
    if backend is None or allow:
        return
    raise ConfigError(
        f"--hicache-storage-backend {backend} is refused: every role flip clears the whole "
        "HiCache storage backend (SGLang srt/disaggregation/role_switch.py "
        "_release_prefix_cache_for_role_switch calls the tree cache's clear_storage_backend(), "
        "e.g. Mooncake's remove_all()), which wipes the entries of every other engine sharing "
        f"that store. Set {ALLOW_HICACHE_STORAGE_ENV}=1 if this engine's store is its own."
    )


def prefix_cache_flags(args: Sequence[str], *, hicache: bool = True) -> list[str]:
    """The prefix-cache flags to add to ``args`` so the cache survives the launch role.

    Every engine starts as decode, and SGLang disables the radix cache of a decode server
    unless ``--disaggregation-decode-enable-radix-cache`` is given
    (``srt/arg_groups/pd_disaggregation_hook.py`` ``handle_pd_disaggregation``); a role flip
    does not bring it back (``role_switch.py`` ``_release_prefix_cache_for_role_switch``
    returns early when it is disabled), so a flipped prefill engine would recompute every
    multi-turn context in full. ``--enable-hierarchical-cache`` adds a host-memory tier of
    this instance only (a flip resets it with the GPU tree, ``unified_radix_cache.py``
    ``reset``). Neither is added when the user gave it, gave ``--disable-radix-cache``, or
    gave a flag SGLang refuses next to it; HiCache also needs the radix cache of the launch
    role (``kv_cache_hook.py`` ``handle_cache_compatibility`` refuses it with a disabled one).
    """
    if has_flag(args, "--disable-radix-cache"):
        return []
    added: list[str] = []
    mode = flag_value(args, "--disaggregation-mode") or "decode"
    speculative = _speculative(args)
    decode_radix = has_flag(args, DECODE_RADIX_CACHE)
    if (
        not decode_radix
        and not has_flag(args, "--enable-hisparse")
        and flag_value(args, "--disaggregation-transfer-backend") != "fake"
        and (speculative is None or speculative in DECODE_RADIX_SPECULATIVE)
    ):
        added.append(DECODE_RADIX_CACHE)
        decode_radix = True
    radix_at_launch = decode_radix or mode != "decode"
    if (
        hicache
        and radix_at_launch
        and not any(has_flag(args, f) for f in HIERARCHICAL_CACHE)
        and not any(has_flag(args, f) for f in HICACHE_REFUSED_WITH)
        # HiCache with DCP needs an MLA model and no draft but DSPARK (hicache_hook.py
        # resolve_hicache_dcp_compatibility): the agent cannot tell the model.
        and _int_flag(args, "--dcp-size", "--decode-context-parallel-size") <= 1
        # The unified pool refuses HiCache with an EAGLE draft (kv_cache_hook.py).
        and not (
            has_flag(args, "--enable-unified-memory")
            and speculative in ("EAGLE", "EAGLE3", "NEXTN")
        )
    ):
        added.append(HIERARCHICAL_CACHE[0])
    return added


def kv_store_args(args: Sequence[str], store: KvStoreConfig, *, hicache: bool) -> list[str]:
    """The store's flags (``KvStoreConfig.engine_flags``), refused next to flags that would
    contradict them: the store is HiCache's storage tier, so it needs HiCache (and so the
    radix cache), and the flags it sets may not be given a second time."""
    for flag in KV_STORE_FLAGS:
        if has_flag(args, flag):
            raise ConfigError(
                f"{flag} is set by the operator for spec.kvStore; remove it from the engine flags"
            )
    if not hicache or has_flag(args, "--disable-radix-cache"):
        raise ConfigError(
            "spec.kvStore is HiCache's storage tier: it needs the radix cache and HiCache "
            f"(unset {DISABLE_HICACHE_ENV}, remove --disable-radix-cache)"
        )
    return store.engine_flags()


ADMIN_KEY_FLAG = "--admin-api-key"
API_KEY_FLAG = "--api-key"


def admin_key_args(args: Sequence[str], key: str) -> list[str]:
    """``--admin-api-key KEY``: SGLang then refuses its admin endpoints without that key.

    SGLang 0.5.23 (``srt/utils/auth.py`` ``decide_request_auth``) marks ``/pd_role_switch``,
    ``/abort_request``, ``/flush_cache``, the weight-update and pause endpoints
    ``ADMIN_OPTIONAL``: with an admin key set only that key opens them (401 otherwise),
    while ``/generate``, ``/v1/loads``, ``/server_info`` and the probes stay open to the
    router, which holds no key. A second ``--api-key`` would close those too, and the agent,
    which holds only the admin key, could no longer read the engine's state: both are
    refused next to an operator-managed key.
    """
    for flag in (ADMIN_KEY_FLAG, API_KEY_FLAG):
        if has_flag(args, flag):
            raise ConfigError(
                f"{flag} is set by the operator from the cluster's engine admin key Secret "
                "(PRORSA_ENGINE_API_KEY_FILE); remove it from the engine flags"
            )
    if not key.strip():
        raise ConfigError("the engine admin key file is empty")
    # One argument, ``--admin-api-key=KEY``: the operator's keys are URL-safe base64, and
    # one in 64 starts with "-", which SGLang's argparse takes for an option when it is an
    # argument of its own ("expected one argument": the engine never starts).
    return [f"{ADMIN_KEY_FLAG}={key.strip()}"]


def engine_argv(
    *,
    command: Sequence[str],
    engine_url: str,
    env_args: Sequence[str] = (),
    explicit: Sequence[str] = (),
    hicache: bool = True,
    allow_hicache_storage: bool = False,
    admin_api_key: str | None = None,
    bootstrap_gate: BootstrapGateConfig | None = None,
    kv_store: KvStoreConfig | None = None,
) -> list[str]:
    """The full engine command line: command, env flags, explicit flags, required flags.

    ``hicache=False`` (``PRORSA_DISABLE_HICACHE=1``) leaves out the host-memory tier;
    ``allow_hicache_storage`` (``PRORSA_ALLOW_HICACHE_STORAGE=1``) accepts an L3 storage
    backend, see ``check_hicache_storage``; ``admin_api_key`` (read from
    ``PRORSA_ENGINE_API_KEY_FILE``) protects the engine's admin endpoints, see
    ``admin_key_args``; with ``bootstrap_gate`` SGLang's bootstrap server listens on the
    gate's ``engine_port`` (the agent serves the announced port, prorsa_agent.bootstrap_gate);
    ``kv_store`` adds the shared KV store's flags (``kv_store_args``).
    """
    args = [*env_args, *explicit]
    if kv_store is not None:
        args += kv_store_args(args, kv_store, hicache=hicache)
    if bootstrap_gate is not None:
        moved = [BOOTSTRAP_FLAG, str(bootstrap_gate.engine_port)]
        args = [*without_flag(args, BOOTSTRAP_FLAG), *moved]
    if admin_api_key is not None:
        args += admin_key_args(args, admin_api_key)
    port = urlsplit(engine_url).port or (443 if engine_url.startswith("https") else 80)
    given = flag_value(args, "--port")
    if given is not None and given != str(port):
        raise ConfigError(f"the engine flag --port {given} does not match --engine-url {port}")
    check_hicache_storage(args, allow=allow_hicache_storage or kv_store is not None)
    if not has_flag(args, "--disaggregation-mode"):
        args += ["--disaggregation-mode", "decode"]
    if not has_flag(args, "--enable-pd-role-switch"):
        args.append("--enable-pd-role-switch")
    if not has_flag(args, "--enable-metrics"):
        args.append("--enable-metrics")
    args += prefix_cache_flags(args, hicache=hicache)
    if given is None:
        args += ["--port", str(port)]
    return [*command, *args]
