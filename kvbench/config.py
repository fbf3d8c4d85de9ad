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
    chosen = {"strategy": _default_choice("strategy")}
    for arg in overrides:
        if "=" in arg and arg.split("=", 1)[0] == "strategy":
            chosen["strategy"] = arg.split("=", 1)[1]
    for arg in overrides:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key.startswith("strategy.") and "," not in chosen["strategy"]:
            _check_strategy_param(chosen["strategy"], key.split(".", 1)[1])
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


def _default_choice(group: str) -> str:
    import yaml

    defaults = yaml.safe_load((conf_dir() / "config.yaml").read_text()).get("defaults", [])
    for entry in defaults:
        if isinstance(entry, dict) and group in entry:
            return str(entry[group])
    return ""


def _check_strategy_param(strategy: str, param: str) -> None:
    """``strategy.<param>=...`` must name a parameter of the chosen strategy (Hydra would print a traceback)."""
    import dataclasses

    import strategies

    cls = strategies.strategy_class(strategy)
    valid = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    top = param.split(".", 1)[0]
    if top != "name" and top not in valid:
        raise KVBenchError(f"strategy {strategy!r} has no parameter {top!r}; valid: {', '.join(valid) or '(none)'}")
