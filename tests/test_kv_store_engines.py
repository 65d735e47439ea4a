"""The shared KV store (``spec.kvStore``) as engines show it: the same assertions on the
engine double and on the real SGLang 0.5.23 (the real one needs CUDA: ``gpu``, skipped here).

Three engines share one store directory: ``writer`` and ``reader`` serve whole requests,
``flipper`` is launched as decode with role switching, as every Prorsa engine is. In order:

1. after a weight update the same context misses (the stale-page case, first);
2. a flip keeps the other engines' entries (counted before and after);
3. a generation cancelled mid-way resumes on another engine from the store: the engine's
   own ``cached_tokens`` shows it recomputed at most the last page, and the output is token
   for token the uninterrupted one.

The real engines get the flags the agent renders for ``kvStore`` (``prorsa_agent.kv_store``)
and the backend the engine image ships (``prorsa_agent.kv_backend``); HiCache does not start
on this CPU (its host pool registers with CUDA: docs/kv-store.md, "What is proven where").
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from prorsa_agent.kv_store import KvStoreConfig
from prorsa_lab.doubles.sglang_double import EngineConfig, EngineDouble, TimingModel

PAGE = 16
# 18 whole pages and 12 tokens: longer than SGLang's prefetch threshold (256 tokens), below
# which a store hit is not fetched.
PROMPT = [(7 * i + 3) % 997 + 5 for i in range(300)]
NEW_TOKENS = 96
CUT_AFTER = 24
V1, V2 = "weights-v1", "weights-v2"  # prorsa_sdk.weight_version_key(1), (2)
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Engines:
    writer: str
    reader: str
    flipper: str
    store_dir: Path

    def entries(self) -> int:
        return sum(1 for p in self.store_dir.iterdir() if p.name.endswith(".bin"))


def _gpu_skip_reason() -> str | None:
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("torch") is None:
        return "SGLang 0.5.23 with CUDA is not installed (the engine image has it)"
    if importlib.metadata.version("sglang") != "0.5.23":
        return "this check is for SGLang 0.5.23"
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the engine at {url} exited ({proc.returncode})"
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            await asyncio.sleep(2.0)
    raise AssertionError(f"the engine at {url} did not start in {timeout:g}s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def _real_engines(store_dir: Path) -> AsyncIterator[Engines]:
    """Three SGLang 0.5.23 engines on one GPU with the store's flags (``PRORSA_GPU_MODEL``)."""
    model = os.environ.get("PRORSA_GPU_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    store = KvStoreConfig(backend="file", endpoint=str(store_dir), size_gib=4)
    common = [
        "--model-path", model, "--page-size", str(PAGE), "--mem-fraction-static", "0.25",
        # A host pool of 4 GB each: three engines sizing theirs against the whole host would
        # ask for more than it has.
        "--enable-hierarchical-cache", "--hicache-size", "4",
        "--hicache-write-policy", "write_through",
        "--hicache-storage-prefetch-policy", "wait_complete", "--enable-metrics",
    ]  # fmt: skip
    unified = [*common, *store.engine_flags()[:4]]  # no decode offload outside PD decode
    flipper = [
        *common, *store.engine_flags(), "--disaggregation-mode", "decode",
        "--enable-pd-role-switch", "--disaggregation-decode-enable-radix-cache",
        "--disaggregation-transfer-backend", "mooncake",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "engine_image"), "MOONCAKE_PROTOCOL": "tcp"}
    procs: list[subprocess.Popen[bytes]] = []
    urls = []
    try:
        for args in (unified, unified, flipper):
            port = free_port()
            cmd = [sys.executable, "-m", "sglang.launch_server", *args, "--port", str(port)]
            procs.append(subprocess.Popen(cmd, env=env))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            await _wait_healthy(
                url, proc, float(os.environ.get("PRORSA_GPU_STARTUP_TIMEOUT", "900"))
            )
        yield Engines(urls[0], urls[1], urls[2], store_dir)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextlib.asynccontextmanager
async def _doubles(store_dir: Path, *, clears_on_flip: bool = False) -> AsyncIterator[Engines]:
    timing = TimingModel(decode_step_seconds=0.005)
    common = {"kv_store_dir": str(store_dir), "kv_page_size": PAGE, "timing": timing}
    async with (
        EngineDouble(EngineConfig(role="null", **common)) as writer,  # type: ignore[arg-type]
        EngineDouble(EngineConfig(role="null", **common)) as reader,  # type: ignore[arg-type]
        EngineDouble(
            EngineConfig(role="decode", kv_store_clears_on_flip=clears_on_flip, **common)  # type: ignore[arg-type]
        ) as flipper,
    ):
        yield Engines(writer.url, reader.url, flipper.url, store_dir)


@pytest_asyncio.fixture(params=["double", pytest.param("sglang", marks=pytest.mark.gpu)])
async def engines(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Engines]:
    store_dir = tmp_path / "kv-store"
    store_dir.mkdir()
    if request.param == "sglang":
        reason = _gpu_skip_reason()
        if reason is not None:
            pytest.skip(reason)
        async with _real_engines(store_dir) as real:
            yield real
        return
    async with _doubles(store_dir) as doubles:
        yield doubles


