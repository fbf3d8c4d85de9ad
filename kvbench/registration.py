"""Pre-registration of a sequential design as a mechanism (measurement spec v1.2 §2.6), not a sentence.

A design file (``conf/design/<name>.yaml``) declares everything a verdict depends on — endpoint, margin, level,
baseline, the family (the claim's memory band), the scopes tested as one family, the multiplicity rule, the
looks, the planned n, the spending function and the secondary endpoints — and is identified by the SHA-256 of
its content (the parsed YAML as canonical JSON: comments and layout do not count). The file is *registered*
by the first git commit that holds exactly that content.

``kvbench leaderboard --design <name>`` (and ``kvbench plan``) then:

* checks that the declared values are the ones the code judges by (a design that says margin 2 while the
  code tests 1 is refused: a registration must describe the analysis that is run);
* compares the registration with the store's first record — the first commit that added a file under
  ``<results-dir>/store`` or ``runs``, else (an uncommitted store) the oldest file there — and **refuses** a
  design registered after it (or never committed) unless the file declares itself ``post_hoc``;
* for a post-hoc design, charges every look published before the registration (``post_hoc.earlier_looks``:
  contexts per task) to the alpha spending: they become looks of the schedule at their information
  fractions (Lan & DeMets 1983 allow unplanned looks exactly so), every later boundary is computed with them,
  and the verdicts of the claim check are re-stated under that accounting. ``published_error`` gives the
  one-sided error the looks as *actually* published carried (fixed-sample level at the earlier looks), the
  figure the claim check discloses beside it.

Records carry no timestamps, so git is the clock: the only one a reader can check after the fact.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from kvbench import paired, scoretest, sequential
from kvbench.errors import KVBenchError
from kvbench.paths import conf_dir
from kvbench.vocab import BASELINE

KEYS = ("name", "sweep", "endpoint", "margin_pp", "alpha", "baseline", "family", "scopes", "multiplicity",
        "planned_contexts", "look_every", "spending", "secondary", "relative_margin", "post_hoc",
        # A confirmatory design (spec v1.3 §2.7) declares these too; a design without them is judged as v1.2's.
        "margin_reason", "members", "statistic", "information", "futility", "planning", "samples", "reader")
#: Keys a v1.2 design may leave out (the headline's was registered before they existed).
OPTIONAL = ("post_hoc", "margin_reason", "members", "statistic", "information", "futility", "planning", "samples",
            "reader")
FUTILITY_KEYS = ("beta", "spending", "binding")
PLANNING_KEYS = ("power", "alternative_pp", "discordance", "design_effect", "members_in_gate", "questions_per_context",
                 "tasks", "source")
POST_HOC_KEYS = ("declared", "reason", "earlier_looks")
#: The secondary endpoints a design may declare (the reader's loss, :func:`kvbench.paired.reader_loss`).
SECONDARY = paired.READER
#: Scope name of the pooled hypotheses in a design file (every task at one context length).
POOLED = paired.POOLED


@dataclass(frozen=True)
class Registration:
    """A design file, its content hash and where git says it was registered."""

    path: Path
    content: dict
    sha256: str
    design: sequential.Design
    post_hoc: bool
    reason: str
    earlier_looks: tuple[int, ...]
    registered: float | None  # unix time of the first commit holding this content; None: never committed
    commit: str  # that commit (abbreviated), "" when none

    def describe(self) -> str:
        where = (f"registered by commit {self.commit}" if self.commit
                 else "not committed (its registration cannot be checked)")
        return f"`{self.path.name}` (sha256 {self.sha256[:12]}, {where})"


def content_hash(data: Mapping) -> str:
    """SHA-256 of the parsed design as canonical JSON: the same declarations hash alike however written."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def design_path(name: str | Path) -> Path | None:
    """A design file by path, or by name in ``conf/design``; None when there is none (a sweep file's design)."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p if _is_design(p) else None
    cand = conf_dir() / "design" / f"{p.name}.yaml"
    return cand if p.suffix == "" and cand.is_file() else None


def _is_design(p: Path) -> bool:
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and "endpoint" in data and "look_every" in data


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def registered_at(path: Path, sha256: str) -> tuple[float | None, str]:
    """Commit time and hash of the first commit whose copy of ``path`` has content hash ``sha256``."""
    path = path.resolve()
    top = _git(["rev-parse", "--show-toplevel"], path.parent)
    if not top:
        return None, ""
    root = Path(top.strip())
    rel = path.relative_to(root).as_posix()
    log = _git(["log", "--reverse", "--format=%H %ct", "--", rel], root) or ""
    for line in log.splitlines():
        commit, when = line.split()
        blob = _git(["show", f"{commit}:{rel}"], root)
        if blob is None:
            continue
        try:
            data = yaml.safe_load(blob)
        except yaml.YAMLError:
            continue
        if isinstance(data, dict) and content_hash(data) == sha256:
            return float(when), commit[:12]
    return None, ""


def first_record_at(results_dir: str | Path) -> float | None:
    """When the store's first record was written: the first commit adding a file under ``store`` or ``runs``;
    for a store never committed, the oldest modification time of its files. None: no record at all."""
    d = Path(results_dir).resolve()
    parts = [p for p in (d / "store", d / "runs") if p.exists()]
    if not parts:
        return None
    top = _git(["rev-parse", "--show-toplevel"], d)
    if top:
        root = Path(top.strip())
        rels = [p.relative_to(root).as_posix() for p in parts]
        log = _git(["log", "--reverse", "--diff-filter=A", "--format=%ct", "--", *rels], root)
        if log and log.split():
            return float(log.split()[0])
    times = [f.stat().st_mtime for p in parts for f in p.rglob("*") if f.is_file()]
    return min(times) if times else None


def _fail(path: Path, text: str) -> KVBenchError:
    return KVBenchError(f"design {path}: {text}")


def load(name: str | Path) -> Registration:
    """Read and validate a design file (one line naming the problem when it is wrong)."""
    path = design_path(name)
    if path is None:
        raise KVBenchError(f"no design file {name!r}; valid: a path, or one of "
                           f"{', '.join(sorted(p.stem for p in (conf_dir() / 'design').glob('*.yaml'))) or '(none)'}")
    data = yaml.safe_load(path.read_text())
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise _fail(path, f"unknown key {', '.join(unknown)}; valid: {', '.join(KEYS)}")
    missing = [k for k in KEYS if k not in data and k not in OPTIONAL]
    if missing:
        raise _fail(path, f"missing {', '.join(missing)} (a registration declares every one)")
    # What the code judges by: a registration that says otherwise describes an analysis that is not run.
    from kvbench.claims.headline_claim import CLAIM_HIGH, CLAIM_LOW

    expected = {"endpoint": paired.PRIMARY, "margin_pp": paired.MARGIN_PP, "alpha": paired.ALPHA,
                "baseline": BASELINE, "family": {"memory_reduction": [CLAIM_LOW, CLAIM_HIGH]},
                "relative_margin": paired.RELATIVE_MARGIN}
    for key, want in expected.items():
        got = data[key]
        same = (math.isclose(float(got), float(want)) if isinstance(want, float) and isinstance(got, (int, float))
                else got == want)
        if not same:
            raise _fail(path, f"{key} is {got!r} but kvbench judges by {want!r}")
    secondary = data["secondary"] or []
    if not set(secondary) <= set(SECONDARY):
        raise _fail(path, f"secondary endpoints must be among {', '.join(SECONDARY)} (got {secondary!r})")
    scopes = data["scopes"]
    if not isinstance(scopes, list) or not scopes or not all(isinstance(s, str) and s for s in scopes):
        raise _fail(path, f"scopes must list {POOLED!r} and/or task names (got {scopes!r})")
    if data["multiplicity"] not in ("holm", "gatekeeping"):
        raise _fail(path, f"multiplicity must be holm or gatekeeping (got {data['multiplicity']!r})")
    if data["multiplicity"] == "gatekeeping" and scopes[0] != POOLED:
        raise _fail(path, f"a gatekeeping order starts with the {POOLED!r} scope (got {scopes!r})")
    post = data.get("post_hoc") or {}
    if not isinstance(post, dict) or set(post) - set(POST_HOC_KEYS):
        raise _fail(path, f"post_hoc must map {', '.join(POST_HOC_KEYS)}")
    declared = bool(post.get("declared", False))
    earlier = tuple(post.get("earlier_looks") or ())
    if declared and not str(post.get("reason", "")).strip():
        raise _fail(path, "a post-hoc declaration needs its reason")
    statistic, beta, drift = _confirmatory(path, data)
    samples = data.get("samples") or {}
    first = samples.get("first_context") if isinstance(samples, Mapping) else None
    if first is not None and (isinstance(first, bool) or not isinstance(first, int) or first < 0):
        raise _fail(path, f"samples.first_context must be an integer >= 0 (got {first!r})")
    design = sequential.Design(data["planned_contexts"], data["look_every"], str(data["spending"]),
                               earlier if declared else (), tuple(scopes), str(data["multiplicity"]),
                               statistic, beta, drift, tuple(str(m) for m in data.get("members") or ()), first)
    sha = content_hash(data)
    when, commit = registered_at(path, sha)
    return Registration(path, data, sha, design, declared, str(post.get("reason", "")).strip(), earlier, when,
                        commit)


def planned_drift(planning: Mapping, planned_contexts: int, margin_pp: float) -> float:
    """The expected z of the pooled score statistic at the planned n under the planning alternative: (alternative
    + margin) / sqrt(discordance x design effect / n), n = contexts x questions per context x tasks."""
    n = planned_contexts * int(planning["questions_per_context"]) * int(planning["tasks"])
    var = float(planning["discordance"]) * float(planning["design_effect"])
    return (float(planning["alternative_pp"]) + margin_pp) / 100 * math.sqrt(n / var)


def planned_contexts(planning: Mapping, alpha: float, margin_pp: float, look_every: int, spending: str,
                     beta: float) -> int:
    """The fewest contexts per task, in whole looks of ``look_every``, whose design reaches the planned power for
    a pooled hypothesis holding ``alpha / members_in_gate`` with its futility boundaries obeyed (Monte Carlo power,
    :func:`kvbench.sequential.power`)."""
    share = alpha / int(planning["members_in_gate"])
    contexts = look_every
    while contexts <= 100 * look_every:
        looks = math.ceil(contexts / look_every)
        fractions = tuple(min(j * look_every, contexts) / contexts for j in range(1, looks + 1))
        drift = planned_drift(planning, contexts, margin_pp)
        if sequential.power(share, fractions, spending, beta, drift) >= float(planning["power"]):
            return contexts
        contexts += look_every
    raise KVBenchError("the planning assumptions need more than 100 looks: check discordance and margin")


def _confirmatory(path: Path, data: Mapping) -> tuple[str, float, float]:
    """(statistic, futility beta, planned drift) of a design; ("", 0, nan) for a v1.2 design without them."""
    statistic = data.get("statistic") or ""
    if statistic and statistic != scoretest.NAME:
        raise _fail(path, f"statistic must be {scoretest.NAME} (got {statistic!r})")
    fut = data.get("futility")
    if not fut:
        return statistic, 0.0, float("nan")
    if not isinstance(fut, Mapping) or set(fut) - set(FUTILITY_KEYS):
        raise _fail(path, f"futility must map {', '.join(FUTILITY_KEYS)}")
    if fut.get("binding", False):
        raise _fail(path, "futility must be non-binding (binding: false): the efficacy boundaries ignore it")
    if fut.get("spending", data["spending"]) != data["spending"]:
        raise _fail(path, "futility spends beta by the design's own spending function")
    beta = float(fut.get("beta", 0))
    if not 0 < beta < 0.5:
        raise _fail(path, f"futility beta must be in (0, 0.5) (got {beta})")
    plan = data.get("planning")
    if not isinstance(plan, Mapping) or set(PLANNING_KEYS) - set(plan):
        raise _fail(path, f"a futility boundary needs planning with {', '.join(PLANNING_KEYS)}")
    return statistic, beta, planned_drift(plan, int(data["planned_contexts"]), float(data["margin_pp"]))


def check(reg: Registration, results_dir: str | Path) -> sequential.Design:
    """The design to judge ``results_dir`` by: refused when registered after the store's first record (or never
    committed) unless declared post hoc; a post-hoc design's earlier looks are charged to its spending."""
    first = first_record_at(results_dir)
    late = first is not None and (reg.registered is None or reg.registered > first)
    if late and not reg.post_hoc:
        when = "is not committed" if reg.registered is None else "was registered after the store's first record"
        raise KVBenchError(f"design {reg.path} {when} (sha256 {reg.sha256[:12]}); register it before a sweep's "
                           "first record, or declare it post hoc (post_hoc: {declared: true, reason: ..., "
                           "earlier_looks: [contexts per task of every look published before it]})")
    reader = reg.content.get("reader")
    if reader:
        # A changed reader sums attention in another order: its records are another run and never join the store
        # a design judges (spec §5.1). Each run states its reader in identity.json (absent: PyTorch's blocks).
        for ident in sorted((Path(results_dir) / "runs").glob("*/identity.json")):
            try:
                used = json.loads(ident.read_text()).get("attention_reader", "blocks")
            except (OSError, ValueError, AttributeError):
                used = "unreadable"
            if used != reader:
                raise KVBenchError(f"run {ident.parent.name} in {results_dir} was read by {used!r}; design "
                                   f"{reg.path.name} judges only runs read by {reader!r}")
    if reg.post_hoc and late and not reg.earlier_looks:
        raise KVBenchError(f"design {reg.path} is post hoc: list every look published before it in "
                           "post_hoc.earlier_looks (contexts per task), so the spending is charged for them")
    return replace(reg.design, registered=reg.describe(), post_hoc=reg.reason if reg.post_hoc else "")
