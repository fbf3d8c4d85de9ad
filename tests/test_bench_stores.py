"""``scripts/bench_stores.py`` measures every store it lists without a model, and its checksum (what the
before/after comparison trusts to say two trees' stores return the same K/V) is deterministic."""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_listed_store_runs_without_a_model_and_reads_repeat() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_stores
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    names = bench_stores.DEFAULT.split(",")
    # A few KB per layer for the cold-cache pass: its reads are checked against the hot pass's inside measure().
    first = bench_stores.measure(names, tokens=64, steps=4, weight_bytes=4096)
    again = bench_stores.measure(names, tokens=64, steps=4, weight_bytes=4096)
    assert list(first) == names
    for name in names:
        assert first[name]["ms"] >= 0 and first[name]["cold_ms"] >= 0 and math.isfinite(first[name]["checksum"])
        assert first[name]["checksum"] == again[name]["checksum"], name
    # int8 quantizes every token on arrival, so it reads back other values than the exact store: the checksum
    # tells stores apart (int2/int4 would not here: at 64 tokens KIVI's 128-token residual holds all exactly).
    assert first["int8"]["checksum"] != first["full"]["checksum"]
