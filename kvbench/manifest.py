"""A published results directory is verifiable: ``MANIFEST.sha256`` lists every results file with its sha256.

``kvbench verify --write`` (run by ``scripts/publish_results.sh`` when it publishes) records the sha256 of every
file a table is computed from — each run's records and identity (``runs/``), the parquet store (``store/``) and
the stored baselines (``baselines/``) — in ``sha256sum`` format, so ``sha256sum -c MANIFEST.sha256`` checks it
too. ``kvbench verify`` and ``kvbench leaderboard`` compare the tree with it and name every file that is
unlisted (added since: a copied or forged store file), missing or altered: the leaderboard warns (one line) and
goes on, ``--strict`` refuses, as ``kvbench verify`` does. Without a manifest nothing is checked by default
(a working directory being measured has none); ``--strict`` and ``kvbench verify`` refuse.

A listed baseline that is absent is not a mismatch: baselines are a cache (recomputed when missing, and
not committed with a published tree); one that is present must be the one listed. The files listed are the
ones every reader of the tree reads (:func:`kvbench.results.tree.results_files`): a run's lock, its claims and
temporary files are transient and not listed; a symbolic link, any other hidden file or a special file in
``runs/``, ``store/`` or ``baselines/`` is refused, named, by verify, publishing and every table alike.
Everything else in the directory (reports, plots, multirun logs) is derived and not listed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.errors import KVBenchError
from kvbench.paths import sha256_file
from kvbench.results import (
    DuplicateRecordError,
    atomic_write_text,
    printable,
    records_duplicates,
    safe_message,
    warn,
)
from kvbench.results.tree import results_files

MANIFEST = "MANIFEST.sha256"


def tracked_files(root: Path) -> list[str]:
    """Relative paths of the files the manifest lists, sorted: the one list every reader of the tree reads
    (:func:`kvbench.results.tree.results_files`; a link or a hidden file there is refused, named)."""
    return results_files(root)


def write_manifest(root: str | Path) -> Path:
    """Write ``root/MANIFEST.sha256`` for the tree as it is now; returns its path."""
    root = Path(root)
    lines = [f"{sha256_file(root / rel)}  {rel}\n" for rel in tracked_files(root)]
    path = root / MANIFEST
    atomic_write_text(path, "".join(lines))
    return path


def read_manifest(root: Path) -> dict[str, str] | None:
    """``{relative path: sha256}`` of ``root``'s manifest; None when there is none. A malformed line is an error."""
    return read_listing(root / MANIFEST)


