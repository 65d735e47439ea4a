"""How the agent assembles the SGLang command line and reads its own settings."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from prorsa_agent.agent_cli import build_config, configure
from prorsa_agent.config import (
    AgentConfig,
    BootstrapGateConfig,
    ConfigError,
    RestartBackoff,
    Timeouts,
    args_from_env,
    engine_argv,
    parse_listen,
)
from prorsa_agent.engine_client import EngineProtocolError, Loads
from prorsa_agent.redact import Redactor, redact_argv

SGLANG = ("python", "-m", "sglang.launch_server")


def test_every_engine_starts_as_decode_with_role_switching_and_metrics():
    argv = engine_argv(
        command=SGLANG,
        engine_url="http://127.0.0.1:30000",
        env_args=["--model-path", "/models/qwen", "--tp-size", "8"],
    )
    assert argv == [
        *SGLANG,
        "--model-path", "/models/qwen", "--tp-size", "8",
        "--disaggregation-mode", "decode", "--enable-pd-role-switch", "--enable-metrics",
        "--disaggregation-decode-enable-radix-cache", "--enable-hierarchical-cache",
        "--port", "30000",
    ]  # fmt: skip


def test_explicit_flags_come_after_env_flags_and_are_not_duplicated():
    argv = engine_argv(
        command=SGLANG,
        engine_url="http://127.0.0.1:31000",
        env_args=["--tp-size", "8"],
        explicit=["--tp-size", "4", "--disaggregation-mode=prefill", "--port", "31000"],
    )
    assert argv.index("8") < argv.index("4")  # argparse keeps the last: explicit wins
    assert argv.count("--port") == 1
    assert "--disaggregation-mode" not in argv  # given as --disaggregation-mode=prefill
    assert "--enable-pd-role-switch" in argv


def _cache_flags(*explicit: str) -> list[str]:
    """The prefix-cache flags in the engine command line, in order, however they were given."""
    argv = engine_argv(command=SGLANG, engine_url="http://127.0.0.1:30000", explicit=explicit)
    names = (
        "--disaggregation-decode-enable-radix-cache",
        "--enable-hierarchical-cache",
        "--enable-hicache",
        "--disable-radix-cache",
    )
    return [a for a in argv if a.split("=")[0] in names]


def test_an_engine_launched_as_decode_keeps_a_radix_cache_and_a_host_tier():
    # SGLang disables a decode server's radix cache without the decode flag, and a flip to
    # prefill does not bring it back: a flipped engine would have no prefix cache at all.
    assert _cache_flags() == [
        "--disaggregation-decode-enable-radix-cache",
        "--enable-hierarchical-cache",
    ]
    # Also when launched as prefill: a flip to decode keeps the cache consistent.
    assert _cache_flags("--disaggregation-mode", "prefill") == [
        "--disaggregation-decode-enable-radix-cache",
        "--enable-hierarchical-cache",
    ]


def test_prefix_cache_flags_given_by_the_user_are_not_duplicated():
    assert _cache_flags("--enable-hicache", "--disaggregation-decode-enable-radix-cache") == [
        "--enable-hicache",
        "--disaggregation-decode-enable-radix-cache",
    ]
    assert _cache_flags("--enable-hierarchical-cache", "--hicache-ratio", "1.5") == [
        "--enable-hierarchical-cache",
        "--disaggregation-decode-enable-radix-cache",
    ]


def test_disable_radix_cache_leaves_out_every_prefix_cache_flag():
    assert _cache_flags("--disable-radix-cache") == ["--disable-radix-cache"]


@pytest.mark.parametrize(
    "explicit",
    [
        ("--enable-hisparse",),
        ("--disaggregation-transfer-backend", "fake"),
        ("--speculative-algorithm", "NGRAM"),
    ],
)
def test_no_decode_radix_cache_where_sglang_refuses_it_and_so_no_hicache(explicit):
    # HiCache next to a decode server's disabled radix cache is refused by SGLang.
    assert _cache_flags(*explicit) == []


@pytest.mark.parametrize(
    "explicit",
    [
        ("--enable-lmcache",),
        ("--enable-unified-cache-external-linker",),
        ("--enable-int8-mamba-checkpoint",),
        ("--dcp-size", "2"),
        ("--enable-unified-memory", "--speculative-algorithm", "EAGLE3"),
    ],
)
def test_no_hicache_where_sglang_refuses_it(explicit):
    assert _cache_flags(*explicit) == ["--disaggregation-decode-enable-radix-cache"]


def test_eagle_keeps_both_prefix_cache_flags():
    assert _cache_flags("--speculative-algorithm", "eagle") == [
        "--disaggregation-decode-enable-radix-cache",
        "--enable-hierarchical-cache",
    ]


def test_hicache_can_be_left_out():
    argv = engine_argv(command=SGLANG, engine_url="http://127.0.0.1:30000", hicache=False)
    assert "--disaggregation-decode-enable-radix-cache" in argv
    assert "--enable-hierarchical-cache" not in argv


def test_a_hicache_storage_backend_needs_an_explicit_opt_in():
    with pytest.raises(ConfigError, match="wipes the entries of every other engine"):
        engine_argv(
            command=SGLANG,
            engine_url="http://127.0.0.1:30000",
            explicit=["--hicache-storage-backend", "mooncake"],
        )
    argv = engine_argv(
        command=SGLANG,
        engine_url="http://127.0.0.1:30000",
        explicit=["--hicache-storage-backend", "mooncake"],
        allow_hicache_storage=True,
    )
    assert "--enable-hierarchical-cache" in argv


def test_a_port_flag_that_contradicts_the_engine_url_is_refused():
    with pytest.raises(ConfigError, match="does not match"):
        engine_argv(command=SGLANG, engine_url="http://127.0.0.1:30000", explicit=["--port=1"])


def test_env_flags_from_json_or_shell_quoting():
    env = {
        "PRORSA_MODEL_PATH": "/m",
        "PRORSA_TRANSFER_BACKEND": "mooncake",
        "PRORSA_BOOTSTRAP_PORT": "8998",
        "PRORSA_EXTRA_ARGS": json.dumps(["--chunked-prefill-size", "4096", "--x", "a b"]),
    }
    assert args_from_env(env) == [
        "--model-path", "/m",
        "--disaggregation-transfer-backend", "mooncake",
        "--disaggregation-bootstrap-port", "8998",
        "--chunked-prefill-size", "4096", "--x", "a b",
    ]  # fmt: skip
    assert args_from_env({"PRORSA_EXTRA_ARGS": "--x 'a b' --y"}) == ["--x", "a b", "--y"]
    with pytest.raises(ConfigError, match="PRORSA_EXTRA_ARGS"):
        args_from_env({"PRORSA_EXTRA_ARGS": '["--x", 3]'})
    assert args_from_env({}) == []


def test_listen_addresses():
    assert parse_listen("0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert parse_listen(":9000") == ("0.0.0.0", 9000)
    for bad in ("8080", "host:", "host:99999", "host:http"):
        with pytest.raises(ConfigError):
            parse_listen(bad)


def test_backoff_grows_and_caps():
    backoff = RestartBackoff(initial=1.0, factor=2.0, maximum=5.0)
    delays = [1.0]
    for _ in range(4):
        delays.append(backoff.next(delays[-1]))
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]
    with pytest.raises(ConfigError):
        RestartBackoff(initial=0.0)


def test_invalid_settings_name_the_setting(tmp_path: Path):
    token = tmp_path / "t"
    with pytest.raises(ConfigError, match="engine-url"):
        AgentConfig(engine_url="127.0.0.1:30000", token_file=token, instance="x")
    with pytest.raises(ConfigError, match="instance"):
        AgentConfig(engine_url="http://127.0.0.1:1", token_file=token, instance="")
    with pytest.raises(ConfigError, match="switch"):
        Timeouts(switch=0)


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(argv)


def test_command_line_to_config(tmp_path: Path):
    args = _args(
        [
            "--engine-url", "http://127.0.0.1:30001", "--listen", "127.0.0.1:0",
            "--token-file", str(tmp_path / "t"), "--instance", "rc-engine-2",
            "--switch-timeout", "90", "--header-timeout", "12", "--launch", "--",
            "--model-path", "/m",
        ]
    )  # fmt: skip
    config = build_config(args, env={"PRORSA_TP_SIZE": "4"})
    assert config.instance == "rc-engine-2" and config.listen_port == 0
    assert config.timeouts.switch == 90 and config.timeouts.client_headers == 12
    assert config.launch is not None
    argv = list(config.launch.argv)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    # SGLang's bootstrap server moves behind the agent's gate, which serves SGLang's default.
    assert argv[3:] == [
        "--tp-size", "4", "--model-path", "/m", "--disaggregation-bootstrap-port", "9998",
        "--disaggregation-mode", "decode", "--enable-pd-role-switch", "--enable-metrics",
        "--disaggregation-decode-enable-radix-cache", "--enable-hierarchical-cache",
        "--port", "30001",
    ]  # fmt: skip
    assert config.bootstrap_gate == BootstrapGateConfig(port=8998, engine_port=9998, hold=15.0)
    attach = build_config(_args(["--token-file", "t"]), env={})
    assert attach.launch is None and attach.bootstrap_gate is None


def test_the_bootstrap_gate_serves_the_pods_port_and_moves_sglangs(tmp_path: Path):
    """The pod announces PRORSA_BOOTSTRAP_PORT: the agent serves it, SGLang's server moves a
    fixed offset up (every pod of a multi-node group registers with its head there), given
    once whichever way the user wrote it; the hold follows SGLang's heartbeat settings."""
    env = {
        "PRORSA_BOOTSTRAP_PORT": "7000",
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "3",
    }
    args = _args(
        [
            "--engine-url", "http://127.0.0.1:30001", "--token-file", str(tmp_path / "t"),
            "--instance", "rc-engine-0", "--launch", "--", "--model-path", "/m",
        ]
    )  # fmt: skip
    config = build_config(args, env=env)
    assert config.bootstrap_gate == BootstrapGateConfig(port=7000, engine_port=8000, hold=8.0)
    assert config.launch is not None
    argv = list(config.launch.argv)
    assert [a for a in argv if a.startswith("--disaggregation-bootstrap-port")] == [
        "--disaggregation-bootstrap-port"
    ]
    assert argv[argv.index("--disaggregation-bootstrap-port") + 1] == "8000"
    explicit = _launch_argv(tmp_path, {}, "--disaggregation-bootstrap-port=6000")
    assert "--disaggregation-bootstrap-port=6000" not in explicit
    assert explicit[explicit.index("--disaggregation-bootstrap-port") + 1] == "7000"
    with pytest.raises(ConfigError, match="disaggregation-bootstrap-port"):
        _launch_argv(tmp_path, {"PRORSA_BOOTSTRAP_PORT": "eighty"})
    with pytest.raises(ConfigError, match="share port"):
        BootstrapGateConfig(port=9000, engine_port=9000, hold=1.0)
    with pytest.raises(ConfigError, match="needs --launch"):
        AgentConfig(
            engine_url="http://127.0.0.1:1",
            token_file=tmp_path / "t",
            instance="x",
            bootstrap_gate=BootstrapGateConfig(port=1, engine_port=2, hold=0.0),
        )


