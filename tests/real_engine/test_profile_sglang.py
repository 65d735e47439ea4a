"""`prorsa profile` against the real SGLang 0.5.23 on this CPU.

The engine is launched as a user launches one to profile it: the engine pods' flags (the
CPU ones here) and the model, without ``--disaggregation-mode``, since an engine in a PD
role serves ``/generate`` only behind a router and the profile refuses it. A real engine
has no ground truth to compare with, so this runs the checks of ``tests/test_profile.py``
that hold for any engine (a snippet the CRD accepts, progress for every measurement, a
knee among the batches it measured); the engine double, whose timing model is the truth,
runs all of them in ``make test``. On top: the KV pool in the snippet is the one this
engine was launched with, and the figures are a CPU engine's, not a GPU's.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_profile import Target, check_profile

from prorsa.core.capacity_profile import GROWTH_RESERVE_TOKENS
from prorsa_lab.sglang_cpu.environment import CpuEngineEnv
from prorsa_lab.sglang_cpu.sglang_pod import START_TIMEOUT, free_port

pytestmark = pytest.mark.real_engine

HOST = "127.0.0.1"
KV_POOL = 16_384  # --max-total-tokens of every CPU engine (CPU_FLAGS)
# The tiny model's context is 4,096 tokens: prompts up to 2,048 and decode contexts of 256
# keep each measurement to seconds on one core; a 1 s window per decode batch.
ARGS = ("--max-prompt-tokens", "2048", "--decode-context", "256", "--window", "1")


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def plain_engine(
    engine_env: CpuEngineEnv, engines_stopped: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One real engine without a PD role, up and idle (after the shared cluster stopped)."""
    port = free_port(HOST)
    flags = engine_env.flags(
        host=HOST, bootstrap_port=free_port(HOST), engine_info_port=free_port(HOST)
    )
    argv = [*engine_env.command(host_ip=HOST), *flags, "--port", str(port)]
    log = tmp_path_factory.mktemp("profile") / "engine.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        with httpx.Client(base_url=url, timeout=10.0, trust_env=False) as client:
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"the engine exited with {proc.returncode}:\n{_tail(log)}")
                if time.monotonic() > deadline:
                    pytest.fail(f"the engine was not up after {START_TIMEOUT:.0f}s:\n{_tail(log)}")
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def test_profile_measures_the_real_engine(plain_engine: str) -> None:
    spec, progress = check_profile(Target(url=plain_engine, truth=None, args=ARGS))
    print(progress)  # the figures, for docs/crd-reference.md (with -s)
    knee = spec.decode_concurrency
    assert knee is not None and spec.decode_kv_tokens is not None
    # The pool the engine reports (its --max-total-tokens, give or take a page), less the
    # growth reserve of the knee's requests.
    pool = spec.decode_kv_tokens + knee * GROWTH_RESERVE_TOKENS
    assert 0.9 * KV_POOL <= pool <= KV_POOL, (pool, spec)
    # A tiny model on one CPU core: thousands of prefill tokens a second, not a GPU's
    # hundreds of thousands (the figures are measured, not defaults).
    assert spec.prefill_tokens_per_second is not None
    assert 100 < spec.prefill_tokens_per_second < 200_000, spec
