"""Every engine command line the product renders, checked by SGLang 0.5.23 itself.

For each RolloutCluster below, the operator renders its engine pods (``group_pods``: one
pod, or a leader and worker ranks), and each pod's agent assembles the SGLang command line
from the pod's environment exactly as ``prorsa-agent --launch`` does (``engine_argv``: the
admin key, ``--disaggregation-mode decode``, role switching, metrics, the decode radix
cache, HiCache). SGLang's own validation (``sglang_validate.py``: argparse, the resolution
hooks, the launch-time checks; no GPU needed) then judges every command line.

The rule held: a RolloutCluster SGLang refuses is refused by the operator's admission, with
a message naming the field; one admission accepts, SGLang accepts. Admission refuses a few
more (flags the operator sets itself), each listed with its reason and SGLang's verdict.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from prorsa.core.spec import RolloutClusterSpec, SpecError, parse_cluster
from prorsa.k8s.groups import group_pods
from prorsa_agent.config import (
    ALLOW_HICACHE_STORAGE_ENV,
    DISABLE_HICACHE_ENV,
    ConfigError,
    args_from_env,
    engine_argv,
)
from prorsa_agent.kv_store import KvStoreConfig
from prorsa_lab.sglang_cpu.environment import CpuEngineEnv

from .engine_helpers import ROOT

pytestmark = pytest.mark.real_engine

# A key that starts with "-", as one in 64 of the operator's do: SGLang's argparse must
# still read it as the admin key's value.
ADMIN_KEY = "-validation-admin-key"
EXAMPLES = ROOT / "examples"

MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 32,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
"""A Qwen3-MoE shape (config only: validation reads no weights) for DP attention + MoE TP."""


def _example(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    assert doc["kind"] == "RolloutCluster"
    return dict(doc)


def _with(manifest: dict[str, Any], **engine: Any) -> dict[str, Any]:
    out = copy.deepcopy(manifest)
    out["spec"]["engine"] |= engine
    return out


def _cases(dense: Path, moe: Path) -> dict[str, dict[str, Any]]:
    """The RolloutClusters the product offers (its examples and documented options)."""
    example = _example("rolloutcluster.yaml")
    example["spec"]["model"]["path"] = str(dense)
    multinode = _example("rolloutcluster-multinode.yaml")
    multinode["spec"]["model"]["path"] = str(moe)
    dp_moe = copy.deepcopy(example)
    dp_moe["spec"]["model"]["path"] = str(moe)
    dp_moe["spec"]["engine"]["extraArgs"] = ["--enable-dp-attention", "--dp-size", "8"]
    no_hicache = _with(example, env=[{"name": DISABLE_HICACHE_ENV, "value": "1"}])
    storage = _with(
        example,
        extraArgs=["--hicache-storage-backend", "file"],
        env=[{"name": ALLOW_HICACHE_STORAGE_ENV, "value": "1"}],
    )
    mooncake_store = copy.deepcopy(example)
    mooncake_store["spec"]["kvStore"] = {
        "backend": "mooncake",
        "endpoint": "mooncake-master.rl:50051",
        "sizeGiB": 64,
    }
    file_store = copy.deepcopy(example)
    file_store["spec"]["kvStore"] = {"backend": "file", "endpoint": "/mnt/kv", "sizeGiB": 8}
    refused = {f"refused: {' '.join(args)}": _with(dp_moe, extraArgs=args) for args in REFUSED}
    return {
        "example: TP8, fp8 KV cache, HiCache host tier, decode radix cache, admin key": example,
        "HiCache off (PRORSA_DISABLE_HICACHE=1)": no_hicache,
        "HiCache with a private storage backend (opted in)": storage,
        "mori transfer backend": _with(example, transferBackend="mori"),
        "DP attention with MoE TP (TP8, DP8)": dp_moe,
        "multi-node: two pods of 8 GPUs, TP16": multinode,
        "a shared KV store (kvStore: Mooncake)": mooncake_store,
        "a shared KV store (kvStore: a shared directory)": file_store,
        **refused,
    }


REFUSED: dict[tuple[str, ...], str] = {
    ("--ep-size", "8"): "--enable-pd-role-switch",
    ("--enable-dp-attention", "--dp-size", "8", "--ep-size", "8"): "--enable-pd-role-switch",
    ("--pp-size", "2"): "--enable-pd-role-switch",
    ("--moe-a2a-backend", "deepep"): "--enable-pd-role-switch",
    ("--speculative-algorithm", "EAGLE"): "--enable-pd-role-switch",
    ("--dcp-size", "2"): "--enable-pd-role-switch",
    (
        "--enable-dp-attention",
        "--dp-size",
        "8",
        "--enable-dp-attention-local-control-broadcast",
    ): "--enable-pd-role-switch",
    ("--attn-dp-size", "8", "--enable-dp-attention-local-control-broadcast"): "--enable-pd",
    ("--attn-dp-size", "8", "--dp-size", "2"): "data-parallel replicas combined with attention",
    ("--disaggregation-decode-host-receive-threshold", "0.5"): "role switching",
}
"""Engine flags SGLang refuses (each with words of SGLang's error), on the DP-attention MoE
deployment; admission must refuse every one, naming the field."""

OPERATOR_ONLY = {
    "operator only: --disaggregation-mode prefill": (
        ["--disaggregation-mode", "prefill"],
        "every engine launches as decode (docs/sglang-role-switch.md, 'Launched as prefill')",
    ),
    "operator only: --api-key": (
        ["--api-key", "k2"],
        "it closes /v1/loads and /server_info to the agent (which refuses it too)",
    ),
    "operator only: --tp-size": (
        ["--tp-size", "4"],
        "it would silently replace engine.tensorParallelSize (argparse keeps the last value)",
    ),
}
"""Accepted by SGLang, refused by admission: the operator sets these or forbids the state."""


def _argvs(spec: RolloutClusterSpec) -> list[list[str]]:
    """Each pod's SGLang arguments, as its agent assembles them from the pod's env."""
    out = []
    for pod in group_pods(cluster="c", namespace="rl", index=0, role="decode", spec=spec):
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e.get("value", "") for e in container["env"] if "value" in e}
        out.append(
            engine_argv(
                command=[],
                engine_url=f"http://127.0.0.1:{env['PRORSA_ENGINE_PORT']}",
                env_args=args_from_env(env),
                hicache=env.get(DISABLE_HICACHE_ENV) != "1",
                allow_hicache_storage=env.get(ALLOW_HICACHE_STORAGE_ENV) == "1",
                admin_api_key=ADMIN_KEY,
                kv_store=KvStoreConfig.from_env(env),
            )
        )
    return out


def _unchecked(manifest: dict[str, Any]) -> RolloutClusterSpec:
    """The spec as it would render without admission (to ask SGLang about it anyway)."""
    base = copy.deepcopy(manifest)
    extra = base["spec"]["engine"].pop("extraArgs", [])
    spec = parse_cluster(base).spec
    engine = spec.engine.model_copy(update={"extra_args": list(extra)})
    return spec.model_copy(update={"engine": engine})


def _sglang(env: CpuEngineEnv, cases: dict[str, list[list[str]]]) -> dict[str, str | None]:
    """SGLang's verdict per case: None (every pod's command line accepted) or the error."""
    query = [
        {"name": f"{name}#{i}", "argv": argv}
        for name, argvs in cases.items()
        for i, argv in enumerate(argvs)
    ]
    out = subprocess.run(
        [str(env.python), str(Path(__file__).with_name("sglang_validate.py"))],
        input=json.dumps(query),
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    verdicts: dict[str, str | None] = dict.fromkeys(cases)
    for line in out.stdout.splitlines():
        row = json.loads(line)
        name = row["name"].rsplit("#", 1)[0]
        if not row["ok"] and verdicts[name] is None:
            verdicts[name] = row["error"]
    return verdicts


@pytest.fixture(scope="module")
def verdicts(
    engine_env: CpuEngineEnv, engines_stopped: None, tmp_path_factory
) -> dict[str, tuple[str | None, str | None]]:
    """``{case: (admission error or None, SGLang error or None)}``."""
    moe = tmp_path_factory.mktemp("qwen3-moe-shape")
    (moe / "config.json").write_text(json.dumps(MOE_CONFIG))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (moe / name).write_bytes((engine_env.model / name).read_bytes())
    manifests = _cases(engine_env.model, moe)
    for name, (args, _why) in OPERATOR_ONLY.items():
        manifests[name] = _with(manifests[next(iter(manifests))], extraArgs=args)
    admission: dict[str, str | None] = {}
    argvs: dict[str, list[list[str]]] = {}
    for name, manifest in manifests.items():
        try:
            spec = parse_cluster(manifest).spec
            admission[name] = None
        except SpecError as exc:
            admission[name] = str(exc)
            spec = _unchecked(manifest)
        try:
            argvs[name] = _argvs(spec)
        except ConfigError as exc:
            # The agent refuses it too: ask SGLang about the flags appended as given.
            assert admission[name] is not None, f"{name}: admitted, but the agent refuses: {exc}"
            extra = spec.engine.extra_args
            bare = spec.model_copy(
                update={"engine": spec.engine.model_copy(update={"extra_args": []})}
            )
            argvs[name] = [[*argv, *extra] for argv in _argvs(bare)]
    sglang = _sglang(engine_env, argvs)
    for name in manifests:
        print(f"{name}\n  admission: {admission[name] or 'accepted'}")
        print(f"  SGLang: {sglang[name] or 'accepted'}")
    return {name: (admission[name], sglang[name]) for name in manifests}


def test_sglang_accepts_every_combination_admission_accepts(verdicts):
    accepted = {name: s for name, (a, s) in verdicts.items() if a is None}
    assert len(accepted) == 8
    assert accepted == dict.fromkeys(accepted), accepted


def test_admission_refuses_what_sglang_refuses_naming_the_field(verdicts):
    for args, words in REFUSED.items():
        name = f"refused: {' '.join(args)}"
        admission, sglang = verdicts[name]
        assert sglang is not None, f"{name}: SGLang accepted it"
        assert admission is not None, f"{name}: admission accepted what SGLang refuses: {sglang}"
        assert admission.startswith("spec.engine.extraArgs: "), admission
        assert words in sglang, (name, sglang)


def test_what_only_admission_refuses_has_its_reason(verdicts):
    for name, (_args, why) in OPERATOR_ONLY.items():
        admission, sglang = verdicts[name]
        assert admission is not None and admission.startswith("spec.engine.extraArgs: ")
        assert sglang is None, f"{name}: SGLang refuses it too ({sglang}); move it to refused"
        assert why
