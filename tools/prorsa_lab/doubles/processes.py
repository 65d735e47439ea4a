"""Ending a child process the way the kubelet ends a pod's container."""

from __future__ import annotations

import asyncio
import contextlib
import signal


async def terminate(
    process: asyncio.subprocess.Process, *, grace: float, sig: int = signal.SIGTERM
) -> int | None:
    """``sig`` (SIGTERM: the process may hand its Lease over), then SIGKILL after ``grace``
    seconds; its exit code."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        try:
            await asyncio.wait_for(process.wait(), grace)
        except TimeoutError:
            process.kill()
            await process.wait()
    return process.returncode
