"""The AReaL example against the real AReaL 1.0.4 (``pip install -e '.[areal,test]'``).

AReaL's own asynchronous rollout runs: ``RemoteInfEngine`` (through the example's
``ProrsaRemoteSGLangEngine``) with its ``WorkflowExecutor``, ``StalenessManager`` and
``AsyncTaskRunner``, AReaL's ``RLVRWorkflow`` with its ``gsm8k_reward_fn`` (math-verify,
in AReaL's ``AsyncRewardWrapper`` process pool), and a multi-turn tool workflow of the
user's. The model is a fake SGLang server on loopback (``/generate``, ``/health``, pause,
continue and the weight update); the tokenizer is a byte-level BPE built here (no hub
download). The weight update is AReaL's own sequence on the rollout engine, as its FSDP
actor drives it: ``pause_generation``, ``update_weights_from_distributed``,
``continue_generation``, ``set_version``. The events go to the real webhook.

Skipped where AReaL is not installed (it pulls torch, Ray and agent frameworks: several
GB), unless ``PRORSA_REQUIRE_TRAINERS=1`` (CI), where that is a failure.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("PRORSA_REQUIRE_TRAINERS") == "1":
    import areal  # noqa: F401  (CI: a missing AReaL fails here)
else:
    pytest.importorskip(
        "areal", reason="AReaL is not installed (optional extra: pip install -e '.[areal]')"
    )

import torch
from aiohttp import web
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest, ParamSpec, WeightUpdateMeta
from areal.api.reward_api import AsyncRewardWrapper
from areal.api.workflow_api import RolloutWorkflow
from areal.reward.gsm8k import gsm8k_reward_fn
from areal.workflow.rlvr import RLVRWorkflow
from byte_tokenizer import byte_tokenizer
from conftest import make_spec
from pydantic import TypeAdapter
from test_ingest_server import TOKEN, serve
from transformers import PreTrainedTokenizerFast

from prorsa.core.controller import Controller
from prorsa_contract.events import Event

EVENT: TypeAdapter[Any] = TypeAdapter(Event)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "areal_prorsa.py"
TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>'
ANSWER = "2 + 3 = 5. The answer is \\boxed{5}<|im_end|>"
BATCH = 2  # consumer_batch_size; max_head_offpolicyness 0: one batch ahead at most


@dataclass
class FakeSGLang:
    """SGLang's HTTP surface as AReaL's SGLangBackend uses it, recording every request."""

    tok: PreTrainedTokenizerFast
    generate: list[dict[str, Any]] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    hold: asyncio.Event | None = None  # held generations wait for it

    async def on_generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.generate.append(body)
        self.calls.append("/generate")
        prompt = self.tok.decode(body["input_ids"])
        tool_turn = "Use the add tool" in prompt and "<|im_start|>tool" not in prompt
        text = TOOL_CALL if tool_turn else ANSWER
        ids = self.tok.encode(text, add_special_tokens=False)
        finish = "tool_calls" if text == TOOL_CALL else "stop"
        return web.json_response(
            {
                "text": text,
                "meta_info": {
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": len(ids),
                    "finish_reason": {"type": finish},
                    "output_token_logprobs": [[-0.1, i, None] for i in ids],
                },
            }
        )

    async def on_control(self, request: web.Request) -> web.Response:
        self.calls.append(request.path)
        return web.json_response({"success": True})


@asynccontextmanager
async def fake_sglang(tok: PreTrainedTokenizerFast) -> AsyncIterator[tuple[str, FakeSGLang]]:
    fake = FakeSGLang(tok)
    app = web.Application()
    app.router.add_post("/generate", fake.on_generate)
    app.router.add_get("/health", fake.on_control)
    for path in ("/pause_generation", "/continue_generation", "/update_weights_from_distributed"):
        app.router.add_post(path, fake.on_control)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"127.0.0.1:{port}", fake
    finally:
        await runner.cleanup()


class ToolWorkflow(RolloutWorkflow):
    """A user's multi-turn workflow: generate, run the tool it asked for, generate again,
    reward with AReaL's gsm8k reward."""

    def __init__(self, tok: PreTrainedTokenizerFast, example: Any) -> None:
        self.tok = tok
        self.example = example
        self.gconfig = GenerationHyperparameters(
            max_new_tokens=256
        ).new_with_stop_and_pad_token_ids(tok)
        self.async_reward_fn = AsyncRewardWrapper(gsm8k_reward_fn)

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        messages = list(data["messages"])
        ids = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        resp = await engine.agenerate(
            ModelRequest(input_ids=list(ids), gconfig=self.gconfig.new(n_samples=1))
        )
        while resp.stop_reason == "tool_calls":
            with self.example.reported_tool("add") as report:
                result = self.tok.encode(
                    "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n",
                    add_special_tokens=False,
                )
                report.result_tokens = len(result)
            ids = resp.input_tokens + resp.output_tokens + result
            resp = await engine.agenerate(
                ModelRequest(input_ids=ids, gconfig=self.gconfig.new(n_samples=1))
            )
        completion = self.tok.decode(resp.output_tokens)
        reward = await self.async_reward_fn(
            "", completion, resp.input_tokens, resp.output_tokens, answer=data["answer"]
        )
        seq = resp.input_tokens + resp.output_tokens
        return {
            "input_ids": torch.tensor([seq], dtype=torch.int32),
            "attention_mask": torch.ones((1, len(seq)), dtype=torch.bool),
            "rewards": torch.tensor([reward], dtype=torch.float32),
        }