def _launch_argv(tmp_path: Path, env: dict[str, str], *engine: str) -> list[str]:
    args = _args(
        [
            "--engine-url", "http://127.0.0.1:30001", "--token-file", str(tmp_path / "t"),
            "--instance", "rc-engine-0", "--launch", "--", "--model-path", "/m", *engine,
        ]
    )  # fmt: skip
    config = build_config(args, env=env)
    assert config.launch is not None
    return list(config.launch.argv)


def test_hicache_storage_backend_is_refused_unless_opted_in(tmp_path: Path):
    with pytest.raises(ConfigError) as refused:
        _launch_argv(tmp_path, {}, "--hicache-storage-backend", "mooncake")
    message = str(refused.value)
    assert "--hicache-storage-backend mooncake" in message
    assert "role_switch.py" in message and "_release_prefix_cache_for_role_switch" in message
    assert "every other engine" in message and "PRORSA_ALLOW_HICACHE_STORAGE=1" in message
    with pytest.raises(ConfigError, match="clears the whole HiCache storage backend"):
        _launch_argv(tmp_path, {"PRORSA_EXTRA_ARGS": '["--hicache-storage-backend=file"]'})
    argv = _launch_argv(
        tmp_path, {"PRORSA_ALLOW_HICACHE_STORAGE": "1"}, "--hicache-storage-backend", "file"
    )
    assert argv.count("--hicache-storage-backend") == 1
    assert "--enable-hierarchical-cache" in argv  # L3 sits behind the host tier


