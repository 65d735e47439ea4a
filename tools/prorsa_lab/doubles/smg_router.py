"""The real smg router (PyPI ``smg``, the chart's ``lightseekorg/smg``) as a local process.

The fake kubelet runs the router Deployment the operator renders with the binary of the
installed ``smg`` distribution: the container's command and arguments as rendered, with
only the addresses changed for loopback (``--host``, ``--port``, the engines' shared port
``--service-discovery-port``) and a free ``--prometheus-port`` added (its default, 29000,
may be taken). Its Kubernetes discovery reads the API emulator through ``KUBECONFIG``; the
in-cluster variables are removed, since with them and no service-account files smg carries
on silently without discovery.

What smg 1.13.0 does with engine pods (read from its source and checked against the
binary, see docs/testing.md): it registers only pods that are Running, Ready and have a
podIP, at ``podIP:--service-discovery-port``; a pod matching the prefill selector is a
prefill worker (bootstrap port from the ``sglang.ai/bootstrap-port`` annotation), one
matching the decode selector a decode worker, and it keeps a worker's type as long as the
same pod keeps matching either selector. A pod that stops matching (``draining``) is
removed: about 1 s to notice (events are coalesced), then a fixed 5 s drain in which it
takes no new requests, then it leaves ``/workers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.metadata
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent thread ends

log = logging.getLogger("prorsa.kubelet.smg")

ADDRESS_FLAGS = ("--host", "--port", "--service-discovery-port", "--prometheus-port")


def smg_binary() -> str | None:
    """The ``smg`` console script of this environment (or on PATH), if installed."""
    beside = Path(sys.executable).with_name("smg")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("smg")


def smg_version(binary: str) -> str | None:
    """The installed distribution's version (e.g. ``1.13.0``), else ``smg --version``'s."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version("smg")
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for word in out.replace(",", " ").split():
        word = word.removeprefix("v")
        if word[:1].isdigit() and word.count(".") >= 1:
            return word
    return None


def local_args(
    args: Sequence[str], *, host: str, port: int, engine_port: int, prometheus_port: int
) -> list[str]:
    """The rendered arguments with the addresses replaced (module docstring)."""
    wanted = {
        "--host": host,
        "--port": str(port),
        "--service-discovery-port": str(engine_port),
        "--prometheus-port": str(prometheus_port),
    }
    out: list[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg in ADDRESS_FLAGS and i + 1 < len(args):
            skip = True
            continue
        out.append(arg)
    for flag, value in wanted.items():
        out += [flag, value]
    return out


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, have the kernel kill smg when the thread that
    started it ends, so a demo or test killed outright (SIGKILL, a timeout) leaves no router
    holding its ports. Its own session keeps it clear of the terminal's Ctrl-C, which the
    demo handles to stop it in order."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(kw_only=True)
class SmgRouter:
    """One smg process; ``url`` is where it listens."""

    binary: str
    args: list[str]  # after ``smg``, e.g. ``["launch", ...]``
    kubeconfig: str
    port: int
    host: str = "127.0.0.1"
    log_path: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    _log: Any = None
    started_at: float = 0.0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env |= {"KUBECONFIG": self.kubeconfig, "NO_PROXY": "*", "no_proxy": "*"} | self.env
        for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
            env.pop(proxy, None)
        self._log = (
            open(self.log_path, "ab")  # noqa: SIM115 - held for the process's lifetime
            if self.log_path
            else subprocess.DEVNULL
        )
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            [self.binary, *self.args],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.info("smg started (pid %d) on %s", self.process.pid, self.url)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """Ends the process at once: its graceful shutdown holds the port for 5 s more."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._log = None

    async def workers(self, client: httpx.AsyncClient) -> list[dict[str, Any]] | None:
        """``GET /workers``: the registered workers, None when smg does not answer."""
        try:
            reply = await client.get(f"{self.url}/workers", timeout=5)
            reply.raise_for_status()
            data = reply.json()
        except (httpx.HTTPError, ValueError):
            return None
        workers = data.get("workers") if isinstance(data, dict) else None
        return workers if isinstance(workers, list) else None

    async def readiness(self, client: httpx.AsyncClient) -> dict[str, Any] | None:
        """``GET /readiness`` (``{"status", "healthy_workers", "total_workers"}``)."""
        try:
            reply = await client.get(f"{self.url}/readiness", timeout=5)
            data = reply.json()
        except (httpx.HTTPError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    async def wait_workers(
        self,
        check: Callable[[list[dict[str, Any]]], bool],
        *,
        timeout: float = 60.0,
        what: str = "smg workers",
    ) -> list[dict[str, Any]]:
        """Poll ``/workers`` every 0.1 s until ``check`` holds; return that list."""
        deadline = time.monotonic() + timeout
        last: list[dict[str, Any]] | None = None
        async with httpx.AsyncClient(trust_env=False) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise RuntimeError(f"smg exited with {self.process and self.process.poll()}")
                last = await self.workers(client)
                if last is not None and check(last):
                    return last
                await asyncio.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def worker_types(workers: list[dict[str, Any]]) -> dict[str, str]:
    """``{pod IP: worker type}`` of smg's ``/workers`` list."""
    out: dict[str, str] = {}
    for w in workers:
        url = str(w.get("url", ""))
        host = url.split("://", 1)[-1].rsplit(":", 1)[0]
        out[host] = str(w.get("worker_type", ""))
    return out
