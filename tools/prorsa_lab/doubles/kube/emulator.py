"""An in-process Kubernetes API server for tests, CI and ``make demo`` (no cluster needed).

:class:`KubeEmulator` is a subclass of ``kmock.KubernetesEmulator`` (kmock 0.8, by kopf's
author) that fills the gaps listed below (and in docs/testing.md) so that kopf,
the official ``kubernetes`` client and ``kubectl`` behave against it as against a cluster:

* server-filled metadata: namespace from the URL, ``uid``, a ``resourceVersion`` that
  grows on every write, ``creationTimestamp``, a ``generation`` that moves on spec changes
  only, ``generateName``; with a ``status`` subresource the main endpoint keeps the status
  and ``/status`` changes only the status;
* 201 on create, PUT, 409 on duplicates and on stale ``resourceVersion`` s, merge,
  strategic-merge and RFC 6902 JSON patches (``test`` included, 422 when it fails),
  server-side apply (simplified), ``dryRun``;
* label and field selectors, paginated lists, watches that replay from a
  ``resourceVersion`` with nothing lost between a list and the watch, honour
  ``timeoutSeconds`` and end cleanly, 410 Gone once a version is compacted away;
* finalizers and ``deletionTimestamp``, garbage collection through ``ownerReferences``
  (background, foreground and orphan propagation), namespace termination, CRDs that
  register their resource when created through the API, structural pruning, defaulting
  and validation (CEL rules too when ``cel-python`` is installed), validating and mutating
  admission webhooks reached by ``clientConfig.url``;
* ``kubectl`` tables with a CRD's printer columns, and a pod-phase helper in lieu of a
  kubelet.

:class:`KubeEmulatorServer` serves it on 127.0.0.1 (an ephemeral port) and writes a
kubeconfig; ``with`` runs it on a thread of its own, ``async with`` in the current loop.
``python -m prorsa_lab.doubles.kube.emulator`` serves it until interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import pathlib
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any, Self

import aiohttp
import aiohttp.web
import attrs
import yaml

from prorsa_contract.aio import stop_requested
from prorsa_lab.doubles.kube.errors import ApiError
from prorsa_lab.doubles.kube.http_api import HttpApi
from prorsa_lab.doubles.kube.resources import (
    BUILTIN_RESOURCES,
    NAMESPACES_KEY,
    ResourceSpec,
)
from prorsa_lab.doubles.kube.store import (
    DEFAULT_TOKEN,
    ResourceRef,
)

__all__ = [
    "ApiError",
    "KubeEmulator",
    "KubeEmulatorServer",
    "ResourceRef",
    "ResourceSpec",
    "main",
    "write_kubeconfig",
]

SYSTEM_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


@attrs.define(kw_only=True)
class KubeEmulator(HttpApi):
    """kmock's Kubernetes emulator with an API server's semantics (see the module doc).

    One class assembled from layers, each a module named for what it does, each using only
    the layers below it: storage (``store``), validation, garbage collection, writes
    and patches, the Python object API (``create_object``, ``get_object``, ...), pod
    lifecycle, admission webhooks, watches and HTTP. Every change goes through one lock,
    so the Python API is safe to call from any thread, also while a server thread serves
    kopf; kmock reactions still take precedence over the emulator's HTTP answers.
    """

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for probe in ("/healthz", "/livez", "/readyz"):
            self.fallback[f"get {probe}"] << b"ok"
        self._own_reactions = len(self._payloads)
        self._log = collections.deque()
        for spec in BUILTIN_RESOURCES:
            self._register(spec)
        with self._state:
            for name in (*SYSTEM_NAMESPACES, *self.namespaces):
                if self._current(self._specs[NAMESPACES_KEY], None, name) is None:
                    self.create_object("v1/namespaces", {"metadata": {"name": name}})

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close_watches()
        await super().__aexit__(exc_type, exc_value, traceback)


# --- kubeconfig and the server ----------------------------------------------------------------


def write_kubeconfig(
    path: str | pathlib.Path,
    *,
    server: str,
    token: str = DEFAULT_TOKEN,
    namespace: str = "default",
    name: str = "prorsa-emulator",
) -> pathlib.Path:
    """Write a kubeconfig for ``server`` (plain http, a bearer token) and return its path."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server}}],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [
            {"name": name, "context": {"cluster": name, "user": name, "namespace": namespace}}
        ],
        "current-context": name,
        "preferences": {},
    }
    target = pathlib.Path(path)
    target.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return target


