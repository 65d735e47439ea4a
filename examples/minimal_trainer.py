"""A minimal asyncio agentic-RL rollout loop that reports its trajectories to Prorsa.

Run the sandbox, then this trainer against it:

    echo s3cret > token
    prorsa ingest --cluster examples/rolloutcluster.yaml --token-file token &  # 127.0.0.1:8787
    python examples/minimal_trainer.py --url http://127.0.0.1:8787 --namespace rl \\
        --name qwen3-coder --token-file token --duration 60

Each trajectory is a multi-turn agent: a sandbox starts, then turns of "model call ->
tool call" until the model stops, then a reward. The model and the tool are fakes with
realistic timing (a prompt that grows by each tool result, lognormal tool latencies, a
cold or prewarmed sandbox); pass ``--engine http://router:30000`` to send the model calls
to a real SGLang router through :class:`prorsa_sdk.ResumableGeneration` instead, so
requests aborted by a role switch resume with their partial output.

Rollout is asynchronous with replace-on-reward: ``--concurrency`` trajectories are live at
once and each finished one is replaced by a new sample (the cluster manifest's
``forecast.injection.policy: replaceOnReward``). The emitter tracks every trajectory it
reports (``track=True``), so when ``prorsa ingest`` (or the operator) restarts, the resync
snapshot is built automatically. ``--speed 10`` runs the fake clock ten times faster.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import math
import random
import time
from pathlib import Path

import httpx

from prorsa_sdk import AsyncEventEmitter, ResumableGeneration

TOOLS = {"bash": (1.5, 0.8), "read_file": (-2.5, 0.5), "run_tests": (2.5, 0.6)}  # lognormal μ, σ


class FakeModel:
    """Prefill ~20k tokens/s, decode ~60 tokens/s: the timing a trainer would observe."""

    def __init__(self, rng: random.Random, speed: float) -> None:
        self.rng = rng
        self.speed = speed

    async def prefill(self, prompt_tokens: int) -> None:
        """Until the first token (a streaming client sees this moment)."""
        await asyncio.sleep((0.05 + prompt_tokens / 20_000) / self.speed)

    async def decode(self, *, last_turn: bool) -> tuple[int, str]:
        output = max(1, int(self.rng.lognormvariate(5.0, 0.6)))
        await asyncio.sleep(output / 60 / self.speed)
        return output, "stop" if last_turn else "tool"


class RouterModel:
    """A real SGLang router behind ResumableGeneration (token ids are synthetic here)."""

    def __init__(self, http: httpx.AsyncClient, rng: random.Random, emitter: AsyncEventEmitter):
        self.gen = ResumableGeneration(http, emitter=emitter)
        self.rng = rng

    async def generate(
        self, prompt_tokens: int, *, last_turn: bool, trajectory: str, turn: int
    ) -> tuple[int, str]:
        ids = [self.rng.randrange(1000, 30000) for _ in range(prompt_tokens)]
        out = await self.gen.generate(
            {"input_ids": ids, "sampling_params": {"max_new_tokens": 256, "temperature": 1.0}},
            trajectory=trajectory,
            turn=turn,
        )
        meta = out["meta_info"]
        finish = "stop" if last_turn else "tool"
        if meta["finish_reason"]["type"] == "length":
            finish = "length"
        return int(meta["completion_tokens"]), finish


async def trajectory(
    em: AsyncEventEmitter,
    model: FakeModel | RouterModel,
    rng: random.Random,
    *,
    tid: str,
    group: str,
    speed: float,
) -> bool:
    em.sample_dispatched(tid, group=group, task="swe", prompt_tokens=1500)
    mode = "prewarm" if rng.random() < 0.7 else "cold"
    em.sandbox_started(tid, mode=mode, image="python:3.12")
    startup = rng.uniform(0.5, 1.5) if mode == "prewarm" else rng.uniform(8.0, 20.0)
    await asyncio.sleep(startup / speed)

    context = 1500
    turns = rng.randint(2, 8)
    for turn in range(turns):
        last = turn == turns - 1
        em.request_queued(tid, prompt_tokens=context, turn=turn)
        # Only what the client observes: it never sees a prefill start (the engine queues
        # it) and, behind the router, not which engine prefilled.
        if isinstance(model, RouterModel):
            # Blocking call: the end of the prefill is not seen either, so no prefill event;
            # the Controller learns it from the prefill engines' /v1/state.
            output, finish = await model.generate(
                context, last_turn=last, trajectory=tid, turn=turn
            )
        else:
            await model.prefill(context)
            em.prefill_finished(tid)  # the first token streamed back: prefill (+ transfer) over
            output, finish = await model.decode(last_turn=last)
        em.decode_finished(tid, output_tokens=output, finish=finish)
        context += output
        if finish != "tool":
            break
        tool = rng.choice(list(TOOLS))
        em.tool_started(tid, tool=tool)
        mu, sigma = TOOLS[tool]
        await asyncio.sleep(rng.lognormvariate(mu, sigma) / speed)
        result = int(rng.lognormvariate(6.0, 0.8))
        em.tool_finished(tid, result_tokens=result)
        context += result

    em.reward_started(tid)
    await asyncio.sleep(rng.uniform(2.0, 6.0) / speed)  # the test suite runs
    accepted = rng.random() < 0.6
    em.reward_finished(tid, accepted=accepted)
    return accepted


async def main(args: argparse.Namespace) -> int:
    token = Path(args.token_file).read_text().strip()
    rng = random.Random(args.seed)
    ids = itertools.count()
    async with AsyncEventEmitter(
        url=args.url, namespace=args.namespace, name=args.name, token=token, track=True
    ) as em:
        engine = httpx.AsyncClient(base_url=args.engine, timeout=600) if args.engine else None
        model: FakeModel | RouterModel = (
            RouterModel(engine, rng, em) if engine else FakeModel(rng, args.speed)
        )
        deadline = time.monotonic() + args.duration
        finished = accepted = 0

        async def worker() -> None:
            nonlocal finished, accepted
            while time.monotonic() < deadline:  # replace-on-reward
                n = next(ids)
                group = f"g{n // args.group_size}"
                tid = f"traj-{n}"
                ok = await trajectory(em, model, rng, tid=tid, group=group, speed=args.speed)
                finished += 1
                accepted += ok

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        if engine is not None:
            await engine.aclose()
        await em.flush()
        stats = em.stats
    print(
        f"minimal_trainer: {finished} trajectories ({accepted} accepted); "
        f"{stats.emitted} events emitted, {stats.sent} delivered, {stats.dropped} dropped, "
        f"{stats.resyncs} resync(s)"
    )
    async with httpx.AsyncClient(base_url=args.url) as http:
        r = await http.get(
            f"/v1/namespaces/{args.namespace}/rolloutclusters/{args.name}/forecast",
            headers={"Authorization": f"Bearer {token}"},
        )
        if r.status_code == 200:
            d = r.json()
            print(
                f"latest decision: {d['mode']} {d['target']['prefill']}P:"
                f"{d['target']['decode']}D, prefill demand {d['forecast']['prefillTokens']} tokens"
            )
    return 0 if stats.dropped == 0 else 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8787", help="prorsa ingest / webhook URL")
    p.add_argument("--namespace", default="rl")
    p.add_argument("--name", default="qwen3-coder", help="RolloutCluster name")
    p.add_argument("--token-file", required=True)
    p.add_argument("--engine", default=None, help="SGLang router URL (default: a fake model)")
    p.add_argument("--concurrency", type=int, default=32, help="live trajectories at once")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of rollout")
    p.add_argument("--speed", type=float, default=1.0, help="fake-time speed-up factor")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not (args.speed > 0 and math.isfinite(args.speed)):
        p.error("--speed must be > 0")
    return args


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    raise SystemExit(asyncio.run(main(parse_args())))
