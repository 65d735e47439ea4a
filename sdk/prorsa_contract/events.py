"""CONTRACT: the trainer webhook's events and resync snapshot (docs/webhook-events.md).

The models are strict on purpose: a trainer integration bug (a fractional token count, a
boolean or a string for a number, a NaN timestamp, a misspelt field) should fail loudly at
the webhook, naming the event and field, instead of silently skewing the forecast. The one
allowance is JSON Schema's own: an integer field takes a number with no fractional part
(``3.0``, ``1e3``) as that integer, since many JSON encoders write every number as a float.
Field names are the wire names (snake_case).

Two kinds of event share one discriminated union: trajectory events (the lifecycle of
Figure 4, each naming its ``trajectory``) and cluster events (weight updates), which concern
every live trajectory at once and so name none; a cluster event that carries a
``trajectory`` is refused like any other unknown field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

MAX_ID = 256
MAX_NAME = 128
MAX_TEXT = 1024

EMITTER_HEADER = "X-Prorsa-Emitter"
"""Names the emitter that sends a batch or a snapshot, for trainers that run more than one
(one per worker): a snapshot with it replaces only the trajectories that emitter reported
last, one without it every trajectory (docs/webhook-events.md#more-than-one-emitter)."""
EMITTER_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}"
_EMITTER = re.compile(EMITTER_PATTERN)


def valid_emitter(emitter: str) -> bool:
    """An emitter id: 1-128 characters of letters, digits and ``_.:-``, starting with a
    letter or digit (an HTTP header value, and a worker's rank or pod name fits)."""
    return _EMITTER.fullmatch(emitter) is not None


