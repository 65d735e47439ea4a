"""``prorsa-agent``: flags, their environment defaults, and the process main loop.

Every flag has a ``PRORSA_*`` environment default, because the operator configures engine
pods through their environment (the image's entrypoint is just ``prorsa-agent --launch``).
:func:`main` is the ``prorsa-agent`` command of the light distribution the engine image
installs (``engine_image/pyproject.toml``); ``prorsa agent`` runs the same flags from the
full CLI. This module stays light to import (no aiohttp): ``prorsa --help`` loads it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from prorsa_agent.bootstrap_gate import hold_seconds
from prorsa_agent.config import (
    ALLOW_HICACHE_STORAGE_ENV,
    DISABLE_HICACHE_ENV,
    SGLANG_COMMAND,
    AgentConfig,
    ConfigError,
    LaunchSpec,
    RestartBackoff,
    Timeouts,
    args_from_env,
    bootstrap_gate_for,
    engine_argv,
    parse_listen,
)
from prorsa_agent.kv_store import KvStoreConfig, KvStoreError
from prorsa_agent.redact import redact_argv
from prorsa_contract.aio import stop_requested
from prorsa_contract.labels import AGENT_COMMAND

HELP = "run the in-pod agent: supervise SGLang, report its state, flip its PD role"


def _env_float(name: str, default: float | None) -> float | None:
    value = os.environ.get(name, "").strip()
    return float(value) if value else default


def configure(parser: argparse.ArgumentParser) -> None:
    env = os.environ
    parser.add_argument(
        "--engine-url",
        default=env.get("PRORSA_ENGINE_URL")
        or f"http://127.0.0.1:{env.get('PRORSA_ENGINE_PORT', '30000')}",
        help="the engine's base URL (env PRORSA_ENGINE_URL; default http://127.0.0.1:"
        "$PRORSA_ENGINE_PORT, port 30000)",
    )
    parser.add_argument(
        "--listen",
        default=env.get("PRORSA_AGENT_LISTEN", "0.0.0.0:8080"),
        help="HOST:PORT to serve on; port 0 picks a free port (env PRORSA_AGENT_LISTEN)",
    )
    parser.add_argument(
        "--token-file",
        default=env.get("PRORSA_AGENT_TOKEN_FILE"),
        help="file holding the bearer token of POST /v1/role (env PRORSA_AGENT_TOKEN_FILE)",
    )
    parser.add_argument(
        "--instance",
        default=env.get("PRORSA_INSTANCE") or env.get("POD_NAME") or socket.gethostname(),
        help="instance name in /v1/state (env PRORSA_INSTANCE, POD_NAME; default hostname)",
    )
    parser.add_argument(
        "--engine-api-key-file",
        default=env.get("PRORSA_ENGINE_API_KEY_FILE"),
        help="file holding the engine's admin key: sent on every engine call, and passed "
        "to the engine as --admin-api-key with --launch (env PRORSA_ENGINE_API_KEY_FILE)",
    )
    parser.add_argument(
        "--tls-cert-file",
        default=env.get("PRORSA_AGENT_TLS_CERT_FILE"),
        help="serve HTTPS with this PEM certificate (chain); with --tls-key-file "
        "(env PRORSA_AGENT_TLS_CERT_FILE; without both: plain HTTP)",
    )
    parser.add_argument(
        "--tls-key-file",
        default=env.get("PRORSA_AGENT_TLS_KEY_FILE"),
        help="the PEM private key of --tls-cert-file (env PRORSA_AGENT_TLS_KEY_FILE)",
    )
    parser.add_argument(
        "--decode-cuda-graph-memory-gb",
        type=float,
        default=_env_float("PRORSA_DECODE_CUDA_GRAPH_MEMORY_GB", None),
        help="decode CUDA graph memory to pass on a flip to decode when the engine has none "
        "captured (it was launched as prefill); read it from a decode peer's /server_info",
    )
    parser.add_argument(
        "--launch",
        action="store_true",
        default=env.get("PRORSA_LAUNCH", "") in ("1", "true"),
        help="start and supervise the engine (flags from PRORSA_* and after '--')",
    )
    parser.add_argument(
        "--worker",
        action="store_true",
        help="a worker rank of a multi-node instance (PRORSA_NODE_RANK >= 1): build the "
        "engine command as --launch does and become it. SGLang's rank 0 on the leader pod "
        "drives every rank (role switches included), so a worker runs no agent API",
    )
    parser.add_argument(
        "--engine-command",
        default=env.get("PRORSA_ENGINE_COMMAND"),
        help="the engine command for --launch (shell-quoted; default: python -m "
        "sglang.launch_server with this interpreter)",
    )
    t = parser.add_argument_group("timing (seconds)")
    defaults = Timeouts()
    t.add_argument("--switch-timeout", type=float, default=defaults.switch)
    t.add_argument("--verify-timeout", type=float, default=defaults.verify)
    t.add_argument("--abort-settle-timeout", type=float, default=defaults.abort_settle)
    t.add_argument("--request-timeout", type=float, default=defaults.request)
    t.add_argument("--poll-interval", type=float, default=defaults.poll)
    t.add_argument("--health-interval", type=float, default=defaults.health_interval)
    t.add_argument("--health-timeout", type=float, default=defaults.health_probe)
    t.add_argument(
        "--header-timeout",
        type=float,
        default=defaults.client_headers,
        help="seconds a client may take to send a request's headers (from its connect, or "
        "from the previous reply on a kept-alive connection) before it is disconnected",
    )
    t.add_argument(
        "--body-timeout",
        type=float,
        default=defaults.client_body,
        help="seconds a client may take to send a POST /v1/role body once its headers are "
        "in; then 408 and the connection is closed",
    )
    backoff = RestartBackoff()
    t.add_argument("--restart-backoff", type=float, default=backoff.initial)
    t.add_argument("--restart-backoff-max", type=float, default=backoff.maximum)
    t.add_argument("--stop-grace", type=float, default=30.0)
    parser.add_argument("--max-switch-attempts", type=int, default=3)
    parser.add_argument("--log-level", default=env.get("PRORSA_LOG_LEVEL", "info"))
    parser.add_argument(
        "engine_args",
        nargs=argparse.REMAINDER,
        help="-- then SGLang flags for --launch (appended after the PRORSA_* ones)",
    )


def build_config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> AgentConfig:
    env = os.environ if env is None else env
    if not args.token_file:
        raise ConfigError("--token-file is required (or PRORSA_AGENT_TOKEN_FILE)")
    host, port = parse_listen(args.listen)
    explicit = list(args.engine_args or [])
    if explicit and explicit[0] == "--":
        explicit = explicit[1:]
    if explicit and not args.launch:
        raise ConfigError("engine flags after '--' need --launch")
    launch = gate = None
    try:
        kv_store = KvStoreConfig.from_env(env)
    except KvStoreError as exc:
        raise ConfigError(str(exc)) from exc
    if args.launch:
        command: Sequence[str] = (
            shlex.split(args.engine_command) if args.engine_command else SGLANG_COMMAND
        )
        admin_key = _read_key(args.engine_api_key_file) if args.engine_api_key_file else None
        env_args = args_from_env(env)
        gate = bootstrap_gate_for([*env_args, *explicit], hold=hold_seconds(env))
        launch = LaunchSpec(
            argv=tuple(
                engine_argv(
                    command=command,
                    engine_url=args.engine_url,
                    env_args=env_args,
                    explicit=explicit,
                    hicache=env.get(DISABLE_HICACHE_ENV, "") not in ("1", "true"),
                    allow_hicache_storage=env.get(ALLOW_HICACHE_STORAGE_ENV, "") in ("1", "true"),
                    admin_api_key=admin_key,
                    bootstrap_gate=gate,
                    kv_store=kv_store,
                )
            ),
            secrets=(admin_key.strip(),) if admin_key else (),
            backoff=RestartBackoff(
                initial=args.restart_backoff,
                maximum=max(args.restart_backoff, args.restart_backoff_max),
            ),
            stop_grace=args.stop_grace,
        )
    timeouts = Timeouts(
        request=args.request_timeout,
        switch=args.switch_timeout,
        verify=args.verify_timeout,
        abort_settle=args.abort_settle_timeout,
        poll=args.poll_interval,
        health_interval=args.health_interval,
        health_probe=args.health_timeout,
        client_headers=args.header_timeout,
        client_body=args.body_timeout,
    )
    return AgentConfig(
        engine_url=args.engine_url,
        token_file=Path(args.token_file),
        instance=args.instance,
        listen_host=host,
        listen_port=port,
        engine_api_key_file=Path(args.engine_api_key_file) if args.engine_api_key_file else None,
        tls_cert_file=Path(args.tls_cert_file) if args.tls_cert_file else None,
        tls_key_file=Path(args.tls_key_file) if args.tls_key_file else None,
        decode_cuda_graph_memory_gb=args.decode_cuda_graph_memory_gb,
        max_switch_attempts=args.max_switch_attempts,
        timeouts=timeouts,
        launch=launch,
        bootstrap_gate=gate,
        kv_store=kv_store,
    )


def _read_key(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the engine admin key file {path}: {exc}") from exc


async def serve(config: AgentConfig) -> None:
    """Run until SIGINT/SIGTERM; the engine (if launched) is stopped on the way out."""
    from prorsa_agent.server import Agent

    with stop_requested() as stop:
        agent = Agent(config)
        url = await agent.start()
        if config.launch is not None:
            shown = redact_argv(config.launch.argv, config.launch.secrets)
            print(f"prorsa agent: engine command: {shlex.join(shown)}", flush=True)
        print(f"prorsa agent listening on {url} (engine {config.engine_url})", flush=True)
        try:
            await stop.wait()
        finally:
            await agent.stop()


def worker_argv(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> list[str]:
    """The engine command of a worker rank: the leader's flags, this pod's node rank."""
    env = os.environ if env is None else env
    rank = env.get("PRORSA_NODE_RANK", "").strip()
    if not rank.isdigit() or int(rank) < 1:
        raise ConfigError("--worker needs PRORSA_NODE_RANK >= 1 (rank 0 is the leader)")
    if not env.get("PRORSA_DIST_INIT_ADDR", "").strip():
        raise ConfigError("--worker needs PRORSA_DIST_INIT_ADDR (the leader's rendezvous)")
    args.launch = True
    config = build_config(args, env)
    assert config.launch is not None
    return list(config.launch.argv)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.worker:
        try:
            argv = worker_argv(args)
        except (ConfigError, ValueError) as exc:
            print(f"prorsa agent: {exc}", file=sys.stderr)
            return 2
        print(f"prorsa agent: worker rank, exec {shlex.join(argv[:3])} ...", flush=True)
        os.execvp(argv[0], argv)  # the engine replaces this process
    try:
        config = build_config(args)
    except (ConfigError, ValueError) as exc:
        print(f"prorsa agent: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except ValueError as exc:  # an unreadable certificate or key
        print(f"prorsa agent: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"prorsa agent: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``prorsa-agent`` command: engine pods run it without the ``prorsa`` CLI."""
    parser = argparse.ArgumentParser(prog=AGENT_COMMAND, description=HELP)
    configure(parser)
    return run(parser.parse_args(argv))
