"""``prorsa operator``: run the operator (kopf), cluster-wide or for some namespaces."""

from __future__ import annotations

import argparse
import logging
import os

HELP = "run the Kubernetes operator (kopf): RolloutClusters, webhook, metrics"


def configure(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch this namespace (repeat)"
    )
    parser.add_argument("--listen", default="0.0.0.0:8787", help="trainer webhook HOST:PORT")
    parser.add_argument(
        "--metrics-listen",
        default="0.0.0.0:8788",
        help="/metrics HOST:PORT, a port apart from the webhook's (empty: no metrics)",
    )
    parser.add_argument(
        "--webhook-tls-dir",
        help="directory with tls.crt and tls.key (a mounted kubernetes.io/tls Secret): the "
        "webhook and /metrics serve HTTPS, re-reading a renewed pair; without it, plain HTTP",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness probe URL; the readiness probe is /readyz on the same listener",
    )
    election = parser.add_argument_group(
        "leader election (several replicas, one acting: a Lease in --operator-namespace)"
    )
    election.add_argument(
        "--leader-elect", action="store_true", help="stand by until this replica holds the Lease"
    )
    election.add_argument("--leader-elect-resource-name", default="prorsa-operator")
    election.add_argument(
        "--leader-elect-lease-duration",
        type=float,
        default=15.0,
        help="seconds a standby waits on a Lease nobody renews before it takes it",
    )
    election.add_argument(
        "--leader-elect-renew-deadline",
        type=float,
        default=10.0,
        help="seconds the leader keeps acting without renewing the Lease",
    )
    election.add_argument(
        "--leader-elect-retry-period", type=float, default=2.0, help="seconds between tries"
    )
    parser.add_argument(
        "--pod-name",
        default=os.environ.get("POD_NAME") or None,
        help="this replica's pod (default $POD_NAME): labelled prorsa.io/leader=true while it "
        "leads, which the webhook Service selects",
    )
    parser.add_argument("--agent-port", type=int, default=8080, help="engine agents' port")
    parser.add_argument(
        "--operator-namespace", help="create the shared webhook Service in this namespace"
    )
    parser.add_argument(
        "--router-url-template",
        default="http://{name}-router.{namespace}.svc:{port}",
        help="how to reach a cluster's router ({name}, {namespace}, {port})",
    )
    parser.add_argument("--admission", action="store_true", help="serve validating admission")
    parser.add_argument(
        "--admission-tls-dir",
        help="directory with tls.crt, tls.key (and ca.crt) for the admission webhook; "
        "without it kopf self-signs (needs the certbuilder package)",
    )
    parser.add_argument("--kubeconfig", help="use this kubeconfig instead of in-cluster config")
    parser.add_argument(
        "--tick-seconds", type=float, help="control period (default: forecast.horizonSeconds)"
    )
    parser.add_argument("--verbose", "-v", action="store_true")


def run(args: argparse.Namespace) -> int:
    from prorsa.control.runtime import ClusterLoopSettings
    from prorsa.k8s.leader import LeaderElection
    from prorsa.shell.gc_tuning import tune_gc
    from prorsa.shell.handlers import OperatorSettings
    from prorsa.shell.process import run_operator

    tune_gc()

    host, port = _host_port("--listen", args.listen)
    metrics_host, metrics_port = (
        _host_port("--metrics-listen", args.metrics_listen) if args.metrics_listen else ("", None)
    )
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    clusterwide = args.all_namespaces or not args.namespace
    election = None
    if args.leader_elect:
        if not args.operator_namespace:
            raise SystemExit(
                "prorsa operator: error: --leader-elect needs --operator-namespace (the Lease's)"
            )
        try:
            election = LeaderElection(
                lease_name=args.leader_elect_resource_name,
                lease_duration=args.leader_elect_lease_duration,
                renew_deadline=args.leader_elect_renew_deadline,
                retry_period=args.leader_elect_retry_period,
            )
        except ValueError as exc:  # timings that leave the leader no time to stop
            raise SystemExit(f"prorsa operator: error: {exc}") from None
    config = OperatorSettings(
        namespaced=not clusterwide,
        namespaces=tuple(args.namespace),
        liveness=args.liveness or None,
        leader_election=election,
        pod_name=args.pod_name,
        listen_host=host,
        listen_port=port,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        webhook_tls_dir=args.webhook_tls_dir,
        operator_namespace=args.operator_namespace,
        admission=args.admission,
        admission_tls_dir=args.admission_tls_dir,
        login_kubeconfig=args.kubeconfig,
        options=ClusterLoopSettings(
            agent_port=args.agent_port,
            router_url_template=args.router_url_template,
            tick_seconds=args.tick_seconds,
        ),
    )
    try:
        return run_operator(config)
    except ValueError as exc:
        raise SystemExit(f"prorsa operator: error: {exc}") from None


def _host_port(flag: str, value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"prorsa operator: error: {flag} must be HOST:PORT, got {value!r}")
    return host, int(port)