def read_listing(path: Path) -> dict[str, str] | None:
    """``{relative path: sha256}`` of the manifest file ``path`` (a tree's own, or a committed one saved aside);
    None when there is none. A malformed line is an error."""
    if not path.is_file():
        return None
    listed: dict[str, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise KVBenchError(f"{printable(path)}:{n} is not a '<sha256>  <path>' line; rewrite it with "
                               "`kvbench verify --write` once the tree is known to be right")
        listed[rel] = digest
    return listed


@dataclass
class Verification:
    """How a results directory compares with its manifest."""

    root: Path
    has_manifest: bool
    unlisted: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    altered: list[str] = field(default_factory=list)
    #: One line per file that holds a (config, sample, strategy) twice, whatever the manifest says.
    duplicated: list[str] = field(default_factory=list)
    files: int = 0

    @property
    def ok(self) -> bool:
        return self.has_manifest and not (self.unlisted or self.missing or self.altered or self.duplicated)

    def problem(self) -> str:
        """One line naming every file that differs (empty when the tree matches)."""
        if self.duplicated:  # a manifest rewritten after a duplicate was written would vouch for it
            more = len(self.duplicated) - 1
            return self.duplicated[0] + (f" (and {more} more file(s) holding a record twice)" if more else "")
        if not self.has_manifest:
            return (f"{self.root} has no {MANIFEST}, so nothing vouches for its files; publish it with "
                    "scripts/publish_results.sh (or `kvbench verify --write --results-dir "
                    f"{self.root}` once the tree is known to be right)")
        parts = [f"{what} {', '.join(printable(f) for f in files)}" for what, files in
                 (("unlisted (added since it was published)", self.unlisted), ("missing", self.missing),
                  ("altered", self.altered)) if files]
        if not parts:
            return ""
        return (f"{self.root} does not match its {MANIFEST}: " + "; ".join(parts)
                + " — a file added, removed or edited after publishing; remove what does not belong, or "
                  "republish")


def duplicates(root: Path, files: list[str]) -> list[str]:
    """One line per results file among ``files`` (relative to ``root``) that holds a (config, sample, strategy)
    twice: each run's records and each store file."""
    out = []
    for rel in files:
        try:
            records_duplicates(root / rel)
        except DuplicateRecordError as exc:
            out.append(str(exc))
    return out


def verify(root: str | Path, content: bool = True) -> Verification:
    """Compare the tree under ``root`` with its manifest; with ``content``, also name every file that holds a
    record twice (:func:`duplicates`), which a manifest written after it would not catch."""
    root = Path(root)
    listed = read_manifest(root)
    present = tracked_files(root)
    found = duplicates(root, present) if content else []
    if listed is None:
        return Verification(root, False, duplicated=found)
    out = Verification(root, True, files=len(present), duplicated=found)
    out.unlisted = [rel for rel in present if rel not in listed]
    # A stored baseline is a cache (recomputed when absent, and not committed with a published tree): only one
    # that is present must be the one listed.
    out.missing = [rel for rel in sorted(listed) if not (root / rel).is_file() and not rel.startswith("baselines/")]
    out.altered = [rel for rel in present if rel in listed and sha256_file(root / rel) != listed[rel]]
    return out


def check(root: str | Path, strict: bool = False) -> None:
    """For readers of a results directory (``kvbench leaderboard``): a mismatch with the manifest is one warning,
    or with ``strict`` one :class:`KVBenchError`; a directory without a manifest passes unless ``strict``."""
    result = verify(root, content=False)  # the readers refuse a record stored twice themselves
    if result.ok or (not result.has_manifest and not strict):
        return
    if strict:
        raise KVBenchError(result.problem())
    warn(result.problem())


def _run_vouches(root: Path, run_id: str, cache: dict[str, str | None]) -> str | None:
    """Why the run ``runs/<run_id>`` does not vouch for its files (None: it does): its records must be readable,
    held once, and all of this run (``run_id`` and the config hash its id ends with)."""
    if run_id not in cache:
        from kvbench.results import RunStore

        why = None
        try:
            records = RunStore(root, run_id).load_records(quiet=True)
        except KVBenchError as exc:
            records, why = [], str(exc)
        suffix = run_id.rsplit("-", 1)[-1]
        other = next((r for r in records if r.get("config_hash") != suffix or r.get("run_id", run_id) != run_id), None)
        if why is None and not (root / "runs" / run_id / "records.jsonl").is_file():
            why = "its run has no records.jsonl"
        elif why is None and other is not None:
            why = (f"its run's records.jsonl holds a record of run {printable(other.get('run_id'))!r}, config "
                   f"{printable(other.get('config_hash'))!r}")
        cache[run_id] = why
    return cache[run_id]


def _store_matches_run(root: Path, rel: str) -> str | None:
    """Why ``store/<run-id>.parquet`` is not its run's own snapshot (None: it is): every record in it must be
    a record of ``runs/<run-id>/records.jsonl``, agreeing on every measured field."""
    import pandas as pd

    from kvbench.results import RECORD_KEY, RunStore, disagreement, flatten_for_store, record_key

    run_id = Path(rel).stem
    try:
        stored = pd.read_parquet(root / rel)
    except Exception:
        return "not a readable parquet file"
    records = RunStore(root, run_id).load_records(quiet=True)
    own = {record_key(r): r for r in flatten_for_store(pd.DataFrame(records)).to_dict("records")} if records else {}
    for row in stored.to_dict("records"):
        mine = own.get(tuple(row.get(k) for k in RECORD_KEY))
        if mine is None:
            return (f"sample {printable(row.get('sample_id'))!r}, strategy {printable(row.get('strategy'))!r} is in "
                    f"no record of runs/{run_id}/records.jsonl")
        field_ = disagreement(mine, row)
        if field_ is not None:
            return (f"{field_} of sample {printable(row.get('sample_id'))!r}, strategy "
                    f"{printable(row.get('strategy'))!r} differs from runs/{run_id}/records.jsonl")
    return None


RUN_FILES = ("records.jsonl", "config.yaml", "environment.json", "identity.json", "summary.csv")


def unvouched(root: Path, listed: dict[str, str] | None, accept: list[str] | None = None) -> list[str]:
    """The files of ``root`` that nothing vouches for, each with why: a file may be sealed when the manifest it is
    checked against (``listed``) has it with its hash, when ``accept`` names it, or when its run vouches for it —
    a run's own files (its records all of that run), a store file that is exactly its run's records (the
    snapshot a run writes when it ends), a stored baseline sealed by this machine's kvbench. Anything else (a
    store file no run wrote, a parquet whose scores differ from its run's records, a file kvbench never writes)
    is unknown."""
    accept = set(accept or [])
    runs: dict[str, str | None] = {}
    out = []
    for rel in results_files(root):
        if rel in accept or (listed is not None and listed.get(rel) == sha256_file(root / rel)):
            continue
        parts = rel.split("/")
        why: str | None = "kvbench never writes such a file"
        if parts[0] == "runs" and len(parts) == 3 and parts[2] in RUN_FILES:
            why = _run_vouches(root, parts[1], runs)
        elif parts[0] == "store" and len(parts) == 2 and rel.endswith(".parquet"):
            if (root / "runs" / Path(parts[1]).stem / "records.jsonl").is_file():
                why = _run_vouches(root, Path(parts[1]).stem, runs) or _store_matches_run(root, rel)
            else:
                why = "no run of this tree wrote it"
        elif parts[0] == "baselines":
            from kvbench.baselines import sealed_here

            why = None if sealed_here(root / rel) else "a baseline not sealed by this machine's kvbench"
        if why:
            out.append(f"{printable(rel)} ({why})")
    return out


def seal(root: Path, against: Path | None = None, accept: list[str] | None = None) -> Path:
    """``kvbench verify --write``: write the manifest only for a tree whose every file is vouched for
    (:func:`unvouched`, checked against ``against`` — the committed manifest — or the tree's own), that holds no
    record twice and no link or hidden file. Otherwise one :class:`KVBenchError` naming what is unknown, and
    the old manifest stays: publishing never seals a forged file into the answer."""
    if against is not None and not against.is_file():
        raise KVBenchError(f"--against {printable(against)} is not a file")
    listed = read_listing(against if against is not None else root / MANIFEST)
    files = results_files(root)
    found = duplicates(root, files)
    if found:
        raise KVBenchError(found[0])
    bad = unvouched(root, listed, accept)
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise KVBenchError(
            f"refusing to seal {printable(root)}: {len(bad)} file(s) are neither in the manifest it was checked "
            f"against nor vouched for by the run that wrote them: {shown} — remove what does not belong (a file "
            "you made yourself, e.g. an lm-eval import, is sealed with --accept <path>)")
    return write_manifest(root)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbench verify",
        description=f"Check a results directory against its {MANIFEST} (every file of runs/, store/ and "
                    "baselines/ with its sha256): names every unlisted, missing or altered file, exit 2 if any.")
    p.add_argument("--results-dir", default="results", help="the directory to check (default results)")
    p.add_argument("--write", action="store_true",
                   help=f"(re)write {MANIFEST} for the tree as it is now (what publishing does); refused when a "
                        "file is neither in the manifest checked against nor vouched for by the run that wrote it")
    p.add_argument("--against", default=None, metavar="MANIFEST",
                   help=f"with --write: the manifest to check the tree against (publishing passes the committed "
                        f"one; default the tree's own {MANIFEST})")
    p.add_argument("--accept", action="append", default=[], metavar="PATH",
                   help="with --write: a file (relative to the results directory) you vouch for yourself, such as "
                        "an lm-eval import; repeatable")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvbench verify``; returns the exit status (0 ok, 2 mismatch or bad input)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    root = Path(args.results_dir)
    try:
        if not root.is_dir():
            raise KVBenchError(f"--results-dir {args.results_dir!r} is not a directory")
        if args.write:
            path = seal(root, Path(args.against) if args.against else None, args.accept)
            print(f"{path}: {len(tracked_files(root))} file(s)")
            return 0
        result = verify(root)
        if not result.ok:
            raise KVBenchError(result.problem())
    except KVBenchError as exc:
        print(f"kvbench verify: error: {safe_message(exc)}", file=sys.stderr)
        return 2
    print(f"{root}: {result.files} file(s) match {MANIFEST}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
