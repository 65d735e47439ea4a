"""The product's documentation: links resolve, generated tables are current, no private paths.

Users get the repository, not the workspace it was built in: no tracked file may point into
``shared/`` (its design notes and the paper's copy). The paper is cited by title and arXiv
id, the contracts are the pages in docs/.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Pages the README and docs link to that other work on the project is still writing.
# Remove an entry once its page is committed (the test then checks its links too).
ARRIVING: set[str] = set()

# Tracked files that still name a path in shared/, edited elsewhere on the project; each
# must still contain such a reference (so the list only shrinks) and none may be added.
PENDING_SHARED: set[str] = set()

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
SHARED = re.compile(r"shared/(DESIGN\.md|notes/|seed/)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            if rel not in ARRIVING:
                broken.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {rel}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_arriving_pages_are_still_missing() -> None:
    """Once a page of ARRIVING is committed, drop it from the list."""
    here = sorted(p for p in ARRIVING if (ROOT / p).exists())
    assert not here, f"committed now, remove from ARRIVING: {here}"


def test_readme_shows_the_commands_and_links_every_page() -> None:
    readme = (ROOT / "README.md").read_text()
    for command in ("make demo", "make test", "make bench"):
        assert command in readme
    assert "arXiv 2610.16592" in readme
    linked = {t.partition("#")[0] for t in _links(ROOT / "README.md")}
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in linked, f"README does not link docs/{page.name}"
    assert len(readme.splitlines()) <= 300


def _tracked() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.split("\0") if p]


def test_no_tracked_file_points_into_shared() -> None:
    offenders = set()
    for rel in _tracked():
        path = ROOT / rel
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if SHARED.search(text):
            offenders.add(rel)
    new = sorted(offenders - PENDING_SHARED)
    assert not new, f"files pointing into shared/ (cite docs/ or the paper instead): {new}"
    fixed = sorted(PENDING_SHARED - offenders)
    assert not fixed, f"no longer point into shared/: remove from PENDING_SHARED: {fixed}"


def test_generated_reference_tables_are_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_reference_docs.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_readme_says_what_make_venv_is_and_how_to_run_one_test_file() -> None:
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^make venv\s+# .*\.venv", readme, re.M), "README: what is make venv for?"
    one = re.search(r"^\.venv/bin/python -m pytest -q (tests/\S+\.py)", readme, re.M)
    assert one, "README: how to run one test file"
    assert (ROOT / one.group(1)).is_file()


CLUSTER_ARG = re.compile(r"--cluster[ =](\S+?)[`\s]|load_cluster\(\"([^\"]+)\"\)")


def test_every_cluster_manifest_the_docs_pass_exists() -> None:
    """`--cluster cluster.yaml` in a copy-pasted command fails for a new user: every manifest
    the docs and examples name is one the repository has (or a <placeholder>)."""
    missing = []
    for path in [*PAGES, *sorted((ROOT / "examples").glob("*.py"))]:
        for m in CLUSTER_ARG.finditer(path.read_text()):
            name = m.group(1) or m.group(2)
            if not name.startswith("<") and not (ROOT / name).is_file():
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_operations_and_role_switch_pages_agree_on_dp_attention() -> None:
    """SGLang 0.5.23 allows DP attention with role switching and refuses EP: both pages."""
    for page in ("operations.md", "sglang-role-switch.md"):
        text = " ".join((ROOT / "docs" / page).read_text().split())
        assert "no DP attention" not in text, page
        assert re.search(r"DP attention (itself )?is \**allowed", text), page
        assert "expert parallelism" in text, page
        assert re.search(r"local[ _-]control[ _-]broadcast", text), page


def test_demo_page_states_the_default_trajectories() -> None:
    from prorsa_lab.demo.run import TRAJECTORIES_PER_INSTANCE

    text = " ".join((ROOT / "docs" / "demo.md").read_text().split())
    trainer = text.partition("**A simulated agentic trainer**")[2].partition("* **")[0]
    stated = re.search(r"(\d+) (?:live )?trajectories per instance", trainer)
    assert stated, "docs/demo.md: the trainer's bullet does not say how many trajectories"
    assert int(stated.group(1)) == TRAJECTORIES_PER_INSTANCE


def test_webhook_page_documents_every_cluster_endpoint() -> None:
    """The page calls itself the whole contract: every route the webhook mounts is on it."""
    from aiohttp import web

    from prorsa.ingest import WebhookServer
    from prorsa.ingest.openapi import CLUSTER_PATH

    app = web.Application()
    WebhookServer().add_routes(app, health=False, metrics=False)
    routes = {
        (r.method, r.resource.canonical.removeprefix(CLUSTER_PATH))
        for r in app.router.routes()
        if r.resource is not None and r.resource.canonical.startswith(CLUSTER_PATH)
    }
    routes.discard(("HEAD", "/status"))
    routes.discard(("HEAD", "/forecast"))
    text = (ROOT / "docs" / "webhook-events.md").read_text()
    assert routes, "no cluster routes found"
    for method, suffix in sorted(routes):
        assert f"{method} {CLUSTER_PATH}{suffix}" in text or f"{method} .../{suffix[1:]}" in (
            text
        ), f"docs/webhook-events.md does not document {method} {suffix}"
