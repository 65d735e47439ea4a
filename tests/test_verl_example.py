"""The verl example's weight-sync hook, on stand-ins for the verl modules it imports.

verl is not a test dependency; the stand-ins copy only what the example touches, and
``auto_await`` keeps verl 0.9.1's rule (a coroutine for an async caller, ``asyncio.run``
otherwise). The events go to the real webhook over loopback HTTP.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import importlib.util
import sys
import time
import types
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from test_ingest_server import TOKEN, ev, queued, serve

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verl_agent_loop.py"


def auto_await(func: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        coro = func(*args, **kwargs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        return coro

    return wrapper


class CheckpointEngineManager:
    """verl's weight sync: aborts the replicas, loads the weights, resumes generation."""

    def __init__(self, on_sync: Callable[[], None]) -> None:
        self.on_sync = on_sync

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        self.on_sync()
        await asyncio.sleep(0.05)
        return {"synced": global_steps}


def install_fake_verl(monkeypatch: pytest.MonkeyPatch) -> None:
    class AgentState(enum.Enum):
        PROCESSING_TOOLS = "processing_tools"

    contents: dict[str, dict[str, Any]] = {
        "verl": {},
        "verl.checkpoint_engine": {},
        "verl.checkpoint_engine.base": {"CheckpointEngineManager": CheckpointEngineManager},
        "verl.experimental": {},
        "verl.experimental.agent_loop": {},
        "verl.experimental.agent_loop.agent_loop": {
            "AgentLoopOutput": object,
            "register": lambda name: lambda cls: cls,
        },
        "verl.experimental.agent_loop.tool_agent_loop": {
            "AgentData": object,
            "AgentState": AgentState,
            "ToolAgentLoop": object,
        },
        "verl.utils": {},
        "verl.utils.ray_utils": {"auto_await": auto_await},
        "verl.utils.reward_score": {"default_compute_score": lambda *a: 0.0},
    }
    for name, attrs in contents.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    original = CheckpointEngineManager.__dict__["update_weights"]
    monkeypatch.setattr(CheckpointEngineManager, "update_weights", original)


def load_example() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("verl_agent_loop_under_test", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_verl_weight_sync_is_announced_around_itself(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    install_fake_verl(monkeypatch)
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    async with serve() as srv:
        for key, value in {
            "PRORSA_URL": srv.url,
            "PRORSA_NAMESPACE": "rl",
            "PRORSA_CLUSTER": "c",
            "PRORSA_TOKEN_FILE": str(token),
        }.items():
            monkeypatch.setenv(key, value)
        # Live: one decoding, one in a tool (both re-prefill), one computing its reward.
        t = time.time() - 5.0  # before the syncs below, within the webhook's window
        r = await srv.post(
            [
                queued("d1", "dec", t),
                ev("d2", "prefill_finished", "dec", t + 1),
                queued("t1", "tool", t),
                ev("t2", "decode_finished", "tool", t + 1, output_tokens=5, finish="tool"),
                queued("r1", "rew", t),
                ev("r2", "decode_finished", "rew", t + 1, output_tokens=5, finish="stop"),
            ]
        )
        assert r.status_code == 200
        anomalies = srv.handle.anomalies  # trajectories first heard of mid-life
        example = load_example()
        example.install_weight_update_events()  # imported twice: wrapped once
        seen: list[int] = []
        manager = CheckpointEngineManager(
            on_sync=lambda: seen.append(example._UPDATES.emitter.stats.emitted)
        )
        assert await manager.update_weights(global_steps=3) == {"synced": 3}
        assert seen == [1]  # weight_update_started went out before the sync began
        em = example._UPDATES.emitter
        assert await asyncio.to_thread(em.flush)
        table = srv.handle.controller.table
        wu = table.weight_update
        assert (wu.version, wu.pending, wu.reprefill_trajectories) == (3, False, 2)
        assert table.cache_flushes == 1
        # Without a step number (verl's initial sync path) the version still moves on, and
        # the last sync's duration is announced as the expected one.
        await manager.update_weights()
        assert await asyncio.to_thread(em.flush)
        wu = table.weight_update
        assert wu.version == 4 and wu.expected_seconds is not None and wu.expected_seconds > 0
        stats = await asyncio.to_thread(em.close)
        assert (stats.emitted, stats.sent, stats.dropped) == (4, 4, 0)
        assert srv.handle.anomalies == anomalies  # no weight-update event was refused or stale
