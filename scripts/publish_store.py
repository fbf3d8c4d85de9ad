"""Publish interrupted runs: write ``store/<run-id>.parquet`` (and ``summary.csv``) from each run's ``records.jsonl``.

A run publishes its store snapshot when it ends; a sweep stopped early (``kill``, a time limit) keeps every
finished sample in ``runs/<run-id>/records.jsonl`` but has no snapshot yet. This writes it the same way the run's
end would, so ``kvbench leaderboard`` sees those samples.

    python scripts/publish_store.py [--results-dir results]
"""

from __future__ import annotations

import argparse

import pandas as pd

from kvbench.report import summarize
from kvbench.results import RunStore
from kvbench.results.tree import run_records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results-dir", default="results")
    args = ap.parse_args()
    for run_dir in run_records(args.results_dir):  # the files every reader reads (links, hidden refused)
        store = RunStore(args.results_dir, run_dir.parent.name)
        records = store.load_records()
        store.write_outputs(summarize(pd.DataFrame(records)))
        print(f"{run_dir.parent.name}: {len(records)} records")


if __name__ == "__main__":
    main()
