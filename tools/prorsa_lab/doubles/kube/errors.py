"""The emulator's API errors: a ``Status`` body and an HTTP code, as an API server answers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prorsa_lab.doubles.kube.resources import (
    ResourceSpec,
)
from prorsa_lab.doubles.kube.schema import FieldIssue


class ApiError(Exception):
    """A refusal rendered as a ``kind: Status`` body with the real server's code and reason."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body

    @classmethod
    def not_found(cls, spec: ResourceSpec, name: str) -> ApiError:
        return cls(
            404,
            "NotFound",
            f'{spec.group_resource} "{name}" not found',
            details={"name": name, "group": spec.group, "kind": spec.plural},
        )

    @classmethod
    def conflict(cls, spec: ResourceSpec, name: str, why: str = "") -> ApiError:
        why = why or (
            "the object has been modified; please apply your changes to the latest "
            "version and try again"
        )
        return cls(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {spec.group_resource} "{name}": {why}',
            details={"name": name, "group": spec.group, "kind": spec.plural},
        )

    @classmethod
    def invalid(cls, spec: ResourceSpec, name: str, issues: Sequence[FieldIssue]) -> ApiError:
        kind = f"{spec.kind}.{spec.group}" if spec.group else spec.kind
        texts = [issue.text() for issue in issues]
        joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
        return cls(
            422,
            "Invalid",
            f'{kind} "{name}" is invalid: {joined}',
            details={
                "name": name,
                "group": spec.group,
                "kind": spec.kind,
                "causes": [
                    {"reason": i.reason, "message": i.message, "field": i.field} for i in issues
                ],
            },
        )

    @classmethod
    def bad_request(cls, message: str) -> ApiError:
        return cls(400, "BadRequest", message)
