"""One simulated engine pod: an SGLang double and its in-pod agent, both on loopback.

For the operator's end-to-end tests and the demo::

    async with EnginePod(instance="demo-engine-0", token="t") as pod:
        pod.agent_url   # the agent CONTRACT (GET /v1/state, POST /v1/role, ...)
        pod.engine_url  # SGLang's endpoints (/generate, /v1/loads, ...)
        pod.double      # the EngineDouble: faults, counters, crash(), restart()

With ``engine_api_key`` the double requires that admin key (as SGLang launched with
``--admin-api-key``) and the agent reads it from a file, as in an engine pod; with
``tls_cert`` and ``tls_key`` (PEM) the agent serves HTTPS from files, as in an engine pod.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

from prorsa_agent.config import AgentConfig, Timeouts
from prorsa_agent.kv_store import KvStoreConfig
from prorsa_agent.server import Agent
from prorsa_lab.doubles.engine.model import EngineConfig, Faults
from prorsa_lab.doubles.engine.server import EngineDouble

FAST_TIMEOUTS = Timeouts(
    request=2.0,
    switch=10.0,
    verify=5.0,
    abort_settle=5.0,
    retry_drain=0.5,
    poll=0.02,
    health_interval=0.1,
    health_probe=2.0,
)
"""Agent timeouts scaled for a double: a whole switch takes tens of milliseconds."""


class EnginePod:
    def __init__(
        self,
        *,
        instance: str,
        token: str,
        engine: EngineConfig | None = None,
        faults: Faults | None = None,
        timeouts: Timeouts = FAST_TIMEOUTS,
        decode_cuda_graph_memory_gb: float | None = None,
        agent_host: str = "127.0.0.1",
        agent_port: int = 0,
        engine_api_key: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        kv_store: KvStoreConfig | None = None,
    ) -> None:
        if not token:
            raise ValueError("the agent token must not be empty")
        self.instance = instance
        self.token = token
        self.engine_api_key = engine_api_key
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        self._tls = (tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
        config = engine or EngineConfig()
        if engine_api_key is not None:
            # As `prorsa-agent --launch` would start SGLang: --admin-api-key from the file.
            config = dataclasses.replace(config, admin_api_key=engine_api_key)
        self.double = EngineDouble(config, faults=faults)
        self._timeouts = timeouts
        self._graph_gb = decode_cuda_graph_memory_gb
        self._agent_host = agent_host
        self._agent_port = agent_port
        self._dir: Path | None = None
        self._kv_store = kv_store
        self.agent: Agent | None = None

    @property
    def engine_url(self) -> str:
        return self.double.url

    @property
    def agent_url(self) -> str:
        if self.agent is None:
            raise RuntimeError("the pod is not started")
        return self.agent.url

    async def start(self) -> EnginePod:
        await self.double.start()
        self._dir = Path(tempfile.mkdtemp(prefix="prorsa-pod-"))
        (self._dir / "token").write_text(self.token)
        if self.engine_api_key is not None:
            (self._dir / "engine-admin-key").write_text(self.engine_api_key)
        if self._tls is not None:
            (self._dir / "tls.crt").write_text(self._tls[0])
            (self._dir / "tls.key").write_text(self._tls[1])
        await self.start_agent()
        return self

    async def stop_agent(self) -> None:
        """The agent goes away (crash, network partition); the engine keeps its role."""
        if self.agent is not None:
            await self.agent.stop()
            self.agent = None

    async def start_agent(self) -> None:
        """A fresh agent on the same address, as after a container restart."""
        if self._dir is None:
            raise RuntimeError("the pod is not started")
        token_file = self._dir / "token"
        key_file = self._dir / "engine-admin-key" if self.engine_api_key is not None else None
        cert_file = self._dir / "tls.crt" if self._tls is not None else None
        tls_key_file = self._dir / "tls.key" if self._tls is not None else None
        self.agent = Agent(
            AgentConfig(
                engine_url=self.double.url,
                token_file=token_file,
                engine_api_key_file=key_file,
                tls_cert_file=cert_file,
                tls_key_file=tls_key_file,
                instance=self.instance,
                listen_host=self._agent_host,
                listen_port=self._agent_port,
                decode_cuda_graph_memory_gb=self._graph_gb,
                timeouts=self._timeouts,
                kv_store=self._kv_store,
            )
        )
        await self.agent.start()

    async def stop(self) -> None:
        await self.stop_agent()
        await self.double.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    async def __aenter__(self) -> EnginePod:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
