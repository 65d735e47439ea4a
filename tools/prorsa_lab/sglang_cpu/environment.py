"""Where the real engine lives on this machine and how a CPU engine is launched.

The engine environment is apart from the project's (sglang pins its own torch, transformers
and pydantic): ``scripts/engine-env.sh`` builds ``.venv-engine`` and the tiny model, and the
CPU stand-ins stay in the test tree (``tests/real_engine/cpu``), never in an image.
:meth:`CpuEngineEnv.find` locates all three or says what is missing, so that a test skips
with the reason and the demo exits with it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SGLANG_VERSION = "0.5.23"
ENGINE_VENV = ".venv-engine"
STANDINS = Path("tests/real_engine/cpu")
MODEL_DIR = Path(".cache/real-engine/tiny-llama")
MODEL_SCRIPT = Path("tests/real_engine/tiny_model.py")
SETUP = "scripts/engine-env.sh"
# Another checkout's ``.venv-engine`` and tiny model (about 11 GB, built once): a git
# worktree uses its main checkout's instead of building its own; the CPU stand-ins still
# come from this checkout.
ROOT_VARIABLE = "PRORSA_ENGINE_ROOT"

CPU_ENV: Mapping[str, str] = {
    # SGLang's CPU engine is off without it (srt/platforms/__init__.py).
    "SGLANG_USE_CPU_ENGINE": "1",
    # mooncake defaults to RDMA; TCP works on loopback.
    "MOONCAKE_PROTOCOL": "tcp",
    # With it on, a prefix-cache hit on an engine flipped to prefill asks for a CUDA stream
    # (srt/disaggregation/prefill.py, the early send of a cached prefix).
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
    # One thread per engine: two or three engines share two cores.
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
"""Environment of every CPU engine process (docs/testing.md, "The real engine on a CPU")."""

CPU_FLAGS: tuple[str, ...] = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--tp-size", "1",
    "--max-total-tokens", "16384",
    "--disaggregation-transfer-backend", "mooncake",
)  # fmt: skip
"""SGLang flags of a CPU engine, beside those the agent adds to every engine."""

DECODE_GRAPH_MEMORY_GB = 0.0
"""What the agent sends as ``decode_cuda_graph_memory_gb`` on a flip to decode: an engine
without CUDA graphs has none captured, and SGLang asks for the value then."""


class EngineEnvMissing(RuntimeError):
    """The engine environment is not built; the message says what to run."""


@dataclass(frozen=True, kw_only=True)
class CpuEngineEnv:
    root: Path
    """The repository checkout."""
    python: Path
    standins: Path
    model: Path

    @classmethod
    def find(cls, root: Path | None = None) -> CpuEngineEnv:
        """The engine environment of the checkout at ``root`` (default: the current
        directory, then this file's checkout); raises :class:`EngineEnvMissing`."""
        candidates = [root] if root is not None else [Path.cwd(), _checkout()]
        problems: list[str] = []
        for base in candidates:
            if base is None:
                continue
            base = base.resolve()
            built = Path(os.environ.get(ROOT_VARIABLE) or base).resolve()
            python = built / ENGINE_VENV / "bin" / "python"
            stamp = built / ENGINE_VENV / ".complete"
            model = built / MODEL_DIR
            standins = base / STANDINS
            missing = [
                what
                for what, ok in (
                    (f"{ENGINE_VENV} (complete)", python.exists() and stamp.exists()),
                    (f"the tiny model in {MODEL_DIR}", (model / "config.json").exists()),
                    (f"the CPU stand-ins in {STANDINS}", (standins / "sitecustomize.py").exists()),
                )
                if not ok
            ]
            if not missing:
                return cls(root=base, python=python, standins=standins, model=model)
            problems.append(f"{base}: no {', '.join(missing)}")
        raise EngineEnvMissing(
            f"the real-engine environment is not built ({'; '.join(problems)}): "
            f"run `{SETUP}` or `make engine-env`"
        )

    def process_env(self, *, host_ip: str) -> dict[str, str]:
        """Variables every process of one engine gets (on top of the caller's).

        ``SGLANG_HOST_IP`` pins the address SGLang and mooncake advertise to the engine's
        own loopback address: without it SGLang picks the first network interface's.
        ``PRORSA_TEST_DIE_WITH_PARENT`` has the stand-ins' ``sitecustomize`` tie the engine
        to the process that started it, so a test killed outright leaves no engine behind.
        """
        path = os.environ.get("PYTHONPATH", "")
        return {
            **CPU_ENV,
            "SGLANG_HOST_IP": host_ip,
            "PYTHONPATH": f"{self.standins}{os.pathsep}{path}" if path else str(self.standins),
            "PRORSA_TEST_DIE_WITH_PARENT": "1",
        }

    def command(self, *, host_ip: str) -> list[str]:
        """``env K=V ... python -m sglang.launch_server``: the engine command the agent runs,
        with the environment a pod's container spec would set."""
        assignments = [f"{k}={v}" for k, v in self.process_env(host_ip=host_ip).items()]
        return ["env", *assignments, str(self.python), "-m", "sglang.launch_server"]

    def flags(
        self,
        *,
        host: str,
        bootstrap_port: int,
        engine_info_port: int,
        served_model_name: str | None = None,
        extra: Sequence[str] = (),
    ) -> list[str]:
        """A CPU engine's SGLang flags; the agent adds the role, switch, metrics, cache,
        port and admin-key flags (``prorsa_agent.config.engine_argv``)."""
        flags = [
            "--model-path", str(self.model),
            "--host", host,
            "--disaggregation-bootstrap-port", str(bootstrap_port),
            "--engine-info-bootstrap-port", str(engine_info_port),
            *CPU_FLAGS,
        ]  # fmt: skip
        if served_model_name:
            flags += ["--served-model-name", served_model_name]
        return [*flags, *extra]


def _checkout() -> Path | None:
    """The checkout this module was installed from (``pip install -e .``), if any."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").exists() and (parent / STANDINS).exists():
            return parent
    return None
