"""Locating and checking the Hydra configuration tree (``conf/`` in a checkout, ``kvbench/conf`` in a wheel)."""

from __future__ import annotations

from pathlib import Path

from kvbench.errors import KVBenchError

GROUPS = ("strategy", "task", "model", "hardware")


def conf_dir() -> Path:
    """The config root: packaged inside the wheel, or the checkout's top-level ``conf/``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise KVBenchError("kvbench's configuration directory is missing; reinstall kvbench")


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def check_overrides(overrides: list[str]) -> None:
    """Reject unknown group choices up front with one line naming the valid ones (Hydra's own error is
    several lines long), and unknown names inside ``strategies=[...]``."""
    for arg in overrides:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key in GROUPS:
            valid = group_options(key)
            for choice in value.split(","):  # multirun: strategy=a,b
                if choice not in valid:
                    raise KVBenchError(f"unknown {key} {choice!r}; valid: {', '.join(valid)}")
        elif key == "strategies":
            import strategies

            names = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
            if not names:
                raise KVBenchError("strategies=[...] needs at least one name; valid: "
                                   + ", ".join(strategies.available()))
            for n in names:
                strategies.strategy_class(n)
