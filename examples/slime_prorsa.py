"""Emit Prorsa lifecycle events from a slime rollout (THUDM/slime, SGLang rollout engines).

slime generates each sample with ``slime.rollout.sglang_rollout.generate(args, sample,
sampling_params)``, or with the function ``--custom-generate-function-path`` names, called
the same way from its RolloutManager (one Ray actor, one asyncio loop for the whole
rollout). This module's :func:`generate` is such a function: slime's own generation with
every lifecycle transition reported, and the weight updates of the trainer process:

=================================  ====================================================
slime step                          Prorsa event
=================================  ====================================================
a sample's first generation          ``sample_dispatched`` (group = ``sample.group_index``)
before each ``/generate``            ``request_queued`` (prompt plus the response so far)
``/generate`` returned               ``decode_finished`` (finish from ``sample.status``:
                                     COMPLETED stop, TRUNCATED length, ABORTED abort)
an abort slime did not ask for       the request is resent with prompt plus partial output
(a Prorsa role switch)               (slime's ``generate`` continues an ABORTED sample)
the reward (``async_rm``)            ``reward_started`` / ``reward_finished``
slime's abort at the step's end      ``decode_finished`` abort; with ``--partial-rollout``
                                     the sample returns in a later step, without it
                                     ``trajectory_dropped``
``RayTrainGroup.update_weights``     ``weight_update_started`` before, ``weight_update_
(trainer process)                    finished`` after (version: 0 for the initial sync,
                                     then one more per update)
=================================  ====================================================

No prefill events: slime's ``/generate`` through the router is one blocking call, so
the Controller reads which queued requests the prefill engines still hold from their
``/v1/state`` (docs/webhook-events.md, "What a trainer can observe").

Use it: put this file on the PYTHONPATH of the job, then

    python examples/slime_prorsa.py train.py <slime's arguments> \\
        --custom-generate-function-path slime_prorsa.generate

which installs the weight-update events in the trainer (driver) process and runs slime's
``train.py`` (or ``train_async.py``) unchanged; the RolloutManager imports this module
again to find :func:`generate`. Settings come from the environment (the job's Ray
runtime_env):

    PRORSA_URL=https://prorsa-webhook.prorsa-system.svc:8787  # prorsa ingest: http://127.0.0.1:8787
    PRORSA_NAMESPACE=rl  PRORSA_CLUSTER=qwen3-coder  PRORSA_TOKEN_FILE=/var/run/prorsa/token
    PRORSA_CA_FILE=/var/run/prorsa/webhook-ca.crt  # the CA of the webhook's certificate
    PRORSA_RECORD=/data/qwen3-coder.ndjson          # optional: record for prorsa plan

The rollout's emitter tracks every trajectory (``track=True``): slime's RolloutManager
sees all of them, so after an operator restart the resync snapshot is whole. Set
``PRORSA_TRACK=0`` with a data source spread over several processes.

With ``--group-rm`` slime rewards a group once all of its samples are done, outside any
generate function: the trajectory's reward is then reported as done (``accepted``) when its
last generation ends.
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import functools
import logging
import os
import runpy
import sys
import time
from argparse import Namespace
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
from slime.ray.actor_group import RayTrainGroup
from slime.rollout.rm_hub import async_rm
from slime.rollout.sglang_rollout import GenerateState
from slime.rollout.sglang_rollout import generate as slime_generate
from slime.utils.types import Sample

from prorsa_sdk import AsyncEventEmitter, EventEmitter, tls_context

log = logging.getLogger("prorsa.slime")

# States whose trajectories compute their whole context again on new weights.
_REPREFILL_STATES = ("ready", "prefill", "decode", "tool")
# Resends after aborts slime did not ask for, before the sample is given back as aborted.
MAX_RESUMES = 16
_FINISH = {
    Sample.Status.COMPLETED: "stop",
    Sample.Status.TRUNCATED: "length",
    Sample.Status.ABORTED: "abort",
}


def _settings() -> dict[str, Any]:
    return {
        "url": os.environ.get("PRORSA_URL", "http://127.0.0.1:8787"),
        "namespace": os.environ.get("PRORSA_NAMESPACE", "default"),
        "name": os.environ["PRORSA_CLUSTER"],
        "token": Path(os.environ["PRORSA_TOKEN_FILE"]).read_text().strip(),
        "verify": os.environ.get("PRORSA_CA_FILE") or None,
    }


_EMITTERS: dict[asyncio.AbstractEventLoop, AsyncEventEmitter] = {}


def prorsa_emitter() -> AsyncEventEmitter:
    """The rollout's emitter, one per event loop (slime runs the rollout on one)."""
    loop = asyncio.get_running_loop()
    emitter = _EMITTERS.get(loop)
    if emitter is None:
        emitter = AsyncEventEmitter(
            **_settings(),
            track=os.environ.get("PRORSA_TRACK", "1") != "0",
            record=os.environ.get("PRORSA_RECORD") or None,
        )
        _EMITTERS[loop] = emitter
    return emitter


# -- the rollout: slime's generate, reported ---------------------------------------------


def _trajectory(sample: Sample) -> tuple[str, bool]:
    """The sample's trajectory id (kept in its metadata across partial rollouts), and
    whether this is its first generation."""
    tid = sample.metadata.get("prorsa_trajectory")
    if tid is not None:
        return str(tid), False
    tid = uuid4().hex
    sample.metadata["prorsa_trajectory"] = tid
    sample.metadata["prorsa_turn"] = 0
    return tid, True


