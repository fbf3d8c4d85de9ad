"""The sample sizes the README and docs/results.md cite are the committed boards' (spec v1.2 §2.6, one number
everywhere).

docs/results.md said the leaderboard pooled "n = 200 questions / 200 documents query-aware, 200 / 50
query-agnostic" while results/leaderboard.md's n column reads 200 / 168 and 200 / 49 (questions / clusters of
shared source works). Every ``questions / clusters`` pair a page cites beside a query setting must be one the
committed board prints in that setting's tables, and every ``questions / contexts / clusters`` triple one a
committed claim check prints (``n = Q questions / C contexts / K documents``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", ROOT / "docs" / "results.md")
#: The boards of all 18 strategies: the earlier engine's and the one re-measured on the fused reader (issue 49).
BOARDS = tuple(b for b in (ROOT / "results" / "leaderboard.md", ROOT / "results" / "fused" / "leaderboard.md")
               if b.is_file())
CHECKS = sorted((ROOT / "results").glob("**/claim_check.md"))
N = r"(\d[\d,]*)"
#: ``200 / 168 query-aware`` or ``200 questions / 168 clusters of shared source works query-aware``.
PAIR = re.compile(N + r"(?: questions)? / " + N + r"((?: [a-z]+)*?) (query-(?:aware|agnostic))\b")
TRIPLE = re.compile(N + r" questions / " + N + r" contexts / " + N + r" (?:clusters|documents)\b")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def cited_pairs(text: str) -> list[tuple[str, int, int]]:
    """(setting, questions, clusters) for every pair cited beside a query setting (lines joined: prose wraps)."""
    flat = " ".join(text.replace("\u2009", " ").split())
    return [(m.group(4), _int(m.group(1)), _int(m.group(2))) for m in PAIR.finditer(flat)]


def board_pairs(board: str) -> set[tuple[str, int, int]]:
    """(setting, questions, clusters) of every n cell of the board's tables, by the setting its heading names."""
    out, setting = set(), None
    for line in board.splitlines():
        heading = re.match(r"#+ Query-(aware|agnostic)\b", line)
        if heading:
            setting = f"query-{heading.group(1)}"
        elif line.startswith("#"):
            setting = None
        elif setting and line.startswith("|"):
            cell = line.rstrip().rstrip("|").rsplit("|", 1)[-1].strip()
            m = re.fullmatch(r"(\d+) / (\d+)", cell)
            if m:
                out.add((setting, int(m.group(1)), int(m.group(2))))
    return out


def printed_triples(text: str) -> set[tuple[int, int, int]]:
    return {tuple(map(_int, t)) for t in TRIPLE.findall(" ".join(text.split()))}


@pytest.mark.skipif(not BOARDS, reason="no committed leaderboard")
def test_pages_cite_the_boards_n():
    printed = set()
    for board in BOARDS:
        pairs = board_pairs(board.read_text())
        assert {s for s, _, _ in pairs} == {"query-aware", "query-agnostic"}, f"{board}'s tables were not read"
        printed |= pairs
    cited = [(page.name, pair) for page in PAGES for pair in cited_pairs(page.read_text())]
    assert len(cited) >= 2, "docs/results.md cites no pooled n for the board"
    for page, pair in cited:
        assert pair in printed, f"{page} cites n = {pair[1]} / {pair[2]} {pair[0]}; the boards print " \
                                f"{sorted(p for p in printed if p[0] == pair[0])}"


@pytest.mark.skipif(not CHECKS, reason="no committed claim checks")
def test_pages_cite_the_claim_checks_question_context_cluster_counts():
    printed = set().union(*(printed_triples(p.read_text()) for p in CHECKS))
    cited = [(page.name, t) for page in PAGES for t in printed_triples(page.read_text())]
    assert cited, "no page cites questions / contexts / clusters"
    for page, triple in cited:
        assert triple in printed, f"{page} cites {triple} (questions / contexts / clusters); no claim check prints it"


def test_the_extraction_reads_what_a_page_cites():
    text = ("Pooled (legal + papers; n = 200 questions / 200 documents query-aware,\n200 / 50 query-agnostic; "
            "fiction 100 / 25 is not pooled) and 3,600 questions / 450 contexts / 246 clusters.")
    assert cited_pairs(text) == [("query-aware", 200, 200), ("query-agnostic", 200, 50)]
    assert printed_triples(text) == {(3600, 450, 246)}
    board = ("### Query-aware: ranked (legal, papers)\n\n| # | strategy | n (questions / docs) |\n|---|---|---:|\n"
             "| 1 | int8 | 200 / 168 |\n\n### Query-agnostic: ranked\n\n| 1 | int8 | 200 / 49 |\n"
             "### Per task\n\n| legal | 100 / 80 |\n")
    assert board_pairs(board) == {("query-aware", 200, 168), ("query-agnostic", 200, 49)}
