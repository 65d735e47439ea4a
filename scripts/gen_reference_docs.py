"""Generate the field table of docs/crd-reference.md and the tables of docs/metrics.md.

The RolloutCluster fields come from the pydantic models in ``operator/prorsa/core/spec.py`` (the
same models the CRD is generated from): wire name, Python attribute, type, default and
description. A field whose model carries no description gets the one in ``DESCRIPTIONS``
below. The metrics come from the registries the operator, the webhook and the in-pod agent
create. Each table sits between ``<!-- BEGIN GENERATED: name -->`` and ``<!-- END
GENERATED: name -->`` in its page; everything else in the page is written by hand.

    python scripts/gen_reference_docs.py          # rewrite the generated blocks
    python scripts/gen_reference_docs.py --check  # exit 1 when a page is out of date

``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
CRD_PAGE = ROOT / "docs" / "crd-reference.md"
METRICS_PAGE = ROOT / "docs" / "metrics.md"

# Descriptions of the spec fields whose pydantic Field has none (wire path -> text).
DESCRIPTIONS: dict[str, str] = {
    "model.servedName": "Model name the engines and the router serve (SGLang "
    "`--served-model-name`).",
    "engine.gpusPerInstance": "m of Eq. 1: GPUs per engine instance; the in-place switch keeps "
    "an instance's GPUs.",
    "engine.tensorParallelSize": "SGLang `--tp-size`; at most gpusPerInstance (SGLang's role "
    "switch needs pure tensor parallelism).",
    "engine.transferBackend": "KV transfer backend; `mooncake` and `mori` are the two that "
    "can switch roles.",
    "engine.extraArgs": "More SGLang launch flags. The Controller reads attention DP here "
    "(`--attn-dp-size N`, or the deprecated `--enable-dp-attention` with `--dp-size N`): "
    "each request then runs on one attention-DP rank. `prorsa plan` names the flags SGLang "
    "refuses with role switching.",
    "engine.resources": "Resources of the engine container; the GPU request of "
    "gpuResourceName is added.",
    "engine.nodeSelector": "Node selector of the engine pods.",
    "engine.tolerations": "Tolerations of the engine pods.",
    "engine.volumes": "Extra volumes of the engine pods (e.g. the model weights).",
    "engine.volumeMounts": "Extra volume mounts of the engine container.",
    # A list of objects: without an entry here only its members would get a row.
    "engine.imagePullSecrets": "Secrets the kubelet pulls the engine image with.",
    "gpuBudget": "G of Eq. 1: GPUs for all engines; instances = gpuBudget / "
    "engine.gpusPerInstance (must divide).",
    "roles.prefill.min": "Never fewer prefill instances than this.",
    "roles.prefill.initial": "Prefill instances the cluster starts with; unset: a quarter of "
    "the instances, within the minimums. From a recorded job (`prorsa record`), `prorsa "
    "replay` prints the best static split of that job as this value. Unset or not, once the "
    "first weight update closes the run's first step the Controller moves toward the split "
    "that step favours (`switching.stepCycle`).",
    "roles.decode.min": "Never fewer decode instances than this.",
    "roles.decode.initial": "Not used: decode takes the instances prefill does not.",
    "forecast.horizonSeconds": "S: the forecast horizon and the control period.",
    "forecast.toolEmaAlpha": "α of Eq. 10 (the tool-duration EMA).",
    "forecast.biasCorrection": "Multiply the predicted prefill demand by a factor learned from "
    "the last scored windows (observed / predicted, within [0.5, 2]).",
    "forecast.injection.policy": "How the trainer injects new samples (f of Eq. 4): "
    "`replaceOnReward`, `fixedRate` (needs ratePerSecond), `groupReplenish` (groupSize), "
    "`none` (synchronous rollout).",
    "forecast.injection.groupSize": "Samples per group for `groupReplenish`.",
    "forecast.injection.ratePerSecond": "Samples per second for `fixedRate` (> 0 then).",
    "switching.mode": "`Auto`: switch; `Recommend`: a dry run (status and a "
    "`SwitchRecommended` Event say what Auto would do); `Off`: nothing moves. In every mode "
    "the operator first brings fresh engines (all launched as decode) to "
    "`roles.prefill.initial`, once: PD without a prefill engine serves nothing. A cluster "
    "that already has a prefill engine when the operator starts (a restart) keeps its split.",
    "switching.cooldownSeconds": "An instance is not switched again sooner than this after "
    "its last switch ended.",
    "switching.maxConcurrent": (
        "Switches in flight at once (the bootstrap of a fresh cluster flips all of "
        "`roles.prefill.initial` at once: nothing is served before)."
    ),
    "switching.drainTimeoutSeconds": "How long the agent waits for in-flight requests before "
    "aborting them; at most 3600 s, the agent's limit for a role request.",
    "router.enabled": "Deploy the smg router in PD mode with Kubernetes discovery on the "
    "role labels; false: your own router routes by `prorsa.io/role`.",
    "router.image": "Router image.",
    "router.policy": "smg routing policy.",
    "trainer.tokenSecretRef": "Secret holding the trainer's bearer token; unset: the operator "
    "creates `<cluster>-trainer-token` (key `token`). Read again every 2 s: a changed token "
    "(or Secret named here) is in force at once and the old one refused "
    "([security.md](security.md#rotating-the-trainer-token)).",
    "trainer.tokenSecretRef.name": "Secret name.",
    "trainer.tokenSecretRef.key": "Key in the Secret.",
}


def _type_name(ann: Any) -> str:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(names)
    if origin in (list, dict):
        return "list" if origin is list else "map"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "object"
    return getattr(ann, "__name__", str(ann))


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "`[]`" if isinstance(value, list) else "`{}`"
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "unset"
    value = field.default
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def _submodel(ann: Any) -> type[BaseModel] | None:
    for t in (ann, *typing.get_args(ann)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def spec_fields(model: type[BaseModel] | None = None, prefix: str = "", py: str = "") -> list:
    """(wire path, python path, type, default, description) of every leaf field."""
    if model is None:
        from prorsa.core.spec import RolloutClusterSpec

        model = RolloutClusterSpec
    rows = []
    for name, field in model.model_fields.items():
        wire = prefix + (field.alias or name)
        attr = py + name
        sub = _submodel(field.annotation)
        if sub is not None and wire not in DESCRIPTIONS:
            rows.extend(spec_fields(sub, wire + ".", attr + "."))
            continue
        text = field.description or DESCRIPTIONS.get(wire)
        if not text:
            raise SystemExit(f"spec field {wire} has no description: add one to DESCRIPTIONS")
        text = " ".join(text.split())
        rows.append((wire, attr, _type_name(field.annotation), _default(field), text))
        if sub is not None:
            rows.extend(spec_fields(sub, wire + ".", attr + "."))
    return rows


def crd_block() -> str:
    lines = []
    section = None
    for wire, attr, kind, default, text in spec_fields():
        top = wire.split(".")[0]
        if top != section:
            section = top
            if lines:
                lines.append("")
            lines += [
                f"### `{top}`",
                "",
                "| field | Python attribute | type | default | description |",
                "|---|---|---|---|---|",
            ]
        lines.append(f"| `{wire}` | `{attr}` | {kind} | {default} | {text} |")
    return "\n".join(lines)


def _metrics(obj: Any) -> list[tuple[str, str, str, str]]:
    from prometheus_client.metrics import MetricWrapperBase

    rows = []
    for value in vars(obj).values():
        if not isinstance(value, MetricWrapperBase):
            continue
        kind = value._type  # type: ignore[attr-defined]
        name = value._name  # type: ignore[attr-defined]
        if kind == "counter":
            name += "_total"
        labels = ", ".join(f"`{x}`" for x in value._labelnames)  # type: ignore[attr-defined]
        doc = " ".join(value._documentation.split())  # type: ignore[attr-defined]
        rows.append((name, kind, labels or "—", doc))
    return rows


def metrics_blocks() -> dict[str, str]:
    from prorsa.control.metrics import OperatorMetrics
    from prorsa.ingest.webhook_metrics import WebhookMetrics
    from prorsa_agent.agent_metrics import AgentMetrics

    out = {}
    for key, obj in (
        ("operator-metrics", OperatorMetrics()),
        ("webhook-metrics", WebhookMetrics()),
        ("agent-metrics", AgentMetrics("engine-0")),
    ):
        lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
        lines += [f"| `{n}` | {k} | {lab} | {d} |" for n, k, lab, d in _metrics(obj)]
        out[key] = "\n".join(lines)
    return out


def render(text: str, name: str, block: str) -> str:
    pattern = re.compile(
        rf"(<!-- BEGIN GENERATED: {re.escape(name)} [^>]*-->\n)(?:.*?\n)?(<!-- END GENERATED: "
        rf"{re.escape(name)} -->)",
        re.S,
    )
    if not pattern.search(text):
        raise SystemExit(f"no generated block {name!r} in the page")
    return pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(2), text)


def pages() -> dict[Path, str]:
    """Every page with its generated blocks filled in."""
    crd = render(CRD_PAGE.read_text(), "spec-fields", crd_block())
    metrics = METRICS_PAGE.read_text()
    for name, block in metrics_blocks().items():
        metrics = render(metrics, name, block)
    return {CRD_PAGE: crd, METRICS_PAGE: metrics}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when a page is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, text in pages().items():
        if path.read_text() != text:
            stale.append(path)
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
        print(f"out of date: {names}; run python scripts/gen_reference_docs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
