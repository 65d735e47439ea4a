"""Structural-schema handling of custom resources: pruning, defaulting and validation.

A real API server drops fields that the CRD's ``openAPIV3Schema`` does not declare, fills
declared defaults, and refuses objects that break the schema (types, ``required``, ``enum``,
bounds, ``pattern``, and the CEL ``x-kubernetes-validations`` rules). Without this an
operator that writes an undeclared status field, or relies on a default, passes against a
plain in-memory store and breaks on a cluster. CEL rules are evaluated with ``celpy``
(PyPI ``cel-python``) when it is installed, and skipped otherwise.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FieldIssue", "apply_structural_schema", "validate"]

_ROOT_KEPT = ("apiVersion", "kind", "metadata")


@dataclass(frozen=True)
class FieldIssue:
    """One refused field, in the shape of a Status ``details.causes`` entry."""

    field: str
    reason: str  # FieldValueInvalid, FieldValueRequired, FieldValueNotSupported, ...
    message: str

    def text(self) -> str:
        return f"{self.field}: {self.message}"


def _preserves(schema: Mapping[str, Any]) -> bool:
    return bool(schema.get("x-kubernetes-preserve-unknown-fields"))


def _prune_and_default(value: Any, schema: Mapping[str, Any]) -> Any:
    if isinstance(value, dict):
        properties: Mapping[str, Any] = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        embedded = bool(schema.get("x-kubernetes-embedded-resource"))
        result: dict[str, Any] = {}
        for key, item in value.items():
            if key in properties:
                sub = properties[key]
                if item is None and not sub.get("nullable"):
                    continue  # a null for a non-nullable field is dropped, then defaulted
                result[key] = _prune_and_default(item, sub)
            elif isinstance(additional, Mapping):
                result[key] = _prune_and_default(item, additional)
            elif additional is True or _preserves(schema) or (embedded and key in _ROOT_KEPT):
                result[key] = item
        for key, sub in properties.items():
            if key not in result and "default" in sub:
                result[key] = _prune_and_default(copy.deepcopy(sub["default"]), sub)
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [_prune_and_default(item, schema["items"]) for item in value]
    return value


def apply_structural_schema(obj: dict[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``obj`` pruned to ``schema`` and defaulted (metadata and type fields kept)."""
    kept = {k: obj[k] for k in _ROOT_KEPT if k in obj}
    body = {k: v for k, v in obj.items() if k not in _ROOT_KEPT}
    result = _prune_and_default(body, schema)
    return {**kept, **(result if isinstance(result, dict) else {})}


_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def _type_ok(value: Any, expected: str) -> bool:
    if expected in ("integer", "number") and isinstance(value, bool):
        return False
    if expected == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES.get(expected, (object,)))


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return f'"{"object" if isinstance(value, dict) else "array"}"'
    return str(value)


def _check(value: Any, schema: Mapping[str, Any], path: str, out: list[FieldIssue]) -> None:
    if value is None:
        if not schema.get("nullable") and schema.get("type"):
            out.append(
                FieldIssue(
                    path,
                    "FieldValueInvalid",
                    f'Invalid value: "null": {path} in body must be of type '
                    f'{schema["type"]}: "null"',
                )
            )
        return
    expected = schema.get("type")
    if expected and not _type_ok(value, expected):
        actual = type(value).__name__
        out.append(
            FieldIssue(
                path,
                "FieldValueTypeInvalid",
                f"Invalid value: {_show(value)}: {path} in body must be of type "
                f'{expected}: "{actual}"',
            )
        )
        return
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(_show(v) for v in schema["enum"])
        out.append(
            FieldIssue(
                path,
                "FieldValueNotSupported",
                f"Unsupported value: {_show(value)}: supported values: {supported}",
            )
        )
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None:
            exclusive = bool(schema.get("exclusiveMinimum"))
            if value < low or (exclusive and value == low):
                word = "greater than" if exclusive else "greater than or equal to"
                out.append(
                    FieldIssue(
                        path,
                        "FieldValueInvalid",
                        f"Invalid value: {_show(value)}: {path} in body should be {word} {low}",
                    )
                )
        if high is not None:
            exclusive = bool(schema.get("exclusiveMaximum"))
            if value > high or (exclusive and value == high):
                word = "less than" if exclusive else "less than or equal to"
                out.append(
                    FieldIssue(
                        path,
                        "FieldValueInvalid",
                        f"Invalid value: {_show(value)}: {path} in body should be {word} {high}",
                    )
                )
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            out.append(
                FieldIssue(
                    path,
                    "FieldValueInvalid",
                    f"Invalid value: {_show(value)}: {path} in body should be at "
                    f"least {schema['minLength']} chars long",
                )
            )
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            out.append(
                FieldIssue(
                    path,
                    "FieldValueTooLong",
                    f"Too long: may not be more than {schema['maxLength']} bytes",
                )
            )
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(
                FieldIssue(
                    path,
                    "FieldValueInvalid",
                    f"Invalid value: {_show(value)}: {path} in body should match "
                    f"'{schema['pattern']}'",
                )
            )
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            out.append(
                FieldIssue(
                    path,
                    "FieldValueInvalid",
                    f"Invalid value: {len(value)}: {path} in body should have at "
                    f"least {schema['minItems']} items",
                )
            )
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            out.append(
                FieldIssue(
                    path,
                    "FieldValueTooMany",
                    f"Too many: {len(value)}: must have at most {schema['maxItems']} items",
                )
            )
        items = schema.get("items")
        if isinstance(items, Mapping):
            for i, item in enumerate(value):
                _check(item, items, f"{path}[{i}]", out)
    if isinstance(value, dict):
        for key in schema.get("required") or []:
            if key not in value:
                out.append(FieldIssue(_join(path, key), "FieldValueRequired", "Required value"))
        properties = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        for key, item in value.items():
            if key in properties:
                _check(item, properties[key], _join(path, key), out)
            elif isinstance(additional, Mapping):
                _check(item, additional, _join(path, key), out)
    _check_cel(value, schema, path, out)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_CEL_CACHE: dict[str, Any] = {}


