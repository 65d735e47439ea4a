"""Decode the few protobuf bodies ``kubectl create <kind>`` sends, into JSON-like dicts.

``kubectl create namespace|configmap|secret|serviceaccount`` (the generator commands) and
helm's release storage post ``application/vnd.kubernetes.protobuf`` and cannot be told to
send JSON. The emulator speaks JSON, so it decodes these kinds (and ``DeleteOptions``) here:
the ``k8s\\x00`` envelope (``runtime.Unknown``), then the message by its field numbers from
the Kubernetes ``generated.proto`` files. Anything else gets 415 from the emulator, and
``kubectl apply -f`` (JSON) is the way to create it.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

__all__ = ["PROTOBUF", "ProtobufError", "decode"]

PROTOBUF = "application/vnd.kubernetes.protobuf"
_MAGIC = b"k8s\x00"


class ProtobufError(ValueError):
    """A body that is not one of the protobuf messages this module knows."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(data):
            raise ProtobufError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) pairs: ints for varints, bytes for length-delimited fields."""
    pos = 0
    while pos < len(data):
        tag, pos = _varint(data, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, value
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise ProtobufError("truncated field")
            yield number, data[pos : pos + length]
            pos += length
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")


def _text(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a string")
    return value.decode("utf-8")


def _map_entry(value: int | bytes, *, binary: bool) -> tuple[str, str]:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a map entry")
    key, item = "", ""
    for number, field in _fields(value):
        if number == 1:
            key = _text(field)
        elif number == 2:
            raw = field if isinstance(field, bytes) else b""
            item = base64.b64encode(raw).decode() if binary else raw.decode("utf-8")
    return key, item


def _object_meta(data: bytes) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    names = {1: "name", 2: "generateName", 3: "namespace", 5: "uid", 6: "resourceVersion"}
    for number, value in _fields(data):
        if number in names:
            if text := _text(value):  # proto2 sends empty optional strings: drop them
                meta[names[number]] = text
        elif number in (11, 12):
            key, item = _map_entry(value, binary=False)
            meta.setdefault("labels" if number == 11 else "annotations", {})[key] = item
        elif number == 14:
            meta.setdefault("finalizers", []).append(_text(value))
    return meta


def _message(data: bytes, kind: str) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for number, value in _fields(data):
        if number == 1 and isinstance(value, bytes):
            obj["metadata"] = _object_meta(value)
        elif kind == "Namespace" and number == 2 and isinstance(value, bytes):
            finalizers = [_text(v) for n, v in _fields(value) if n == 1]
            obj["spec"] = {"finalizers": finalizers} if finalizers else {}
        elif kind in ("ConfigMap", "Secret") and number == 2:
            key, item = _map_entry(value, binary=kind == "Secret")
            obj.setdefault("data", {})[key] = item
        elif kind == "ConfigMap" and number == 3:
            key, item = _map_entry(value, binary=True)
            obj.setdefault("binaryData", {})[key] = item
        elif kind == "Secret" and number == 3 and _text(value):
            obj["type"] = _text(value)
        elif kind == "Secret" and number == 4:
            key, item = _map_entry(value, binary=False)
            obj.setdefault("stringData", {})[key] = item
        elif kind == "ServiceAccount" and number == 4:
            obj["automountServiceAccountToken"] = bool(value)
    return obj


def _delete_options(data: bytes) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for number, value in _fields(data):
        if number == 1 and isinstance(value, int):
            options["gracePeriodSeconds"] = value
        elif number == 2 and isinstance(value, bytes):
            names = {1: "uid", 2: "resourceVersion"}
            options["preconditions"] = {names[n]: _text(v) for n, v in _fields(value) if n in names}
        elif number == 3 and isinstance(value, int):
            options["orphanDependents"] = bool(value)
        elif number == 4:
            options["propagationPolicy"] = _text(value)
        elif number == 5:
            options.setdefault("dryRun", []).append(_text(value))
    return options


_KINDS = frozenset({"Namespace", "ConfigMap", "Secret", "ServiceAccount", "DeleteOptions"})


def decode(body: bytes) -> dict[str, Any]:
    """Decode a Kubernetes protobuf envelope holding one of the kinds above."""
    if not body.startswith(_MAGIC):
        raise ProtobufError("not a Kubernetes protobuf envelope")
    api_version = kind = ""
    raw = b""
    for number, value in _fields(body[len(_MAGIC) :]):
        if number == 1 and isinstance(value, bytes):
            for sub, item in _fields(value):
                if sub == 1:
                    api_version = _text(item)
                elif sub == 2:
                    kind = _text(item)
        elif number == 2 and isinstance(value, bytes):
            raw = value
    if kind not in _KINDS:
        raise ProtobufError(f"the emulator does not decode protobuf {kind or 'bodies'}")
    fields = _delete_options(raw) if kind == "DeleteOptions" else _message(raw, kind)
    return {"apiVersion": api_version, "kind": kind, **fields}
