"""Result storage, one module per role (each attack surface has one place):

* :mod:`~kvbench.results.files` — atomic file writes, umask, leftovers of killed writers, printable names;
* :mod:`~kvbench.results.seal` — this machine's keyed seal on files kvbench reuses as caches;
* :mod:`~kvbench.results.store` — the run store: ``runs/<run-id>/`` and its records, each stored once;
* :mod:`~kvbench.results.tree` — the one list of a results tree's files (what the manifest covers and every
  reader reads; links and hidden files refused, named);
* :mod:`~kvbench.results.read` — reading and checking the store (``read_store``, ``read_unpublished``);
* :mod:`~kvbench.results.claims` — the claims and workers protocol of concurrent workers.

The names below are the package's interface; import them from ``kvbench.results``.
"""

from __future__ import annotations

from kvbench.results.claims import ActiveWorker, SampleClaims
from kvbench.results.files import (
    STALE_TMP_SECONDS,
    TMP_SUFFIX,
    UnwritableError,
    apply_umask,
    atomic_write,
    atomic_write_parquet,
    atomic_write_text,
    clean_stale_tmp,
    printable,
    quiet_warnings,
    safe_message,
    slug,
    stable_hash,
    warn,
    write_bytes,
)
from kvbench.results.read import (
    AGREE_RTOL,
    SOURCE_COLUMN,
    check_values,
    disagreement,
    read_store,
    read_unpublished,
    records_duplicates,
    refuse_duplicates,
)
from kvbench.results.schema import BadValueError
from kvbench.results.seal import SEAL_KEY, local_seal, seal_matches
from kvbench.results.store import (
    RECORD_KEY,
    DuplicateRecordError,
    RunStore,
    environment,
    flatten_for_store,
    record_key,
)
from kvbench.results.tree import TRACKED, TreeError, results_files

__all__ = [
    "AGREE_RTOL", "RECORD_KEY", "SEAL_KEY", "SOURCE_COLUMN", "STALE_TMP_SECONDS", "TMP_SUFFIX", "TRACKED",
    "ActiveWorker", "BadValueError", "DuplicateRecordError", "RunStore", "SampleClaims", "TreeError",
    "UnwritableError",
    "apply_umask", "atomic_write", "atomic_write_parquet", "atomic_write_text", "check_values", "clean_stale_tmp",
    "disagreement", "environment", "flatten_for_store", "local_seal", "printable", "quiet_warnings", "read_store",
    "read_unpublished", "record_key", "records_duplicates", "refuse_duplicates", "results_files", "safe_message",
    "seal_matches", "slug", "stable_hash", "warn", "write_bytes",
]