def _cel_join(items: Any, separator: Any = "") -> Any:
    """CEL's ``<list<string>>.join(<string>)`` (cel-go's strings extension, which Kubernetes
    enables for every CEL rule); cel-python has no strings extension."""
    from celpy import celtypes

    return celtypes.StringType(str(separator).join(str(item) for item in items))


KUBERNETES_CEL_FUNCTIONS: dict[str, Any] = {"join": _cel_join}
"""The functions of Kubernetes' CEL libraries the CRD's rules use beyond cel-python's."""


def cel_program(text: str) -> Any:
    """A compiled CEL rule as the API server runs it (with :data:`KUBERNETES_CEL_FUNCTIONS`),
    cached by its text."""
    program = _CEL_CACHE.get(text)
    if program is None:
        import celpy

        env = celpy.Environment()
        program = env.program(env.compile(text), functions=KUBERNETES_CEL_FUNCTIONS)
        _CEL_CACHE[text] = program
    return program


def _check_cel(value: Any, schema: Mapping[str, Any], path: str, out: list[FieldIssue]) -> None:
    rules = schema.get("x-kubernetes-validations") or []
    if not rules:
        return
    try:
        from celpy.adapter import json_to_cel
    except ImportError:  # cel-python is optional: rules are then not enforced
        return
    for rule in rules:
        text = rule.get("rule", "")
        if "oldSelf" in text:
            continue  # transition rules need the old object; creation and updates skip them
        try:
            ok = bool(cel_program(text).evaluate({"self": json_to_cel(value)}))
        except Exception as exc:  # a rule that does not evaluate is a refusal, as on a cluster
            out.append(
                FieldIssue(
                    path,
                    "FieldValueInvalid",
                    f"Invalid value: {_show(value)}: rule {text!r} failed: {exc}",
                )
            )
            continue
        if not ok:
            field = _join(path, rule["fieldPath"].lstrip(".")) if rule.get("fieldPath") else path
            message = rule.get("message") or f"failed rule: {text}"
            reason = rule.get("reason", "FieldValueInvalid")
            shown = (
                "Forbidden: "
                if reason == "FieldValueForbidden"
                else (f"Invalid value: {_show(value)}: ")
            )
            out.append(FieldIssue(field, reason, f"{shown}{message}"))


def validate(obj: Mapping[str, Any], schema: Mapping[str, Any]) -> list[FieldIssue]:
    """Every way ``obj`` breaks ``schema``; metadata is validated by the server elsewhere."""
    issues: list[FieldIssue] = []
    body = {k: v for k, v in obj.items() if k not in _ROOT_KEPT}
    properties = schema.get("properties") or {}
    for key in schema.get("required") or []:
        if key not in _ROOT_KEPT and key not in body:
            issues.append(FieldIssue(key, "FieldValueRequired", "Required value"))
    for key, value in body.items():
        if key in properties:
            _check(value, properties[key], key, issues)
    _check_cel(dict(obj), schema, "", issues)
    return issues
