"""The emitters' typed helpers say what the webhook contract says, field for field.

``sdk/prorsa_sdk/event_helpers.py`` writes one method per event type, with the event's
fields as keyword arguments, so that an editor completes them and mypy checks a trainer's
calls. They repeat :mod:`prorsa_contract.events`' models; here each helper is held to its
model: every event type has one, every field is a keyword argument of the same name, type
and required-ness, nothing else is, and what it emits validates as that event.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

import pytest
from pydantic import BaseModel, TypeAdapter

from prorsa_contract.events import CLUSTER_EVENT_TYPES, EVENT_TYPES, Event, SandboxMode
from prorsa_sdk import AsyncEventEmitter, EventEmitter
from prorsa_sdk.emitter_core import EmitterCore
from prorsa_sdk.event_helpers import EventHelpers

EVENTS: TypeAdapter[Any] = TypeAdapter(Event)
MODELS: dict[str, type[BaseModel]] = {
    get_args(model.model_fields["type"].annotation)[0]: model
    for model in get_args(get_args(Event)[0])
}
# What every event carries and the emitter fills in (``id``: the helpers of cluster events
# take it, since several processes may report one weight update).
ENVELOPE = {"id", "ts", "type", "trajectory"}


def shape(annotation: Any) -> Any:
    """An annotation without its constraints: ``Annotated`` dropped, unions as sets."""
    if get_origin(annotation) is Annotated:
        return shape(get_args(annotation)[0])
    if get_origin(annotation) in (typing.Union, types.UnionType):
        return frozenset(shape(a) for a in get_args(annotation))
    if get_origin(annotation) is Literal:
        return frozenset(get_args(annotation))
    return annotation


def mismatches(helper: Callable[..., Any], model: type[BaseModel]) -> list[str]:
    """How ``helper``'s parameters differ from ``model``'s fields (empty: none)."""
    event_type = get_args(model.model_fields["type"].annotation)[0]
    params = dict(inspect.signature(helper).parameters)
    hints = get_type_hints(helper)
    params.pop("self", None)
    found: list[str] = []
    cluster = event_type in CLUSTER_EVENT_TYPES
    trajectory = params.pop("trajectory", None)
    if cluster and trajectory is not None:
        found.append("a cluster event names no trajectory")
    if not cluster and (
        trajectory is None or trajectory.kind is not trajectory.POSITIONAL_OR_KEYWORD
    ):
        found.append("trajectory: the first positional parameter")
    ts = params.pop("ts", None)
    if ts is None or ts.default is not None:
        found.append("ts: a keyword defaulting to None (the emitter's clock)")
    ident = params.pop("id", None)
    if cluster and (ident is None or ident.default is not None):
        found.append("id: a keyword defaulting to None")
    fields = {n: f for n, f in model.model_fields.items() if n not in ENVELOPE}
    for name in sorted(set(params) - set(fields)):
        found.append(f"{name}: not a field of {model.__name__}")
    for name, field in fields.items():
        param = params.get(name)
        if param is None:
            found.append(f"{name}: a field of {model.__name__} the helper does not take")
            continue
        if param.kind is not param.KEYWORD_ONLY:
            found.append(f"{name}: keyword-only")
        required = param.default is inspect.Parameter.empty
        if required != field.is_required():
            found.append(f"{name}: required is {field.is_required()} in the model")
        elif not required and param.default != field.default:
            found.append(f"{name}: defaults to {field.default!r} in the model")
        if shape(hints[name]) != shape(field.annotation):
            found.append(f"{name}: {hints[name]} where the model has {field.annotation}")
    return found


def test_every_event_type_has_one_helper_and_no_helper_is_extra() -> None:
    helpers = {
        name
        for name, member in vars(EventHelpers).items()
        if inspect.isfunction(member) and not name.startswith("_") and name != "emit"
    }
    assert helpers == set(EVENT_TYPES) == set(MODELS)


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_the_helper_takes_the_model_fields(event_type: str) -> None:
    assert mismatches(getattr(EventHelpers, event_type), MODELS[event_type]) == []


def test_a_helper_that_drifts_from_its_model_is_caught() -> None:
    """The check itself: a helper with a misspelt, a missing-default, a mistyped and a
    missing field is reported on each."""

    def request_queued(
        self: Any,
        trajectory: str,
        *,
        prompt_token: int,
        turn: int | None = None,
        request: int | None = None,
        ts: float | None = None,
    ) -> str:
        raise AssertionError("never called")

    def sandbox_started(
        self: Any, trajectory: str, *, mode: Literal["cold"], ts: float | None = None
    ) -> str:
        raise AssertionError("never called")

    found = mismatches(request_queued, MODELS["request_queued"])
    assert any(f.startswith("prompt_token: not a field") for f in found), found
    assert any(f.startswith("prompt_tokens: a field") for f in found), found
    assert any(f.startswith("turn: required") for f in found), found
    assert any(f.startswith("request: ") and "where the model" in f for f in found), found
    found = mismatches(sandbox_started, MODELS["sandbox_started"])
    assert any(f.startswith("mode: ") for f in found), found
    assert any(f.startswith("image: a field") for f in found), found
    assert shape(SandboxMode) == frozenset({"prewarm", "cold"})


class Capture(EventHelpers):
    """The helpers over the emitter's own event builder, keeping what they emit."""

    def __init__(self) -> None:
        self.core = EmitterCore(url="http://127.0.0.1:1", namespace="rl", name="c")
        self.events: list[dict[str, Any]] = []

    def emit(
        self,
        type: str,
        trajectory: str | None,
        *,
        ts: float | None = None,
        id: str | None = None,
        **fields: Any,
    ) -> str:
        event = self.core.make(type, trajectory, ts, id, fields)
        self.events.append(event)
        return str(event["id"])


