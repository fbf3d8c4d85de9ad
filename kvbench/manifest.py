"""A published results directory is verifiable: ``MANIFEST.sha256`` lists every results file with its sha256.

``kvbench verify --write`` (run by ``scripts/publish_results.sh`` when it publishes) records the sha256 of every
file a table is computed from — each run's records and identity (``runs/``), the parquet store (``store/``) and
the stored baselines (``baselines/``) — in ``sha256sum`` format, so ``sha256sum -c MANIFEST.sha256`` checks it
too. ``kvbench verify`` and ``kvbench leaderboard`` compare the tree with it and name every file that is
unlisted (added since: a copied or forged store file), missing or altered: the leaderboard warns (one line) and
goes on, ``--strict`` refuses, as ``kvbench verify`` does. Without a manifest nothing is checked by default
(a working directory being measured has none); ``--strict`` and ``kvbench verify`` refuse.

A listed baseline that is absent is not a mismatch: baselines are a cache (recomputed when missing, and
not committed with a published tree); one that is present must be the one listed. Hidden files (locks,
claims, temporary files) and everything else in the directory (reports, plots, multirun
logs) are derived or transient and not listed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.errors import KVBenchError
from kvbench.paths import sha256_file
from kvbench.results import DuplicateRecordError, atomic_write_text, printable, records_duplicates, warn

MANIFEST = "MANIFEST.sha256"
#: The subdirectories whose files tables are computed from.
TRACKED = ("runs", "store", "baselines")


def tracked_files(root: Path) -> list[str]:
    """Relative paths of the files the manifest lists, sorted."""
    out = []
    for sub in TRACKED:
        base = root / sub
        if not base.is_dir():
            continue
        for p in base.rglob("*"):
            rel = p.relative_to(root)
            if p.is_file() and not p.is_symlink() and not any(part.startswith(".") for part in rel.parts):
                out.append(rel.as_posix())
    return sorted(out)


def write_manifest(root: str | Path) -> Path:
    """Write ``root/MANIFEST.sha256`` for the tree as it is now; returns its path."""
    root = Path(root)
    lines = [f"{sha256_file(root / rel)}  {rel}\n" for rel in tracked_files(root)]
    path = root / MANIFEST
    atomic_write_text(path, "".join(lines))
    return path


def read_manifest(root: Path) -> dict[str, str] | None:
    """``{relative path: sha256}`` of ``root``'s manifest; None when there is none. A malformed line is an error."""
    path = root / MANIFEST
    if not path.is_file():
        return None
    listed: dict[str, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise KVBenchError(f"{path}:{n} is not a '<sha256>  <path>' line; rewrite it with "
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbench verify",
        description=f"Check a results directory against its {MANIFEST} (every file of runs/, store/ and "
                    "baselines/ with its sha256): names every unlisted, missing or altered file, exit 2 if any.")
    p.add_argument("--results-dir", default="results", help="the directory to check (default results)")
    p.add_argument("--write", action="store_true",
                   help=f"(re)write {MANIFEST} for the tree as it is now (what publishing does)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvbench verify``; returns the exit status (0 ok, 2 mismatch or bad input)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    root = Path(args.results_dir)
    try:
        if not root.is_dir():
            raise KVBenchError(f"--results-dir {args.results_dir!r} is not a directory")
        if args.write:
            path = write_manifest(root)
            print(f"{path}: {len(tracked_files(root))} file(s)")
            return 0
        result = verify(root)
        if not result.ok:
            raise KVBenchError(result.problem())
    except KVBenchError as exc:
        print(f"kvbench verify: error: {exc}", file=sys.stderr)
        return 2
    print(f"{root}: {result.files} file(s) match {MANIFEST}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
