"""One engine pod with the real engine: the in-pod agent launching SGLang 0.5.23 on a CPU.

The agent runs in this process, as :class:`prorsa_lab.doubles.engine.pod.EnginePod` runs it
in front of a double; the engine is its supervised child, launched exactly as
``prorsa-agent --launch`` launches it in the engine image (``engine_argv``: role ``decode``,
role switching, metrics, the decode radix cache, HiCache and the admin key are the agent's
own additions), with the CPU flags and environment of
:mod:`prorsa_lab.sglang_cpu.environment`. Stopping the pod stops the engine's whole process
group.

HiCache is off by default here (the agent's ``PRORSA_DISABLE_HICACHE=1``): SGLang 0.5.23's
host tier registers its buffer with CUDA (``srt/mem_cache/pool_host/common.py``
``alloc_with_host_register``), so an engine with it does not start without a GPU. The
HiCache flags are checked by SGLang's own validation instead
(``tests/real_engine/test_sglang_validation.py``).

A CPU engine takes 1.5 to 2 minutes to start on a loaded 2-core machine and about 3.5 GB:
start the pods of a test together and share them between tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

import httpx

from prorsa_agent.bootstrap_gate import hold_seconds
from prorsa_agent.config import (
    AgentConfig,
    BootstrapGateConfig,
    LaunchSpec,
    RestartBackoff,
    Timeouts,
    engine_argv,
)
from prorsa_agent.server import Agent
from prorsa_lab.sglang_cpu.environment import DECODE_GRAPH_MEMORY_GB, CpuEngineEnv

CPU_TIMEOUTS = Timeouts(
    request=10.0,
    switch=120.0,
    verify=60.0,
    abort_settle=30.0,
    retry_drain=2.0,
    poll=0.1,
    health_interval=2.0,
    health_probe=30.0,
)
"""Agent timeouts for a CPU engine: a flip takes 0.1-0.6 s, a one-token check up to seconds
while two other engines share the cores."""

START_TIMEOUT = 1800.0
"""Seconds an engine may take to load before its pod fails: the engine pods' startupProbe
(``prorsa.k8s.objects``: ``/healthz`` every 10 s, 180 failures), as a kubelet would. A load
took 94-127 s on a loaded 2-core machine, and more than 600 s with the cores some fifteen
times oversubscribed (a tighter bound failed the pod, and its replacement loaded again)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EngineStartFailed(RuntimeError):
    """The engine did not come up; the message carries the tail of its log."""


