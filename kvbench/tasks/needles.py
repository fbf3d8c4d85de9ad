"""Needle families: a fact in the domain's own form, plus distractors that differ only in the detail asked.

A family renders statements like "14.3 Notice Period. The notice period for the Orchard Analytics
account is 45 days, ..." For one sample it draws ``1 + n_distractors`` statements of the same form
and the same type of value, with different keys (party, cohort, character) and different values,
and either the needle's kind of detail (all notice periods) or other kinds (a cure period, a payment
term). The question names the target's kind and key; the distractors' values are exactly the wrong
answers a model confuses it with.

Values are drawn so that no value's normalised form occurs inside another's (so a substring hit can
only come from the right value), and all draws use the caller's ``random.Random``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kvbench.errors import KVBenchError
from kvbench.tasks.metrics import normalize


@dataclass(frozen=True)
class Needle:
    """One rendered statement with the question that targets it."""

    family: str
    key: str
    value: str
    text: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    gold: str  # reference continuation after the answer prefix (teacher-forced for NLL/KL)
    kind: str = ""


@dataclass(frozen=True)
class Family:
    """A statement template over keys, kinds and values.

    ``{kind}`` names what is stated (notice period, cure period, ...: all with the same type of value);
    ``{Kind}`` is its capitalised form for headings. Distractors either share the needle's kind
    ("same": they differ from it only in key and value) or each take another kind ("other").
    """

    name: str
    domain: str
    keys: tuple[str, ...]
    kinds: tuple[str, ...]
    value: Callable[[random.Random], str]
    statement: str
    question: str
    answer_prefix: str
    gold: str = "{value}"

    def render(self, key: str, kind: str, value: str, clause: str) -> Needle:
        fields = {"key": key, "value": value, "kind": kind, "Kind": kind[:1].upper() + kind[1:],
                  "clause": clause}
        return Needle(
            family=self.name, key=key, value=value, text=self.statement.format(**fields),
            question=self.question.format(**fields), answer_prefix=self.answer_prefix.format(**fields),
            answers=(value,), gold=self.gold.format(**fields), kind=kind)


def _pick(pool: tuple[str, ...]) -> Callable[[random.Random], str]:
    return lambda rng: rng.choice(pool)


def _clause(rng: random.Random) -> str:
    return f"{rng.randint(2, 24)}.{rng.randint(1, 9)}"


def _percent(rng: random.Random) -> str:
    return f"{rng.randint(520, 989) / 10:.1f}"


def _auc(rng: random.Random) -> str:
    return f"0.{rng.randint(61, 97)}"


def _six_digits(rng: random.Random) -> str:
    return str(rng.randint(100000, 999999))


PARTIES = (
    "Orchard Analytics", "Bluefin Systems", "Copperleaf Media", "Harborline Logistics", "Quillon Health",
    "Marlowe Foods", "Tidewater Labs", "Kestrel Mining", "Ashgrove Retail", "Brightwater Energy",
    "Northgate Robotics", "Silverpine Software", "Redfern Pharma", "Wexford Capital", "Lumen Textiles",
    "Caldera Games", "Fernhill Insurance", "Granite Peak Hotels", "Oakmont Telecom", "Saltmarsh Shipping",
)
JURISDICTIONS = (
    "Delaware", "New York", "California", "Ontario", "England and Wales", "Ireland", "Singapore", "Bavaria",
    "Scotland", "Queensland", "Switzerland", "the Netherlands", "Sweden", "Japan", "Texas", "Quebec",
)
NOTICE_DAYS = tuple(str(d) for d in (10, 14, 15, 20, 21, 28, 30, 35, 40, 45, 60, 75, 90, 120, 150, 180))
LIABILITY_CAPS = tuple(f"{v:,}" for v in (50_000, 75_000, 100_000, 150_000, 200_000, 250_000, 300_000,
                                          400_000, 600_000, 750_000, 800_000, 900_000, 1_000_000, 3_000_000))
COHORTS = (
    "Alder Creek", "Brennan Valley", "Calloway", "Dunmore", "Eastfield", "Fairhaven", "Glenrock",
    "Holloway Bay", "Ivybridge", "Juniper Ridge", "Kingsmere", "Larkspur", "Millbrook", "Northwood",
    "Oakhurst", "Pinecrest", "Redmoor", "Stonybrook",
)
CHARACTERS = (
    "Tobias Wren", "Adela Thorne", "Silas Hartwell", "Clara Penrose", "Captain Hollis", "Jeremiah Blunt",
    "Agatha Finch", "Edmund Gray", "Lydia Marsh", "Bartholomew Crane", "Nell Ashby", "Rufus Pemberton",
    "Hester Vane", "Ambrose Quill", "Martha Greenleaf", "Jasper Kettle",
)
PET_NAMES = ("Biscuit", "Pepper", "Juniper", "Marmalade", "Thistle", "Bramble", "Clover", "Nutmeg", "Sorrel",
             "Tinker", "Barnaby", "Pippin", "Mabel", "Duchess", "Soot", "Wellington")
KEEPSAKES = ("silver compass", "brass telescope", "tin whistle", "pocket watch", "copper locket",
             "ivory chess piece", "wooden flute", "green glass bottle", "leather diary", "blue silk ribbon",
             "pewter thimble", "carved walnut box", "cracked magnifying glass", "china teacup")
VILLAGES = ("Marbury", "Thornwick", "Eldermere", "Ashcombe", "Lowenfold", "Harrowfield", "Pennington",
            "Stourbury", "Fallowmere", "Brackenholt", "Wrenfold", "Cresswick", "Dunstable Green", "Oxley Marsh")
ARCHIVES = ("Amber Lighthouse", "Cobalt River", "Crimson Orchard", "Silent Harbour", "Granite Tower",
            "Velvet Meadow", "Iron Bridge", "Golden Canyon", "Willow Station", "Frost Garden", "Copper Mill",
            "Hidden Valley", "Marble Gate", "Ember Forest", "Quiet Lagoon", "Saffron Market")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    # --- legal: numbered clauses of a contract schedule
    Family("notice", "legal", PARTIES,
           ("notice period", "cure period", "payment term", "warranty period", "acceptance period"),
           _pick(NOTICE_DAYS),
           "{clause} {Kind}. The {kind} for the {key} account is {value} days, and any notice under this "
           "clause must be given in writing to the other party.",
           "What is the {kind} for the {key} account?",
           "The {kind} for the {key} account is", gold="{value} days"),
    Family("liability_cap", "legal", PARTIES,
           ("aggregate liability cap", "annual licence fee", "minimum annual commitment", "indemnity cap",
            "service credit cap"),
           _pick(LIABILITY_CAPS),
           "{clause} {Kind}. The {kind} for the {key} account is US${value}, unless both parties agree "
           "otherwise in a signed amendment to this Agreement.",
           "What is the {kind} for the {key} account?",
           "The {kind} for the {key} account is", gold="US${value}"),
    Family("governing_law", "legal", PARTIES,
           ("governing jurisdiction", "seat of arbitration", "venue for disputes", "data hosting location",
            "place of performance"),
           _pick(JURISDICTIONS),
           "{clause} {Kind}. The {kind} for the {key} account is {value}, and neither party may change it "
           "without the prior written consent of the other.",
           "What is the {kind} for the {key} account?",
           "The {kind} for the {key} account is"),
    # --- papers: a reported figure, a metric on a named cohort or dataset
    Family("sensitivity", "papers", COHORTS,
           ("sensitivity", "specificity", "positive predictive value", "negative predictive value",
            "overall accuracy"),
           _percent,
           "In the validation analysis, the {kind} of the assay on the {key} cohort was {value}% "
           "(95% confidence interval reported in the supplementary table).",
           "What was the {kind} of the assay on the {key} cohort?",
           "The {kind} of the assay on the {key} cohort was", gold="{value}%"),
    Family("auc", "papers", COHORTS,
           ("area under the ROC curve", "C-statistic", "Cohen's kappa", "intraclass correlation",
            "calibration slope"),
           _auc,
           "For the external validation, the {kind} on the {key} dataset was {value}, computed with the "
           "same risk score and thresholds as in the derivation set.",
           "What was the {kind} on the {key} dataset?",
           "The {kind} on the {key} dataset was"),
    Family("prevalence", "papers", COHORTS,
           ("seroprevalence", "vaccination coverage", "case fatality rate", "attack rate", "response rate"),
           _percent,
           "Across the survey, the {kind} in the {key} district was {value}%, as measured with the "
           "protocol described in the Methods.",
           "What was the {kind} in the {key} district?",
           "The {kind} in the {key} district was", gold="{value}%"),
    # --- fiction: an early character attribute (a name, an object, a place)
    Family("pet_name", "fiction", CHARACTERS, ("dog", "cat", "horse", "parrot", "goat"), _pick(PET_NAMES),
           "Everyone in the neighbourhood knew that {key}'s {kind} was called {value}, and the creature "
           "followed its owner everywhere.",
           "What was {key}'s {kind} called?",
           "{key}'s {kind} was called"),
    Family("keepsake", "fiction", CHARACTERS,
           ("keepsake", "lucky charm", "heirloom", "christening gift", "secret treasure"), _pick(KEEPSAKES),
           "It was well known that the {kind} {key} carried everywhere was a {value}, wrapped in an old "
           "handkerchief.",
           "What was the {kind} that {key} carried everywhere?",
           "The {kind} {key} carried everywhere was a"),
    Family("birthplace", "fiction", CHARACTERS,
           ("been born", "been married", "gone to school", "first found work", "been baptised"),
           _pick(VILLAGES),
           "Few people remembered that {key} had {kind} in the village of {value}, a long day's journey "
           "from the town.",
           "In which village had {key} {kind}?",
           "{key} had {kind} in the village of"),
    # --- generic (custom corpora): RULER-style key-value facts
    Family("access_code", "generic", ARCHIVES,
           ("access code", "backup code", "serial number", "vault number", "locker code"), _six_digits,
           "The {kind} for the {key} archive is {value}.",
           "What is the {kind} for the {key} archive?",
           "The {kind} for the {key} archive is"),
)}

DOMAIN_FAMILIES: dict[str, tuple[str, ...]] = {
    domain: tuple(f.name for f in FAMILIES.values() if f.domain == domain)
    for domain in ("legal", "papers", "fiction", "generic")
}


def _contains(a: str, b: str) -> bool:
    """True when normalised ``b`` occurs in normalised ``a`` on word boundaries."""
    na, nb = normalize(a), normalize(b)
    return bool(nb) and f" {nb} " in f" {na} "


DISTRACTOR_KINDS = ("same", "other")


def sample_needles(family_name: str, rng: random.Random, n_distractors: int,
                   distractor_kind: str = "same") -> tuple[Needle, list[Needle]]:
    """Draw the target needle and ``n_distractors`` distractors with distinct keys and values.

    ``distractor_kind="same"``: every statement has the needle's kind (e.g. all notice periods), so a
    distractor differs from the needle only in its key and value. ``"other"``: each distractor states
    another kind with the same type of value (a cure period, a payment term, ... in days).
    """
    if family_name not in FAMILIES:
        raise KVBenchError(f"unknown needle family {family_name!r}; valid: {', '.join(sorted(FAMILIES))}")
    if distractor_kind not in DISTRACTOR_KINDS:
        raise KVBenchError(f"unknown task.distractor_kind {distractor_kind!r}; valid: {', '.join(DISTRACTOR_KINDS)}")
    if n_distractors < 0:
        raise KVBenchError(f"task.distractors must be >= 0 (got {n_distractors})")
    fam = FAMILIES[family_name]
    n = n_distractors + 1
    most = min(len(fam.keys), len(fam.kinds) if distractor_kind == "other" else len(fam.keys))
    if n > most:
        raise KVBenchError(f"task.distractors={n_distractors} is too many for needle family {family_name!r} "
                           f"with distractor_kind={distractor_kind} (at most {most - 1})")
    keys = rng.sample(fam.keys, n)
    kinds = rng.sample(fam.kinds, n) if distractor_kind == "other" else [rng.choice(fam.kinds)] * n
    values: list[str] = []
    for _ in range(1000 * n):
        if len(values) == n:
            break
        v = fam.value(rng)
        if all(not _contains(v, w) and not _contains(w, v) for w in values):
            values.append(v)
    if len(values) < n:
        raise KVBenchError(f"task.distractors={n_distractors} is too many for needle family {family_name!r}")
    clauses: list[str] = []
    while len(clauses) < n:  # clause numbers only appear in legal statements but are drawn for all
        c = _clause(rng)
        if c not in clauses:
            clauses.append(c)
    rendered = [fam.render(k, kind, v, c) for k, kind, v, c in zip(keys, kinds, values, clauses, strict=True)]
    return rendered[0], rendered[1:]


def sample_needle_set(family_names: list[str], rng: random.Random, n_distractors: int,
                      distractor_kind: str = "same") -> list[tuple[Needle, list[Needle]]]:
    """Draw one (needle, distractors) group per entry of ``family_names`` for a single context.

    The groups share the context, so they are drawn together: within a family every statement has its own
    key (a question names its key and kind, so it identifies exactly one statement of the context), and
    across the whole context no value's normalised form occurs inside another's (a substring hit can only
    come from the asked needle's value). Within a group the kinds follow ``distractor_kind`` as in
    :func:`sample_needles`; different groups of one family may share kinds, since their keys differ.
    """
    if distractor_kind not in DISTRACTOR_KINDS:
        raise KVBenchError(f"unknown task.distractor_kind {distractor_kind!r}; valid: {', '.join(DISTRACTOR_KINDS)}")
    if n_distractors < 0:
        raise KVBenchError(f"task.distractors must be >= 0 (got {n_distractors})")
    n = n_distractors + 1
    per_family: dict[str, int] = {}
    for name in family_names:
        if name not in FAMILIES:
            raise KVBenchError(f"unknown needle family {name!r}; valid: {', '.join(sorted(FAMILIES))}")
        per_family[name] = per_family.get(name, 0) + 1
    keys: dict[str, list[str]] = {}
    for name, groups in per_family.items():
        fam = FAMILIES[name]
        if distractor_kind == "other" and n > len(fam.kinds):
            raise KVBenchError(f"task.distractors={n_distractors} is too many for needle family {name!r} with "
                               f"distractor_kind=other (at most {len(fam.kinds) - 1})")
        if groups * n > len(fam.keys):
            raise KVBenchError(f"{groups} questions with {n_distractors} distractors each need {groups * n} keys of "
                               f"needle family {name!r}, which has {len(fam.keys)}; lower task.questions_per_context "
                               "or task.distractors, or list more families in task.needles")
        keys[name] = rng.sample(fam.keys, groups * n)
    values: list[str] = []
    clauses: list[str] = []
    out: list[tuple[Needle, list[Needle]]] = []
    for name in family_names:
        fam = FAMILIES[name]
        group_keys, keys[name] = keys[name][:n], keys[name][n:]
        kinds = rng.sample(fam.kinds, n) if distractor_kind == "other" else [rng.choice(fam.kinds)] * n
        group_values: list[str] = []
        for _ in range(1000 * n):
            if len(group_values) == n:
                break
            v = fam.value(rng)
            if all(not _contains(v, w) and not _contains(w, v) for w in values + group_values):
                group_values.append(v)
        if len(group_values) < n:
            raise KVBenchError(f"needle family {name!r} has too few distinct values for {len(family_names)} "
                               "questions per context; lower task.questions_per_context or task.distractors")
        values.extend(group_values)
        group_clauses: list[str] = []
        while len(group_clauses) < n:
            c = _clause(rng)
            if c not in clauses and c not in group_clauses:
                group_clauses.append(c)
        clauses.extend(group_clauses)
        rendered = [fam.render(k, kind, v, c)
                    for k, kind, v, c in zip(group_keys, kinds, group_values, group_clauses, strict=True)]
        out.append((rendered[0], rendered[1:]))
    return out
