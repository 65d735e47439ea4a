"""The three patch formats of the Kubernetes API, applied to plain JSON-like dicts.

The emulator in :mod:`prorsa_lab.doubles.kube.emulator` applies every PATCH request through these
functions. They are pure (the inputs are never modified) so that a failed patch leaves the
stored object untouched, which is what the API server guarantees too.

* :func:`merge_patch` is RFC 7386 (``application/merge-patch+json``): maps merge, ``null``
  deletes a key, lists and scalars are replaced. kopf and the operator use it for custom
  resources and their status.
* :func:`strategic_merge_patch` is the built-in resources' default
  (``application/strategic-merge-patch+json``, what ``kubectl patch`` and the Python client
  send for pods and config maps). Maps merge like a merge patch; the lists that the real
  server merges by a key (containers by ``name``, conditions by ``type``, owner references
  by ``uid``, ...) merge here by the same key, ``metadata.finalizers`` merges as a set, and
  every other list is replaced. Replacing a merged list therefore needs ``$patch: replace``
  exactly as on a real cluster, so a test cannot pass here and fail there.
* :func:`json_patch` is RFC 6902 (``application/json-patch+json``) with all six operations;
  kopf sends a ``test`` on ``/metadata/resourceVersion`` first to get optimistic locking.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "PatchError",
    "json_patch",
    "merge_patch",
    "strategic_merge_patch",
]


class PatchError(ValueError):
    """A patch that cannot be applied; the server answers 422 with this message."""


def merge_patch(target: Any, patch: Any) -> Any:
    """Apply an RFC 7386 JSON merge patch and return the new document."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result: dict[str, Any] = copy.deepcopy(dict(target)) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# Lists that the real API server merges instead of replacing (patchStrategy=merge in the
# Kubernetes Go types), by field name, with the merge key of their items. ``None`` marks a
# list of scalars merged as a set. Field names are unambiguous enough for the objects the
# operator touches; ``ports`` picks its key from the items (containers vs. services).
_MERGE_LISTS: dict[str, str | None] = {
    "finalizers": None,
    "ownerReferences": "uid",
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "conditions": "type",
    "topologySpreadConstraints": "topologyKey",
    "ports": "port",
}


def _merge_key(field: str, items: Sequence[Any]) -> str | None:
    key = _MERGE_LISTS[field]
    if field == "ports" and any(isinstance(i, Mapping) and "containerPort" in i for i in items):
        return "containerPort"
    return key


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Apply a strategic merge patch (the subset of the directives that clients send)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if not k.startswith("$")}
    if directive == "delete":
        return None
    if directive not in (None, "merge"):
        raise PatchError(f"unknown patch directive $patch: {directive!r}")
    result: dict[str, Any] = copy.deepcopy(dict(target)) if isinstance(target, Mapping) else {}
    deletions: list[tuple[str, Any]] = []
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            deletions.append((key.split("/", 1)[1], value))
            continue
        if key.startswith("$"):  # $setElementOrder/..., $retainKeys, $patch: ordering hints
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, Mapping):
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list) and key in _MERGE_LISTS:
            old = result.get(key)
            result[key] = _merge_list(key, old if isinstance(old, list) else [], value)
        else:
            result[key] = copy.deepcopy(value)
    for key, values in deletions:
        if not isinstance(values, list):
            raise PatchError(f"$deleteFromPrimitiveList/{key} must be a list")
        if isinstance(result.get(key), list):
            result[key] = [item for item in result[key] if item not in values]
    retain = patch.get("$retainKeys")
    if retain is not None:
        if not isinstance(retain, list):
            raise PatchError("$retainKeys must be a list")
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_list(field: str, old: list[Any], new: list[Any]) -> list[Any]:
    if any(isinstance(item, Mapping) and item.get("$patch") == "replace" for item in new):
        return [copy.deepcopy(i) for i in new if not (isinstance(i, Mapping) and "$patch" in i)]
    key = _merge_key(field, old + new)
    if key is None:
        merged = list(old)
        merged.extend(copy.deepcopy(item) for item in new if item not in merged)
        return merged
    merged = [copy.deepcopy(item) for item in old]
    for item in new:
        if not isinstance(item, Mapping) or key not in item:
            raise PatchError(f"items of {field} must carry the merge key {key!r}")
        index = next(
            (i for i, o in enumerate(merged) if isinstance(o, Mapping) and o.get(key) == item[key]),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del merged[index]
        elif index is None:
            merged.append(strategic_merge_patch({}, item))
        else:
            merged[index] = strategic_merge_patch(merged[index], item)
    return merged


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"JSON pointer {path!r} must start with '/'")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _index(container: list[Any], token: str, *, path: str, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise PatchError(f"invalid array index {token!r} in {path}")
    index = int(token)
    if index > len(container) or (index == len(container) and not allow_end):
        raise PatchError(f"array index {index} out of range in {path}")
    return index


def _parent(doc: Any, tokens: list[str], path: str) -> Any:
    node = doc
    for token in tokens[:-1]:
        if isinstance(node, dict):
            if token not in node:
                raise PatchError(f"doc is missing path: {path}")
            node = node[token]
        elif isinstance(node, list):
            node = node[_index(node, token, path=path, allow_end=False)]
        else:
            raise PatchError(f"doc is missing path: {path}")
    return node


def _get(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return doc
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"doc is missing path: {path}")
        return parent[last]
    if isinstance(parent, list):
        return parent[_index(parent, last, path=path, allow_end=False)]
    raise PatchError(f"doc is missing path: {path}")


def _add(doc: Any, path: str, value: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, path=path, allow_end=True), value)
    else:
        raise PatchError(f"doc is missing path: {path}")
    return doc


def _remove(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        raise PatchError("cannot remove the whole document")
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"unable to remove nonexistent key: {last}: missing value")
        del parent[last]
    elif isinstance(parent, list):
        del parent[_index(parent, last, path=path, allow_end=False)]
    else:
        raise PatchError(f"doc is missing path: {path}")
    return doc


def _json_equal(a: Any, b: Any) -> bool:
    """JSON equality: numbers by value, but ``true`` is not ``1`` as it is in Python."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def json_patch(target: Any, operations: Any) -> Any:
    """Apply an RFC 6902 JSON patch; any failing operation (a ``test`` too) fails it whole."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for number, op in enumerate(operations):
        if not isinstance(op, Mapping) or not isinstance(op.get("path"), str):
            raise PatchError(f"operation {number} needs an 'op' and a string 'path'")
        kind, path = op.get("op"), op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise PatchError(f"operation {number} ({kind}) needs a 'value'")
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            doc = _remove(doc, path)
        elif kind == "replace":
            _get(doc, path)  # the target must exist
            value = copy.deepcopy(op["value"])
            doc = _add(_remove(doc, path), path, value) if path else value
        elif kind in ("move", "copy"):
            source = op.get("from")
            if not isinstance(source, str):
                raise PatchError(f"operation {number} ({kind}) needs a string 'from'")
            value = copy.deepcopy(_get(doc, source))
            if kind == "move":
                if path.startswith(source + "/"):
                    raise PatchError(f"cannot move {source} into its own child {path}")
                doc = _remove(doc, source)
            doc = _add(doc, path, value)
        elif kind == "test":
            actual = _get(doc, path)
            if not _json_equal(actual, op["value"]):
                raise PatchError(f"testing value {path} failed: test failed")
        else:
            raise PatchError(f"operation {number} has an unknown op {kind!r}")
    return doc
