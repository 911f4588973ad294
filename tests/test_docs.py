"""The README and docs/ link to files and sections that exist (the docs were split in session 44)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors: headings lowercased, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def relative_links(path: Path) -> list[str]:
    return [link for link in LINK.findall(path.read_text()) if not re.match(r"[a-z]+:", link)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_relative_links_resolve(document):
    broken = []
    for link in relative_links(document):
        target, _, anchor = link.partition("#")
        resolved = (document.parent / target).resolve() if target else document
        if not resolved.exists():
            broken.append(f"{link}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
            broken.append(f"{link}: no heading #{anchor} in {resolved.name}")
    assert not broken, f"{document.name} has broken links:\n" + "\n".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n[ok](#title) [bad](#nowhere) [gone](missing.md)\n")
    assert relative_links(page) == ["#title", "#nowhere", "missing.md"]
    assert heading_anchors(page) == {"title"}
