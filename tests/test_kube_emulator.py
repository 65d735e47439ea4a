"""The Kubernetes API emulator, driven over loopback HTTP by the clients the project uses.

Every test talks to a served :class:`KubeEmulatorServer` through the official ``kubernetes``
client, kopf, ``kubectl`` or raw aiohttp, and checks what a user of a real cluster would
see: status codes, server-filled metadata, watch events, garbage collection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import aiohttp
import aiohttp.web
import kopf
import pytest
from kopf.testing import KopfRunner
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from prorsa_lab.doubles.kube_emulator import KubeEmulator, KubeEmulatorServer

REPO = pathlib.Path(__file__).resolve().parent.parent
CRD_FILE = REPO / "crds" / "rolloutcluster.yaml"
RC = ("prorsa.io", "v1alpha1", "rolloutclusters")
T = TypeVar("T")


def wait_until(probe: Callable[[], T], *, timeout: float = 5.0) -> T:
    """Poll ``probe`` until it returns something truthy; fail with the last value."""
    deadline = time.monotonic() + timeout
    value = probe()
    while not value and time.monotonic() < deadline:
        time.sleep(0.02)
        value = probe()
    assert value, f"condition not met within {timeout}s (last: {value!r})"
    return value


@pytest.fixture
def kube() -> Iterator[KubeEmulatorServer]:
    emulator = KubeEmulator(namespaces=["rl"])
    with KubeEmulatorServer(emulator, crds=[CRD_FILE]) as server:
        yield server


@pytest.fixture
def api(kube: KubeEmulatorServer) -> Iterator[client.ApiClient]:
    with kube.api_client() as api_client:
        yield api_client


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture
def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def pod(name: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "engine", "image": "prorsa/engine:test"}]},
    }


def cluster(name: str, gpu_budget: int = 16) -> dict[str, Any]:
    return {
        "apiVersion": "prorsa.io/v1alpha1",
        "kind": "RolloutCluster",
        "metadata": {"name": name},
        "spec": {"model": {"path": "/models/m"}, "gpuBudget": gpu_budget},
    }


def status_of(exc: pytest.ExceptionInfo[ApiException]) -> dict[str, Any]:
    return json.loads(exc.value.body)


# -- CRUD with the official client ------------------------------------------------------------


def test_pod_crud_fills_metadata_and_refuses_conflicts(core: client.CoreV1Api) -> None:
    created = core.create_namespaced_pod("rl", pod("p1", role="prefill"))
    assert created is not None  # 201 with a body (kmock alone answered 200: the client got None)
    meta = created.metadata
    assert meta.namespace == "rl" and meta.uid and meta.creation_timestamp
    assert meta.generation == 1 and int(meta.resource_version) > 0
    assert created.status.phase == "Pending"

    with pytest.raises(ApiException) as dup:
        core.create_namespaced_pod("rl", pod("p1"))
    assert dup.value.status == 409 and status_of(dup)["reason"] == "AlreadyExists"

    # Strategic merge (the client's default for built-ins): labels merge, rv grows.
    patched = core.patch_namespaced_pod("p1", "rl", {"metadata": {"labels": {"x": "y"}}})
    assert patched.metadata.labels == {"role": "prefill", "x": "y"}
    assert int(patched.metadata.resource_version) > int(meta.resource_version)

    # PUT with the current version replaces; with a stale one it is a conflict.
    body = client.ApiClient().sanitize_for_serialization(core.read_namespaced_pod("p1", "rl"))
    body["metadata"]["annotations"] = {"note": "replaced"}
    replaced = core.replace_namespaced_pod("p1", "rl", body)
    assert replaced.metadata.annotations == {"note": "replaced"}
    body["metadata"]["annotations"] = {"note": "stale"}
    with pytest.raises(ApiException) as stale:
        core.replace_namespaced_pod("p1", "rl", body)
    assert stale.value.status == 409 and status_of(stale)["reason"] == "Conflict"

    # A merge patch carrying a stale resourceVersion is a conflict too.
    with pytest.raises(ApiException) as stale_patch:
        core.patch_namespaced_pod(
            "p1",
            "rl",
            {"metadata": {"resourceVersion": meta.resource_version, "labels": {"z": "1"}}},
        )
    assert stale_patch.value.status == 409

    generated = core.create_namespaced_pod(
        "rl", {"metadata": {"generateName": "worker-"}, "spec": pod("x")["spec"]}
    )
    assert generated.metadata.name.startswith("worker-") and len(generated.metadata.name) == 12
    names = sorted(p.metadata.name for p in core.list_namespaced_pod("rl").items)
    assert names == sorted(["p1", generated.metadata.name])

    core.delete_namespaced_pod("p1", "rl")
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_pod("p1", "rl")
    assert gone.value.status == 404


def test_strategic_merge_merges_keyed_lists_like_a_cluster(core: client.CoreV1Api) -> None:
    body = pod("two")
    body["spec"]["containers"].append(
        {"name": "agent", "image": "prorsa/agent:1", "env": [{"name": "A", "value": "1"}]}
    )
    core.create_namespaced_pod("rl", body)
    patch = {"spec": {"containers": [{"name": "agent", "env": [{"name": "B", "value": "2"}]}]}}
    merged = core.patch_namespaced_pod("two", "rl", patch)
    containers = {c.name: c for c in merged.spec.containers}
    assert set(containers) == {"engine", "agent"}  # merged by name, not replaced
    assert [(e.name, e.value) for e in containers["agent"].env] == [("A", "1"), ("B", "2")]
    assert containers["agent"].image == "prorsa/agent:1"
    dropped = core.patch_namespaced_pod(
        "two", "rl", {"spec": {"containers": [{"name": "agent", "$patch": "delete"}]}}
    )
    assert [c.name for c in dropped.spec.containers] == ["engine"]
    # A merge patch replaces lists, as RFC 7386 says.
    replaced = core.patch_namespaced_pod(
        "two",
        "rl",
        {"metadata": {"finalizers": ["a"]}},
        _content_type="application/merge-patch+json",
    )
    assert replaced.metadata.finalizers == ["a"]
    unioned = core.patch_namespaced_pod("two", "rl", {"metadata": {"finalizers": ["b"]}})
    assert unioned.metadata.finalizers == ["a", "b"]  # finalizers merge as a set under SMP


def test_writes_are_validated_like_a_cluster(
    core: client.CoreV1Api, custom: client.CustomObjectsApi
) -> None:
    with pytest.raises(ApiException) as no_ns:
        core.create_namespaced_pod("missing", pod("p"))
    assert no_ns.value.status == 404
    assert status_of(no_ns)["message"] == 'namespaces "missing" not found'
    body = cluster("c") | {"metadata": {"name": "c", "labels": {"replicas": 3}}}
    with pytest.raises(ApiException) as bad_label:  # the typed client refuses it client-side
        custom.create_namespaced_custom_object(*RC[:2], "rl", RC[2], body)
    assert bad_label.value.status == 422 and "metadata.labels.replicas" in bad_label.value.body
    with pytest.raises(ApiException) as bad_name:
        core.create_namespaced_config_map("rl", {"metadata": {"name": "Upper_Case"}})
    assert bad_name.value.status == 422


def test_namespaces_list_and_termination(core: client.CoreV1Api) -> None:
    names = {n.metadata.name for n in core.list_namespace().items}
    assert {"default", "kube-system", "rl"} <= names
    core.create_namespace({"metadata": {"name": "scratch"}})
    core.create_namespaced_config_map("scratch", {"metadata": {"name": "c"}, "data": {"a": "b"}})
    core.create_namespaced_secret(
        "scratch", {"metadata": {"name": "s"}, "stringData": {"token": "t0k"}}
    )
    secret = core.read_namespaced_secret("s", "scratch")
    assert secret.data == {"token": "dDBr"} and secret.type == "Opaque"  # stringData encoded
    core.delete_namespace("scratch")
    with pytest.raises(ApiException):
        core.read_namespace("scratch")
    assert core.list_namespaced_config_map("scratch").items == []


# -- custom resources and the status subresource ---------------------------------------------


def test_custom_resource_status_subresource(custom: client.CustomObjectsApi) -> None:
    body = cluster("c1") | {"status": {"phase": "Running"}}
    created = custom.create_namespaced_custom_object(*RC[:2], "rl", RC[2], body)
    assert "phase" not in created.get("status", {})  # status is ignored on create
    assert created["spec"]["engine"]["gpusPerInstance"] == 8  # CRD default applied
    assert created["metadata"]["generation"] == 1

    # The status endpoint changes only the status: spec edits there are ignored.
    after_status = custom.patch_namespaced_custom_object_status(
        *RC[:2], "rl", RC[2], "c1", {"status": {"phase": "Running"}, "spec": {"gpuBudget": 99}}
    )
    assert after_status["status"]["phase"] == "Running"
    assert after_status["spec"]["gpuBudget"] == 16
    assert after_status["metadata"]["generation"] == 1

    # The main endpoint ignores status and bumps generation on spec changes only.
    after_spec = custom.patch_namespaced_custom_object(
        *RC[:2], "rl", RC[2], "c1", {"spec": {"gpuBudget": 24}, "status": {"phase": "Degraded"}}
    )
    assert after_spec["spec"]["gpuBudget"] == 24
    assert after_spec["status"]["phase"] == "Running"
    assert after_spec["metadata"]["generation"] == 2
    labelled = custom.patch_namespaced_custom_object(
        *RC[:2], "rl", RC[2], "c1", {"metadata": {"labels": {"team": "rl"}}}
    )
    assert labelled["metadata"]["generation"] == 2

    # Undeclared fields are pruned, schema violations are refused naming the field.
    pruned = custom.patch_namespaced_custom_object_status(
        *RC[:2], "rl", RC[2], "c1", {"status": {"notInSchema": 1}}
    )
    assert "notInSchema" not in pruned["status"]
    with pytest.raises(ApiException) as invalid:
        custom.create_namespaced_custom_object(*RC[:2], "rl", RC[2], cluster("c2", gpu_budget=0))
    assert invalid.value.status == 422 and "spec.gpuBudget" in invalid.value.body
    with pytest.raises(ApiException) as cel:
        custom.create_namespaced_custom_object(*RC[:2], "rl", RC[2], cluster("c3", gpu_budget=12))
    assert cel.value.status == 422 and "multiple of engine.gpusPerInstance" in cel.value.body


def test_json_patch_test_op_on_resource_version(custom: client.CustomObjectsApi) -> None:
    created = custom.create_namespaced_custom_object(*RC[:2], "rl", RC[2], cluster("c1"))
    rv = created["metadata"]["resourceVersion"]
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/metadata/finalizers", "value": ["prorsa.io/cleanup"]},
    ]
    patched = custom.patch_namespaced_custom_object(
        *RC[:2], "rl", RC[2], "c1", ops, _content_type="application/json-patch+json"
    )
    assert patched["metadata"]["finalizers"] == ["prorsa.io/cleanup"]
    with pytest.raises(ApiException) as failed:  # same rv again: now stale
        custom.patch_namespaced_custom_object(
            *RC[:2], "rl", RC[2], "c1", ops, _content_type="application/json-patch+json"
        )
    assert failed.value.status == 422  # what kopf expects to retry on


def test_crd_created_through_the_api_registers_its_resource(api: client.ApiClient) -> None:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com",
            "scope": "Cluster",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }
    stored = client.ApiextensionsV1Api(api).create_custom_resource_definition(crd)
    established = {c.type: c.status for c in stored.status.conditions}
    assert established["Established"] == "True"
    objects = client.CustomObjectsApi(api)
    widget = objects.create_cluster_custom_object(
        "example.com",
        "v1",
        "widgets",
        {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "x": 1},
    )
    assert widget["metadata"]["uid"] and "namespace" not in widget["metadata"]
    # Deleting the CRD deletes its objects, then the resource is gone from the API.
    client.ApiextensionsV1Api(api).delete_custom_resource_definition("widgets.example.com")
    with pytest.raises(ApiException) as gone:
        objects.list_cluster_custom_object("example.com", "v1", "widgets")
    assert gone.value.status == 404


def test_declared_resource_without_status_subresource(kube: KubeEmulatorServer) -> None:
    spec = kube.emulator.add_custom_resource(
        group="example.com",
        version="v1",
        plural="jobs",
        kind="Job",
        status_subresource=False,
        short_names=["ej"],
    )
    assert spec.namespaced and not spec.has_status
    assert kube.emulator.get_object("customresourcedefinitions", "jobs.example.com") is not None
    with kube.api_client() as api:
        objects = client.CustomObjectsApi(api)
        created = objects.create_namespaced_custom_object(
            "example.com",
            "v1",
            "rl",
            "jobs",
            {
                "apiVersion": "example.com/v1",
                "kind": "Job",
                "metadata": {"name": "j"},
                "spec": {"n": 1},
                "status": {"done": False},
            },
        )
        assert created["status"] == {"done": False}  # no subresource: status is plain data
        updated = objects.patch_namespaced_custom_object(
            "example.com", "v1", "rl", "jobs", "j", {"status": {"done": True}}
        )
        assert updated["status"] == {"done": True}
        assert updated["metadata"]["generation"] == 2  # every non-metadata change counts
        with pytest.raises(ApiException) as no_status:
            objects.get_namespaced_custom_object_status("example.com", "v1", "rl", "jobs", "j")
        assert no_status.value.status == 404


def test_pagination_deletecollection_and_dry_run(core: client.CoreV1Api) -> None:
    for i in range(5):
        core.create_namespaced_config_map(
            "rl", {"metadata": {"name": f"c{i}", "labels": {"batch": str(i % 2)}}}
        )
    first = core.list_namespaced_config_map("rl", limit=2)
    assert [c.metadata.name for c in first.items] == ["c0", "c1"]
    assert first.metadata.remaining_item_count == 3
    names = [c.metadata.name for c in first.items]
    token = first.metadata._continue
    while token:
        page = core.list_namespaced_config_map("rl", limit=2, _continue=token)
        names += [c.metadata.name for c in page.items]
        token = page.metadata._continue
    assert names == ["c0", "c1", "c2", "c3", "c4"]

    dry = core.create_namespaced_config_map("rl", {"metadata": {"name": "dry"}}, dry_run="All")
    assert dry.metadata.name == "dry"
    with pytest.raises(ApiException):
        core.read_namespaced_config_map("dry", "rl")

    core.delete_collection_namespaced_config_map("rl", label_selector="batch=0")
    left = sorted(c.metadata.name for c in core.list_namespaced_config_map("rl").items)
    assert left == ["c1", "c3"]


# -- selectors and watches --------------------------------------------------------------------


def test_label_and_field_selectors(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("rl", pod("a", role="prefill", cluster="c"))
    core.create_namespaced_pod("rl", pod("b", role="decode", cluster="c"))
    core.create_namespaced_pod("rl", pod("d", role="draining"))
    core.create_namespaced_pod("default", pod("e", role="prefill"))

    def names(**kwargs: Any) -> list[str]:
        return sorted(p.metadata.name for p in core.list_pod_for_all_namespaces(**kwargs).items)

    assert names(label_selector="role=prefill") == ["a", "e"]
    assert names(label_selector="role==prefill,cluster=c") == ["a"]
    assert names(label_selector="role!=prefill") == ["b", "d"]
    assert names(label_selector="cluster") == ["a", "b"]
    assert names(label_selector="!cluster") == ["d", "e"]
    assert names(label_selector="role in (prefill, decode)") == ["a", "b", "e"]
    assert names(label_selector="role notin (prefill,decode),cluster") == []
    assert names(field_selector="metadata.name=b") == ["b"]
    assert names(field_selector="metadata.namespace!=rl") == ["e"]
    assert names(field_selector="metadata.namespace=rl,metadata.name!=a") == ["b", "d"]
    with pytest.raises(ApiException) as bad:
        core.list_pod_for_all_namespaces(label_selector="role in prefill")
    assert bad.value.status == 400
    with pytest.raises(ApiException) as unsupported:
        core.list_pod_for_all_namespaces(field_selector="spec.notAField=x")
    assert unsupported.value.status == 400


def collect(stream_fn: Callable[..., Any], count: int, **kwargs: Any) -> list[tuple[str, str, str]]:
    """Read ``count`` watch events (type, name, resourceVersion), then stop watching."""
    events: list[tuple[str, str, str]] = []
    w = watch.Watch()
    for event in w.stream(stream_fn, timeout_seconds=5, **kwargs):
        obj = event["object"]
        events.append((event["type"], obj.metadata.name, obj.metadata.resource_version))
        if len(events) >= count:
            w.stop()
    return events


def test_watch_after_list_loses_nothing(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("rl", pod("before"))
    listed = core.list_namespaced_pod("rl")
    # Writes between the list and the watch must be replayed from the list's version.
    core.create_namespaced_pod("rl", pod("during"))
    core.patch_namespaced_pod("before", "rl", {"metadata": {"labels": {"seen": "yes"}}})
    core.delete_namespaced_pod("during", "rl")
    events = collect(
        core.list_namespaced_pod,
        3,
        namespace="rl",
        resource_version=listed.metadata.resource_version,
    )
    assert [(t, n) for t, n, _ in events] == [
        ("ADDED", "during"),
        ("MODIFIED", "before"),
        ("DELETED", "during"),
    ]
    versions = [int(rv) for _, _, rv in events]
    assert versions == sorted(versions) and versions[0] > int(listed.metadata.resource_version)


def test_watch_delivers_live_events_and_honours_timeout(core: client.CoreV1Api) -> None:
    rv = core.list_namespaced_pod("rl").metadata.resource_version

    def writer() -> None:
        time.sleep(0.2)
        core.create_namespaced_pod("rl", pod("live", role="prefill"))
        core.patch_namespaced_pod("live", "rl", {"metadata": {"labels": {"role": "draining"}}})

    thread = threading.Thread(target=writer)
    thread.start()
    # A selector watch sees the pod leave its selection as DELETED, as informers expect.
    events = collect(
        core.list_namespaced_pod,
        2,
        namespace="rl",
        resource_version=rv,
        label_selector="role=prefill",
    )
    thread.join()
    assert [(t, n) for t, n, _ in events] == [("ADDED", "live"), ("DELETED", "live")]

    started = time.monotonic()
    quiet = list(
        watch.Watch().stream(
            core.list_namespaced_pod,
            "rl",
            resource_version=core.list_namespaced_pod("rl").metadata.resource_version,
            timeout_seconds=1,
        )
    )
    assert quiet == [] and 0.9 < time.monotonic() - started < 4


def test_watch_from_a_compacted_version_is_gone() -> None:
    emulator = KubeEmulator(event_log_limit=5)
    with KubeEmulatorServer(emulator) as kube, kube.api_client() as api:
        core = client.CoreV1Api(api)
        old = core.list_namespaced_pod("default").metadata.resource_version
        for i in range(10):
            core.create_namespaced_config_map("default", {"metadata": {"name": f"c{i}"}})
        with pytest.raises(ApiException) as gone:
            list(
                watch.Watch().stream(
                    core.list_namespaced_pod, "default", resource_version=old, timeout_seconds=2
                )
            )
        assert gone.value.status == 410


async def test_async_server_streams_a_watch_to_aiohttp() -> None:
    async with KubeEmulatorServer() as kube, aiohttp.ClientSession(kube.url) as http:
        headers = {"Authorization": "Bearer anything"}
        async with http.get("/api/v1/namespaces", headers=headers) as reply:
            listing = await reply.json()
        assert reply.status == 200 and listing["kind"] == "NamespaceList"
        rv = listing["metadata"]["resourceVersion"]
        url = f"/api/v1/namespaces/default/configmaps?watch=true&resourceVersion={rv}"
        async with http.get(url + "&timeoutSeconds=5", headers=headers) as stream:
            kube.emulator.create_object(
                "configmaps", {"metadata": {"name": "c", "namespace": "default"}}
            )
            line = await asyncio.wait_for(stream.content.readline(), timeout=5)
        event = json.loads(line)
        assert event["type"] == "ADDED" and event["object"]["metadata"]["name"] == "c"


# -- deletion: finalizers and garbage collection ---------------------------------------------


def test_finalizers_hold_deletion_until_removed(core: client.CoreV1Api) -> None:
    body = pod("held")
    body["metadata"]["finalizers"] = ["prorsa.io/drain"]
    core.create_namespaced_pod("rl", body)
    rv = core.list_namespaced_pod("rl").metadata.resource_version
    deleted = core.delete_namespaced_pod("held", "rl")
    assert deleted.metadata.deletion_timestamp is not None
    still = core.read_namespaced_pod("held", "rl")
    assert still.metadata.finalizers == ["prorsa.io/drain"]
    with pytest.raises(ApiException) as no_new:
        core.patch_namespaced_pod(
            "held", "rl", {"metadata": {"finalizers": ["prorsa.io/drain", "other"]}}
        )
    assert no_new.value.status == 422
    core.patch_namespaced_pod(
        "held", "rl", {"metadata": {"$deleteFromPrimitiveList/finalizers": ["prorsa.io/drain"]}}
    )
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_pod("held", "rl")
    assert gone.value.status == 404
    events = collect(core.list_namespaced_pod, 3, namespace="rl", resource_version=rv)
    assert [t for t, _, _ in events] == ["MODIFIED", "MODIFIED", "DELETED"]


def test_owner_references_garbage_collection(
    core: client.CoreV1Api, custom: client.CustomObjectsApi
) -> None:
    owner = custom.create_namespaced_custom_object(*RC[:2], "rl", RC[2], cluster("c1"))
    other = custom.create_namespaced_custom_object(*RC[:2], "rl", RC[2], cluster("c2"))

    def ref(obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return {
            "apiVersion": "prorsa.io/v1alpha1",
            "kind": "RolloutCluster",
            "name": meta["name"],
            "uid": meta["uid"],
            "controller": False,
        }

    solo, shared = pod("solo"), pod("shared")
    solo["metadata"]["ownerReferences"] = [ref(owner)]
    shared["metadata"]["ownerReferences"] = [ref(owner), ref(other)]
    core.create_namespaced_pod("rl", solo)
    core.create_namespaced_pod("rl", shared)
    core.create_namespaced_service(
        "rl",
        {
            "metadata": {"name": "svc", "ownerReferences": [ref(owner)]},
            "spec": {"ports": [{"port": 80}]},
        },
    )
    custom.delete_namespaced_custom_object(*RC[:2], "rl", RC[2], "c1")
    remaining = sorted(p.metadata.name for p in core.list_namespaced_pod("rl").items)
    assert remaining == ["shared"]  # still owned by c2
    refs = core.read_namespaced_pod("shared", "rl").metadata.owner_references
    assert [r.name for r in refs] == ["c2"]  # the dangling reference is dropped
    assert core.list_namespaced_service("rl").items == []

    # Orphan propagation keeps the dependents and drops the reference.
    custom.delete_namespaced_custom_object(*RC[:2], "rl", RC[2], "c2", propagation_policy="Orphan")
    orphan = core.read_namespaced_pod("shared", "rl")
    assert not orphan.metadata.owner_references


def test_foreground_deletion_waits_for_dependents(
    core: client.CoreV1Api, custom: client.CustomObjectsApi
) -> None:
    owner = custom.create_namespaced_custom_object(*RC[:2], "rl", RC[2], cluster("c1"))
    dependent = pod("held")
    dependent["metadata"]["finalizers"] = ["prorsa.io/drain"]
    dependent["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "prorsa.io/v1alpha1",
            "kind": "RolloutCluster",
            "name": "c1",
            "uid": owner["metadata"]["uid"],
            "blockOwnerDeletion": True,
        }
    ]
    core.create_namespaced_pod("rl", dependent)
    custom.delete_namespaced_custom_object(
        *RC[:2], "rl", RC[2], "c1", propagation_policy="Foreground"
    )
    waiting = custom.get_namespaced_custom_object(*RC[:2], "rl", RC[2], "c1")
    assert "foregroundDeletion" in waiting["metadata"]["finalizers"]
    assert core.read_namespaced_pod("held", "rl").metadata.deletion_timestamp is not None
    core.patch_namespaced_pod("held", "rl", {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as gone:
        custom.get_namespaced_custom_object(*RC[:2], "rl", RC[2], "c1")
    assert gone.value.status == 404


# -- helpers, reactions, admission -------------------------------------------------------------


def test_pod_status_helper_moves_pods_through_phases(
    kube: KubeEmulatorServer, core: client.CoreV1Api
) -> None:
    core.create_namespaced_pod("rl", pod("engine-0"))
    kube.emulator.set_pod_status("rl", "engine-0", phase="Running")
    running = core.read_namespaced_pod("engine-0", "rl")
    ready = {c.type: c.status for c in running.status.conditions}
    assert running.status.phase == "Running" and ready["Ready"] == "True"
    assert running.status.pod_ip and running.status.container_statuses[0].ready
    kube.emulator.set_pod_status("rl", "engine-0", phase="Failed", reason="OOMKilled")
    failed = core.read_namespaced_pod("engine-0", "rl")
    assert failed.status.phase == "Failed"
    assert failed.status.container_statuses[0].state.terminated.reason == "OOMKilled"
    assert failed.status.pod_ip == running.status.pod_ip


def test_pods_start_by_themselves_when_asked() -> None:
    emulator = KubeEmulator(pod_startup_seconds=0.05)
    with KubeEmulatorServer(emulator) as kube, kube.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod("default", pod("auto"))
        wait_until(lambda: core.read_namespaced_pod("auto", "default").status.phase == "Running")


def test_kmock_reactions_take_precedence(kube: KubeEmulatorServer, core: client.CoreV1Api) -> None:
    kube.emulator["get /api/v1/namespaces/rl/pods"] << 503 << {"kind": "Status", "code": 503}
    with pytest.raises(ApiException) as injected:
        core.list_namespaced_pod("rl")
    assert injected.value.status == 503
    assert core.list_namespaced_pod("default").items == []
    # kmock's request views see the emulator's parsed requests.
    creates = kube.emulator[kube.emulator.action.CREATE]
    core.create_namespaced_pod("rl", pod("p"))
    assert [(r.namespace, r.data["metadata"]["name"]) for r in creates] == [("rl", "p")]


async def test_validating_and_mutating_webhooks_are_called() -> None:
    reviews: list[dict[str, Any]] = []

    async def validate(request: aiohttp.web.Request) -> aiohttp.web.Response:
        review = await request.json()
        reviews.append(review)
        spec = review["request"]["object"]["spec"]
        allowed = spec["gpuBudget"] <= 64
        response: dict[str, Any] = {"uid": review["request"]["uid"], "allowed": allowed}
        if not allowed:
            response["status"] = {"code": 422, "message": "spec.gpuBudget: too many GPUs"}
        return aiohttp.web.json_response(
            {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
        )

    async def mutate(request: aiohttp.web.Request) -> aiohttp.web.Response:
        import base64

        review = await request.json()
        patch = [{"op": "add", "path": "/metadata/labels", "value": {"mutated": "yes"}}]
        return aiohttp.web.json_response(
            {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "response": {
                    "uid": review["request"]["uid"],
                    "allowed": True,
                    "patchType": "JSONPatch",
                    "patch": base64.b64encode(json.dumps(patch).encode()).decode(),
                },
            }
        )

    app = aiohttp.web.Application()
    app.router.add_post("/validate", validate)
    app.router.add_post("/mutate", mutate)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    rule = {
        "operations": ["CREATE", "UPDATE"],
        "apiGroups": ["prorsa.io"],
        "apiVersions": ["*"],
        "resources": ["rolloutclusters"],
    }
    try:
        async with KubeEmulatorServer(crds=[CRD_FILE]) as kube:
            emulator = kube.emulator
            for kind, path in (("Validating", "validate"), ("Mutating", "mutate")):
                emulator.create_object(
                    f"admissionregistration.k8s.io/v1/{kind.lower()}webhookconfigurations",
                    {
                        "metadata": {"name": path},
                        "webhooks": [
                            {
                                "name": f"{path}.prorsa.io",
                                "rules": [rule],
                                "clientConfig": {"url": f"http://127.0.0.1:{port}/{path}"},
                                "admissionReviewVersions": ["v1"],
                                "sideEffects": "None",
                            }
                        ],
                    },
                )
            url = f"{kube.url}/apis/prorsa.io/v1alpha1/namespaces/default/rolloutclusters"
            async with aiohttp.ClientSession() as http:
                async with http.post(url, json=cluster("big", gpu_budget=128)) as denied:
                    refusal = await denied.json()
                async with http.post(url, json=cluster("ok")) as accepted:
                    stored = await accepted.json()
        assert denied.status == 422 and "spec.gpuBudget: too many GPUs" in refusal["message"]
        assert accepted.status == 201 and stored["metadata"]["labels"] == {"mutated": "yes"}
        assert reviews[-1]["request"]["object"]["metadata"]["labels"] == {"mutated": "yes"}
        assert reviews[-1]["request"]["operation"] == "CREATE"
    finally:
        await runner.cleanup()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
async def test_https_webhook_is_verified_with_the_ca_bundle(tmp_path: pathlib.Path) -> None:
    import base64
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    seen: list[str] = []

    async def deny(request: aiohttp.web.Request) -> aiohttp.web.Response:
        review = await request.json()
        seen.append(review["request"]["name"])
        return aiohttp.web.json_response(
            {
                "response": {
                    "uid": review["request"]["uid"],
                    "allowed": False,
                    "status": {"code": 403, "reason": "Forbidden", "message": "no secrets today"},
                }
            }
        )

    app = aiohttp.web.Application()
    app.router.add_post("/deny", deny)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with KubeEmulatorServer() as kube, aiohttp.ClientSession(kube.url) as http:
            kube.emulator.create_object(
                "validatingwebhookconfigurations",
                {
                    "metadata": {"name": "deny"},
                    "webhooks": [
                        {
                            "name": "deny.prorsa.io",
                            "rules": [
                                {
                                    "operations": ["CREATE"],
                                    "apiGroups": [""],
                                    "apiVersions": ["v1"],
                                    "resources": ["secrets"],
                                }
                            ],
                            "clientConfig": {
                                "url": f"https://127.0.0.1:{port}/deny",
                                "caBundle": base64.b64encode(cert.read_bytes()).decode(),
                            },
                        }
                    ],
                },
            )
            async with http.post(
                "/api/v1/namespaces/default/secrets", json={"metadata": {"name": "s"}}
            ) as denied:
                refusal = await denied.json()
            async with http.post(
                "/api/v1/namespaces/default/configmaps", json={"metadata": {"name": "c"}}
            ) as unmatched:
                assert unmatched.status == 201
        assert denied.status == 403 and refusal["message"].endswith("no secrets today")
        assert seen == ["s"]
    finally:
        await runner.cleanup()


def _proto_field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (enough to build a DeleteOptions by hand)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


async def test_protobuf_delete_options_are_honoured() -> None:
    # helm (client-go typed clients) sends DeleteOptions as protobuf, not JSON.
    type_meta = _proto_field(1, b"meta.k8s.io/v1") + _proto_field(2, b"DeleteOptions")
    options = _proto_field(4, b"Orphan")
    envelope = b"k8s\x00" + _proto_field(1, type_meta) + _proto_field(2, options)
    async with KubeEmulatorServer() as kube, aiohttp.ClientSession(kube.url) as http:
        owner = kube.emulator.create_object(
            "configmaps", {"metadata": {"name": "owner", "namespace": "default"}}
        )
        ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
               "uid": owner["metadata"]["uid"]}  # fmt: skip
        kube.emulator.create_object(
            "configmaps",
            {"metadata": {"name": "dependent", "namespace": "default", "ownerReferences": [ref]}},
        )
        headers = {"Content-Type": "application/vnd.kubernetes.protobuf"}
        url = "/api/v1/namespaces/default/configmaps/owner"
        async with http.delete(url, data=envelope, headers=headers) as deleted:
            assert deleted.status == 200
        left = kube.emulator.get_object("configmaps", "dependent", namespace="default")
        assert left is not None and "ownerReferences" not in left["metadata"]
        async with http.post(
            "/api/v1/namespaces/default/pods",
            data=b"k8s\x00" + _proto_field(2, b""),
            headers=headers,
        ) as refused:
            assert refused.status == 415


# -- kopf and kubectl ---------------------------------------------------------------------------


def test_kopf_operator_creates_a_pod_and_writes_status(kube: KubeEmulatorServer) -> None:
    registry = kopf.OperatorRegistry()
    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 2
    settings.watching.client_timeout = 5
    settings.watching.reconnect_backoff = 0.1
    settings.posting.enabled = True
    settings.posting.level = logging.INFO

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kube.kopf_connection_info()

    @kopf.on.create(*RC, registry=registry)
    def create_engine(
        body: kopf.Body, name: str, namespace: str, patch: kopf.Patch, **_: Any
    ) -> None:
        engine = pod(f"{name}-engine-0", **{"prorsa.io/cluster": name})
        kopf.adopt(engine, owner=body)
        with kube.api_client() as api:
            client.CoreV1Api(api).create_namespaced_pod(namespace, engine)
        kopf.info(body, reason="EngineCreated", message=engine["metadata"]["name"])
        patch.status["phase"] = "Running"

    cleaned: list[str] = []

    @kopf.on.delete(*RC, registry=registry)
    def clean_up(name: str, **_: Any) -> None:
        cleaned.append(name)

    def current() -> dict[str, Any]:
        return kube.emulator.get_object("rolloutclusters", "c1", namespace="rl") or {}

    args = ["run", "--all-namespaces", "--standalone"]
    with KopfRunner(args, registry=registry, settings=settings, timeout=20) as runner:
        kube.emulator.create_object("rolloutclusters", cluster("c1"), namespace="rl")
        engine = wait_until(
            lambda: kube.emulator.get_object("pods", "c1-engine-0", namespace="rl"), timeout=15
        )
        owner = kube.emulator.get_object("rolloutclusters", "c1", namespace="rl")
        assert owner is not None
        assert engine["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
        wait_until(lambda: current().get("status", {}).get("phase") == "Running")
        # The delete handler made kopf add its finalizer (a JSON patch with a `test` op).
        assert current()["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]
        wait_until(
            lambda: any(
                e.get("reason") == "EngineCreated"
                for e in kube.emulator.list_objects("v1/events", namespace="rl")
            )
        )
        kube.emulator.delete_object("rolloutclusters", "c1", namespace="rl")
        assert current()["metadata"]["deletionTimestamp"]  # held by kopf's finalizer
        wait_until(lambda: not current())  # kopf ran the handler and released it
        assert cleaned == ["c1"]
        assert kube.emulator.get_object("pods", "c1-engine-0", namespace="rl") is None  # collected
    assert runner.exit_code == 0, runner.output
    assert "Traceback" not in runner.output, runner.output


needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


def kubectl(kube: KubeEmulatorServer, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    return subprocess.run(
        ["kubectl", "--kubeconfig", str(kube.kubeconfig_path), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )


@needs_kubectl
def test_kubectl_lists_pods_and_printer_columns(
    kube: KubeEmulatorServer, core: client.CoreV1Api
) -> None:
    core.create_namespaced_pod("rl", pod("engine-0"))
    kube.emulator.set_pod_status("rl", "engine-0", phase="Running")
    listed = kubectl(kube, "get", "pods", "-A")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()[:2]
    assert header.split()[:4] == ["NAMESPACE", "NAME", "READY", "STATUS"]
    assert row.split()[:4] == ["rl", "engine-0", "1/1", "Running"]

    manifest = json.dumps(cluster("c1") | {"metadata": {"name": "c1", "namespace": "rl"}})
    applied = subprocess.run(
        [
            "kubectl",
            "--kubeconfig",
            str(kube.kubeconfig_path),
            "apply",
            "--validate=false",
            "-f",
            "-",
        ],
        input=manifest,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert applied.returncode == 0, applied.stderr
    kube.emulator.patch_object(
        "rolloutclusters",
        "c1",
        {"status": {"instances": {"prefill": 2, "decode": 6}}},
        namespace="rl",
        subresource="status",
    )
    printed = kubectl(kube, "get", "rolloutclusters", "-n", "rl")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.split()[:3] == ["NAME", "PREFILL", "DECODE"]
    assert printed.stdout.splitlines()[1].split()[:3] == ["c1", "2", "6"]


@needs_kubectl
def test_kubectl_create_generators_and_wait(kube: KubeEmulatorServer) -> None:
    # These subcommands post protobuf; the emulator decodes their four kinds.
    for args in (
        ("create", "namespace", "demo"),
        ("create", "secret", "generic", "trainer-token", "-n", "demo", "--from-literal=token=t0k"),
        ("create", "configmap", "settings", "-n", "demo", "--from-literal=mode=auto"),
        ("create", "serviceaccount", "prorsa", "-n", "demo"),
        ("label", "namespace", "demo", "team=rl"),
    ):
        done = kubectl(kube, *args)
        assert done.returncode == 0, done.stderr
    secret = kube.emulator.get_object("secrets", "trainer-token", namespace="demo")
    assert secret is not None and secret["data"] == {"token": "dDBr"}
    namespace = kube.emulator.get_object("namespaces", "demo")
    assert namespace is not None and namespace["metadata"]["labels"]["team"] == "rl"

    kube.emulator.create_object("pods", pod("engine-0"), namespace="demo")
    threading.Timer(0.3, kube.emulator.set_pod_status, ("demo", "engine-0")).start()
    waited = kubectl(
        kube, "wait", "-n", "demo", "--for=condition=Ready", "pod/engine-0", "--timeout=10s"
    )
    assert waited.returncode == 0 and "condition met" in waited.stdout, waited.stderr


def test_python_dash_m_serves_and_prints_the_kubeconfig(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "kubeconfig"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prorsa_lab.doubles.kube_emulator",
            "--kubeconfig",
            str(config),
            "--namespace",
            "rl",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        serving = proc.stdout.readline().split()
        exported = proc.stdout.readline().strip()
        assert serving[0] == "serving" and exported == f"export KUBECONFIG={config}"
        with KubeEmulatorServer.client_for(config) as api:
            names = {n.metadata.name for n in client.CoreV1Api(api).list_namespace().items}
        assert "rl" in names
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        if proc.stdout is not None:
            proc.stdout.close()


def test_audit_log_records_each_users_calls_as_rbac_sees_them(kube, core, tmp_path):
    from prorsa_lab.doubles.kube_audit import ApiCall

    operator = client.CoreV1Api(
        KubeEmulatorServer.client_for(kube.kubeconfig_for("op", tmp_path / "op"))
    )
    operator.create_namespaced_pod("rl", pod("p1"))
    operator.read_namespaced_pod("p1", "rl")
    operator.patch_namespaced_pod("p1", "rl", {"metadata": {"labels": {"x": "1"}}})
    operator.patch_namespaced_pod_status("p1", "rl", {"status": {"phase": "Running"}})
    operator.list_pod_for_all_namespaces()
    operator.list_namespaced_pod("rl", watch=True, timeout_seconds=1, _preload_content=False).read()
    operator.delete_namespaced_pod("p1", "rl")
    operator.delete_collection_namespaced_config_map("rl")
    core.list_namespaced_secret("rl")  # another user: not the operator's
    client.ApiextensionsV1Api(operator.api_client).list_custom_resource_definition()

    def call(verb: str, resource: str, namespace: str | None, group: str = "") -> ApiCall:
        return ApiCall(user="op", verb=verb, group=group, resource=resource, namespace=namespace)

    assert set(kube.emulator.api_calls("op")) == {
        call("create", "pods", "rl"), call("get", "pods", "rl"), call("patch", "pods", "rl"),
        call("patch", "pods/status", "rl"), call("list", "pods", None),
        call("watch", "pods", "rl"), call("delete", "pods", "rl"),
        call("deletecollection", "configmaps", "rl"),
        call("list", "customresourcedefinitions", None, "apiextensions.k8s.io"),
    }  # fmt: skip
    admin = {c for c in kube.emulator.api_calls() if c.user == "admin"}
    assert ApiCall(user="admin", verb="list", group="", resource="secrets", namespace="rl") in admin


def test_printer_columns_follow_jsonpath_filters_as_the_real_server_does() -> None:
    """``.status.conditions[?(@.type=="Ready")].status``: the first match, as the API server's
    table convertor takes it (cert-manager and Prorsa print such columns)."""
    import datetime

    from prorsa_lab.doubles.kube_resources import specs_from_crd, table_columns, table_row

    (spec,) = specs_from_crd(
        {
            "metadata": {"name": "things.example.com"},
            "spec": {
                "group": "example.com",
                "scope": "Namespaced",
                "names": {"plural": "things", "kind": "Thing"},
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "additionalPrinterColumns": [
                            {"name": "Ready", "type": "string",
                             "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
                            {"name": "Since", "type": "string",
                             "jsonPath": ".status.conditions[?(@.type=='Ready')].reason"},
                            {"name": "First", "type": "string",
                             "jsonPath": ".status.conditions[0].type"},
                        ],
                    }
                ],
            },
        }
    )  # fmt: skip
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    names = [c["name"] for c in table_columns(spec)]
    assert names == ["Name", "Ready", "Since", "First", "Age"]
    thing = {
        "metadata": {"name": "t", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "status": {
            "conditions": [
                {"type": "Degraded", "status": "True", "reason": "AgentTimeout"},
                {"type": "Ready", "status": "False", "reason": "EnginesUnavailable"},
            ]
        },
    }
    assert table_row(spec, thing, now)[1:4] == ["False", "EnginesUnavailable", "Degraded"]
    assert table_row(spec, {"metadata": {"name": "bare"}}, now)[1:4] == [None, None, None]


def test_leases_are_written_under_optimistic_concurrency(kube: KubeEmulatorServer) -> None:
    """What leader election rests on: of two writers that read the same Lease, only the
    first replace succeeds (409 for the second), and a second create is refused."""
    with kube.api_client() as api:
        leases = client.CoordinationV1Api(api)
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "prorsa-operator"},
            "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15,
                     "renewTime": "2026-01-01T00:00:00.000000Z"},
        }  # fmt: skip
        leases.create_namespaced_lease("rl", body)
        with pytest.raises(ApiException) as info:
            leases.create_namespaced_lease("rl", body)
        assert info.value.status == 409
        seen = api.sanitize_for_serialization(leases.read_namespaced_lease("prorsa-operator", "rl"))
        first = {**seen, "spec": {**seen["spec"], "holderIdentity": "b"}}
        second = {**seen, "spec": {**seen["spec"], "holderIdentity": "c"}}
        leases.replace_namespaced_lease("prorsa-operator", "rl", first)
        with pytest.raises(ApiException) as info:
            leases.replace_namespaced_lease("prorsa-operator", "rl", second)
        assert info.value.status == 409
        now = leases.read_namespaced_lease("prorsa-operator", "rl")
        assert now.spec.holder_identity == "b"
        assert now.spec.renew_time is not None  # MicroTime round-trips
