"""Stored ``full`` baselines: ``results/baselines/<key>.safetensors``, a format that cannot carry code.

A baseline is the ``full`` strategy's record plus its teacher-forced log-probs over the gold positions,
keyed by everything that determines them (:mod:`kvbench.identity`). The log-probs are a safetensors tensor and
the record is JSON in the file's metadata, so reading a baseline never unpickles anything: a crafted file can
at worst fail to parse, and is then recomputed. Files of any other format (the ``.pt`` pickles older versions
wrote) are never opened; the run says once that it ignored them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvbench.record import StrategyResult
from kvbench.results import atomic_write, warn

if TYPE_CHECKING:
    from kvbench.tasks.base import Sample

SUFFIX = ".safetensors"
# Formats that could execute code on load; seen beside a key, they are ignored with a warning.
REFUSED_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".npy", ".npz")
_LOGP = "logp"
_RECORD = "record"


def baseline_path(root: Path, key: str) -> Path:
    return root / f"{key}{SUFFIX}"


def load_baseline(root: Path, key_fn: Callable[[Sample], str], sample: Sample) -> StrategyResult | None:
    """The stored baseline for ``sample``, or None (missing, unreadable, or of a refused format)."""
    from safetensors import SafetensorError, safe_open

    key = key_fn(sample)
    for suffix in REFUSED_SUFFIXES:
        other = root / f"{key}{suffix}"
        if other.exists():
            warn(f"ignored {other}: baselines are only read from {SUFFIX} files (this format can run code); "
                 "recomputing the baseline")
    path = baseline_path(root, key)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            logp = fh.get_tensor(_LOGP).float()
        rec = json.loads(meta[_RECORD])
        if not isinstance(rec, dict) or logp.dim() != 2:
            raise ValueError("not a kvbench baseline")
    except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as exc:
        # A torn or foreign file is recomputed (and overwritten), never trusted.
        warn(f"ignored unreadable baseline {path} ({type(exc).__name__}); recomputing it")
        return None
    rec["baseline_reused"] = True
    return StrategyResult(rec, logp)


def save_baseline(root: Path, key: str, result: StrategyResult) -> None:
    """Write atomically (temp file + rename), with the user's umask."""
    from safetensors.torch import save_file

    record: dict[str, Any] = result.record
    meta = {_RECORD: json.dumps(record, sort_keys=True, default=_json_default)}
    logp = result.logp.detach().to("cpu").contiguous()
    atomic_write(baseline_path(root, key), lambda tmp: save_file({_LOGP: logp}, tmp, metadata=meta))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)
