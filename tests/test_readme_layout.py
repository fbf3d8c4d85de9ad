"""The README as a newcomer meets it: under 200 lines, the answer first, then the quick start (set up once and run;
then the tests) within the first screen, no heading naming an issue, and every relative link (there and in the
docs it hands the narrative to) pointing at a file of the checkout."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_readme_is_short_and_starts_with_the_answer_and_the_quick_start():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) < 200
    headings = [ln for ln in lines if ln.startswith("#")]
    assert headings[:3] == ["# kvbench", "## The answer", "## Quick start"]
    assert not [h for h in headings if re.search(r"\bissue\s+\d", h, re.I)]
    assert lines.index("## Quick start") < 50  # in the first screen
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    setup, test = _blocks(quick)[:2]
    assert [c.split("#")[0].strip() for c in setup.strip().splitlines()] == [
        "bash scripts/setup.sh", ".venv/bin/python -m kvbench strategy=int8 task=legal"]
    assert test.strip() == ".venv/bin/python -m pytest -q"
    nxt = text.split("## Next", 1)[1].split("\n## ", 1)[0]
    topics = re.findall(r"^\*\*(.+?)\.\*\*", nxt, re.M)
    assert topics == ["Your own documents", "Sweeps", "The leaderboard", "Tracking", "Notebooks"]
    assert len(_blocks(nxt)) == len(topics) and all(len(b.strip().splitlines()) == 1 for b in _blocks(nxt))


def test_relative_links_resolve():
    for page in (README, ROOT / "docs" / "guide.md", ROOT / "docs" / "results.md"):
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            assert path.exists(), f"{page.name} links to {target}, which is not in the checkout"