Id = Annotated[str, Field(min_length=1, max_length=MAX_ID)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
Tokens = Annotated[int, Field(strict=True, ge=0, le=1 << 40)]
Turn = Annotated[int, Field(strict=True, ge=0, le=1 << 20)]
Timestamp = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Version = Annotated[int, Field(strict=True, ge=0, le=1 << 62)]
Count = Annotated[int, Field(strict=True, ge=0, le=1 << 40)]
Seconds = Annotated[float, Field(gt=0, le=1e7, allow_inf_nan=False)]

STATES = ("starting", "ready", "prefill", "decode", "tool", "reward")
State = Literal["starting", "ready", "prefill", "decode", "tool", "reward"]
SandboxMode = Literal["prewarm", "cold"]
Finish = Literal["tool", "stop", "length", "abort"]


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Id
    ts: Timestamp


class _Event(_Base):
    """A step of one trajectory's lifecycle."""

    trajectory: Id


class _ClusterEvent(_Base):
    """A fact about the whole rollout cluster: no trajectory."""


class SampleDispatched(_Event):
    type: Literal["sample_dispatched"]
    group: Name | None = None
    task: Name | None = None
    prompt_tokens: Tokens | None = None


class SandboxStarted(_Event):
    type: Literal["sandbox_started"]
    mode: SandboxMode
    image: Name | None = None
    node_class: Name | None = None


class RequestQueued(_Event):
    type: Literal["request_queued"]
    prompt_tokens: Tokens
    turn: Turn
    request: Id | None = None


class PrefillStarted(_Event):
    type: Literal["prefill_started"]
    request: Id | None = None
    instance: Name | None = None


class PrefillFinished(_Event):
    type: Literal["prefill_finished"]
    request: Id | None = None
    instance: Name | None = None


class DecodeFinished(_Event):
    type: Literal["decode_finished"]
    output_tokens: Tokens
    finish: Finish


class ToolStarted(_Event):
    type: Literal["tool_started"]
    tool: Name | None = None


class ToolFinished(_Event):
    type: Literal["tool_finished"]
    result_tokens: Tokens | None = None


class RewardStarted(_Event):
    type: Literal["reward_started"]


class RewardFinished(_Event):
    type: Literal["reward_finished"]
    accepted: bool


class TrajectoryDropped(_Event):
    type: Literal["trajectory_dropped"]
    reason: Annotated[str, Field(max_length=MAX_TEXT)] | None = None


class WeightUpdateStarted(_ClusterEvent):
    """The trainer is about to load ``version``: every generation in flight will be
    interrupted and every prefix cache flushed (SGLang drops its radix cache with the old
    weights)."""

    type: Literal["weight_update_started"]
    version: Version
    expected_seconds: Seconds | None = None


class WeightUpdateFinished(_ClusterEvent):
    """``version`` is loaded; ``reprefill_trajectories`` live trajectories will compute
    their whole context again on it (paper §3.1: carried-over trajectories re-prefill)."""

    type: Literal["weight_update_finished"]
    version: Version
    reprefill_trajectories: Count


TrajectoryEvent = (
    SampleDispatched
    | SandboxStarted
    | RequestQueued
    | PrefillStarted
    | PrefillFinished
    | DecodeFinished
    | ToolStarted
    | ToolFinished
    | RewardStarted
    | RewardFinished
    | TrajectoryDropped
)
ClusterEvent = WeightUpdateStarted | WeightUpdateFinished

Event = Annotated[TrajectoryEvent | ClusterEvent, Field(discriminator="type")]

# Events without a ``trajectory`` field.
CLUSTER_EVENT_TYPES: tuple[str, ...] = ("weight_update_started", "weight_update_finished")

EVENT_TYPES: tuple[str, ...] = (
    "sample_dispatched",
    "sandbox_started",
    "request_queued",
    "prefill_started",
    "prefill_finished",
    "decode_finished",
    "tool_started",
    "tool_finished",
    "reward_started",
    "reward_finished",
    "trajectory_dropped",
    *CLUSTER_EVENT_TYPES,
)


class EventBatch(BaseModel):
    """The JSON body of ``POST .../events``."""

    model_config = ConfigDict(extra="forbid")

    events: list[Event]


class SnapshotTrajectory(BaseModel):
    """One live trajectory as the trainer sees it, for a resync after an operator restart."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trajectory: Id
    state: State
    since: Timestamp = Field(description="When the trajectory entered `state` (trainer clock).")
    context_tokens: Tokens = Field(
        description="Full context length: the queued prompt in ready/prefill/decode, "
        "prompt plus output in tool/reward."
    )
    group: Name | None = None
    task: Name | None = None
    turn: Turn = 0
    instance: Name | None = None
    mode: SandboxMode | None = None
    tool: Name | None = None


class SnapshotWeightUpdate(BaseModel):
    """A weight update under way when the snapshot was taken (its start event may be lost)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Version
    started_at: Timestamp = Field(description="The update's weight_update_started ts.")
    expected_seconds: Seconds | None = None


class Snapshot(BaseModel):
    """The body of ``POST .../snapshot``: every live trajectory, replacing what was known."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ts: Timestamp
    trajectories: list[SnapshotTrajectory]
    weight_update: SnapshotWeightUpdate | None = Field(
        None, description="Set while a weight update is under way: started, not finished."
    )


@dataclass(frozen=True, slots=True)
class FieldError:
    """One problem in a batch: which event (None for the batch itself), which field, why."""

    index: int | None
    field: str
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "field": self.field, "message": self.message}

    def __str__(self) -> str:
        where = "batch" if self.index is None else f"event {self.index}"
        return f"{where}: {self.field}: {self.message}"


class BatchError(ValueError):
    """A batch was refused whole; ``errors`` names every bad event and field."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        shown = "; ".join(str(e) for e in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        super().__init__(f"{len(errors)} invalid: {shown}{more}")


_EVENT_LIST = TypeAdapter(list[Event])
_EVENT = TypeAdapter(Event)
_BATCH = TypeAdapter(EventBatch)
_SNAPSHOT = TypeAdapter(Snapshot)

T = TypeVar("T")


class _Invalid(Exception):
    """pydantic's error details of a body that does not validate."""

    def __init__(self, errors: list[ErrorDetails]) -> None:
        super().__init__(f"{len(errors)} validation error(s)")
        self.errors = errors


def _whole_number(err: ErrorDetails) -> bool:
    """A float with no fractional part where an integer belongs: JSON Schema's integer."""
    value = err["input"]
    return err["type"] == "int_type" and type(value) is float and value.is_integer()


def _set_integer(data: Any, loc: Sequence[int | str], value: int) -> bool:
    """Put ``value`` at pydantic's ``loc`` in decoded JSON; False if the path is not there.

    A union member's tag in the location (``('events', 3, 'request_queued', 'turn')``)
    names no key of the data and is skipped.
    """
    *path, last = loc
    node = data
    for part in path:
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if in_list or (isinstance(node, dict) and part in node):
            node = node[part]
        elif not (isinstance(node, dict) and part in EVENT_TYPES):
            return False
    if not (isinstance(node, dict) and type(node.get(last)) is float):
        return False
    node[last] = value
    return True


def _validate_json(adapter: TypeAdapter[T], body: bytes | str) -> T:
    """Strict validation, except that whole-number floats count as integers.

    The fast path is one strict pass in pydantic-core. Only a body refused for nothing but
    whole-number floats in integer fields is decoded again, the floats made integers, and
    validated once more (as strictly); a body with any other problem is refused with those
    problems alone, so ``3.0`` is never reported as an error. Raises :class:`_Invalid`.
    """
    try:
        return adapter.validate_json(body, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    problems = [e for e in errors if not _whole_number(e)]
    if problems:
        raise _Invalid(problems)
    data = json.loads(body)
    if not all(_set_integer(data, e["loc"], int(e["input"])) for e in errors):
        raise _Invalid(errors)
    try:
        return adapter.validate_python(data, strict=True)
    except ValidationError as exc:
        raise _Invalid(exc.errors(include_url=False)) from None


def _field_errors(errors: Iterable[ErrorDetails], *, prefix: int) -> list[FieldError]:
    """Turn pydantic's locations into (event index, dotted field) pairs.

    pydantic locates a union member by its tag (``('events', 3, 'tool_started', 'tool')``);
    the tag is noise to a trainer developer, so it is dropped.
    """
    out: list[FieldError] = []
    for err in errors:
        loc = list(err["loc"])
        if loc[prefix:] == [] and prefix:
            out.append(FieldError(None, ".".join(map(str, loc)) or "body", err["msg"]))
            continue
        if prefix and loc and loc[0] == "events":
            loc = loc[1:]
        if not loc or not isinstance(loc[0], int):
            out.append(FieldError(None, ".".join(map(str, loc)) or "body", err["msg"]))
            continue
        index, rest = loc[0], loc[1:]
        if rest and rest[0] in EVENT_TYPES:
            rest = rest[1:]
        msg = err["msg"]
        if err["type"] == "union_tag_invalid":
            rest, msg = ["type"], f"unknown event type; expected one of {', '.join(EVENT_TYPES)}"
        elif err["type"] == "union_tag_not_found":
            rest, msg = ["type"], "missing event type"
        out.append(FieldError(index, ".".join(map(str, rest)) or "event", msg))
    return out


def parse_batch(body: bytes | str) -> list[Event]:
    """Validate a JSON ``{"events": [...]}`` body as a whole; raise :class:`BatchError`."""
    try:
        # Strict: nothing is coerced (the field types are strict already); it skips the
        # lax-mode fallbacks and validates ~15% faster.
        return _validate_json(_BATCH, body).events
    except _Invalid as exc:
        raise BatchError(_field_errors(exc.errors, prefix=1)) from None


def parse_ndjson(body: bytes | str) -> list[Event]:
    """Validate one event per line (blank lines skipped); raise :class:`BatchError`."""
    text = body.decode() if isinstance(body, bytes) else body
    lines = [line for line in text.splitlines() if line.strip()]
    return parse_lines(lines)


def parse_lines(lines: Iterable[str]) -> list[Event]:
    payload = "[" + ",".join(lines) + "]"
    try:
        return _validate_json(_EVENT_LIST, payload)
    except _Invalid as exc:
        errors = _field_errors(exc.errors, prefix=0)
        if any(e.index is None for e in errors):
            # A syntax error in one line breaks the joined array: find the line.
            return _parse_lines_one_by_one(list(lines))
        raise BatchError(errors) from None


def _parse_lines_one_by_one(lines: list[str]) -> list[Event]:
    events: list[Event] = []
    errors: list[FieldError] = []
    for i, line in enumerate(lines):
        try:
            events.append(_validate_json(_EVENT, line))
        except _Invalid as exc:
            for err in exc.errors:
                loc = [p for p in err["loc"] if p not in EVENT_TYPES]
                msg = err["msg"]
                if err["type"] == "union_tag_invalid":
                    loc, msg = ["type"], "unknown event type"
                elif err["type"] == "union_tag_not_found":
                    loc, msg = ["type"], "missing event type"
                field = ".".join(map(str, loc)) or "event"
                if err["type"] == "json_invalid":
                    field = "line"
                errors.append(FieldError(i, field, msg))
    if errors:
        raise BatchError(errors)
    return events


def parse_events(items: list[Any]) -> list[Event]:
    """Validate already-decoded event dicts (Python callers, tests, the simulator)."""
    try:
        return _EVENT_LIST.validate_python(items)
    except ValidationError as exc:
        raise BatchError(_field_errors(exc.errors(include_url=False), prefix=0)) from None


def parse_snapshot(body: bytes | str) -> Snapshot:
    """Validate a snapshot body as strictly as events (``since: false`` is no time)."""
    try:
        return _validate_json(_SNAPSHOT, body)
    except _Invalid as exc:
        errors = [
            FieldError(None, ".".join(map(str, e["loc"])) or "body", e["msg"]) for e in exc.errors
        ]
        raise BatchError(errors) from None


def dump_events(events: Iterable[Event]) -> list[dict[str, Any]]:
    """Wire form of events, omitting unset optional fields."""
    return [e.model_dump(exclude_none=True) for e in events]
