"""README statements match the claim checks word for word in their numbers (spec v1.2 §2.6, one number everywhere).

Wherever they sit, the README's verdict statements about the headline strategies — a line naming int8, fp8 or
bfp and a verdict (holds, fails, undetermined) — are read for the figures they cite: Δ with its interval, the
relative change with its interval, p-values and levels, look numbers and questions-to-decide counts. Each must be
printed in a committed claim check (``results/headline/claim_check.md`` or ``results/claim_check.md``) exactly as
cited; the README's typographic minus reads as a hyphen.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = (ROOT / "results" / "headline" / "claim_check.md", ROOT / "results" / "claim_check.md",
          ROOT / "results" / "confirm" / "claim_check.md")
STATEMENT = re.compile(r"\b(int8|fp8|bfp)\b.*\b(holds|fails|undetermined)\b|\b(holds|fails|undetermined)\b.*"
                       r"\b(int8|fp8|bfp)\b", re.I)
S = r"([+-]\d+\.\d+)"
PP = re.compile(S + r" pp \[(?:95% CI )?" + S + ", " + S + r"\]")
PCT = re.compile(S + r"% \[(?:95% CI )?" + S + "%?, " + S + r"%?\]")
PVALUE = re.compile(r"(?<![\d.])(\d\.\d+e-\d+|0\.\d*[1-9]\d*)(?![\d.%])")
LOOK = re.compile(r"\blooks? (\d+)(?: of (\d+))?")
NEEDED = re.compile(r"~(\d[\d,]*) questions")


def _plain(text: str) -> str:
    return text.replace("−", "-").replace("\u2009", " ")


def statements(readme: str) -> list[str]:
    """README lines (table rows and sentences) that state a headline strategy's verdict."""
    out = []
    for line in _plain(readme).splitlines():
        for sentence in re.split(r"(?<=[.;])\s+(?=[A-Z*(])", line):
            if STATEMENT.search(sentence) and re.search(r"pp \[|p = |\blook \d", sentence):
                out.append(sentence)
    return out


DECIDED = re.compile(r"p = (\d[\d.e-]*\d) < (\d[\d.e-]*\d)")
STRATEGY = re.compile(r"\b(int8|fp8|bfp)\b")


def cited(sentence: str) -> dict[str, list]:
    """The figures a statement cites; a Δ interval keyed by the strategy named last before it."""
    pp = [((STRATEGY.findall(sentence[: m.start()]) or ["*"])[-1], *m.groups()) for m in PP.finditer(sentence)]
    pct = PCT.findall(sentence)
    decided = [(float(a), float(b)) for a, b in DECIDED.findall(sentence)]
    rest = PCT.sub("", PP.sub("", sentence))
    return {"pp": pp, "pct": pct, "decided": decided, "p": [float(v) for v in PVALUE.findall(rest)],
            "look": [m[0] for m in LOOK.findall(rest)], "needed": [n.replace(",", "") for n in NEEDED.findall(rest)]}


def printed_figures(text: str) -> dict[str, set]:
    text = _plain(text)
    pp = {("*", *t) for t in PP.findall(text)}
    for line in text.splitlines():  # a Δ [interval] belongs to the strategy named last before it
        for m in PP.finditer(line):
            named = re.findall(r"`(int8|fp8|bfp)\(", line[: m.start()])
            if named:
                pp.add((named[-1], *m.groups()))
    decided = {(float(a), float(b)) for a, b in re.findall(r"(\d[\d.e-]*\d) < (\d[\d.e-]*\d) \(look", text)}
    return {"pp": pp, "pct": set(PCT.findall(text)), "decided": decided,
            "p": {float(v) for v in re.findall(r"(?<![\d.])(\d\.\d+e-\d+|\d\.\d+|\d+)(?![\d.])", text)},
            "look": {m[0] for m in LOOK.findall(text)}, "needed": {n.replace(",", "") for n in
                                                                  re.findall(r"~(\d[\d,]*)", text)}}


@pytest.mark.skipif(not all(p.is_file() for p in CHECKS), reason="no committed claim checks")
def test_readme_verdict_statements_cite_the_claim_checks_numbers():
    found = [printed_figures(p.read_text()) for p in CHECKS]
    known = {k: set().union(*(f[k] for f in found)) for k in found[0]}
    said = statements((ROOT / "README.md").read_text())
    assert said, "the README states no headline verdict"
    n = 0
    for sentence in said:
        for kind, values in cited(sentence).items():
            for v in values:
                assert v in known[kind], f"README cites {kind} {v!r} that no claim check prints: {sentence!r}"
                n += 1
    assert n >= 5  # the headline's statements cite at least Δ, interval, p, level and look
    # the pooled headline's verdict is stated with the claim check's own interval
    pooled = re.search(r"`int8\(axis=token,group_size=64\)` − `full` = " + S + r" pp \[95% CI " + S + ", " + S + r"\]"
                       r"[^\n]*\n", CHECKS[0].read_text().split("(pooled)**", 1)[-1])
    assert pooled and any(("int8", *pooled.group(1, 2, 3)) in cited(s)["pp"] for s in said)


def test_the_extraction_reads_what_a_statement_cites():
    s = statements("Pooled, **int8 holds**: −0.1 pp [−0.6, +0.4], relative change −0.17% [−1.25%, +0.89%]; "
                   "decided at look 17 of 18 (p = 0.0012 < 0.0047), ~13,878 questions for bfp.\n"
                   "A line about setup with 2 numbers.")
    assert len(s) == 1
    c = cited(s[0])
    assert c["pp"] == [("int8", "-0.1", "-0.6", "+0.4")] and c["pct"] == [("-0.17", "-1.25", "+0.89")]
    assert c["decided"] == [(0.0012, 0.0047)]
    assert c["p"] == [0.0012, 0.0047] and c["look"] == ["17"] and c["needed"] == ["13878"]
    # a deciding p is cited beside its own level: another look's p next to it is not in the claim check
    check = printed_figures("| `bfp(x)` | +0.0 pp [95% CI -0.8, +0.8] | 0.0069 | 0.0053 < 0.0071 (look 14, decided) |")
    assert (0.0053, 0.0071) in check["decided"] and (0.0069, 0.0071) not in check["decided"]
    assert ("bfp", "+0.0", "-0.8", "+0.8") in check["pp"] and ("int8", "+0.0", "-0.8", "+0.8") not in check["pp"]