class RecordingController(Controller):
    """The webhook's Controller, keeping every event it was given."""

    def __init__(self) -> None:
        super().__init__(make_spec())
        self.seen: list[Event] = []

    def observe(self, events: Any) -> Any:
        batch = list(events)
        self.seen.extend(batch)
        return super().observe(batch)


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("areal_prorsa_real", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations there
    spec.loader.exec_module(module)
    return module


def prompt(i: int, *, tool: bool = False) -> dict[str, Any]:
    text = "Use the add tool: what is 2 + 3?" if tool else f"Question {i}: what is 2 + 3?"
    return {"query_id": f"q{i}", "messages": [{"role": "user", "content": text}], "answer": "5"}


async def test_areal_async_rollout_reports_dispatch_requests_tools_rewards_and_weights(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    recording = tmp_path / "rollout.ndjson"
    tok = byte_tokenizer()
    controller = RecordingController()
    async with serve(controller=controller) as srv, fake_sglang(tok) as (addr, fake):
        for key, value in {
            "PRORSA_URL": srv.url,
            "PRORSA_NAMESPACE": "rl",
            "PRORSA_CLUSTER": "c",
            "PRORSA_TOKEN_FILE": str(token),
            # Every batch the webhook accepted, superseded events included: the emitter's
            # start-up snapshot (it tracks its trajectories) may reach the webhook before
            # events older than it, which are then counted, not applied.
            "PRORSA_RECORD": str(recording),
        }.items():
            monkeypatch.setenv(key, value)
        example = load_example()
        config = InferenceEngineConfig(
            experiment_name="prorsa",
            trial_name="areal-real",
            consumer_batch_size=BATCH,
            max_concurrent_rollouts=8,
            max_head_offpolicyness=0,
            setup_timeout=30,
            request_timeout=30,
            pause_grace_period=0,
        )
        engine = example.ProrsaRemoteSGLangEngine(config)
        await asyncio.to_thread(engine.initialize, addr=addr, train_data_parallel_size=1)
        try:
            rlvr = example.ProrsaWorkflow(
                RLVRWorkflow(
                    reward_fn=gsm8k_reward_fn,
                    gconfig=GenerationHyperparameters(max_new_tokens=256),
                    tokenizer=tok,
                ),
                task="gsm8k",
            )
            tools = example.ProrsaWorkflow(ToolWorkflow(tok, example), task="tool")
            # Four prompts, one batch of staleness allowed at version 0: AReaL dispatches
            # two, the other two wait for the next weights.
            engine.submit(prompt(0, tool=True), workflow=tools)
            for i in (1, 2, 3):
                engine.submit(prompt(i), workflow=rlvr)
            first = await asyncio.to_thread(engine.wait, BATCH, timeout=60)
            await asyncio.sleep(0.5)  # what AReaL would dispatch now, it has dispatched
            before_update = len(fake.generate)

            # The trainer's weight update, as AReaL's PPOTrainer and its FSDP actor drive
            # the rollout engine: pause, pause_generation, update, continue_generation,
            # set_version, resume.
            meta = WeightUpdateMeta(type="xccl", nccl_group_name="g").with_version(1)
            engine.pause()
            await asyncio.to_thread(engine.pause_generation)
            spec = [ParamSpec(name="w", shape=(2,), dtype="float32")]
            await asyncio.to_thread(
                lambda: engine.update_weights_from_distributed(meta, spec).result(30)
            )
            await asyncio.to_thread(engine.continue_generation)
            engine.set_version(1)
            engine.resume()
            second = await asyncio.to_thread(engine.wait, BATCH, timeout=60)
        finally:
            await asyncio.to_thread(engine.destroy)

    assert len(first) == len(second) == BATCH
    assert before_update == 3  # the tool episode's two requests and one single-turn one
    sent = fake.generate
    assert len(sent) == 5
    # Every request carries the weight version it was generated on (SGLang's extra_key).
    assert [r["extra_key"] for r in sent[:3]] == ["weights-v0"] * 3
    assert [r["extra_key"] for r in sent[3:]] == ["weights-v1"] * 2
    assert fake.calls.count("/pause_generation") == 1
    assert fake.calls.count("/update_weights_from_distributed") == 1
    assert fake.calls.count("/continue_generation") == 1

    rollout = [
        EVENT.validate_json(line) for line in recording.read_text().splitlines() if line
    ]  # the contract's models: every event the rollout sent, as the webhook validated it
    weights = [e for e in controller.seen if e.type.startswith("weight_update")]
    assert [(e.type, e.version) for e in weights] == [  # type: ignore[union-attr]
        ("weight_update_started", 1),
        ("weight_update_finished", 1),
    ]
    started, finished = weights[0].ts, weights[1].ts
    # Staleness: two episodes (one batch ahead of version 0) started before the update,
    # none during it, the other two after it.
    dispatched = [e.ts for e in rollout if e.type == "sample_dispatched"]
    assert len([ts for ts in dispatched if ts < started]) == BATCH
    assert len([ts for ts in dispatched if ts > finished]) == BATCH
    events = rollout

    by_traj: dict[str, list[Event]] = {}
    for e in events:
        tid = getattr(e, "trajectory", None)
        if tid:
            by_traj.setdefault(tid, []).append(e)
    assert len(by_traj) == 4
    lifecycles = sorted(tuple(e.type for e in evs) for evs in by_traj.values())
    single = (
        "sample_dispatched",
        "request_queued",
        "decode_finished",
        "reward_started",
        "reward_finished",
    )
    with_tool = (
        "sample_dispatched",
        "request_queued",
        "decode_finished",
        "tool_started",
        "tool_finished",
        "request_queued",
        "decode_finished",
        "reward_started",
        "reward_finished",
    )
    assert lifecycles == sorted([single] * 3 + [with_tool])

    # The events' token counts are what the model server received and answered.
    queued = [e for e in events if e.type == "request_queued"]
    assert sorted(e.prompt_tokens for e in queued) == sorted(  # type: ignore[union-attr]
        len(r["input_ids"]) for r in sent
    )
    assert {e.request for e in queued} >= {r.get("rid") for r in sent} - {None}  # type: ignore[union-attr]
    tool_traj = next(evs for evs in by_traj.values() if len(evs) == len(with_tool))
    d0, t1, q1 = tool_traj[2], tool_traj[4], tool_traj[5]
    q0 = tool_traj[1]
    assert d0.finish == "tool" and tool_traj[6].finish == "stop"  # type: ignore[union-attr]
    assert tool_traj[3].tool == "add"  # type: ignore[union-attr]
    assert q1.prompt_tokens == q0.prompt_tokens + d0.output_tokens + t1.result_tokens  # type: ignore[union-attr]
    assert (q0.turn, q1.turn) == (0, 1)  # type: ignore[union-attr]
    assert d0.output_tokens == len(tok.encode(TOOL_CALL, add_special_tokens=False))  # type: ignore[union-attr]
    # AReaL's gsm8k reward (math-verify) accepted every answer.
    rewards = [e for e in events if e.type == "reward_finished"]
    assert [e.accepted for e in rewards] == [True] * 4  # type: ignore[union-attr]
    groups = {e.group for e in events if e.type == "sample_dispatched"}  # type: ignore[union-attr]
    assert groups == {"q0", "q1", "q2", "q3"}

    table = controller.table
    assert len(table) == 0  # every trajectory finished and left the table
    assert sum(table.anomalies.values()) == 0
