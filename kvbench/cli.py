"""Command line: ``python -m kvbench [hydra overrides]`` runs a benchmark; ``kvbench calc|hardware|leaderboard|
lmeval|plan|sweep ...`` dispatch to their own tools. Bad input ends with one line on stderr and exit status 2, never a
traceback, and nothing written. Before the first job starts, every job of a (multi)run is composed and its values
that need no model are checked (overrides, strategy parameters by building the strategies, engine and sample
counts: :func:`kvbench.config.check_overrides`); what needs the model or the data (task files, context lengths)
is checked when its job starts, before that job measures or writes anything."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import hydra
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from kvbench.config import check_overrides, conf_dir, group_options, register_configs
from kvbench.errors import KVBenchError

SUBCOMMANDS = {
    "calc": "kvbench.calc",
    "calibrate": "kvbench.calibrate",
    "hardware": "kvbench.hardware",
    "leaderboard": "kvbench.leaderboard",
    "lmeval": "kvbench.lmeval",
    "plan": "kvbench.plan",
    "sweep": "kvbench.sweep",
}
SUBCOMMAND_HELP = {
    "calibrate": "tune a needle task on your corpus until the full baseline reaches a target accuracy",
    "calc": "KV-cache size and time for any model/context/hardware, from the formulas (`kvbench calc claim`)",
    "hardware": "measure this machine into a hardware profile (`kvbench hardware probe`)",
    "leaderboard": "tables, claim check and plots from the result store",
    "lmeval": "lm-evaluation-harness with a compressed cache",
    "plan": "questions each claim needs to be decided (spec v1.2 §2.4), from the store or from assumptions",
    "sweep": "a named grid (conf/sweep/*.yaml) as Hydra multiruns, with a time projection (--dry-run)",
}

# Registered at import: launchers that run jobs in other processes (joblib, submitit, Ray) compose there too.
register_configs()


def fail(message: str, code: int = 2) -> None:
    print(f"kvbench: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _job(cfg: DictConfig) -> None:
    from kvbench.runner import run, validate_cfg

    try:
        run(cfg, validate_cfg(cfg))
    except KVBenchError as exc:
        fail(str(exc))
    except OmegaConfBaseException as exc:
        fail(str(exc).strip().splitlines()[0])


def _hydra_entry() -> Callable[[], None]:
    return hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_job)


def help_text() -> str:
    groups = "\n".join(f"  {g:<9} {', '.join(group_options(g))}" for g in ("strategy", "task", "model", "hardware"))
    tools = "\n".join(f"  kvbench {name:<12} {text}" for name, text in SUBCOMMAND_HELP.items())
    return f"""kvbench: benchmark KV-cache strategies (quantization, eviction, tiering, recompute) for memory, latency
and accuracy on long documents.

Run a benchmark (Hydra overrides; `full` is always run as the baseline):
  python -m kvbench strategy=int8 task=legal
  python -m kvbench strategies=[int8,snapkv] strategies_params.snapkv.compression_ratio=0.75 task=papers
  python -m kvbench -m strategy=int8,int4 task=legal,papers      # multirun: one job per combination
  python -m kvbench -m 'strategy=glob(int*)' 'task.context_tokens=range(1024,4097,1024)'

Groups (select with group=name, override settings with group.key=value):
{groups}
Other keys: seed, results_dir, engine.prefill (shared|chunked), engine.chunk_tokens, engine.warmup,
  engine.reuse_baseline, engine.progress, strategies, strategies_params.

Tools:
{tools}
  (`kvbench <tool> --help` for each)

Flags: -m/--multirun, --cfg job (print the composed config), --info, --hydra-help (Hydra's own flags).
Docs: README.md, docs/ (checklists for adding a strategy, task, metric or hardware profile: docs/checklists/).
"""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        try:
            module = importlib.import_module(SUBCOMMANDS[argv[0]])
            raise SystemExit(module.main(argv[1:]))
        except KVBenchError as exc:
            fail(str(exc))
    if "--help" in argv or "-h" in argv:
        print(help_text())
        raise SystemExit(0)
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if not (args.hydra_help or args.info or args.shell_completion):
        try:
            check_overrides(args.overrides, multirun=args.multirun)
        except KVBenchError as exc:
            fail(str(exc))
    sys.argv = [sys.argv[0], *argv]
    _hydra_entry()()


def console_main() -> None:
    main()
