"""What the real-engine test modules share: starting engines together, smg in PD mode
driven through its worker API, the measured timings, the model's reference output.

An engine takes 1.5-2.5 minutes to start and about 3.5 GB on a loaded 2-core machine, so
the engines are module-scoped (started together, shared by the module's tests, stopped with
their whole process group at the module's end, whatever failed) and no module runs more
than three.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx
import pytest

from prorsa_lab.sglang_cpu.environment import (
    MODEL_SCRIPT,
    CpuEngineEnv,
)
from prorsa_lab.sglang_cpu.sglang_pod import SglangPod, free_port

ROOT = Path(__file__).resolve().parents[2]
MAX_ENGINES = 3


@contextlib.asynccontextmanager
async def running(pods: Sequence[SglangPod]) -> AsyncIterator[Sequence[SglangPod]]:
    """Start the pods together, wait until every engine serves, stop them all at the end
    (also when starting failed or the test raised)."""
    if len(pods) > MAX_ENGINES:
        raise ValueError(f"at most {MAX_ENGINES} engines at once on this machine")
    try:
        for pod in pods:
            await pod.start()
        await asyncio.gather(*(pod.wait_ready() for pod in pods))
        yield pods
    finally:
        await asyncio.gather(*(pod.stop() for pod in pods), return_exceptions=True)


class PdRouter:
    """The real smg in PD mode with its workers set through its worker API (``POST
    /workers``, ``DELETE /workers/{id}``), as the operator's relabels set them through
    Kubernetes discovery: a test takes an engine out of the router before flipping it
    and puts it back in its new role."""

    def __init__(self, *, log_dir: Path) -> None:
        from prorsa_lab.doubles.smg_router import SmgRouter, smg_binary

        binary = smg_binary()
        if binary is None:
            pytest.skip("smg is not installed (pip install smg==1.13.0)")
        port = free_port()
        self.smg = SmgRouter(
            binary=binary,
            args=[
                *("launch", "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port)),
                *("--prometheus-port", str(free_port()), "--request-timeout-secs", "600"),
            ],
            kubeconfig=str(log_dir / "no-kubeconfig"),
            port=port,
            log_path=log_dir / "smg.log",
        )
        self.ids: dict[str, str] = {}

    @property
    def url(self) -> str:
        return self.smg.url

    async def start(self) -> PdRouter:
        self.smg.start()
        async with httpx.AsyncClient(trust_env=False) as client:
            for _ in range(300):
                if await self.smg.workers(client) is not None:
                    return self
                await asyncio.sleep(0.1)
        raise RuntimeError("smg did not answer /workers")

    def stop(self) -> None:
        self.smg.stop()

    async def add(self, pod: SglangPod, role: str) -> None:
        body: dict[str, object] = {"url": pod.engine_url, "worker_type": role}
        if role == "prefill":
            body["bootstrap_port"] = pod.bootstrap_port
        async with httpx.AsyncClient(trust_env=False) as client:
            reply = await client.post(f"{self.url}/workers", json=body, timeout=10)
            reply.raise_for_status()
            self.ids[pod.engine_url] = reply.json()["worker_id"]
        await self.smg.wait_workers(
            lambda ws: any(
                w.get("url") == pod.engine_url
                and w.get("worker_type") == role
                and w.get("is_healthy")
                for w in ws
            ),
            what=f"{pod.instance} registered as {role}",
        )

    async def remove(self, pod: SglangPod) -> None:
        worker = self.ids.pop(pod.engine_url, None)
        if worker is None:
            return
        async with httpx.AsyncClient(trust_env=False) as client:
            reply = await client.delete(f"{self.url}/workers/{worker}", timeout=10)
            reply.raise_for_status()
        await self.smg.wait_workers(
            lambda ws: all(w.get("url") != pod.engine_url for w in ws),
            what=f"{pod.instance} gone from smg",
        )


class Timings:
    """Measured seconds by name, written with ``PRORSA_ENGINE_TIMINGS=<file>`` (a JSON file
    shared by the modules, one section each) for docs/sglang-role-switch.md."""

    def __init__(self, section: str) -> None:
        self.section = section
        self.values: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.values.setdefault(name, []).append(round(seconds, 3))
        print(f"timing {self.section}.{name}: {seconds:.3f} s")

    def write(self) -> None:
        out = os.environ.get("PRORSA_ENGINE_TIMINGS")
        if not out or not self.values:
            return
        path = Path(out)
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps(old | {self.section: self.values}, indent=2) + "\n")


_REFERENCE: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


async def reference_output(env: CpuEngineEnv, ids: list[int], n: int) -> list[int]:
    """The tiny model's greedy continuation of ``ids`` by a plain forward pass (no SGLang,
    no KV cache; ``tiny_model.py --reference``): what a PD answer must equal when the decode
    engine continued from the KV the prefill engine sent. Computed once per session, in a
    thread: the subprocess imports torch (a minute on busy cores), and the operator, the
    kubelet and the agents run on the test's event loop meanwhile."""
    key = (str(env.model), tuple(ids), n)
    if key not in _REFERENCE:
        query = json.dumps({"input_ids": ids, "max_new_tokens": n})
        out = await asyncio.to_thread(
            subprocess.run,
            [str(env.python), str(ROOT / MODEL_SCRIPT), str(env.model), "--reference", query],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        _REFERENCE[key] = list(json.loads(out.stdout))
    return _REFERENCE[key]
