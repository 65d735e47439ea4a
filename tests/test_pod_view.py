"""The switch path's typed view of an engine pod (prorsa.switching.pod_view)."""

from __future__ import annotations

from typing import Any

import pytest

from prorsa.engines.agents import agent_address
from prorsa.k8s.lws import SET_NAME_LABEL
from prorsa.k8s.objects import AGENT_TLS_CERT_ENV
from prorsa.switching.pod_view import PodView
from prorsa_contract.labels import (
    CLUSTER_LABEL,
    GROUP_LABEL,
    NODE_RANK_LABEL,
    ROLE_LABEL,
    SWITCH_ANNOTATION,
    switch_intent,
)

DECODE = {CLUSTER_LABEL: "c", ROLE_LABEL: "decode"}


def manifest(**overrides: Any) -> dict[str, Any]:
    """A running, ready decode leader of cluster ``c`` in namespace ``rl``."""
    pod: dict[str, Any] = {
        "metadata": {
            "name": "c-engine-2",
            "namespace": "rl",
            "labels": DECODE,
        },
        "spec": {"containers": [{"name": "engine", "env": []}]},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.7",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    for key, value in overrides.items():
        pod[key] = {**pod[key], **value}
    return pod


def test_a_running_engine_pod_reads_as_routable() -> None:
    view = PodView.from_manifest(manifest())
    assert (view.name, view.namespace, view.ip, view.cluster) == (
        "c-engine-2",
        "rl",
        "10.0.0.7",
        "c",
    )
    assert (view.role, view.phase, view.ready, view.leader) == ("decode", "Running", True, True)
    assert not (view.grouped or view.lws_owned or view.tls or view.deleting)
    assert view.intent is None
    assert view.routable()


def test_a_pod_with_no_name_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"metadata\.name"):
        PodView.from_manifest({"metadata": {"namespace": "rl"}, "status": {}})
    with pytest.raises(ValueError, match=r"metadata\.name"):
        PodView.from_manifest({"status": {"podIP": "10.0.0.7"}})


def test_a_bare_manifest_gets_the_api_defaults() -> None:
    view = PodView.from_manifest({"metadata": {"name": "p"}})
    assert (view.namespace, view.ip, view.cluster, view.role, view.phase) == (
        "default",
        None,
        None,
        None,
        None,
    )
    assert view.leader and not view.ready and not view.routable()
    assert view.agent_address(port=8080, ca=None) is None  # no IP yet


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"metadata": {"name": "c-engine-2", "labels": {**DECODE, ROLE_LABEL: "draining"}}}, "out"),
        ({"metadata": {"name": "c-engine-2", "labels": {**DECODE, ROLE_LABEL: "up"}}}, "no role"),
        (
            {"metadata": {"name": "c-engine-2", "labels": {**DECODE, NODE_RANK_LABEL: "1"}}},
            "worker",
        ),
        ({"metadata": {"name": "c-engine-2", "labels": DECODE, "deletionTimestamp": "t"}}, "going"),
        ({"status": {"phase": "Pending"}}, "not running"),
        ({"status": {"podIP": ""}}, "no IP"),
        ({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}, "not ready"),
    ],
)
def test_what_the_router_does_not_route_to(change: dict[str, Any], why: str) -> None:
    assert not PodView.from_manifest(manifest(**change)).routable(), why


def test_group_lws_and_intent_are_read_from_labels_and_annotations() -> None:
    intent = switch_intent(to="prefill", phase="switching", started="t0", origin="decode")
    labels = {CLUSTER_LABEL: "c", ROLE_LABEL: "draining", GROUP_LABEL: "c-engine-2"}
    view = PodView.from_manifest(
        manifest(
            metadata={
                "name": "c-engine-2",
                "labels": {**labels, SET_NAME_LABEL: "c-engine-2"},
                "annotations": {SWITCH_ANNOTATION: intent},
            }
        )
    )
    assert view.grouped and view.lws_owned and view.role == "draining"
    assert view.intent == {"to": "prefill", "from": "decode", "phase": "switching", "started": "t0"}


@pytest.mark.parametrize("tls", [False, True])
def test_the_agent_address_is_the_one_the_control_loop_polls(tls: bool) -> None:
    env = [{"name": AGENT_TLS_CERT_ENV, "value": "/tls/tls.crt"}] if tls else []
    pod = manifest(spec={"containers": [{"name": "engine", "env": env}]})
    view = PodView.from_manifest(pod)
    assert view.tls is tls
    assert view.agent_address(port=8080, ca="PEM") == agent_address(pod, port=8080, ca="PEM")
    address = view.agent_address(port=8080, ca="PEM")
    assert address is not None
    assert address.url == ("https" if tls else "http") + "://10.0.0.7:8080"
    if tls:
        assert address.server_name == "c-engine-2.c-engines.rl.svc"
