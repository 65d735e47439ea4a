"""The agent's configuration and how the SGLang command line is assembled.

The operator configures an engine pod through environment variables (the image's entrypoint
is ``prorsa agent --launch``), so that one image serves every model and size. The engine's
flags come from ``PRORSA_*`` variables, then from the arguments after ``--``, then the flags
every Prorsa engine needs are added when missing: it starts as ``decode`` (so that decode
CUDA graphs are captured at start-up and any flip back to decode finds them), with role
switching and metrics on, on the port the agent talks to.
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
        "PRORSA_DECODE_CUDA_GRAPH_MEMORY_GB",
        "PRORSA_LAUNCH",
        "PRORSA_ENGINE_COMMAND",
        "PRORSA_LOG_LEVEL",
    }
)
"""The agent's own settings (``prorsa agent`` flag defaults)."""

ENV_VARS = AGENT_ENV | {name for name, _ in ENV_FLAGS} | {EXTRA_ARGS_ENV}
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
    """``/health_generate`` after a flip (SGLang's own check waits up to 20 s)."""
    abort_settle: float = 30.0
    """After ``abort_all``, for aborted requests to leave the engine."""
    retry_drain: float = 5.0
    """Drain window before aborting again when the engine answered "not idle"."""
    poll: float = 0.25
    """Drain polling period."""
    health_interval: float = 5.0
    health_probe: float = 30.0
    """One ``/health`` probe (it runs a one-token generation)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"timeout {f.name} must be a finite number > 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class Backoff:
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
    backoff: Backoff = field(default_factory=Backoff)
    stop_grace: float = 30.0
    """SIGTERM, then this long, then SIGKILL (to the engine's whole process group)."""


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    engine_url: str
    token_file: Path
    instance: str
    listen_host: str = "0.0.0.0"
    listen_port: int = 8080
    engine_api_key_file: Path | None = None
    decode_cuda_graph_memory_gb: float | None = None
    """Passed on a flip to decode when the engine has no decode CUDA graphs captured."""
    max_switch_attempts: int = 3
    health_failures: int = 3
    """Consecutive failed probes before a healthy engine is reported unhealthy."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    launch: LaunchSpec | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.engine_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"--engine-url must be an http(s) URL, got {self.engine_url!r}")
        if not self.instance:
            raise ConfigError("the instance name is empty (set --instance or POD_NAME)")
        if not 0 <= self.listen_port < 65536:
            raise ConfigError(f"listen port out of range: {self.listen_port}")
        if self.max_switch_attempts < 1 or self.health_failures < 1:
            raise ConfigError("max_switch_attempts and health_failures must be >= 1")
        gb = self.decode_cuda_graph_memory_gb
        if gb is not None and (not math.isfinite(gb) or gb < 0):
            raise ConfigError("--decode-cuda-graph-memory-gb must be >= 0")


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


def engine_argv(
    *,
    command: Sequence[str],
    engine_url: str,
    env_args: Sequence[str] = (),
    explicit: Sequence[str] = (),
) -> list[str]:
    """The full engine command line: command, env flags, explicit flags, required flags."""
    args = [*env_args, *explicit]
    port = urlsplit(engine_url).port or (443 if engine_url.startswith("https") else 80)
    given = flag_value(args, "--port")
    if given is not None and given != str(port):
        raise ConfigError(f"the engine flag --port {given} does not match --engine-url {port}")
    if not has_flag(args, "--disaggregation-mode"):
        args += ["--disaggregation-mode", "decode"]
    if not has_flag(args, "--enable-pd-role-switch"):
        args.append("--enable-pd-role-switch")
    if not has_flag(args, "--enable-metrics"):
        args.append("--enable-metrics")
    if given is None:
        args += ["--port", str(port)]
    return [*command, *args]
