"""RolloutCluster manifests read from files, as ``kubectl apply -f`` takes them.

The control core validates a manifest it is handed (:func:`prorsa.core.spec.parse_cluster`)
and reads no file; reading one is an adapter's job, done here for the commands that take
``--cluster`` (``prorsa plan``, ``prorsa ingest``).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from prorsa.core.spec import KIND, Problem, RolloutCluster, SpecError, parse_cluster


def load_cluster(path: str | Path) -> RolloutCluster:
    """Read a RolloutCluster manifest (YAML or JSON); the first RolloutCluster document wins.

    Raises OSError when the file cannot be read, and SpecError, naming the file or each bad
    field, when it holds no valid RolloutCluster.
    """
    text = Path(path).read_text()
    try:
        docs = [d for d in yaml.safe_load_all(text) if d]
    except yaml.YAMLError as exc:
        raise SpecError([Problem("", f"not valid YAML: {exc}")], source=str(path)) from None
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == KIND:
            return parse_cluster(doc, source=str(path))
    raise SpecError([Problem("", f"no document of kind {KIND}")], source=str(path))
