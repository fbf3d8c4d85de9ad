"""The one list of a results tree's files: what the manifest covers, ``kvbench verify`` hashes and every table reads.

Tables are computed from ``runs/<run-id>/records.jsonl`` and ``store/*.parquet``; ``baselines/`` is the runs'
cache. :func:`results_files` lists every regular file under those three directories, and refuses — one
:class:`TreeError` line naming each — what no kvbench writer makes there: a symbolic link (file or directory), a
hidden file or directory other than a run's lock, its claims and the temporary files of atomic writes, and
anything that is not a regular file (a FIFO would hang its reader). Before this list was shared, the manifest
skipped hidden files and links while the leaderboard read them: a forged ``store/.x.parquet`` ranked first
under a manifest that matched.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvbench.errors import KVBenchError
from kvbench.results.files import TMP_SUFFIX, printable

#: The subdirectories whose files tables are computed from (and the manifest lists).
TRACKED = ("runs", "store", "baselines")
#: Hidden names kvbench makes in them and no table reads: a run's lock file and claims directory.
TRANSIENT_FILES = (".lock",)
TRANSIENT_DIRS = (".claims",)


class TreeError(KVBenchError):
    """A results tree holds an entry no kvbench writer makes (a link, a hidden or special file)."""


def _transient(name: str, is_dir: bool) -> bool:
    """A hidden entry kvbench itself makes: the lock, the claims, ``.<name>.<random>.tmp`` of an atomic write."""
    if is_dir:
        return name in TRANSIENT_DIRS
    return name in TRANSIENT_FILES or name.endswith(TMP_SUFFIX)


def results_files(root: str | Path) -> list[str]:
    """Relative paths (POSIX, sorted) of every file under ``root``'s ``runs/``, ``store/`` and ``baselines/`` —
    exactly what the manifest lists and the readers may read. A link, an unknown hidden entry or a special file
    among them is one :class:`TreeError` naming each (kvbench makes none; a table must not read one, nor a
    manifest skip it)."""
    root = Path(root)
    out: list[str] = []
    refused: list[str] = []

    def refuse(path: Path, why: str) -> None:
        refused.append(f"{printable(path.relative_to(root).as_posix())} ({why})")

    for sub in TRACKED:
        base = root / sub
        if base.is_symlink():
            refuse(base, "a symbolic link")
            continue
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base):  # os.walk never follows a linked directory
            here = Path(dirpath)
            for name in sorted(dirnames):
                path = here / name
                if path.is_symlink():
                    refuse(path, "a symbolic link")
                    dirnames.remove(name)
                elif name.startswith("."):
                    dirnames.remove(name)
                    if not _transient(name, True):
                        refuse(path, "a hidden directory")
            for name in filenames:
                path = here / name
                try:
                    mode = path.lstat().st_mode
                except FileNotFoundError:  # removed while listing (a temporary file renamed into place)
                    continue
                if stat.S_ISLNK(mode):
                    refuse(path, "a symbolic link")
                elif name.startswith("."):
                    if not _transient(name, False):
                        refuse(path, "a hidden file")
                elif not stat.S_ISREG(mode):
                    refuse(path, "not a regular file")
                else:
                    out.append(path.relative_to(root).as_posix())
    if refused:
        shown = ", ".join(refused[:8]) + (f" and {len(refused) - 8} more" if len(refused) > 8 else "")
        raise TreeError(
            f"{printable(root)} holds {len(refused)} entr{'y' if len(refused) == 1 else 'ies'} in runs/, store/ or "
            f"baselines/ that no kvbench writer makes: {shown}; no manifest vouches for a link or a hidden file and "
            "no table reads one, so remove it (or put the file itself in place of a link) and rerun")
    return sorted(out)


def store_files(root: str | Path, files: list[str] | None = None) -> list[Path]:
    """The parquet files of ``root``'s store (``store/*.parquet``), from :func:`results_files`."""
    root = Path(root)
    rels = results_files(root) if files is None else files
    return [root / rel for rel in rels if rel.startswith("store/") and rel.count("/") == 1 and rel.endswith(".parquet")]


def run_records(root: str | Path, files: list[str] | None = None) -> list[Path]:
    """Each run's records file (``runs/<run-id>/records.jsonl``), from :func:`results_files`."""
    root = Path(root)
    rels = results_files(root) if files is None else files
    return [root / rel for rel in rels
            if rel.startswith("runs/") and rel.count("/") == 2 and rel.endswith("/records.jsonl")]
