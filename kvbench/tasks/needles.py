"""Needle families: a fact in the domain's own form, plus distractors that differ only in the detail asked.

A family renders statements like "14.3 Notice Period. The notice period for the Orchard Analytics
account is 45 days, ..." For one sample it draws ``1 + n_distractors`` statements that share the
same form and the same kind of detail (all notice periods, all sensitivities on a cohort, all pets'
names) but carry different keys (party, cohort, character) and different values. The question names
the target's key; the distractors' values are exactly the wrong answers a model confuses it with.

Values are drawn so that no value's normalised form occurs inside another's (so a substring hit can
only come from the right value), and all draws use the caller's ``random.Random``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Family:
    """A template of statements; ``shared`` fixes per-sample details common to needle and distractors."""

    name: str
    domain: str
    keys: tuple[str, ...]
    value: Callable[[random.Random], str]
    statement: str
    question: str
    answer_prefix: str
    gold: str = "{value}"
    shared: Callable[[random.Random], dict[str, str]] = field(default=lambda rng: {})

    def render(self, key: str, value: str, extra: dict[str, str]) -> Needle:
        fields = {"key": key, "value": value, **extra}
        return Needle(
            family=self.name, key=key, value=value, text=self.statement.format(**fields),
            question=self.question.format(**fields), answer_prefix=self.answer_prefix.format(**fields),
            answers=(value,), gold=self.gold.format(**fields))


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
    Family("notice", "legal", PARTIES, _pick(NOTICE_DAYS),
           "{clause} Notice Period. The notice period for the {key} account is {value} days, and any notice "
           "must be given in writing to the other party.",
           "What is the notice period for the {key} account?",
           "The notice period for the {key} account is", gold="{value} days"),
    Family("liability_cap", "legal", PARTIES, _pick(LIABILITY_CAPS),
           "{clause} Limitation of Liability. The aggregate liability cap for the {key} account is US${value}, "
           "except for liability arising from gross negligence or wilful misconduct.",
           "What is the aggregate liability cap for the {key} account?",
           "The aggregate liability cap for the {key} account is", gold="US${value}"),
    Family("governing_law", "legal", PARTIES, _pick(JURISDICTIONS),
           "{clause} Governing Law. The governing law for the {key} account is the law of {value}, and the "
           "courts of {value} shall have exclusive jurisdiction over any dispute.",
           "Which law governs the {key} account?",
           "The governing law for the {key} account is the law of"),
    # --- papers: a reported figure, a metric on a named cohort or dataset
    Family("sensitivity", "papers", COHORTS, _percent,
           "In the validation analysis, the sensitivity of the assay on the {key} cohort was {value}% "
           "(95% confidence interval reported in the supplementary table).",
           "What was the sensitivity of the assay on the {key} cohort?",
           "The sensitivity of the assay on the {key} cohort was", gold="{value}%"),
    Family("auc", "papers", COHORTS, _auc,
           "For the external validation, the area under the ROC curve on the {key} dataset was {value}, "
           "computed with the same risk score and thresholds as in the derivation set.",
           "What was the area under the ROC curve on the {key} dataset?",
           "The area under the ROC curve on the {key} dataset was"),
    Family("prevalence", "papers", COHORTS, _percent,
           "Among the animals sampled, the seroprevalence in the {key} district was {value}%, as measured "
           "by the IgG ELISA described in the Methods.",
           "What was the seroprevalence in the {key} district?",
           "The seroprevalence in the {key} district was", gold="{value}%"),
    # --- fiction: an early character attribute (a name, an object, a place)
    Family("pet_name", "fiction", CHARACTERS, _pick(PET_NAMES),
           "Everyone in the neighbourhood knew that {key}'s {animal} was called {value}, and the creature "
           "followed its owner everywhere.",
           "What was {key}'s {animal} called?",
           "{key}'s {animal} was called",
           shared=lambda rng: {"animal": rng.choice(("dog", "cat", "horse", "parrot", "goat"))}),
    Family("keepsake", "fiction", CHARACTERS, _pick(KEEPSAKES),
           "It was well known that the keepsake {key} carried everywhere was a {value}, wrapped in an old "
           "handkerchief.",
           "What was the keepsake that {key} carried everywhere?",
           "The keepsake {key} carried everywhere was a"),
    Family("birthplace", "fiction", CHARACTERS, _pick(VILLAGES),
           "Few people remembered that {key} had been born in the village of {value}, a long day's journey "
           "from the town.",
           "In which village had {key} been born?",
           "{key} had been born in the village of"),
    # --- generic (custom corpora): RULER-style key-value facts
    Family("access_code", "generic", ARCHIVES, _six_digits,
           "The access code for the {key} archive is {value}.",
           "What is the access code for the {key} archive?",
           "The access code for the {key} archive is"),
)}

DOMAIN_FAMILIES: dict[str, tuple[str, ...]] = {
    domain: tuple(f.name for f in FAMILIES.values() if f.domain == domain)
    for domain in ("legal", "papers", "fiction", "generic")
}


def _contains(a: str, b: str) -> bool:
    """True when normalised ``b`` occurs in normalised ``a`` on word boundaries."""
    na, nb = normalize(a), normalize(b)
    return bool(nb) and f" {nb} " in f" {na} "


def sample_needles(family_name: str, rng: random.Random, n_distractors: int) -> tuple[Needle, list[Needle]]:
    """Draw the target needle and ``n_distractors`` distractors with distinct keys and values."""
    if family_name not in FAMILIES:
        raise KVBenchError(f"unknown needle family {family_name!r}; valid: {', '.join(sorted(FAMILIES))}")
    if n_distractors < 0:
        raise KVBenchError(f"task.distractors must be >= 0 (got {n_distractors})")
    fam = FAMILIES[family_name]
    n = n_distractors + 1
    if n > len(fam.keys):
        raise KVBenchError(f"task.distractors={n_distractors} is too many for needle family {family_name!r} "
                           f"(at most {len(fam.keys) - 1})")
    keys = rng.sample(fam.keys, n)
    extra = fam.shared(rng)
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
    rendered = [fam.render(k, v, {**extra, "clause": c}) for k, v, c in zip(keys, values, clauses, strict=True)]
    return rendered[0], rendered[1:]