class KubeEmulatorServer:
    """Serve a :class:`KubeEmulator` on 127.0.0.1 with a kubeconfig pointing at it.

    ``async with KubeEmulatorServer() as kube:`` serves in the running event loop (then do
    not block that loop, e.g. with the synchronous ``kubernetes`` client; use a thread).
    ``with KubeEmulatorServer() as kube:`` serves from a thread with its own loop, so any
    client (sync or async, kopf's ``KopfRunner`` thread, ``kubectl``) can use it freely.
    """

    def __init__(
        self,
        emulator: KubeEmulator | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        kubeconfig_path: str | pathlib.Path | None = None,
        token: str = DEFAULT_TOKEN,
        namespace: str = "default",
        crds: Iterable[str | pathlib.Path] = (),
    ) -> None:
        self.emulator = emulator if emulator is not None else KubeEmulator()
        self.host, self.port = host, port
        self.token, self.namespace = token, namespace
        self.emulator.users.setdefault(token, "admin")
        self._kubeconfig_arg = pathlib.Path(kubeconfig_path) if kubeconfig_path else None
        self._tmpdir: pathlib.Path | None = None
        self._runner: aiohttp.web.ServerRunner | None = None
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self.kubeconfig_path: pathlib.Path | None = None
        for crd in crds:
            self.emulator.load_crds(crd)

    @property
    def url(self) -> str:
        if self._runner is None:
            raise RuntimeError("the emulator is not serving")
        return f"http://{self.host}:{self.port}"

    async def start(self) -> Self:
        """Serve in the running loop and write the kubeconfig."""
        await self.emulator.__aenter__()
        self.emulator._bind_loop()
        self.emulator._closing = False
        server = aiohttp.web.Server(self.emulator, handler_cancellation=True, access_log=None)
        self._runner = aiohttp.web.ServerRunner(server, shutdown_timeout=1.0)
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        if self._kubeconfig_arg is not None:
            path = self._kubeconfig_arg
        else:
            self._tmpdir = pathlib.Path(tempfile.mkdtemp(prefix="prorsa-kube-"))
            path = self._tmpdir / "kubeconfig"
        self.kubeconfig_path = write_kubeconfig(
            path, server=self.url, token=self.token, namespace=self.namespace
        )
        return self

    def kubeconfig_for(self, user: str, path: str | pathlib.Path) -> pathlib.Path:
        """A kubeconfig at ``path`` whose token the audit log attributes to ``user``."""
        return write_kubeconfig(
            path, server=self.url, token=self.emulator.add_user(user), namespace=self.namespace
        )

    async def stop(self) -> None:
        """End the watches, stop serving, and remove a kubeconfig this server created."""
        self.emulator.close_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.emulator.__aexit__(None, None, None)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    def start_in_thread(self) -> Self:
        """Serve from a daemon thread with its own loop; returns once the port is open."""
        ready: asyncio.Future[None] | None = None
        started = threading.Event()
        failure: list[BaseException] = []

        def target() -> None:
            nonlocal ready
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._thread_loop = loop
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self.stop())
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=target, name="kube-emulator", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        return self

    def stop_thread(self) -> None:
        loop, thread = self._thread_loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        self._thread = self._thread_loop = None

    def __enter__(self) -> Self:
        return self.start_in_thread()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop_thread()

    # --- clients --------------------------------------------------------------------------

    def kopf_connection_info(self) -> Any:
        """For ``@kopf.on.login()``: credentials of this server (kopf is imported lazily)."""
        import kopf

        return kopf.ConnectionInfo(
            server=self.url, scheme="Bearer", token=self.token, default_namespace=self.namespace
        )

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` configured from this server's kubeconfig."""
        return self.client_for(self.kubeconfig_path)

    @staticmethod
    def client_for(kubeconfig_path: str | pathlib.Path | None) -> Any:
        """A ``kubernetes.client.ApiClient`` for a kubeconfig file, read now (not at import)."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(
            config_file=str(kubeconfig_path), client_configuration=configuration
        )
        return client.ApiClient(configuration)


# --- CLI --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prorsa_lab.doubles.kube.emulator``: serve until interrupted, print the
    kubeconfig."""
    parser = argparse.ArgumentParser(
        prog="python -m prorsa_lab.doubles.kube.emulator",
        description=("Serve the in-process Kubernetes API emulator on 127.0.0.1."),
    )
    parser.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    parser.add_argument(
        "--kubeconfig",
        type=pathlib.Path,
        default=None,
        help="where to write the kubeconfig (default: a temporary file)",
    )
    parser.add_argument(
        "--crd",
        action="append",
        default=[],
        type=pathlib.Path,
        help="a CRD manifest file to register (repeatable)",
    )
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="a namespace to create at start (repeatable)",
    )
    parser.add_argument(
        "--leaderworkerset",
        action="store_true",
        help="install the LeaderWorkerSet CRD (leaderworkerset.x-k8s.io/v1); the fake LWS "
        "controller that creates its pods runs with prorsa_lab's stack",
    )
    parser.add_argument(
        "--pod-startup-seconds",
        type=float,
        default=None,
        help="mark new pods Running and Ready after this many seconds",
    )
    args = parser.parse_args(argv)

    async def serve() -> None:
        emulator = KubeEmulator(
            namespaces=args.namespace, pod_startup_seconds=args.pod_startup_seconds
        )
        if args.leaderworkerset:
            from prorsa_lab.doubles.kube.lws_controller import leader_worker_set_crd

            emulator.add_crd(leader_worker_set_crd())
        server = KubeEmulatorServer(
            emulator, port=args.port, kubeconfig_path=args.kubeconfig, crds=args.crd
        )
        with stop_requested() as stop:
            async with server:
                print(f"serving {server.url}", flush=True)
                print(f"export KUBECONFIG={server.kubeconfig_path}", flush=True)
                await stop.wait()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
