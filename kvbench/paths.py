"""Where kvbench's files live: the config tree it ships and its on-disk cache.

A leaf module (it imports nothing of kvbench but its error type), so any layer may ask for a path without
importing the layers above it: ``hardware`` reads profiles from :func:`conf_dir` without importing ``config``
(which imports the strategies), and the tiered stores spill under :func:`cache_dir` without importing models.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvbench.errors import KVBenchError


def conf_dir() -> Path:
    """The config root: packaged inside the wheel, or the checkout's top-level ``conf/``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise KVBenchError("kvbench's configuration directory is missing; reinstall kvbench")


def cache_dir() -> Path:
    """Root of kvbench's on-disk cache (converted weights, corpora): ``$KVBENCH_CACHE`` or ``~/.cache/kvbench``."""
    return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench")).expanduser()