def _body(
    ids: list[int], *, new: int, extra_key: str | None, rid: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }
    if extra_key is not None:
        body["extra_key"] = extra_key
    if rid is not None:
        body["rid"] = rid
    return body


async def _generate(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(f"{url}/generate", json=body)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


async def _cut(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Stream the request and abort it once it has ``CUT_AFTER`` tokens, as a switch's drain
    deadline does (``POST /abort_request``); returns its last (aborted) chunk."""
    last: dict[str, Any] = {}
    aborted = False
    async with client.stream("POST", f"{url}/generate", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            last = json.loads(line.removeprefix("data: "))
            if not aborted and len(last.get("output_ids", [])) >= CUT_AFTER:
                aborted = True
                await client.post(f"{url}/abort_request", json={"rid": body["rid"]})
    return last


async def _cached_total(client: httpx.AsyncClient, url: str) -> float:
    """``sglang:cached_tokens_total`` over every cache source (the engine's own count)."""
    text = (await client.get(f"{url}/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:cached_tokens_total{")
    )


async def _settled_entries(engines: Engines) -> int:
    """The store's entry count once writes stop (SGLang backs pages up in a background
    thread): the same count twice, a second apart."""
    before = -1
    for _ in range(60):
        now = engines.entries()
        if now == before:
            return now
        before = now
        await asyncio.sleep(1.0)
    return before


async def test_the_store_through_a_weight_update_a_flip_and_a_resume(engines: Engines) -> None:
    async with httpx.AsyncClient(timeout=600.0) as client:
        reference = await _generate(
            client, engines.writer, _body(PROMPT, new=NEW_TOKENS, extra_key="reference")
        )
        ref_ids = reference["output_ids"]
        assert len(ref_ids) == NEW_TOKENS

        cut = await _cut(
            client, engines.writer, _body(PROMPT, new=NEW_TOKENS, extra_key=V1, rid="r1")
        )
        assert cut["meta_info"]["finish_reason"]["type"] == "abort"
        partial = cut["output_ids"]
        assert CUT_AFTER <= len(partial) < NEW_TOKENS
        assert partial == ref_ids[: len(partial)]
        context = PROMPT + partial

        # 1. A weight update: the same context, the next version, finds nothing.
        stale = await _generate(client, engines.reader, _body(context, new=1, extra_key=V2))
        assert stale["meta_info"]["cached_tokens"] == 0

        # 2. A flip of another engine keeps every entry.
        before = await _settled_entries(engines)
        assert before >= len(context) // PAGE
        flip = await client.post(f"{engines.flipper}/pd_role_switch", json={"new_role": "prefill"})
        assert flip.status_code == 200 and flip.json()["success"], flip.text
        assert engines.entries() == before

        # 3. The resume on another engine, from the store.
        left = NEW_TOKENS - len(partial)
        counted = await _cached_total(client, engines.reader)
        resumed = await _generate(client, engines.reader, _body(context, new=left, extra_key=V1))
        meta = resumed["meta_info"]
        assert await _cached_total(client, engines.reader) - counted == meta["cached_tokens"]
        recomputed = meta["prompt_tokens"] - meta["cached_tokens"]
        assert meta["prompt_tokens"] == len(context)
        assert 0 < recomputed <= PAGE, meta
        assert partial + resumed["output_ids"] == ref_ids


async def test_a_store_a_flip_clears_loses_every_engines_pages(tmp_path: Path) -> None:
    """The double with SGLang's own clear-on-flip (``HiCacheFile.clear``): what the shipped
    backend prevents. The resume then recomputes its whole context."""
    async with _doubles(tmp_path, clears_on_flip=True) as engines, httpx.AsyncClient() as client:
        cut = await _cut(
            client, engines.writer, _body(PROMPT, new=NEW_TOKENS, extra_key=V1, rid="r1")
        )
        context = PROMPT + cut["output_ids"]
        assert engines.entries() >= len(context) // PAGE
        flip = await client.post(f"{engines.flipper}/pd_role_switch", json={"new_role": "prefill"})
        assert flip.json()["success"]
        assert engines.entries() == 0
        resumed = await _generate(client, engines.reader, _body(context, new=4, extra_key=V1))
        assert resumed["meta_info"]["cached_tokens"] == 0


async def test_a_store_hit_below_sglangs_prefetch_threshold_is_prefilled(tmp_path: Path) -> None:
    """SGLang fetches from the store only hits of 256 tokens or more (its default
    ``prefetch_threshold``): a short context is prefilled in full even when stored."""
    async with _doubles(tmp_path) as engines, httpx.AsyncClient() as client:
        short = PROMPT[:200]
        await _generate(client, engines.writer, _body(short, new=8, extra_key=V1))
        again = await _generate(client, engines.reader, _body(short, new=8, extra_key=V1))
        assert again["meta_info"]["cached_tokens"] == 0
        await _generate(client, engines.writer, _body(PROMPT, new=8, extra_key=V1))
        long = await _generate(client, engines.reader, _body(PROMPT, new=8, extra_key=V1))
        assert long["meta_info"]["cached_tokens"] == 288  # 18 whole pages of 299 tokens
