"""The verl example against the real verl package (``pip install -e '.[verl]'``).

One agent loop runs with verl 0.9.1's own classes: ``ToolAgentLoop`` (through the
example's ``ProrsaToolAgentLoop``), its ``LLMServerClient``, its continuous-token builder,
its hermes tool parser, a ``FunctionTool`` and ``default_compute_score``. The model is a
fake SGLang ``/generate`` server on loopback; the tokenizer is a byte-level BPE built here
(no hub download). verl reaches its servers through Ray actor handles; the handles here
answer ``.remote(...)`` the way Ray's do (an awaitable), and the server handle posts to the
HTTP server as verl's SGLang server actor does. The events go to the real webhook.

Skipped where verl is not installed (it pulls torch and Ray: several GB), unless
``PRORSA_REQUIRE_TRAINERS=1`` (CI, ``make test-trainers``), where that is a failure.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("PRORSA_REQUIRE_TRAINERS") == "1":
    import verl  # noqa: F401  (CI, `make test-trainers`: a missing verl fails here)
else:
    pytest.importorskip(
        "verl", reason="verl is not installed (optional extra: pip install -e '.[verl]')"
    )

import httpx
from aiohttp import web
from byte_tokenizer import byte_tokenizer
from conftest import make_spec
from omegaconf import OmegaConf
from test_ingest_server import TOKEN, serve
from transformers import PreTrainedTokenizerFast
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
from verl.tools.function_tool import function_tool, get_function_tool
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from prorsa.core.controller import Controller
from prorsa_contract.events import Event

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verl_agent_loop.py"
TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>'
ANSWER = "2 + 3 = 5.\n#### 5<|im_end|>"


@asynccontextmanager
async def fake_sglang(tok: PreTrainedTokenizerFast) -> AsyncIterator[tuple[str, list[dict]]]:
    """SGLang's native ``/generate`` on loopback: a tool call first, then the answer."""
    seen: list[dict] = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        prompt = tok.decode(body["input_ids"])
        text = ANSWER if "<|im_start|>tool" in prompt else TOOL_CALL
        ids = tok.encode(text, add_special_tokens=False)
        return web.json_response(
            {
                "text": text,
                "output_ids": ids,
                "meta_info": {
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": len(ids),
                    "finish_reason": {"type": "stop"},
                },
            }
        )

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


class _Remote:
    """A Ray actor method as verl awaits it: ``await method.remote(...)``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        result = self._fn(*args, **kwargs)
        if asyncio.iscoroutine(result):
            return result
        future = asyncio.get_running_loop().create_future()
        future.set_result(result)
        return future


class SGLangServerHandle:
    """verl's SGLang server actor, reduced to its generate: token ids in, TokenOutput out."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.generate = _Remote(self._generate)

    async def _generate(
        self, *, request_id: str, prompt_ids: list[int], sampling_params: dict, **_: Any
    ) -> TokenOutput:
        params = {k: v for k, v in sampling_params.items() if k != "logprobs"}
        async with httpx.AsyncClient(timeout=10) as client:
            reply = await client.post(
                f"{self.url}/generate",
                json={"rid": request_id, "input_ids": prompt_ids, "sampling_params": params},
            )
        reply.raise_for_status()
        out = reply.json()
        return TokenOutput(token_ids=out["output_ids"], stop_reason="completed")


class LoadBalancerHandle:
    """verl's global load balancer actor with one server."""

    def __init__(self, server: SGLangServerHandle) -> None:
        self.require_acquire_fields = _Remote(lambda: [])
        self.require_release_fields = _Remote(lambda: [])
        self.acquire_server = _Remote(lambda **_: ("server-0", server))
        self.release_server = _Remote(lambda **_: None)


class RecordingController(Controller):
    """The webhook's Controller, keeping every event it was given."""

    def __init__(self) -> None:
        super().__init__(make_spec())
        self.seen: list[Event] = []

    def observe(self, events: Any) -> Any:
        batch = list(events)
        self.seen.extend(batch)
        return super().observe(batch)