def sample(annotation: Any) -> Any:
    """A valid value for a field of that annotation."""
    kinds = shape(annotation)
    options = sorted(kinds - {type(None)}, key=str) if isinstance(kinds, frozenset) else [kinds]
    first = options[0]
    if isinstance(first, frozenset):  # a Literal inside a union
        first = sorted(first)[0]
    if isinstance(first, str):  # a Literal's value
        return first
    return {int: 3, float: 2.5, str: "x", bool: True}[first]


@pytest.mark.parametrize("event_type", EVENT_TYPES)
@pytest.mark.parametrize("optional", [False, True])
def test_what_a_helper_emits_is_that_event(event_type: str, optional: bool) -> None:
    """With the required fields alone, and with every field: each value lands in the field
    of its name, and the event validates as the contract's model."""
    helper = getattr(Capture, event_type)
    hints = get_type_hints(helper)
    params = inspect.signature(helper).parameters
    given = {
        name: sample(hints[name])
        for name, p in params.items()
        if p.kind is p.KEYWORD_ONLY
        and name not in ("ts", "id")
        and (optional or p.default is inspect.Parameter.empty)
    }
    capture = Capture()
    args = () if event_type in CLUSTER_EVENT_TYPES else ("traj-1",)
    ident = getattr(capture, event_type)(*args, ts=5.0, **given)
    (event,) = capture.events
    model = EVENTS.validate_python(event)
    assert isinstance(model, MODELS[event_type])
    assert model.id == ident and model.ts == 5.0
    assert {name: getattr(model, name) for name in given} == given
    assert getattr(model, "trajectory", None) == (args[0] if args else None)


def test_both_emitters_offer_every_helper() -> None:
    for emitter in (EventEmitter, AsyncEventEmitter):
        assert issubclass(emitter, EventHelpers)
        for event_type in EVENT_TYPES:
            assert getattr(emitter, event_type) is getattr(EventHelpers, event_type)


def test_the_names_trainers_import_stay_where_they_were() -> None:
    """The emitter's modules are split; ``prorsa_sdk`` and ``prorsa_sdk.emitter`` still name
    what trainers and the examples import from them."""
    import prorsa_sdk
    import prorsa_sdk.emitter

    assert set(prorsa_sdk.__all__) >= {
        "AsyncEventEmitter",
        "RetryBackoff",
        "EmitterStats",
        "EventEmitter",
        "tls_context",
    }
    for name in prorsa_sdk.__all__:
        assert getattr(prorsa_sdk, name) is not None
    for name in (
        "AsyncEventEmitter",
        "AsyncSnapshotSource",
        "RetryBackoff",
        "EmitterOptions",
        "EmitterStats",
        "EventEmitter",
        "SnapshotRows",
        "SnapshotSource",
        "TlsVerify",
        "tls_context",
    ):
        assert name in prorsa_sdk.emitter.__all__
        assert getattr(prorsa_sdk.emitter, name) is not None
    assert prorsa_sdk.emitter.EventEmitter is prorsa_sdk.EventEmitter
