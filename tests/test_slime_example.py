"""The slime example (``examples/slime_prorsa.py``) on stand-ins for the slime modules it uses.

slime (THUDM/slime) is not on PyPI (the ``slime`` there is an unrelated statistics
package) and needs Megatron-LM, Ray and CUDA, so it cannot run on this CPU machine. The
stand-ins copy only what the example touches, with slime's semantics as its source has
them: ``Sample`` and its statuses (``slime/utils/types.py``), ``generate`` continuing an
ABORTED sample with prompt plus response and ``max_new_tokens`` less what it has
(``slime/rollout/sglang_rollout.py``), ``GenerateState.aborted`` set by slime's own abort
at a step's end, ``RayTrainGroup.update_weights`` in the trainer process. The model is the
engine double behind real HTTP; a role switch's abort is the agent's own
``/abort_request``; the events go to the real webhook and are checked in the recording
the example writes (``PRORSA_RECORD``).
"""

from __future__ import annotations

import asyncio
import enum
import importlib.util
import json
import sys
import time
import types
from argparse import Namespace
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_ingest_server import TOKEN, Served, serve

from prorsa_lab.doubles.sglang_double import EngineConfig, EngineDouble, TimingModel

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "slime_prorsa.py"


class Status(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """slime's Sample: the fields the example and slime's generate touch."""

    group_index: int | None = None
    index: int | None = None
    prompt: str = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    reward: float | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    Status = Status

    def append_response_tokens(self, tokens: list[int], meta_info: dict[str, Any]) -> None:
        self.tokens += tokens
        self.response_length += len(tokens)
        self.status = {
            "length": Status.TRUNCATED,
            "abort": Status.ABORTED,
            "stop": Status.COMPLETED,
        }[meta_info["finish_reason"]["type"]]


class Tokenizer:
    """One token per word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [hash(word) % 1000 for word in text.split()]


class GenerateState:
    """slime's singleton rollout state: its tokenizer, and ``aborted`` once slime aborts
    what is left at the end of a step."""

    instance: GenerateState | None = None

    def __new__(cls, args: Namespace) -> GenerateState:
        if cls.instance is None:
            cls.instance = super().__new__(cls)
            cls.instance.tokenizer = Tokenizer()
            cls.instance.aborted = False
        return cls.instance

    tokenizer: Tokenizer
    aborted: bool


async def slime_generate(
    args: Namespace, sample: Sample, sampling_params: dict[str, Any]
) -> Sample:
    """slime's single-turn generate: prompt (plus the response so far) as input_ids."""
    assert sample.status in (Status.PENDING, Status.ABORTED)
    state = GenerateState(args)
    prompt_ids = sample.tokens or state.tokenizer.encode(sample.prompt)
    sampling_params["max_new_tokens"] -= sample.response_length
    if not sample.tokens:
        sample.tokens = list(prompt_ids)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(
            url, json={"input_ids": list(prompt_ids), "sampling_params": sampling_params}
        )
    reply.raise_for_status()
    output = reply.json()
    sample.append_response_tokens(output["output_ids"], output["meta_info"])
    return sample


async def async_rm(args: Namespace, sample: Sample) -> float:
    await asyncio.sleep(0.01)
    return 1.0 if sample.response_length % 2 == 0 else 0.0


class RayTrainGroup:
    """slime's trainer-side group; ``update_weights`` broadcasts the new weights."""

    def __init__(self, on_sync: Callable[[], None]) -> None:
        self.on_sync = on_sync

    def update_weights(self) -> list[None]:
        self.on_sync()
        time.sleep(0.05)
        return [None]


def install_fake_slime(monkeypatch: pytest.MonkeyPatch) -> None:
    GenerateState.instance = None
    contents: dict[str, dict[str, Any]] = {
        "slime": {},
        "slime.ray": {},
        "slime.ray.actor_group": {"RayTrainGroup": RayTrainGroup},
        "slime.rollout": {},
        "slime.rollout.rm_hub": {"async_rm": async_rm},
        "slime.rollout.sglang_rollout": {
            "GenerateState": GenerateState,
            "generate": slime_generate,
        },
        "slime.utils": {},
        "slime.utils.types": {"Sample": Sample},
    }
    for name, attrs in contents.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    original = RayTrainGroup.__dict__["update_weights"]
    monkeypatch.setattr(RayTrainGroup, "update_weights", original)


def load_example() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("slime_prorsa_under_test", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Job:
    srv: Served
    engine: EngineDouble
    example: types.ModuleType
    record: Path

    def args(self, *, partial_rollout: bool = False) -> Namespace:
        host, port = self.engine.url.removeprefix("http://").rsplit(":", 1)
        return Namespace(
            sglang_router_ip=host,
            sglang_router_port=int(port),
            partial_rollout=partial_rollout,
            group_rm=False,
            reward_key=None,
        )

    def events(self) -> dict[str, list[dict[str, Any]]]:
        by_trajectory: dict[str, list[dict[str, Any]]] = {}
        for line in self.record.read_text().splitlines():
            event = json.loads(line)
            by_trajectory.setdefault(event.get("trajectory", "cluster"), []).append(event)
        return by_trajectory

    async def decoding(self, n: int) -> None:
        """Until ``n`` requests decode on the engine, a few tokens in."""
        deadline = time.monotonic() + 30
        async with httpx.AsyncClient() as client:
            while True:
                (load,) = (await client.get(f"{self.engine.url}/v1/loads")).json()["loads"]
                if load["num_running_reqs"] >= n:
                    break
                assert time.monotonic() < deadline, load
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)

    async def delivered(self) -> None:
        for em in self.example._EMITTERS.values():
            assert await em.flush()


@pytest.fixture
async def job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> AsyncIterator[Job]:
    install_fake_slime(monkeypatch)
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    record = tmp_path / "events.ndjson"
    timing = TimingModel(decode_step_seconds=0.02, prefill_tokens_per_second=1e6)
    async with serve() as srv, EngineDouble(EngineConfig(role="null", timing=timing)) as engine:
        for key, value in {
            "PRORSA_URL": srv.url,
            "PRORSA_NAMESPACE": "rl",
            "PRORSA_CLUSTER": "c",
            "PRORSA_TOKEN_FILE": str(token),
            "PRORSA_RECORD": str(record),
        }.items():
            monkeypatch.setenv(key, value)
        example = load_example()
        try:
            yield Job(srv=srv, engine=engine, example=example, record=record)
        finally:
            for em in example._EMITTERS.values():
                await em.aclose()
            if example._UPDATES.emitter is not None:
                await asyncio.to_thread(example._UPDATES.emitter.close)


def samples(n: int) -> list[Sample]:
    return [Sample(group_index=i // 2, index=i, prompt="solve " * (20 + i)) for i in range(n)]


async def test_a_role_switch_abort_is_resumed_and_every_step_reported(job: Job) -> None:
    args = job.args()
    params = {"max_new_tokens": 40, "temperature": 1.0}
    batch = samples(3)
    runs = [asyncio.create_task(job.example.generate(args, s, dict(params))) for s in batch]
    await job.decoding(3)  # every request is decoding: a role switch drains the engine
    async with httpx.AsyncClient() as client:
        r = await client.post(f"{job.engine.url}/abort_request", json={"abort_all": True})
        assert r.status_code == 200
    done = await asyncio.gather(*runs)
    assert [s.status for s in done] == [Status.TRUNCATED] * 3  # all 40 tokens, resumed
    assert all(s.response_length == 40 and s.reward is not None for s in done)
    await job.delivered()

    counters = job.engine.counters()
    assert counters.requests_received == 6  # each sent twice: before and after the abort
    trajectories = job.events()
    assert len(trajectories) == 3
    for sample in done:
        events = trajectories[sample.metadata["prorsa_trajectory"]]
        assert [e["type"] for e in events] == [
            "sample_dispatched",
            "request_queued",
            "decode_finished",
            "request_queued",
            "decode_finished",
            "reward_started",
            "reward_finished",
        ]
        first, resent = events[1]["prompt_tokens"], events[3]["prompt_tokens"]
        partial = events[2]["output_tokens"]
        assert events[2]["finish"] == "abort" and 0 < partial < 40
        assert resent == first + partial  # prompt plus the partial output
        assert events[4] == events[4] | {"finish": "length", "output_tokens": 40 - partial}
        assert events[6]["accepted"] is (sample.reward == 1.0)
    assert sum(
        e["output_tokens"] for t in trajectories.values() for e in t if "output_tokens" in e
    ) == (counters.generation_tokens)
    table = job.srv.handle.controller.table
    assert sum(table.state_counts().values()) == 0  # every trajectory ended
    assert job.srv.handle.anomalies == 0


async def test_slimes_own_abort_at_a_step_end(job: Job) -> None:
    """With --partial-rollout the sample waits for the next step; without, it is gone."""
    params = {"max_new_tokens": 200}
    kept, dropped = samples(2)
    state = GenerateState(job.args())
    runs = [
        asyncio.create_task(
            job.example.generate(job.args(partial_rollout=True), kept, dict(params))
        ),
        asyncio.create_task(job.example.generate(job.args(), dropped, dict(params))),
    ]
    await job.decoding(2)
    state.aborted = True  # slime's abort(): then every server aborts what it runs
    async with httpx.AsyncClient() as client:
        await client.post(f"{job.engine.url}/abort_request", json={"abort_all": True})
    await asyncio.gather(*runs)
    assert kept.status is Status.ABORTED and dropped.status is Status.ABORTED
    await job.delivered()
    live = job.srv.handle.controller.live_trajectories()
    assert live["ready"] == 1  # the kept one, queued again for its next step
    assert job.events()[dropped.metadata["prorsa_trajectory"]][-1]["type"] == "trajectory_dropped"

    state.aborted = False  # the next step resumes the kept sample where it stopped
    done = await job.example.generate(job.args(partial_rollout=True), kept, dict(params))
    assert done.status is Status.TRUNCATED and done.response_length == 200
    await job.delivered()
    events = job.events()[kept.metadata["prorsa_trajectory"]]
    assert [e["type"] for e in events].count("sample_dispatched") == 1
    assert sum(job.srv.handle.controller.live_trajectories().values()) == 0


async def test_weight_updates_are_announced_around_slimes_sync(job: Job) -> None:
    seen: list[int] = []
    group = RayTrainGroup(on_sync=lambda: seen.append(job.example._UPDATES.emitter.stats.emitted))
    assert await asyncio.to_thread(group.update_weights) == [None]  # the initial sync
    assert seen == [1]  # weight_update_started went out before the sync began
    await asyncio.to_thread(group.update_weights)
    em = job.example._UPDATES.emitter
    assert await asyncio.to_thread(em.flush)
    wu = job.srv.handle.controller.table.weight_update
    assert (wu.version, wu.pending) == (1, False)
    assert wu.expected_seconds is not None and wu.expected_seconds > 0
    job.example.install_weight_update_events()  # imported again by the RolloutManager
    await asyncio.to_thread(group.update_weights)
    assert await asyncio.to_thread(em.flush)
    assert em.stats.emitted == 6 and em.stats.dropped == 0
