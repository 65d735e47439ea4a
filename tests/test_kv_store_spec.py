"""``spec.kvStore`` from the manifest to the engine's command line: admission names the bad
field, the operator passes the section to every engine pod, and the pod's agent renders the
store's SGLang flags from it."""

from __future__ import annotations

import json

import pytest
from test_crd import with_spec

from prorsa.core import engine_flags
from prorsa.core.spec import SpecError, parse_cluster
from prorsa.k8s.groups import group_pods
from prorsa.k8s.objects import engine_pod
from prorsa_agent import kv_store
from prorsa_agent.config import args_from_env, engine_argv

STORE = {"backend": "mooncake", "endpoint": "mooncake-master.rl:50051", "sizeGiB": 64}


def _env(pod: dict) -> dict[str, str]:
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_every_engine_pod_carries_the_store_and_its_agent_renders_the_flags() -> None:
    spec = parse_cluster(with_spec(kvStore=STORE)).spec
    for pod in group_pods(cluster="c", namespace="rl", index=0, role="decode", spec=spec):
        env = _env(pod)
        store = kv_store.KvStoreConfig.from_env(env)
        assert store == kv_store.KvStoreConfig(
            backend="mooncake", endpoint="mooncake-master.rl:50051", size_gib=64
        )
        argv = engine_argv(
            command=[],
            engine_url="http://127.0.0.1:30000",
            env_args=args_from_env(env),
            kv_store=store,
        )
        assert argv[argv.index("--hicache-storage-backend") + 1] == "dynamic"
        extra = json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])
        assert extra["module_path"] == "prorsa_agent.kv_backend"


def test_without_the_section_no_pod_gets_a_store() -> None:
    spec = parse_cluster(with_spec()).spec
    env = _env(engine_pod(cluster="c", namespace="rl", index=0, role="decode", spec=spec))
    assert kv_store.KvStoreConfig.from_env(env) is None
    assert not set(env) & kv_store.KV_STORE_ENV


def test_the_operator_and_the_agent_name_the_same_variables() -> None:
    assert kv_store.KV_STORE_ENV <= engine_flags.OPERATOR_ENV


@pytest.mark.parametrize(
    ("store", "extra", "field"),
    [
        ({**STORE, "endpoint": "http://m:50051"}, {}, "spec.kvStore.endpoint"),
        ({**STORE, "backend": "file"}, {}, "spec.kvStore.endpoint"),
        ({**STORE, "sizeGiB": 0}, {}, "spec.kvStore.sizeGiB"),
        ({k: v for k, v in STORE.items() if k != "backend"}, {}, "spec.kvStore.backend"),
        (STORE, {"engine__extraArgs": ["--hicache-storage-backend=file"]}, "spec.engine.extraArgs"),
        (
            STORE,
            {"engine__env": [{"name": "PRORSA_DISABLE_HICACHE", "value": "1"}]},
            "spec.engine.env",
        ),
    ],
)
def test_admission_names_the_bad_field(store: dict, extra: dict, field: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_cluster(with_spec(kvStore=store, **extra))
    assert f"{field}: " in str(refused.value)
