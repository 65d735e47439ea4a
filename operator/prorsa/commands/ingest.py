"""``prorsa ingest``: the trainer webhook for one RolloutCluster manifest, without Kubernetes.

The sandbox a trainer developer integrates against before going to a cluster: the same
webhook application and the same Controller the operator runs, fed by the trainer's real
events, ticking every ``forecast.horizonSeconds`` and printing each Decision as one
compact line (or as JSON with ``--format json``). Ctrl-C (SIGINT) or SIGTERM stops it
cleanly: the listener closes, in-flight batches finish, a summary is printed. With
``--record FILE`` every event applied is also written to FILE (NDJSON), as ``prorsa
record`` does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prorsa_contract.aio import drop_stop_signals, on_stop_signals

if TYPE_CHECKING:
    from prorsa.clusters import WebhookCluster
    from prorsa.core.decision import Decision
    from prorsa.ingest.recording import EventRecorder
    from prorsa_contract.serving_tls import ServingCert

HELP = "serve the trainer webhook for one RolloutCluster manifest (no Kubernetes)"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
TOKEN_FILE_POLL_SECONDS = 1.0


def configure(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument(
        "--format",
        choices=("line", "json"),
        default="line",
        help="each tick's Decision as a compact line (default) or as one JSON object",
    )
    parser.add_argument(
        "--record",
        type=Path,
        metavar="FILE",
        help="also write every event applied to FILE as NDJSON (prorsa plan --events "
        "replays it); an existing FILE is refused unless --append",
    )
    parser.add_argument("--append", action="store_true", help="append to an existing FILE")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The webhook's arguments, shared by ``prorsa ingest`` and ``prorsa record``."""
    parser.add_argument(
        "--cluster", required=True, type=Path, help="RolloutCluster manifest (YAML or JSON)"
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:8787",
        metavar="HOST:PORT",
        help="address to serve on (default 127.0.0.1:8787; port 0 picks a free one)",
    )
    parser.add_argument(
        "--token-file",
        required=True,
        type=Path,
        help="file holding the bearer token trainers must send; read again every second, "
        "so a new token is in force (and the old one refused) within a second of a change",
    )
    parser.add_argument(
        "--tls-cert-file",
        type=Path,
        metavar="PEM",
        help="serve HTTPS with this certificate (chain); needs --tls-key-file",
    )
    parser.add_argument("--tls-key-file", type=Path, metavar="PEM", help="its private key")
    parser.add_argument(
        "--insecure-plain-http",
        action="store_true",
        help="allow plain HTTP on an address other than loopback (the token then crosses "
        "the network in clear text)",
    )
    parser.add_argument(
        "--tick",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds between control ticks (default: the manifest's forecast.horizonSeconds)",
    )


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[v6]:PORT`` or ``:PORT`` (loopback) -> (host, port)."""
    host, sep, port_text = value.rpartition(":")
    if not sep:
        raise ValueError(f"--listen wants HOST:PORT, got {value!r}")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--listen port must be a number, got {port_text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"--listen port out of range: {port}")
    return host, port


def run(args: argparse.Namespace) -> int:
    return serve(args, command="ingest", record=args.record, append=args.append)


def serve(
    args: argparse.Namespace, *, command: str, record: Path | None, append: bool = False
) -> int:
    """Check the arguments, then serve until Ctrl-C or SIGTERM; the exit code."""
    import asyncio

    from prorsa.core.spec import SpecError
    from prorsa.k8s.manifest_file import load_cluster
    from prorsa.shell.gc_tuning import tune_gc

    tune_gc()

    def fail(message: str) -> int:
        print(f"prorsa {command}: error: {message}", file=sys.stderr)
        return 2

    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        return fail(str(exc))
    try:
        manifest = load_cluster(args.cluster)
    except FileNotFoundError:
        return fail(f"{args.cluster}: no such file")
    except SpecError as exc:
        return fail(str(exc))
    try:
        token = args.token_file.read_text()
    except OSError as exc:
        return fail(f"cannot read --token-file: {exc}")
    from prorsa.clusters.auth import normalize_token

    try:
        normalize_token(token)
    except ValueError as exc:
        return fail(f"{args.token_file}: {exc}")
    if args.tick is not None and not args.tick > 0:
        return fail("--tick must be > 0")
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        return fail("--tls-cert-file and --tls-key-file go together")
    tls = None
    if args.tls_cert_file is not None:
        from prorsa_contract.serving_tls import ServingCert

        try:
            tls = ServingCert(cert_file=args.tls_cert_file, key_file=args.tls_key_file)
        except ValueError as exc:
            return fail(str(exc))
    elif host not in LOOPBACK and not args.insecure_plain_http:
        return fail(
            f"plain HTTP on {host} would send the trainer's token in clear text: give "
            "--tls-cert-file and --tls-key-file, or --insecure-plain-http to accept that"
        )
    recorder = None
    if record is not None:
        from prorsa.ingest.recording import EventRecorder

        try:
            recorder = EventRecorder(record, append=append)
        except FileExistsError:
            return fail(f"{record} exists: give another file, or --append to add to it")
        except OSError as exc:
            return fail(f"cannot write {record}: {exc.strerror}")
    try:
        return asyncio.run(
            _serve(
                args, manifest, token.strip(), host, port, tls, command=command, recorder=recorder
            )
        )
    except OSError as exc:
        print(f"prorsa {command}: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        if recorder is not None and not append and recorder.queued == 0:
            recorder.close()
            recorder.path.unlink(missing_ok=True)  # nothing was recorded: leave no file
        return 1
    finally:
        if recorder is not None:
            recorder.close()


async def _serve(
    args: argparse.Namespace,
    manifest: Any,
    token: str,
    host: str,
    port: int,
    tls: ServingCert | None,
    *,
    command: str,
    recorder: EventRecorder | None,
) -> int:
    import asyncio
    import contextlib
    import json

    from prorsa.clusters import ClusterRegistry
    from prorsa.core.controller import Controller
    from prorsa.ingest import WebhookServer

    meta, spec = manifest.metadata, manifest.spec
    registry = ClusterRegistry()
    # A recording starts with the trainer: no snapshot is asked for (prorsa plan replays
    # events, not snapshots).
    handle = registry.add(
        namespace=meta.namespace,
        name=meta.name,
        token=token,
        controller=Controller(spec),
        resync=recorder is None,
    )
    writer = None
    if recorder is not None:
        handle.on_applied = recorder.add
        writer = asyncio.create_task(recorder.run())
    server = WebhookServer(registry)
    running = await server.start(host=host, port=port, ssl_context=tls.context if tls else None)
    following = asyncio.create_task(follow_token_file(args.token_file, handle, token))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    on_stop_signals(stop.set)
    interval = args.tick or spec.forecast.horizon_seconds
    base = f"{running.url}/v1/namespaces/{meta.namespace}/rolloutclusters/{meta.name}"
    print(
        f"prorsa {command}: serving {meta.namespace}/{meta.name} on {running.url} "
        f"(epoch {handle.epoch}; {spec.instances} instances of {spec.engine.gpus_per_instance} "
        f"GPUs; tick every {interval:g}s)",
        flush=True,
    )
    show = "record" if command == "record" else args.format
    if show != "json":
        print(f"  events:   POST {base}/events  (Authorization: Bearer <token>)", flush=True)
        print(f"  forecast: GET  {base}/forecast   docs: {running.url}/openapi.json", flush=True)
    if recorder is not None and show != "json":
        print(f"  recording to {recorder.path}", flush=True)
    if tls is None and host not in LOOPBACK:
        print(
            f"prorsa {command}: warning: plain HTTP on a non-loopback address sends the "
            "token in clear text",
            file=sys.stderr,
            flush=True,
        )
    applied_before = 0
    next_tick = loop.time()
    try:
        while not stop.is_set():
            decision = await handle.tick()
            if show == "json":
                print(json.dumps(decision.wire()), flush=True)
            elif show == "record":
                print(format_progress(handle, since=applied_before), flush=True)
            else:
                line = format_decision(decision, handle, since=applied_before)
                if recorder is not None:
                    line += f" | recorded {recorder.queued}"
                print(line, flush=True)
            applied_before = handle.applied
            next_tick += interval
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, next_tick - loop.time()))
    finally:
        following.cancel()
        drop_stop_signals()
        await running.stop()
        await handle.idle()
        if writer is not None:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
    print(
        f"prorsa {command}: stopped after {handle.batches} batches: {handle.applied} events "
        f"applied, {handle.duplicates} duplicates, {handle.superseded} superseded, "
        f"{handle.snapshots} snapshots",
        flush=True,
    )
    if recorder is not None:
        print(
            f"prorsa {command}: recorded {recorder.queued} events to {recorder.path}; replay "
            f"them: prorsa plan --cluster {args.cluster} --events {recorder.path}",
            flush=True,
        )
        if handle.snapshots:
            print(
                f"prorsa {command}: warning: {handle.snapshots} resync snapshot(s) are not "
                "in the recording (prorsa plan replays events): the trajectories a snapshot "
                "restored appear there from their next event on",
                file=sys.stderr,
                flush=True,
            )
    return 0


async def follow_token_file(
    path: Path, handle: WebhookCluster, token: str, *, interval: float = TOKEN_FILE_POLL_SECONDS
) -> None:
    """Put the token of ``path`` in force whenever it changes, the old one refused (no
    overlap), as the operator follows its Secret. A file that cannot be read or holds no
    usable token leaves the token in force as it is, and says so once per cause."""
    import asyncio

    from prorsa.clusters.auth import normalize_token

    current = normalize_token(token)
    problem: str | None = None
    while True:
        await asyncio.sleep(interval)
        try:
            fresh = normalize_token(await asyncio.to_thread(path.read_bytes))
        except (OSError, ValueError) as exc:
            if str(exc) != problem:
                problem = str(exc)
                print(
                    f"prorsa ingest: warning: --token-file {path}: {exc}; the token in force stays",
                    file=sys.stderr,
                    flush=True,
                )
            continue
        problem = None
        if fresh != current:
            handle.set_token(fresh)
            current = fresh
            print(
                f"prorsa ingest: {path} changed: its token is in force, the previous one is "
                "refused",
                file=sys.stderr,
                flush=True,
            )


def _tokens(n: float) -> str:
    if abs(n) >= 1e6:
        return f"{n / 1e6:.2f}M"
    if abs(n) >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{n:.0f}"


def format_progress(handle: WebhookCluster, *, since: int = 0) -> str:
    """One line per tick while recording: what has been recorded and what is live."""
    import time

    live = {k: v for k, v in handle.controller.live_trajectories().items() if v}
    parts = [
        f"recorded {handle.applied} events (+{handle.applied - since})",
        f"batches {handle.batches}",
        f"live {sum(live.values())}"
        + (": " + " ".join(f"{k} {v}" for k, v in live.items()) if live else ""),
    ]
    if handle.duplicates:
        parts.append(f"duplicates {handle.duplicates}")
    if handle.anomalies:
        parts.append(f"anomalies {handle.anomalies}")
    return time.strftime("%H:%M:%S") + " " + " | ".join(parts)


def format_decision(decision: Decision, handle: WebhookCluster, *, since: int = 0) -> str:
    """One line per tick: what a trainer developer watches while integrating."""
    import time

    f = decision.forecast
    parts = [
        f"{decision.mode:<10}",
        f"target {decision.target.prefill}P:{decision.target.decode}D",
        f"margin {decision.safety_margin:+.2f}",
    ]
    comps = [f"{k} {_tokens(v)}" for k, v in f.components.model_dump().items() if v]
    parts.append(
        f"prefill {_tokens(f.prefill_tokens)} tok" + (f" ({', '.join(comps)})" if comps else "")
    )
    parts.append(
        f"decode adm {_tokens(f.decode_admission_tokens)} kv {_tokens(f.decode_kv_tokens)}"
    )
    live = {k: v for k, v in handle.controller.live_trajectories().items() if v}
    total = sum(live.values())
    parts.append(
        f"live {total}" + (": " + " ".join(f"{k} {v}" for k, v in live.items()) if live else "")
    )
    parts.append(f"events {handle.applied} (+{handle.applied - since})")
    skew = handle.clock.skew()
    if skew is not None and abs(skew) >= 0.05:
        parts.append(f"trainer clock {skew:+.2f}s")
    if handle.resync:
        parts.append("awaiting snapshot")
    if decision.switches:
        parts.append(
            "switch " + ", ".join(f"{s.instance} {s.from_}->{s.to}" for s in decision.switches)
        )
    try:
        clock = time.strftime("%H:%M:%S", time.localtime(decision.at))
    except (OverflowError, OSError, ValueError):  # beyond what the platform's time_t holds
        clock = f"at {decision.at:g}"
    return f"{clock} " + " | ".join(parts) + f" | {decision.reason}"
