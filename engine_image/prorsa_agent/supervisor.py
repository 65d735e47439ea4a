"""Runs the engine process and restarts it when it dies, with exponential backoff.

The engine runs in its own process group so that stopping it also stops the scheduler and
detokenizer processes SGLang forks. A crash is any exit the agent did not ask for; the delay
before the next start grows by ``RestartBackoff.factor`` up to ``RestartBackoff.maximum``
and resets once a run has lasted ``RestartBackoff.stable_after`` seconds, so a crash loop
does not hammer the GPU while a rare crash is retried quickly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from prorsa_agent.config import RestartBackoff
from prorsa_agent.redact import Redactor, pump

log = logging.getLogger("prorsa_agent.supervisor")


class EngineSupervisor:
    """``state`` is ``starting`` (before the first spawn), ``running``, ``backoff``
    (waiting to restart after a crash) or ``stopped``. ``generation`` counts spawns."""

    def __init__(
        self,
        *,
        argv: Sequence[str],
        backoff: RestartBackoff,
        stop_grace: float,
        env: Mapping[str, str] | None = None,
        on_exit: Callable[[int | None, float], None] | None = None,
        on_spawn: Callable[[int], None] | None = None,
        redact: Sequence[str] = (),
    ) -> None:
        if not argv:
            raise ValueError("empty engine command")
        self.argv = list(argv)
        self.backoff = backoff
        self.stop_grace = stop_grace
        self.env = dict(env) if env is not None else None
        self._on_exit = on_exit
        self._on_spawn = on_spawn
        # Secrets the engine may print (its admin key): its output then passes through the
        # agent, which writes it on with them replaced (prorsa_agent.redact).
        self._redact = tuple(r for r in redact if r)
        self._pumps: list[asyncio.Task[None]] = []
        self.state = "starting"
        self.generation = 0
        self.restarts = 0
        self.last_exit: int | None = None
        self.delays: list[float] = []
        self.process: asyncio.subprocess.Process | None = None
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return (
            self.state == "running" and self.process is not None and self.process.returncode is None
        )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("supervisor already started")
        self._task = asyncio.create_task(self._loop(), name="engine-supervisor")
        # Let the first spawn happen before returning, so `pid` is set for the caller.
        for _ in range(100):
            if self.generation or self._task.done():
                break
            await asyncio.sleep(0.01)

    async def _spawn(self) -> asyncio.subprocess.Process | None:
        piped = asyncio.subprocess.PIPE if self._redact else None
        try:
            process = await asyncio.create_subprocess_exec(
                *self.argv, env=self.env, start_new_session=True, stdout=piped, stderr=piped
            )
        except OSError as exc:
            log.error("cannot start the engine (%s): %s", self.argv[0], exc)
            return None
        if self._redact:
            self._pumps = [
                asyncio.create_task(pump(stream, _writer(out), Redactor(self._redact)))
                for stream, out in ((process.stdout, sys.stdout), (process.stderr, sys.stderr))
                if stream is not None
            ]
        self.process = process
        self.generation += 1
        self.state = "running"
        log.info("engine started, pid %d (start #%d)", process.pid, self.generation)
        if self._on_spawn is not None:
            self._on_spawn(self.generation)
        return process

    async def _loop(self) -> None:
        delay = self.backoff.initial
        while not self._stopping.is_set():
            started = time.monotonic()
            process = await self._spawn()
            code = await process.wait() if process is not None else None
            if process is not None:
                # SGLang forks scheduler and detokenizer processes; a crashed engine can leave
                # them holding GPU memory, which would make the next start fail.
                _signal_group(process.pid, signal.SIGKILL)
                await self._drain_output()
            if self._stopping.is_set():
                break
            ran = time.monotonic() - started
            self.restarts += 1
            self.last_exit = code
            if ran >= self.backoff.stable_after:
                delay = self.backoff.initial
            self.state = "backoff"
            self.delays.append(delay)
            log.error("engine exited with %s after %.1fs; restarting in %.2fs", code, ran, delay)
            if self._on_exit is not None:
                self._on_exit(code, ran)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            delay = self.backoff.next(delay)
        self.state = "stopped"

    async def stop(self) -> None:
        """SIGTERM to the engine's process group, SIGKILL after ``stop_grace`` seconds."""
        self._stopping.set()
        process = self.process
        if process is not None and process.returncode is None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.stop_grace)
            except TimeoutError:
                log.warning("engine ignored SIGTERM for %.0fs; killing it", self.stop_grace)
                _signal_group(process.pid, signal.SIGKILL)
                await process.wait()
        if self._task is not None:
            await self._task
        self.state = "stopped"

    async def _drain_output(self) -> None:
        """Write what the engine printed last; its killed children close the pipes."""
        pumps, self._pumps = self._pumps, []
        if pumps:
            _, pending = await asyncio.wait(pumps, timeout=5.0)
            for task in pending:
                task.cancel()


def _writer(stream: TextIO) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        buffer = getattr(stream, "buffer", None)
        if buffer is not None:
            buffer.write(data)
        else:
            stream.write(data.decode(errors="replace"))
        stream.flush()

    return write


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
