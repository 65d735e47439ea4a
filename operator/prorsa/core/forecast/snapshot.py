"""Loading the trainer's snapshot: the table made to match the trainer's own view.

The trainer posts one after an operator restart, or when a reply asks for it; a named
emitter posts its own trajectories alone (:class:`~prorsa.core.forecast.emitters.EmitterScope`).
"""

from __future__ import annotations

from prorsa.core.forecast.emitters import EmitterScope
from prorsa.core.forecast.interner import Labels
from prorsa.core.forecast.slots import MODE_CODE, STATE_CODE, TOOL, SlotStore
from prorsa.core.forecast.transitions import Transitions, load_bucket
from prorsa.core.forecast.weight_updates import WeightUpdates
from prorsa_contract import events as ev


def load_snapshot(
    snapshot: ev.Snapshot,
    *,
    store: SlotStore,
    labels: Labels,
    scope: EmitterScope,
    transitions: Transitions,
    updates: WeightUpdates,
) -> None:
    """Replace the table's trajectories with the snapshot's.

    Under a named emitter (``scope.current``), only that emitter's trajectories are
    replaced: the others, the ended ones remembered and the prefill busy intervals in
    progress stay, and a snapshot without a weight update leaves the one known alone
    (another emitter may have announced it).
    """
    code = scope.current
    c = store.c
    if code is None:
        for trajectory, slot in list(store.slots.items()):
            store.release(trajectory, slot)
        store.finished.clear()
        transitions.busy.clear()
    else:
        scope.release(code)
        for t in snapshot.trajectories:
            store.finished.pop(t.trajectory, None)
    for t in snapshot.trajectories:
        held = store.slots.get(t.trajectory)
        if held is not None:
            if code is None or c.emitter[held] == code:
                continue  # listed twice: the first row stands
            # Another emitter reported it last: the snapshot's word is the newer.
            store.release(t.trajectory, held, ended=False)
        slot = store.alloc(t.trajectory, STATE_CODE[t.state], t.since)
        c.emitter[slot] = code or 0
        c.x[slot] = t.context_tokens
        c.task[slot] = labels.tasks.code(t.task)
        c.turn[slot] = t.turn
        c.queued_once[slot] = t.state != "starting"
        store.join_group(slot, t.group)
        if t.instance is not None:
            c.instance[slot] = labels.instances.code(t.instance)
        if t.mode is not None:
            c.mode[slot] = MODE_CODE[t.mode]
            if t.state == "starting":
                c.launched[slot] = t.since
        elif t.state == "starting":
            c.dispatched[slot] = t.since
        if t.tool is not None:
            c.tool[slot] = labels.tools.code(t.tool)
        if t.state == "tool":
            c.tool_load[slot] = load_bucket(store.counts[TOOL])
    if code is None or snapshot.weight_update is not None:
        updates.load(snapshot.weight_update)
