"""The agent with ``spec.kvStore``: the engine flags it renders and the flip it refuses while
the store does not answer (against the engine double, over HTTP on loopback)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import httpx
import pytest

from prorsa_agent.agent_cli import build_config, configure
from prorsa_agent.config import ConfigError, engine_argv
from prorsa_agent.kv_store import KvStoreConfig, KvStoreError
from prorsa_contract.agent_api import RoleResult
from prorsa_lab.doubles.sglang_double import EnginePod

TOKEN = "kv-agent-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SGLANG = ["python", "-m", "sglang.launch_server"]
URL = "http://127.0.0.1:30000"


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_store_is_loaded_through_sglangs_dynamic_backend_with_decode_offload() -> None:
    store = KvStoreConfig(backend="mooncake", endpoint="mooncake-master.ns:50051", size_gib=64)
    argv = engine_argv(command=SGLANG, engine_url=URL, kv_store=store)
    assert _value(argv, "--hicache-storage-backend") == "dynamic"
    extra = json.loads(_value(argv, "--hicache-storage-backend-extra-config"))
    assert extra["module_path"] == "prorsa_agent.kv_backend"
    assert extra["class_name"] == "SharedKVStore"
    assert extra["prorsa_store"] == "mooncake"
    assert extra["master_server_address"] == "mooncake-master.ns:50051"
    assert extra["global_segment_size"] == 64 * 2**30
    assert extra["interface_v1"] == 1  # MooncakeStore's zero-copy reads and writes
    assert "--disaggregation-decode-enable-offload-kvcache" in argv
    assert "--enable-hierarchical-cache" in argv  # the store is HiCache's storage tier
    assert "--disaggregation-decode-enable-radix-cache" in argv


def test_a_mooncake_master_without_a_port_gets_the_default_one() -> None:
    store = KvStoreConfig(backend="mooncake", endpoint="mooncake-master", size_gib=1)
    assert store.extra_config()["master_server_address"] == "mooncake-master:50051"


def test_the_file_store_names_its_directory_and_cap() -> None:
    store = KvStoreConfig(backend="file", endpoint="/mnt/kv", size_gib=2)
    extra = json.loads(
        _value(
            engine_argv(command=SGLANG, engine_url=URL, kv_store=store),
            "--hicache-storage-backend-extra-config",
        )
    )
    assert extra["file_storage_path"] == "/mnt/kv" and extra["max_size"] == 2 * 2**30


def test_flags_that_contradict_the_store_are_refused() -> None:
    store = KvStoreConfig(backend="file", endpoint="/mnt/kv", size_gib=2)
    with pytest.raises(
        ConfigError, match=r"--hicache-storage-backend is set by the operator for spec\.kvStore"
    ):
        engine_argv(
            command=SGLANG,
            engine_url=URL,
            explicit=["--hicache-storage-backend", "file"],
            kv_store=store,
        )
    with pytest.raises(ConfigError, match=r"spec\.kvStore is HiCache's storage tier"):
        engine_argv(command=SGLANG, engine_url=URL, hicache=False, kv_store=store)
    with pytest.raises(ConfigError, match="--disable-radix-cache"):
        engine_argv(
            command=SGLANG, engine_url=URL, explicit=["--disable-radix-cache"], kv_store=store
        )


@pytest.mark.parametrize(
    ("env", "named"),
    [
        (
            {"PRORSA_KV_STORE_BACKEND": "redis", "PRORSA_KV_STORE_SIZE_GIB": "1"},
            "PRORSA_KV_STORE_BACKEND",
        ),
        (
            {"PRORSA_KV_STORE_BACKEND": "file", "PRORSA_KV_STORE_SIZE_GIB": "x"},
            "PRORSA_KV_STORE_SIZE_GIB",
        ),
        (
            {
                "PRORSA_KV_STORE_BACKEND": "file",
                "PRORSA_KV_STORE_SIZE_GIB": "1",
                "PRORSA_KV_STORE_ENDPOINT": "kv",
            },
            "PRORSA_KV_STORE_ENDPOINT",
        ),
        (
            {
                "PRORSA_KV_STORE_BACKEND": "mooncake",
                "PRORSA_KV_STORE_SIZE_GIB": "1",
                "PRORSA_KV_STORE_ENDPOINT": "m:x",
            },
            "PRORSA_KV_STORE_ENDPOINT",
        ),
    ],
)
def test_a_bad_store_setting_is_named(env: dict[str, str], named: str) -> None:
    with pytest.raises(KvStoreError, match=named):
        KvStoreConfig.from_env(env)


def test_no_store_without_its_variables() -> None:
    assert KvStoreConfig.from_env({}) is None
    store = KvStoreConfig(backend="file", endpoint="/mnt/kv", size_gib=3)
    assert KvStoreConfig.from_env(store.env()) == store


async def _flip(client: httpx.AsyncClient, pod: EnginePod, role: str) -> RoleResult:
    response = await client.post(
        f"{pod.agent_url}/v1/role", json={"role": role, "drainTimeoutSeconds": 5}, headers=AUTH
    )
    return RoleResult.model_validate(response.json())


async def test_a_flip_is_refused_while_the_store_directory_is_missing(tmp_path: Path) -> None:
    shared = tmp_path / "kv"
    store = KvStoreConfig(backend="file", endpoint=str(shared), size_gib=1)
    async with (
        EnginePod(instance="e-kv", token=TOKEN, kv_store=store) as pod,
        httpx.AsyncClient(timeout=20) as client,
    ):
        refused = await _flip(client, pod, "prefill")
        assert not refused.ok and refused.safe_to_restore
        assert refused.new_role == "decode"
        assert (
            f"KV store is unreachable: the KV store directory {shared} does not exist"
            in refused.message
        )
        assert pod.double.role == "decode" and pod.double.counters().switch_calls == 0
        shared.mkdir()
        assert (await _flip(client, pod, "prefill")).ok
        assert pod.double.role == "prefill"


async def test_a_flip_waits_for_the_mooncake_master(tmp_path: Path) -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    store = KvStoreConfig(backend="mooncake", endpoint=f"127.0.0.1:{port}", size_gib=1)
    async with (
        EnginePod(instance="e-mc", token=TOKEN, kv_store=store) as pod,
        httpx.AsyncClient(timeout=20) as client,
    ):
        refused = await _flip(client, pod, "prefill")
        assert (
            not refused.ok
            and f"the Mooncake master 127.0.0.1:{port} does not answer" in refused.message
        )
        assert pod.double.role == "decode"
        master = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        async with master:
            assert (await _flip(client, pod, "prefill")).ok


def _cli(tmp_path: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(
        ["--engine-url", "http://127.0.0.1:30001", "--token-file", str(tmp_path / "t"),
         "--instance", "rc-engine-0", "--launch", "--", "--model-path", "/m"]
    )  # fmt: skip


def test_the_pods_variables_reach_the_launch_and_the_switch(tmp_path: Path) -> None:
    store = KvStoreConfig(backend="file", endpoint="/mnt/kv", size_gib=2)
    config = build_config(_cli(tmp_path), env=store.env())
    assert config.kv_store == store
    assert config.launch is not None
    argv = list(config.launch.argv)
    assert argv[argv.index("--hicache-storage-backend") + 1] == "dynamic"
    with pytest.raises(ConfigError, match="PRORSA_KV_STORE_SIZE_GIB"):
        build_config(_cli(tmp_path), env={**store.env(), "PRORSA_KV_STORE_SIZE_GIB": "2G"})
