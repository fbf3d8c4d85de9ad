"""Command line: ``python -m kvbench [hydra overrides]`` runs a benchmark; ``kvbench calc|hardware|leaderboard|
lmeval|sweep ...`` dispatch to their own tools. Bad input ends with one line on stderr and exit status 2, never a
traceback."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import hydra
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from kvbench.config import check_overrides, conf_dir
from kvbench.errors import KVBenchError

SUBCOMMANDS = {
    "calc": "kvbench.calc",
    "hardware": "kvbench.hardware",
    "leaderboard": "kvbench.leaderboard",
    "lmeval": "kvbench.lmeval",
    "sweep": "kvbench.sweep",
}


def fail(message: str, code: int = 2) -> None:
    print(f"kvbench: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _job(cfg: DictConfig) -> None:
    from kvbench.runner import run, validate_cfg

    try:
        validate_cfg(cfg)
        run(cfg)
    except KVBenchError as exc:
        fail(str(exc))
    except OmegaConfBaseException as exc:
        fail(str(exc).strip().splitlines()[0])


def _hydra_entry() -> Callable[[], None]:
    return hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_job)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        try:
            module = importlib.import_module(SUBCOMMANDS[argv[0]])
            raise SystemExit(module.main(argv[1:]))
        except KVBenchError as exc:
            fail(str(exc))
    try:
        check_overrides(argv)
    except KVBenchError as exc:
        fail(str(exc))
    # strategies_params is an open dict: its keys are new to Hydra's struct config, so add them with `++`.
    argv = [f"++{a}" if a.startswith("strategies_params.") else a for a in argv]
    sys.argv = [sys.argv[0], *argv]
    _hydra_entry()()


def console_main() -> None:
    main()
