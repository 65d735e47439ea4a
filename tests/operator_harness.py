"""The operator's end-to-end tests run on :mod:`prorsa_lab.doubles.stack`, the same loopback
deployment (API emulator, operator, fake kubelet with engine doubles and agents) that
``prorsa demo`` runs. This module keeps the names the tests import."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from prorsa_lab.doubles.sglang_double import EngineConfig
from prorsa_lab.doubles.stack import NAMESPACE, TOKEN, Stack, cluster_manifest, stack

Deployment = Stack

__all__ = ["NAMESPACE", "TOKEN", "Deployment", "cluster_manifest", "deployment"]


@contextlib.asynccontextmanager
async def deployment(
    engine_config: Callable[[str], EngineConfig] | None = None,
) -> AsyncIterator[Stack]:
    """The whole deployment with the tests' settings: 0.3 s control ticks, 2 s watches."""
    async with stack(engine_config=engine_config, tick_seconds=0.3, watch_timeout=2.0) as env:
        yield env