def test_hicache_can_be_left_out_by_environment(tmp_path: Path):
    argv = _launch_argv(tmp_path, {"PRORSA_DISABLE_HICACHE": "1"})
    assert "--disaggregation-decode-enable-radix-cache" in argv
    assert "--enable-hierarchical-cache" not in argv


def test_loads_are_summed_over_dp_ranks():
    rank = {
        "num_running_reqs": 2,
        "num_waiting_reqs": 1,
        "num_waiting_uncached_tokens": 300,
        "num_used_tokens": 1000,
        "max_total_num_tokens": 5000,
        "total_prefill_busy_us": 1_500_000,
        "total_prefill_uncached_tokens": 9000,
        "disaggregation": {"mode": "prefill", "prefill_inflight_queue_reqs": 4},
    }
    loads = Loads.parse({"loads": [rank, {**rank, "num_running_reqs": 5}]})
    assert loads.role == "prefill" and loads.ranks == 2
    assert (loads.running, loads.waiting, loads.inflight) == (7, 2, 8)
    assert loads.busy == 17
    assert loads.kv_capacity == 10_000 and loads.waiting_tokens == 600
    assert loads.prefill_busy_seconds == 3.0 and loads.prefill_tokens == 18_000
    with pytest.raises(EngineProtocolError):
        Loads.parse({"loads": []})
    with pytest.raises(EngineProtocolError):
        Loads.parse({"loads": [{"num_running_reqs": 1}]})


