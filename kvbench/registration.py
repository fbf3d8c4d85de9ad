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

from kvbench import paired, sequential
from kvbench.errors import KVBenchError
from kvbench.paths import conf_dir
from kvbench.vocab import BASELINE

KEYS = ("name", "sweep", "endpoint", "margin_pp", "alpha", "baseline", "family", "scopes", "multiplicity",
        "planned_contexts", "look_every", "spending", "secondary", "relative_margin", "post_hoc")
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
    missing = [k for k in KEYS if k not in data and k != "post_hoc"]
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
    design = sequential.Design(data["planned_contexts"], data["look_every"], str(data["spending"]),
                               earlier if declared else (), tuple(scopes), str(data["multiplicity"]))
    sha = content_hash(data)
    when, commit = registered_at(path, sha)
    return Registration(path, data, sha, design, declared, str(post.get("reason", "")).strip(), earlier, when,
                        commit)


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
    if reg.post_hoc and late and not reg.earlier_looks:
        raise KVBenchError(f"design {reg.path} is post hoc: list every look published before it in "
                           "post_hoc.earlier_looks (contexts per task), so the spending is charged for them")
    return replace(reg.design, registered=reg.describe(), post_hoc=reg.reason if reg.post_hoc else "")
