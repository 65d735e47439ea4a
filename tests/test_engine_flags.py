"""Engine flags at admission (``prorsa.core.engine_flags``) and the launch role of every
engine pod the operator renders.

SGLang's own verdict on each combination is in ``tests/real_engine/test_sglang_validation.py``
(``make test-engine``); these run in ``make test``.
"""

from __future__ import annotations

import pytest
from conftest import make_spec

from prorsa.core.engine_flags import OPERATOR_ENV, flag_values
from prorsa.core.spec import SpecError
from prorsa.k8s.groups import group_pods
from prorsa_agent.config import args_from_env, engine_argv


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--ep-size", "8"], "--ep-size 8: SGLang 0.5.23 refuses"),
        (["--expert-parallel-size=16"], "expert parallelism"),
        (["--pp-size=2"], "--pp-size=2: SGLang 0.5.23 refuses"),
        (["--pipeline-parallel-size", "4"], "pipeline parallelism"),
        (["--speculative-algorithm", "EAGLE3"], "speculative decoding"),
        (["--moe-a2a-backend", "deepep"], "--moe-a2a-backend deepep: "),
        (["--moe-a2a-backend=non"], "MoE all-to-all"),
        (["--dcp-size", "2"], "decode context parallelism"),
        (
            [
                "--enable-dp-attention",
                "--dp-size",
                "4",
                "--enable-dp-attention-local-control-broadcast",
            ],
            "local control broadcast",
        ),
        (["--attn-dp-size", "4", "--dwdp-size", "4"], "local control broadcast"),
        (["--attn-dp-size", "4", "--dp-size", "2"], "--dp-size above 1 next to --attn-dp-size"),
        (["--disaggregation-decode-host-receive-threshold", "0.5"], "other than 1"),
        (["--disaggregation-mode", "prefill"], "--disaggregation-mode is not allowed"),
        (["--admin-api-key", "k"], "--admin-api-key is not allowed"),
        (["--api-key", "k"], "--api-key is not allowed"),
        (["--port", "31000"], "--port is not allowed"),
        (["--tp-size", "4"], "--tp-size is not allowed: set engine.tensorParallelSize"),
        (["--tensor-parallel-size=4"], "set engine.tensorParallelSize"),
        (["--model-path", "/m"], "set model.path"),
        (["--nnodes", "2"], "set engine.nodesPerInstance"),
        (["--disaggregation-transfer-backend", "nixl"], "engine.transferBackend"),
    ],
)
def test_admission_refuses_engine_flags_naming_the_field(args: list[str], named: str) -> None:
    with pytest.raises(SpecError) as exc:
        make_spec(engine={"extraArgs": args})
    message = str(exc.value)
    assert message.startswith("spec.engine.extraArgs: "), message
    assert named in message
    assert [p.field for p in exc.value.problems] == ["spec.engine.extraArgs"]


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--chunked-prefill-size", "4096", "--kv-cache-dtype", "fp8_e4m3"],
        ["--enable-dp-attention", "--dp-size", "8"],
        ["--attn-dp-size", "8", "--chunked-prefill-size", "16384"],
        ["--ep-size", "1", "--moe-a2a-backend", "none", "--pp-size", "1"],
        ["--ep=1", "--moe-a2a-backend=none", "--disaggregation-decode-host-receive-threshold=1"],
        ["--enable-dp-attention-local-control-broadcast"],  # without attention DP: no effect
        ["--disable-radix-cache"],
        ["--served-model-name-suffix", "x"],  # not --served-model-name: names are whole
    ],
)
def test_admission_accepts_what_sglang_runs(args: list[str]) -> None:
    assert make_spec(engine={"extraArgs": args}).engine.extra_args == args


def test_engine_env_cannot_override_what_the_operator_sets() -> None:
    """``engine.env`` follows the operator's variables in the container, and the last of
    two wins: a PRORSA_EXTRA_ARGS there would carry ``--disaggregation-mode prefill`` past
    the flag checks."""
    smuggled = [{"name": "PRORSA_EXTRA_ARGS", "value": '["--disaggregation-mode", "prefill"]'}]
    with pytest.raises(SpecError, match=r"spec\.engine\.env: PRORSA_EXTRA_ARGS is set by the"):
        make_spec(engine={"env": smuggled})
    with pytest.raises(SpecError, match="extraArgs: --hicache-storage-backend is refused"):
        make_spec(engine={"extraArgs": ["--hicache-storage-backend", "file"]})
    rust = [{"name": "SGLANG_RUST_SERVER", "value": "True"}]
    with pytest.raises(SpecError, match=r"spec\.engine\.env: --attn-dp-size 2: SGLANG_RUST_SERVER"):
        make_spec(engine={"extraArgs": ["--attn-dp-size", "2"], "env": rust})
    assert make_spec(engine={"env": rust}).engine.env == rust  # no attention DP: no effect
    ok = make_spec(
        engine={
            "extraArgs": ["--hicache-storage-backend", "file"],
            "env": [
                {"name": "PRORSA_ALLOW_HICACHE_STORAGE", "value": "1"},
                {"name": "PRORSA_DISABLE_HICACHE", "value": "1"},
                {"name": "NCCL_IB_HCA", "value": "mlx5"},
            ],
        }
    )
    assert len(ok.engine.env) == 3


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_engine_pod_launches_as_decode(nodes: int, role: str) -> None:
    """Whatever the role label a pod is created (or recreated) with, its agent launches
    SGLang as decode: an engine launched as prefill and flipped to decode is a state the
    operator never makes (docs/sglang-role-switch.md, section 6). The variables it sets are
    the ones admission keeps out of engine.env."""
    spec = make_spec(
        gpuBudget=32,
        engine={
            "gpusPerInstance": 16,
            "tensorParallelSize": 16,
            "nodesPerInstance": nodes,
            "extraArgs": ["--chunked-prefill-size", "4096"],
            "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}],
        },
    )
    pods = group_pods(cluster="c", namespace="rl", index=0, role=role, spec=spec)
    assert len(pods) == nodes
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        names = {e["name"] for e in container["env"]}
        assert names - {"NCCL_IB_HCA"} <= OPERATOR_ENV, names - OPERATOR_ENV
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        argv = engine_argv(
            command=[],
            engine_url=f"http://127.0.0.1:{env['PRORSA_ENGINE_PORT']}",
            env_args=args_from_env(env),
            admin_api_key="k",
        )
        assert flag_values(argv, "--disaggregation-mode") == ["decode"]