def test_a_decode_engine_reports_the_prompt_tokens_waiting_for_its_kv_room():
    """SGLang counts no uncached tokens on a decode rank; its prealloc queue's prompts are
    what ``num_total_tokens`` holds beyond ``num_used_tokens``."""
    rank = {
        "num_running_reqs": 3,
        "num_waiting_reqs": 4,  # prealloc and transfer queues
        "num_waiting_uncached_tokens": 0,
        "num_used_tokens": 4000,
        "num_total_tokens": 6500,  # 2,500 prompt tokens wait for KV room
        "max_total_num_tokens": 5000,
        "total_prefill_busy_us": 0,
        "total_prefill_uncached_tokens": 0,
        "disaggregation": {"mode": "decode"},
    }
    loads = Loads.parse({"loads": [rank, {**rank, "num_total_tokens": 4000}]})
    assert loads.role == "decode" and loads.waiting == 8 and loads.waiting_tokens == 2500


OPTIONAL_EXTRAS = ("kopf", "kubernetes", "kmock", "matplotlib", "schemathesis", "hypothesis")


VIA_PRORSA = "from prorsa.cli import main; sys.exit(main(['agent', '--help']))"
VIA_MODULE = (
    "import runpy; sys.argv = ['prorsa_agent', '--help']; "
    "runpy.run_module('prorsa_agent', run_name='__main__')"
)