def trainer_config() -> Any:
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "name": "sglang",
                    "prompt_length": 1024,
                    "response_length": 512,
                    "full_determinism": False,
                    "multi_turn": {
                        "max_user_turns": 4,
                        "max_assistant_turns": 4,
                        "max_parallel_calls": 1,
                        "max_tool_response_length": 256,
                        "tool_response_truncate_side": "middle",
                        "format": "hermes",
                    },
                }
            }
        }
    )


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("verl_agent_loop_real", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b)


async def test_one_verl_agent_loop_reports_what_it_observes_to_the_webhook(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    tok = byte_tokenizer()
    controller = RecordingController()
    async with serve(controller=controller) as srv, fake_sglang(tok) as (model_url, seen):
        for key, value in {
            "PRORSA_URL": srv.url,
            "PRORSA_NAMESPACE": "rl",
            "PRORSA_CLUSTER": "c",
            "PRORSA_TOKEN_FILE": str(token),
        }.items():
            monkeypatch.setenv(key, value)
        example = load_example()
        config = trainer_config()
        client = LLMServerClient(
            config, load_balancer_handle=LoadBalancerHandle(SGLangServerHandle(model_url))
        )
        function_tool("add")(add)  # verl's registry: the same function again is allowed
        loop = example.ProrsaToolAgentLoop(
            trainer_config=DictConfigWrap(config),
            server_manager=client,
            tokenizer=tok,
            processor=None,
            dataset_cls=None,
            data_config=DictConfigWrap(OmegaConf.create({})),
            tools=ToolListWrap([get_function_tool("add")]),
        )
        output = await loop.run(
            {"temperature": 1.0, "top_p": 1.0},
            raw_prompt=[{"role": "user", "content": "What is 2 + 3?"}],
            uid="group-7",
            data_source="openai/gsm8k",
            reward_model={"ground_truth": "5"},
        )
        emitter = example.prorsa_emitter()
        assert await emitter.flush()
        stats = await emitter.aclose()

    assert len(seen) == 2  # the tool call, then the answer after the tool's result
    assert output.reward_score == 1.0  # verl's gsm8k scorer read "#### 5"
    assert (stats.sent, stats.dropped) == (stats.emitted, 0)

    events = [e for e in controller.seen if getattr(e, "trajectory", None)]
    kinds = [e.type for e in events]
    assert kinds == [
        "sample_dispatched",
        "request_queued",
        "decode_finished",
        "tool_started",
        "tool_finished",
        "request_queued",
        "decode_finished",
        "reward_started",
        "reward_finished",
    ]
    # Only what a blocking client behind a router sees: no prefill event at all.
    dispatched, q0, d0, t0, t1, q1, d1, _r0, r1 = events
    assert (dispatched.group, dispatched.task) == ("group-7", "openai/gsm8k")
    assert len({e.trajectory for e in events}) == 1
    assert (q0.turn, q1.turn) == (0, 1)
    assert q0.prompt_tokens == len(seen[0]["input_ids"])
    assert q1.prompt_tokens == len(seen[1]["input_ids"])
    assert d0.finish == "tool" and d1.finish == "stop"
    assert d0.output_tokens == len(tok.encode(TOOL_CALL, add_special_tokens=False))
    assert t0.tool == "add"
    # The tool result grew the context by the tokens verl appended for it.
    assert q1.prompt_tokens == q0.prompt_tokens + d0.output_tokens + t1.result_tokens
    assert r1.accepted is True
    assert [e.ts for e in events] == sorted(e.ts for e in events)

    table = controller.table
    assert len(table) == 0  # the trajectory finished and left the table
    assert sum(table.anomalies.values()) == 0
    assert table.prefill_blind  # the Controller knows this trainer does not see prefills
