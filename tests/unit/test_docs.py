"""The docs agree with what runs: links that resolve, every metric label value listed, cost figures in
one place, the README a front page (its commands are run in tests/engine/test_docs_commands.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_kvguard.metrics import SERIES

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings (lower case, punctuation dropped, spaces to hyphens,
    repeats numbered)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchors_follow_githubs_rules() -> None:
    page = ROOT / "docs" / "support.md"
    assert "kv-connectors-and-prefilldecode" in anchors(page) and "vllm-builds" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    """The README once linked a dead H200 anchor, and "docs/design.md" to design/parallel.md."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    dead = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            dead.append(target)
    assert dead == [], dead


def test_the_readme_links_say_where_they_go() -> None:
    """A link's text that names a file names the file it points to."""
    text = (ROOT / "README.md").read_text()
    for label, target in re.findall(r"\[([^\]]+\.md)\]\(([^)#]+)", text):
        assert target.endswith(label.split("/")[-1]), (label, target)


def test_metrics_doc_lists_every_label_value() -> None:
    """metrics.md once lacked faults_injected's kind="load"."""
    rows = {
        line.split("|")[1].strip(" `"): line
        for line in (ROOT / "docs" / "metrics.md").read_text().splitlines()
        if line.startswith("| `vllm:kvguard_")
    }
    for series in SERIES:
        name = series.name + ("_total" if series.kind == "counter" else "")
        assert name in rows, name
        missing = [v for v in series.values if f"`{v}`" not in rows[name]]
        assert missing == [], (name, missing)


def test_cost_figures_live_in_performance_md_only() -> None:
    """The runbook once said 7.5 % / 25 % while performance.md said 6.6 % / 22.4 %: the README and
    the runbook link to performance.md and quote no share of step time of their own."""
    share = re.compile(r"\d+(\.\d+)? ?% of (the )?step time")
    for page in ("README.md", "docs/runbook.md", "docs/deploy.md", "docs/configuration.md"):
        text = (ROOT / page).read_text()
        assert not share.search(text), (page, share.search(text))
        if page in ("README.md", "docs/runbook.md"):  # the pages that speak of cost link to it
            assert "performance.md" in text, page


def test_the_readme_is_a_front_page() -> None:
    """Issue 59: about 120 lines, in the order a newcomer needs, no table cell of a paragraph."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 125, len(lines)
    heads = [line for line in lines if line.startswith("## ")]
    assert heads[:2] == [
        "## Install and enable",
        "## Two commands (fresh Linux machine, offline apart from the package registry)",
    ]
    assert {"## What it catches", "## Modes and cost", "## Supported", "## More"} <= set(heads)
    assert max(len(cell) for line in lines if line.startswith("|") for cell in line.split("|")) <= 160
    for page in ("configuration.md", "metrics.md", "runbook.md", "deploy.md", "design.md"):
        assert f"(docs/{page}" in text, page