@pytest.mark.parametrize("entry", [VIA_PRORSA, VIA_MODULE])
def test_the_agent_command_needs_no_optional_extras(entry: str):
    """The engine image installs `prorsa` without extras: `prorsa agent` must still start."""
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in OPTIONAL_EXTRAS)
    result = subprocess.run(
        [sys.executable, "-c", f"import sys; {blocked}; {entry}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "--engine-url" in result.stdout and "--launch" in result.stdout


# -- the engine admin key --------------------------------------------------------------------------

ADMIN_KEY = "k3y-Of_the-engine-admin_9f2c"


def test_the_admin_key_file_becomes_the_engines_admin_api_key(tmp_path: Path):
    key_file = tmp_path / "key"
    key_file.write_text(ADMIN_KEY + "\n")
    args = _args(
        [
            "--engine-url", "http://127.0.0.1:30001", "--token-file", str(tmp_path / "t"),
            "--instance", "rc-engine-0", "--engine-api-key-file", str(key_file), "--launch",
        ]
    )  # fmt: skip
    config = build_config(args, env={})
    assert config.launch is not None and config.engine_api_key_file == key_file
    argv = list(config.launch.argv)
    assert f"--admin-api-key={ADMIN_KEY}" in argv
    assert "--api-key" not in argv
    assert config.launch.secrets == (ADMIN_KEY,)
    assert ADMIN_KEY not in repr(config.launch)
    # Without a key file the engine gets no key (an agent attached to an engine run elsewhere).
    assert not any(a.startswith("--admin-api-key") for a in _launch_argv(tmp_path, {}))


def test_an_admin_key_that_starts_with_a_dash_reaches_the_engine(tmp_path: Path):
    """One key in 64 the operator makes (URL-safe base64) starts with "-": given as an
    argument of its own, argparse (SGLang's, the double's) takes it for an option and the
    engine never starts. The real SGLang's parser checks the same in
    tests/real_engine/test_sglang_validation.py."""
    import argparse

    key = "-Xk3y_starting-with-a-dash"
    (tmp_path / "key").write_text(key)
    args = _args(
        [
            "--engine-url", "http://127.0.0.1:30001", "--token-file", str(tmp_path / "t"),
            "--instance", "rc-engine-0", "--engine-api-key-file", str(tmp_path / "key"),
            "--launch",
        ]
    )  # fmt: skip
    config = build_config(args, env={})
    assert config.launch is not None
    parser = argparse.ArgumentParser()
    parser.add_argument("--admin-api-key")
    known, _ = parser.parse_known_args(list(config.launch.argv[3:]))
    assert known.admin_api_key == key


@pytest.mark.parametrize(
    "flags", [["--admin-api-key", "mine"], ["--admin-api-key=mine"], ["--api-key", "data"]]
)
def test_engine_key_flags_next_to_the_managed_key_are_refused(tmp_path: Path, flags):
    key_file = tmp_path / "key"
    key_file.write_text(ADMIN_KEY)
    env = {"PRORSA_EXTRA_ARGS": json.dumps(flags)}
    args = _args(
        ["--token-file", "t", "--instance", "e-0", "--engine-api-key-file", str(key_file),
         "--launch"]
    )  # fmt: skip
    with pytest.raises(ConfigError, match="engine admin key Secret"):
        build_config(args, env=env)


def test_an_unreadable_or_empty_admin_key_file_is_refused(tmp_path: Path):
    base = ["--token-file", "t", "--instance", "e-0", "--launch", "--engine-api-key-file"]
    with pytest.raises(ConfigError, match="cannot read the engine admin key file"):
        build_config(_args([*base, str(tmp_path / "missing")]), env={})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        build_config(_args([*base, str(empty)]), env={})


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64, 10_000])
def test_redactor_replaces_a_key_split_across_any_reads(size: int):
    text = (
        f"server_args={{'admin_api_key': '{ADMIN_KEY}', 'port': 30000}}\n"
        f"launch_command=sglang --admin-api-key {ADMIN_KEY}\nno newline at the end {ADMIN_KEY}"
    ).encode()
    redactor = Redactor([ADMIN_KEY])
    out = b"".join(redactor.feed(text[i : i + size]) for i in range(0, len(text), size))
    out += redactor.flush()
    assert ADMIN_KEY.encode() not in out
    assert out == text.replace(ADMIN_KEY.encode(), b"<redacted>")


def test_redactor_never_holds_back_a_finished_line():
    redactor = Redactor([ADMIN_KEY])
    assert redactor.feed(b"INFO engine ready\n") == b"INFO engine ready\n"
    # A line without its newline yet: only what could start a key is held back.
    assert redactor.feed(b"x" * 100) == b"x" * (100 - (len(ADMIN_KEY) - 1))
    assert redactor.flush() == b"x" * (len(ADMIN_KEY) - 1)
    assert redact_argv(["sglang", "--admin-api-key", ADMIN_KEY], [ADMIN_KEY]) == [
        "sglang", "--admin-api-key", "<redacted>",
    ]  # fmt: skip
