"""Regenerate a run whose ``records.jsonl`` holds a (sample, strategy) twice — written before the store refused it.

    python scripts/regenerate_duplicated_run.py results/long8k/runs/<run-id>

The store's rule (``kvbench.results.RunStore.append``) is that the first measurement of a (config, sample,
strategy) stands and a second is refused. This applies that rule to a file written before the rule existed: it
keeps each key's first line, and refuses (exit 2, nothing written) unless every later copy agrees with the first in
everything the accuracy depends on (score, prediction, kv_bytes, sample identity) — so only a timing measured again
is dropped, never a result. The old file stays in git's history (nothing else is left in the results directory, whose
manifest refuses unknown files), the dropped line numbers are printed, and the run's store snapshot is rewritten from
the regenerated file (as ``scripts/publish_store.py`` does). Then ``scripts/publish_results.sh`` re-seals the directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvbench.report import summarize  # noqa: E402
from kvbench.results import RunStore, record_key  # noqa: E402

#: What must agree between two copies of one key for the later copy to be a re-timing only.
SAME = ("score", "prediction", "kv_bytes", "kv_bytes_fp16", "context_tokens", "sample_id", "strategy", "task",
        "gold_nll", "kl")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    path = run / "records.jsonl"
    lines = path.read_text().splitlines()
    first: dict[tuple, tuple[int, dict]] = {}
    keep, dropped = [], []
    for no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        rec = json.loads(line)
        key = record_key(rec)
        if key in first:
            was_no, was = first[key]
            differ = [k for k in SAME if was.get(k) != rec.get(k)]
            if differ:
                print(f"{path}: line {no} repeats line {was_no} but differs in {', '.join(differ)}: not a re-timing; "
                      "rerun the run instead", file=sys.stderr)
                return 2
            dropped.append((no, was_no))
            continue
        first[key] = (no, rec)
        keep.append(line)
    if not dropped:
        print(f"{path}: no duplicated record")
        return 0
    path.write_text("\n".join(keep) + "\n")
    for no, was_no in dropped:
        print(f"dropped line {no} (a re-timing of line {was_no})")
    store = RunStore(str(run.parent.parent), run.name)
    records = store.load_records()
    store.write_outputs(summarize(pd.DataFrame(records)))
    print(f"{run.name}: {len(records)} records kept, {len(dropped)} dropped; store snapshot rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
