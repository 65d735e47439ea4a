"""Command line of the SGLang double: SGLang's launch flags plus ``--double-*`` knobs.

The flag names are ``python -m sglang.launch_server``'s, so the in-pod agent can launch the
double exactly as it launches SGLang (``prorsa-agent --engine-command 'python -m
prorsa_lab.doubles.sglang_double' --launch -- ...``).
``python -m prorsa_lab.doubles.sglang_double`` ignores SGLang flags it does not model (with a
warning); ``prorsa engine-double`` refuses them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prorsa_contract.aio import stop_requested

if TYPE_CHECKING:
    from prorsa_lab.doubles.engine_server import EngineDouble

HELP = "run an HTTP double of an SGLang 0.5.23 engine (role switching, loads, aborts)"


def configure(parser: argparse.ArgumentParser) -> None:
    sg = parser.add_argument_group("SGLang launch flags (same names as sglang.launch_server)")
    sg.add_argument("--model-path", default="prorsa/engine-double")
    sg.add_argument("--served-model-name", default=None)
    sg.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1, dest="tp_size")
    sg.add_argument("--dp-size", "--data-parallel-size", type=int, default=1, dest="dp_size")
    sg.add_argument("--disaggregation-mode", choices=("null", "prefill", "decode"), default="null")
    sg.add_argument("--enable-pd-role-switch", action="store_true")
    sg.add_argument("--disaggregation-transfer-backend", default="mooncake")
    sg.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    sg.add_argument("--disaggregation-ib-device", default=None, help="accepted, ignored")
    sg.add_argument("--enable-metrics", action="store_true")
    sg.add_argument("--host", default="127.0.0.1")
    sg.add_argument("--port", type=int, default=30000)
    sg.add_argument(
        "--max-total-tokens", type=int, default=200_000, help="KV pool tokens per DP rank"
    )
    sg.add_argument("--max-running-requests", type=int, default=256)
    sg.add_argument("--context-length", type=int, default=131_072)
    sg.add_argument("--chunked-prefill-size", type=int, default=16_384)
    sg.add_argument("--api-key", default=None)
    sg.add_argument("--incremental-streaming-output", action="store_true")
    sg.add_argument("--stream-interval", type=int, default=1)
    sg.add_argument("--admin-api-key", default=None)
    # Prefix-cache flags the agent adds (prorsa_agent.config.prefix_cache_flags): the double
    # keeps no prefix cache, but it accepts them and refuses what SGLang refuses, so a test
    # that launches it through the agent sees a command line SGLang would start with.
    pc = parser.add_argument_group("SGLang prefix-cache flags (accepted, not modelled)")
    pc.add_argument("--disable-radix-cache", action="store_true")
    pc.add_argument("--disaggregation-decode-enable-radix-cache", action="store_true")
    pc.add_argument(
        "--enable-hierarchical-cache",
        "--enable-hicache",
        action="store_true",
        dest="enable_hierarchical_cache",
    )
    pc.add_argument("--hicache-ratio", type=float, default=None)
    pc.add_argument("--hicache-size", type=int, default=0)
    pc.add_argument("--hicache-write-policy", default="write_through")
    pc.add_argument("--hicache-storage-backend", default=None)

    d = parser.add_argument_group("double: timing model and failure injection")
    d.add_argument("--double-prefill-tokens-per-second", type=float, default=200_000.0)
    d.add_argument("--double-prefill-overhead-ms", type=float, default=1.0)
    d.add_argument(
        "--double-prefill-cost-doubling-tokens",
        type=float,
        default=0.0,
        help="prompt position where a token's prefill costs twice the first's (0: flat)",
    )
    d.add_argument("--double-decode-step-ms", type=float, default=4.0)
    d.add_argument("--double-decode-step-ms-per-request", type=float, default=0.05)
    d.add_argument("--double-kv-transfer-ms", type=float, default=1.0)
    d.add_argument("--double-switch-seconds", type=float, default=0.02)
    d.add_argument("--double-startup-seconds", type=float, default=0.0)
    d.add_argument("--double-health-timeout", type=float, default=20.0)
    d.add_argument("--double-graph-memory-gb", type=float, default=1.25)
    d.add_argument("--double-available-gpu-memory-gb", type=float, default=6.0)
    d.add_argument("--double-fail-switch", choices=("safe", "unsafe"), default=None)
    d.add_argument("--double-fail-switch-count", type=int, default=1)
    d.add_argument("--double-busy-on-switch", type=int, default=0)
    d.add_argument("--double-crash-on-switch", action="store_true")
    d.add_argument("--double-hang-on-switch", action="store_true")
    d.add_argument("--double-unhealthy-after-switch", action="store_true")
    d.add_argument("--double-step-multiplier", type=float, default=1.0)
    d.add_argument("--log-level", default="warning")


def check_cache_flags(args: argparse.Namespace) -> None:
    """Refuse the prefix-cache combinations SGLang 0.5.23 refuses at start-up.

    ``srt/arg_groups/kv_cache_hook.py`` ``handle_cache_compatibility``: HiCache and a
    disabled radix cache are mutually exclusive, and a decode server's radix cache is
    disabled unless ``--disaggregation-decode-enable-radix-cache`` is given
    (``pd_disaggregation_hook.py`` ``handle_pd_disaggregation``, which runs first).
    """
    radix_off = args.disable_radix_cache or (
        args.disaggregation_mode == "decode" and not args.disaggregation_decode_enable_radix_cache
    )
    if args.enable_hierarchical_cache and radix_off:
        raise ValueError(
            "The arguments enable-hierarchical-cache and disable-radix-cache are mutually "
            "exclusive (a decode server disables its radix cache without "
            "--disaggregation-decode-enable-radix-cache)"
        )


def build(args: argparse.Namespace, argv: Sequence[str] = ()) -> EngineDouble:
    check_cache_flags(args)
    # Imported here so that `prorsa --help` does not load aiohttp and prometheus_client.
    from prorsa_lab.doubles.engine_model import EngineConfig, Faults, TimingModel
    from prorsa_lab.doubles.engine_server import EngineDouble

    timing = TimingModel(
        prefill_tokens_per_second=args.double_prefill_tokens_per_second,
        prefill_overhead_seconds=args.double_prefill_overhead_ms / 1000,
        prefill_cost_doubling_tokens=args.double_prefill_cost_doubling_tokens,
        max_prefill_tokens=args.chunked_prefill_size,
        decode_step_seconds=args.double_decode_step_ms / 1000,
        decode_step_seconds_per_request=args.double_decode_step_ms_per_request / 1000,
        kv_transfer_seconds=args.double_kv_transfer_ms / 1000,
        switch_seconds=args.double_switch_seconds,
        startup_seconds=args.double_startup_seconds,
        health_check_timeout_seconds=args.double_health_timeout,
    )
    config = EngineConfig(
        role=args.disaggregation_mode,
        enable_pd_role_switch=args.enable_pd_role_switch,
        transfer_backend=args.disaggregation_transfer_backend,
        bootstrap_port=args.disaggregation_bootstrap_port,
        # SGLang serves the bootstrap port in either PD role.
        serve_bootstrap=args.disaggregation_mode != "null",
        incremental_streaming_output=args.incremental_streaming_output,
        stream_interval=args.stream_interval,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        kv_capacity_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        enable_metrics=args.enable_metrics,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        host=args.host,
        port=args.port,
        timing=timing,
        decode_cuda_graph_memory_gb=args.double_graph_memory_gb,
        available_gpu_memory_gb=args.double_available_gpu_memory_gb,
        launch_command=" ".join(["python -m prorsa_lab.doubles.sglang_double", *argv]),
    )
    faults = Faults(
        switch_failure=args.double_fail_switch,
        switch_failure_count=args.double_fail_switch_count,
        busy_on_switch=args.double_busy_on_switch,
        crash_on_switch=args.double_crash_on_switch,
        hang_on_switch=args.double_hang_on_switch,
        unhealthy_after_switch=args.double_unhealthy_after_switch,
        step_time_multiplier=args.double_step_multiplier,
    )
    # A crash of a double run as a process ends the process, as a real engine's would.
    return EngineDouble(config, faults=faults, exit_on_crash=True)


async def serve(engine: EngineDouble) -> None:
    """Run until SIGINT/SIGTERM; print the bound URL first (tests read it)."""
    with stop_requested() as stop:
        url = await engine.start()
        print(f"engine double listening on {url} (role={engine.role})", flush=True)
        # SGLang 0.5.23 logs its resolved server arguments, API keys included, on start-up
        # (srt/entrypoints/engine.py): so does the double, for the agent's redaction to be
        # tested.
        print(f"engine double: server_args={engine.config!r}", flush=True)
        try:
            await stop.wait()
        finally:
            await engine.close()


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine = build(args, argv)
    except ValueError as exc:
        print(f"engine double: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(engine))
    except OSError as exc:
        print(f"engine double: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m prorsa_lab.doubles.sglang_double", description=HELP
    )
    configure(parser)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(
            f"engine double: ignoring SGLang flags it does not model: {' '.join(unknown)}",
            file=sys.stderr,
            flush=True,
        )
    return run(args, argv)
