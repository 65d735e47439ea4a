"""The emulator's Python API: objects and CRDs from tests, without HTTP.

Synchronous and thread-safe; admission webhooks are not called. (The methods are not
named ``get``/``patch``/...: kmock uses those names for its HTTP client shortcuts.)
"""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import yaml

from prorsa_lab.doubles.kube.errors import ApiError
from prorsa_lab.doubles.kube.label_selectors import FieldSelector, LabelSelector
from prorsa_lab.doubles.kube.resources import (
    CRD_KEY,
    ResourceSpec,
    crd_manifest,
    specs_from_crd,
)
from prorsa_lab.doubles.kube.store import (
    ResourceRef,
    metadata_of,
)
from prorsa_lab.doubles.kube.writes import (
    MERGE_PATCH,
    Writes,
)


@attrs.define(kw_only=True)
class ObjectApi(Writes):
    """The synchronous, thread-safe object API for tests (no admission webhooks)."""

    def create_object(
        self,
        resource: ResourceRef,
        body: Mapping[str, Any],
        *,
        namespace: str | None = None,
    ) -> dict[str, Any]:
        """Create as a POST would (metadata filled, events emitted); returns the object."""
        spec = self.spec_for(resource)
        with self._state:
            ns = namespace or (metadata_of(body).get("namespace") if spec.namespaced else None)
            return self._commit(self._prepare_create(spec, ns, dict(body)))

    def replace_object(
        self,
        resource: ResourceRef,
        name: str,
        body: Mapping[str, Any],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """Replace as a PUT would (409 on a stale ``metadata.resourceVersion``)."""
        spec = self.spec_for(resource)
        with self._state:
            old = self._current(spec, namespace, name)
            if old is None:
                raise ApiError.not_found(spec, name)
            return self._commit(
                self._merge_update(
                    spec, namespace, name, old, dict(body), subresource, require_rv=True
                )
            )

    def patch_object(
        self,
        resource: ResourceRef,
        name: str,
        patch: Any,
        *,
        namespace: str | None = None,
        subresource: str | None = None,
        content_type: str = MERGE_PATCH,
    ) -> dict[str, Any]:
        """Patch as a PATCH would; ``content_type`` picks merge, strategic or JSON patch."""
        spec = self.spec_for(resource)
        with self._state:
            return self._commit(
                self._prepare_patch(spec, namespace, name, patch, content_type, subresource)
            )

    def delete_object(
        self,
        resource: ResourceRef,
        name: str,
        *,
        namespace: str | None = None,
        propagation_policy: str = "Background",
    ) -> dict[str, Any]:
        """Delete as a DELETE would: finalizers hold it, dependents are collected."""
        spec = self.spec_for(resource)
        with self._state:
            return self._delete(spec, namespace, name, {"propagationPolicy": propagation_policy})[0]

    def get_object(
        self, resource: ResourceRef, name: str, *, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The stored object (a copy), or None."""
        spec = self.spec_for(resource)
        with self._state:
            obj = self._current(spec, namespace, name)
            return None if obj is None else copy.deepcopy(obj)

    def list_objects(
        self,
        resource: ResourceRef,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        """Stored objects (copies) sorted by namespace and name, filtered like a LIST."""
        spec = self.spec_for(resource)
        labels = LabelSelector.parse(label_selector)
        fields = FieldSelector.parse(field_selector, allowed=spec.field_selectors)
        with self._state:
            return [copy.deepcopy(o) for o in self._select(spec, namespace, None, labels, fields)]

    def add_custom_resource(
        self,
        *,
        group: str,
        version: str,
        plural: str,
        kind: str,
        namespaced: bool = True,
        status_subresource: bool = True,
        singular: str | None = None,
        short_names: Sequence[str] = (),
        categories: Sequence[str] = (),
        schema: Mapping[str, Any] | None = None,
        printer_columns: Sequence[Mapping[str, Any]] = (),
    ) -> ResourceSpec:
        """Declare a custom resource by creating its CRD (a schema-less one by default)."""
        manifest = crd_manifest(
            group=group,
            version=version,
            plural=plural,
            kind=kind,
            namespaced=namespaced,
            status_subresource=status_subresource,
            singular=singular,
            short_names=short_names,
            categories=categories,
            schema=schema,
            printer_columns=printer_columns,
        )
        self.add_crd(manifest)
        return self._specs[(group, version, plural)]

    def add_crd(self, manifest: Mapping[str, Any]) -> list[ResourceSpec]:
        """Create (or replace) a CustomResourceDefinition, as ``kubectl apply`` would."""
        specs = specs_from_crd(manifest)
        name = metadata_of(manifest).get("name", "")
        with self._state:
            current = self._current(self._specs[CRD_KEY], None, name)
            if current is None:
                self.create_object(CRD_KEY, manifest)
            else:
                body = copy.deepcopy(dict(manifest))
                body.setdefault("metadata", {})["resourceVersion"] = metadata_of(current).get(
                    "resourceVersion"
                )
                self.replace_object(CRD_KEY, name, body)
        return specs

    def load_crds(self, source: str | pathlib.Path) -> list[ResourceSpec]:
        """Register every CRD in a YAML file (e.g. ``crds/rolloutcluster.yaml``)."""
        text = pathlib.Path(source).read_text(encoding="utf-8")
        specs: list[ResourceSpec] = []
        for doc in yaml.safe_load_all(text):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                specs += self.add_crd(doc)
        return specs
