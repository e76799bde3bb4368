"""The docs hold together: README.md stays a page with the two commands first, every relative link in
README.md, BENCHMARKS.md and docs/*.md reaches a file (and a heading, for ``#anchors`` into markdown), and
nothing in the repository points at files outside it (``../shared``, DESIGN.md, STYLE.md)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a markdown page."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_the_readme_is_a_page_and_starts_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block[0].startswith("./scripts/install.sh && .venv/bin/arctic-rl fit --config configs/quickstart.yaml")
    assert first_block[1].startswith("./scripts/install.sh && .venv/bin/python -m pytest ")
    test_command = first_block[1].split("&&", 1)[1].split("#", 1)[0].strip()
    assert f"stage pytest {test_command}\n" in (REPO / ".ci" / "run").read_text()  # CI runs the README's test command


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_its_file_and_heading(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert broken == []


def test_nothing_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    needles = ("../shared", "shared/device", "DESIGN.md", "STYLE.md")
    found = []
    for name in files:
        if name == "tests/test_docs.py" or not (REPO / name).is_file():
            continue
        try:
            text = (REPO / name).read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{name}: {n}" for n in needles if n in text]
    assert found == []
