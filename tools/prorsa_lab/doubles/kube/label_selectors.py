"""Label and field selectors, parsed the way the API server parses ``?labelSelector=``.

Both kinds are a comma-separated conjunction of requirements. A label requirement is one
of ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a,b)``, ``k>3`` or
``k<3``; a field requirement is ``path=v``, ``path==v`` or ``path!=v``. As on a real
cluster, ``k!=v`` and ``k notin (...)`` also match objects that lack the label, and a
syntax error is reported (the emulator answers 400) instead of silently matching all.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FieldSelector",
    "LabelSelector",
    "SelectorError",
]


class SelectorError(ValueError):
    """A selector that does not parse; the server answers 400 with this message."""


_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SET_RE = re.compile(rf"^({_KEY})\s+(in|notin)\s+\(([^()]*)\)$")
_CMP_RE = re.compile(rf"^({_KEY})\s*(==|!=|=|>|<)\s*({_VALUE})$")
_EXISTS_RE = re.compile(rf"^(!?)\s*({_KEY})$")


def _split(text: str) -> list[str]:
    """Split on the commas that are outside parentheses."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError(f"unbalanced parenthesis in {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SelectorError(f"unbalanced parenthesis in {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


Requirement = Callable[[Mapping[str, str]], bool]


def _label_requirement(term: str) -> Requirement:
    if match := _SET_RE.match(term):
        key, op, raw = match.groups()
        values = frozenset(v.strip() for v in raw.split(",") if v.strip())
        if not values:
            raise SelectorError(f"{term!r}: a set needs at least one value")
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if match := _CMP_RE.match(term):
        key, op, value = match.groups()
        if op in ("=", "=="):
            return lambda labels: labels.get(key) == value
        if op == "!=":
            return lambda labels: labels.get(key) != value
        try:
            bound = int(value)
        except ValueError:
            raise SelectorError(f"{term!r}: {op} needs an integer") from None

        def compare(labels: Mapping[str, str]) -> bool:
            try:
                actual = int(labels[key])
            except (KeyError, ValueError):
                return False
            return actual > bound if op == ">" else actual < bound

        return compare
    if match := _EXISTS_RE.match(term):
        negate, key = match.groups()
        if negate:
            return lambda labels: key not in labels
        return lambda labels: key in labels
    raise SelectorError(f"unable to parse requirement: {term!r}")


@dataclass(frozen=True)
class LabelSelector:
    """A parsed ``labelSelector``; an empty one matches everything."""

    text: str
    requirements: tuple[Requirement, ...]

    @classmethod
    def parse(cls, text: str | None) -> LabelSelector:
        text = text or ""
        return cls(text, tuple(_label_requirement(t) for t in _split(text)))

    @classmethod
    def from_dict(cls, selector: Mapping[str, Any]) -> LabelSelector:
        """From a ``metav1.LabelSelector`` (``matchLabels`` + ``matchExpressions``)."""
        terms = [f"{k}={v}" for k, v in (selector.get("matchLabels") or {}).items()]
        for expr in selector.get("matchExpressions") or []:
            key, op, values = expr["key"], expr["operator"], expr.get("values") or []
            if op in ("In", "NotIn"):
                terms.append(f"{key} {op.lower()} ({','.join(values)})")
            elif op == "Exists":
                terms.append(key)
            elif op == "DoesNotExist":
                terms.append(f"!{key}")
            else:
                raise SelectorError(f"unknown operator {op!r}")
        return cls.parse(",".join(terms))

    def matches(self, obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(req(labels) for req in self.requirements)

    def __bool__(self) -> bool:
        return bool(self.requirements)


_FIELD_RE = re.compile(r"^([A-Za-z][A-Za-z0-9.]*)\s*(==|!=|=)\s*(.*)$")


def _lookup(obj: Mapping[str, Any], path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return ""
        node = node[part]
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    return str(node)


@dataclass(frozen=True)
class FieldSelector:
    """A parsed ``fieldSelector``; only the paths the resource supports are accepted."""

    text: str
    terms: tuple[tuple[str, bool, str], ...]  # (path, equal?, value)

    @classmethod
    def parse(cls, text: str | None, *, allowed: Iterable[str] | None = None) -> FieldSelector:
        text = text or ""
        permitted = None if allowed is None else set(allowed)
        terms: list[tuple[str, bool, str]] = []
        for term in _split(text):
            match = _FIELD_RE.match(term)
            if not match:
                raise SelectorError(f"invalid field selector: {term!r}")
            path, op, value = match.groups()
            if permitted is not None and path not in permitted:
                raise SelectorError(f'field label not supported: "{path}"')
            terms.append((path, op != "!=", value.strip()))
        return cls(text, tuple(terms))

    def matches(self, obj: Mapping[str, Any]) -> bool:
        return all((_lookup(obj, path) == value) == equal for path, equal, value in self.terms)

    def value_of(self, path: str) -> str | None:
        """The value an equality term pins ``path`` to (used to narrow a lookup), or None."""
        for term_path, equal, value in self.terms:
            if term_path == path and equal:
                return value
        return None

    def __bool__(self) -> bool:
        return bool(self.terms)