def _prompt_tokens(args: Namespace, sample: Sample) -> int:
    """What the next ``/generate`` sends: prompt plus the response so far."""
    if sample.tokens:
        return len(sample.tokens)
    prompt = sample.prompt
    if not isinstance(prompt, str):  # chat messages: slime sends them through the template
        prompt = GenerateState(args).tokenizer.apply_chat_template(prompt, tokenize=False)
    return len(GenerateState(args).tokenizer.encode(prompt, add_special_tokens=False))


def _label(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value)
    return text[:128] or None


async def generate(
    args: Namespace, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample:
    """slime's ``generate`` (``--custom-generate-function-path slime_prorsa.generate``)."""
    em = prorsa_emitter()
    tid, first = _trajectory(sample)
    if first:
        task = sample.metadata.get("task") or ("eval" if evaluation else None)
        em.sample_dispatched(tid, group=_label(sample.group_index), task=_label(task))
    try:
        return await _generate(args, sample, sampling_params, em, tid)
    except BaseException as exc:  # slime cancels what is left at the step's end (no partial
        # rollout), or the generation failed: either way the trajectory is gone
        em.trajectory_dropped(tid, reason=type(exc).__name__)
        raise


async def _generate(
    args: Namespace,
    sample: Sample,
    sampling_params: dict[str, Any],
    em: AsyncEventEmitter,
    tid: str,
) -> Sample:
    resumes = 0
    while True:
        before = sample.response_length
        em.request_queued(
            tid, prompt_tokens=_prompt_tokens(args, sample), turn=sample.metadata["prorsa_turn"]
        )
        # slime's generate takes max_new_tokens less what the sample already has.
        sample = await slime_generate(args, sample, copy.copy(sampling_params))
        finish = _FINISH.get(sample.status)
        if finish is None:  # FAILED, or a status this module does not know
            em.trajectory_dropped(tid, reason=f"slime status {sample.status.value}")
            return sample
        em.decode_finished(tid, output_tokens=sample.response_length - before, finish=finish)
        if finish != "abort":
            break
        if GenerateState(args).aborted or resumes >= MAX_RESUMES:
            # slime's own abort at the end of the step: the sample waits in the buffer
            # (--partial-rollout) or is gone.
            if not args.partial_rollout:
                em.trajectory_dropped(tid, reason="aborted at the end of the rollout step")
            return sample
        resumes += 1  # a role switch drained its engine: resend prompt + partial output
    await _reward(args, sample, em, tid)
    return sample


async def _reward(args: Namespace, sample: Sample, em: AsyncEventEmitter, tid: str) -> None:
    """The reward, computed here as slime's ``generate_and_rm`` would, so its end is seen."""
    em.reward_started(tid)
    if args.group_rm:
        em.reward_finished(tid, accepted=True)
        return
    if sample.reward is None:
        sample.reward = await async_rm(args, sample)
    reward = sample.reward
    if isinstance(reward, dict):
        reward = reward.get(args.reward_key) if args.reward_key else None
    em.reward_finished(tid, accepted=isinstance(reward, int | float) and reward > 0)


# -- weight updates, in the trainer process ---------------------------------------------


class _WeightUpdates:
    """The trainer's emitter (threaded: slime's driver is synchronous) and what the last
    update taught: its version and how long it took."""

    def __init__(self) -> None:
        self.emitter: EventEmitter | None = None
        self.version = -1
        self.seconds: float | None = None

    def get_emitter(self) -> EventEmitter:
        if self.emitter is None:
            self.emitter = EventEmitter(**_settings())
            atexit.register(self.emitter.close)  # deliver the last update before exit
        return self.emitter


_UPDATES = _WeightUpdates()


def _reprefilling() -> int:
    """Live trajectories whose context returns to prefill, as the webhook counts them."""
    cfg = _settings()
    path = f"/v1/namespaces/{cfg['namespace']}/rolloutclusters/{cfg['name']}/status"
    try:
        verify = tls_context(cfg["verify"])
        with httpx.Client(base_url=cfg["url"], timeout=2.0, verify=verify) as client:
            reply = client.get(path, headers={"Authorization": f"Bearer {cfg['token']}"})
            reply.raise_for_status()
            live = reply.json().get("liveTrajectories", {})
    except (httpx.HTTPError, ValueError) as exc:
        log.warning("prorsa: live trajectories unknown (%s); reporting 0 to re-prefill", exc)
        return 0
    return sum(int(live.get(state, 0)) for state in _REPREFILL_STATES)


def install_weight_update_events() -> None:
    """Wrap slime's weight sync so that it reports itself to Prorsa (idempotent)."""
    current = RayTrainGroup.update_weights
    if getattr(current, "_prorsa", False):
        return

    @functools.wraps(current)
    def update_weights(self: RayTrainGroup, *args: Any, **kwargs: Any) -> Any:
        em = _UPDATES.get_emitter()
        _UPDATES.version += 1
        version = _UPDATES.version
        ids = f"slime-weights-{version}-{uuid4().hex[:8]}"
        em.weight_update_started(
            version=version, expected_seconds=_UPDATES.seconds, id=f"{ids}-started"
        )
        began = time.monotonic()
        try:
            return current(self, *args, **kwargs)
        finally:  # also when the sync fails: the Controller must not wait for it forever
            _UPDATES.seconds = max(time.monotonic() - began, 1e-3)
            em.weight_update_finished(
                version=version, reprefill_trajectories=_reprefilling(), id=f"{ids}-finished"
            )

    update_weights._prorsa = True  # type: ignore[attr-defined]
    RayTrainGroup.update_weights = update_weights  # type: ignore[method-assign]


install_weight_update_events()


if __name__ == "__main__":
    # python examples/slime_prorsa.py train.py <slime's arguments>: slime's own entry
    # point, run as its __main__, with the weight updates reported.
    if len(sys.argv) < 2:
        sys.exit("usage: python slime_prorsa.py train.py [slime's arguments]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