class SglangPod:
    """``await SglangPod(...).start()``, then ``await pod.wait_ready()``; ``await pod.stop()``."""

    def __init__(
        self,
        *,
        env: CpuEngineEnv,
        instance: str,
        token: str,
        host: str = "127.0.0.1",
        engine_port: int | None = None,
        agent_host: str | None = None,
        agent_port: int = 0,
        bootstrap_port: int | None = None,
        bootstrap_gate: bool = True,
        engine_api_key: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        served_model_name: str | None = None,
        timeouts: Timeouts = CPU_TIMEOUTS,
        log_dir: Path | None = None,
        extra_flags: tuple[str, ...] = (),
        env_args: tuple[str, ...] = (),
        hicache: bool = False,
        without: tuple[str, ...] = (),
    ) -> None:
        if not token:
            raise ValueError("the agent token must not be empty")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        self.env = env
        self.instance = instance
        self.token = token
        self.host = host
        self.engine_port = engine_port or free_port(host)
        self.bootstrap_port = bootstrap_port or free_port(host)
        self.engine_info_port = free_port(host)
        # The agent serves the announced bootstrap port, SGLang's own server behind it; a
        # test that flips SGLang itself, not through the agent, has SGLang serve it.
        self.gate = (
            BootstrapGateConfig(
                port=self.bootstrap_port,
                engine_port=free_port(host),
                hold=hold_seconds(os.environ),
            )
            if bootstrap_gate
            else None
        )
        self.engine_api_key = engine_api_key
        self.served_model_name = served_model_name
        self._tls = (tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
        self._agent_host = agent_host or host
        self._agent_port = agent_port
        self._timeouts = timeouts
        self._extra = extra_flags
        self._env_args = env_args
        self._without = without
        self._hicache = hicache
        self._dir: Path | None = None
        self._log_dir = log_dir
        self.log_path: Path | None = None
        self.agent: Agent | None = None

    def set_tls(self, cert: str | None, key: str | None) -> None:
        """The agent's serving certificate and key (PEM), before :meth:`start`."""
        if (cert is None) != (key is None):
            raise ValueError("tls_cert and tls_key go together")
        self._tls = (cert, key) if cert is not None and key is not None else None

    @property
    def engine_url(self) -> str:
        return f"http://{self.host}:{self.engine_port}"

    @property
    def agent_url(self) -> str:
        if self.agent is None:
            raise RuntimeError("the pod is not started")
        return self.agent.url

    @property
    def engine_pid(self) -> int | None:
        sup = self.agent.supervisor if self.agent is not None else None
        return sup.pid if sup is not None else None

    def argv(self) -> list[str]:
        """The engine command line as the agent assembles it (the admin key included):
        ``env_args`` (an engine pod's ``PRORSA_*`` flags, ``prorsa_agent.config.
        args_from_env``), then the CPU flags, then the agent's own, less the value-less
        flags in ``without``."""
        command = self.env.command(host_ip=self.host)
        assert self.log_path is not None
        # The engine's log goes to a file of its own (a test prints its tail on failure).
        wrapped = ["sh", "-c", f'exec "$@" >>{shlex.quote(str(self.log_path))} 2>&1', "sh"]
        argv = engine_argv(
            command=[*wrapped, *command],
            engine_url=self.engine_url,
            env_args=self._env_args,
            explicit=self.env.flags(
                host=self.host,
                bootstrap_port=self.bootstrap_port,
                engine_info_port=self.engine_info_port,
                served_model_name=self.served_model_name,
                extra=self._extra,
            ),
            admin_api_key=self.engine_api_key,
            hicache=self._hicache,
            bootstrap_gate=self.gate,
        )
        # A state the agent never makes, for the tests that show why (value-less flags).
        return [a for a in argv if a not in self._without]

    async def start(self) -> SglangPod:
        """Start the agent, which launches the engine; returns before the engine is ready."""
        self._dir = Path(tempfile.mkdtemp(prefix=f"prorsa-sglang-{self.instance}-"))
        log_dir = self._log_dir or self._dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.instance}.engine.log"
        (self._dir / "token").write_text(self.token)
        key_file = None
        if self.engine_api_key is not None:
            key_file = self._dir / "engine-admin-key"
            key_file.write_text(self.engine_api_key)
        cert_file = tls_key_file = None
        if self._tls is not None:
            cert_file, tls_key_file = self._dir / "tls.crt", self._dir / "tls.key"
            cert_file.write_text(self._tls[0])
            tls_key_file.write_text(self._tls[1])
        secrets = (self.engine_api_key,) if self.engine_api_key else ()
        self.agent = Agent(
            AgentConfig(
                engine_url=self.engine_url,
                token_file=self._dir / "token",
                instance=self.instance,
                listen_host=self._agent_host,
                listen_port=self._agent_port,
                engine_api_key_file=key_file,
                tls_cert_file=cert_file,
                tls_key_file=tls_key_file,
                decode_cuda_graph_memory_gb=DECODE_GRAPH_MEMORY_GB,
                timeouts=self._timeouts,
                launch=LaunchSpec(
                    argv=tuple(self.argv()),
                    secrets=secrets,
                    backoff=RestartBackoff(initial=1.0, maximum=10.0),
                    stop_grace=20.0,
                ),
                bootstrap_gate=self.gate,
            )
        )
        await self.agent.start()
        return self

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no engine log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Until the agent reports a healthy engine in a PD role (the engine has loaded
        and warmed up); raises :class:`EngineStartFailed` with the engine's log tail."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=10.0, verify=False, trust_env=False) as client:
            while time.monotonic() < deadline:
                sup = self.agent.supervisor if self.agent is not None else None
                if sup is not None and sup.restarts:
                    raise EngineStartFailed(
                        f"engine {self.instance} exited with {sup.last_exit} while starting; "
                        f"its log ends:\n{self.log_tail()}"
                    )
                try:
                    state = (await client.get(f"{self.agent_url}/v1/state")).json()
                    if state.get("healthy") and state.get("role") in ("prefill", "decode"):
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1.0)
        raise EngineStartFailed(
            f"engine {self.instance} not ready after {timeout:.0f}s; its log ends:\n"
            + self.log_tail()
        )

    async def stop(self) -> None:
        if self.agent is not None:
            pid = self.engine_pid
            try:
                await self.agent.stop()  # SIGTERM, then SIGKILL, to the engine's process group
            except asyncio.CancelledError:
                # The supervisor's own task was cancelled (an event loop shutting down
                # cancels every task): carry on unless this task itself is being cancelled.
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
            finally:
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)  # whatever happened above
            self.agent = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def __aenter__(self) -> SglangPod:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
