"""``kvbench lmeval {run,export,import}``, ``python -m kvbench.lmeval`` and the ``kvbench-lm-eval`` script.

``run`` (and ``kvbench-lm-eval``) is lm-eval's own command line with the ``kvbench`` model registered: lm-eval
0.4.x has no plugin entry-point group for models, so the model must be registered in the process that runs the
evaluation. ``export`` and ``import`` are :mod:`kvbench.lmeval.export` and :mod:`kvbench.lmeval.importer`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvbench.errors import KVBenchError
from kvbench.lmeval.export import export_task
from kvbench.lmeval.importer import find_results_json, import_results
from kvbench.lmeval.model import MODEL_NAME, register


def run_lm_eval(args: Sequence[str]) -> int:
    """lm-eval's own CLI with the ``kvbench`` model registered; ``--model kvbench`` is the default."""
    register()
    argv = list(args)
    if argv and argv[0] in ("run", "ls", "validate"):
        sub, rest = argv[0], argv[1:]
    else:
        sub, rest = "run", argv
    if sub == "run" and not any(a in ("--model", "-M") or a.startswith("--model=") for a in rest):
        rest = ["--model", MODEL_NAME, *rest]
    saved = sys.argv
    sys.argv = ["lm-eval", sub, *rest]
    try:
        return _evaluate()
    finally:
        sys.argv = saved


def _evaluate() -> int:
    """lm-eval's CLI on ``sys.argv``; kvbench's refusals (an unsupported model, a strategy that cannot apply to
    it, a bad model argument) are the same one line and exit status 2 as ``python -m kvbench``, not the end of
    lm-eval's traceback."""
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except KVBenchError as exc:
        print(f"kvbench: error: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


def console_main() -> None:
    """``kvbench-lm-eval``: exactly ``lm-eval``'s command line, with the ``kvbench`` model registered."""
    register()
    raise SystemExit(_evaluate())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbench lmeval", description="lm-evaluation-harness integration: run, export tasks, import results.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,export,import}")
    run = sub.add_parser("run", help="lm-eval's CLI with the kvbench model registered (--model kvbench by default)",
                         add_help=False)
    run.add_argument("args", nargs=argparse.REMAINDER)
    exp = sub.add_parser("export", help="write kvbench tasks as lm-eval task YAML + JSONL")
    exp.add_argument("--task", required=True, help="task name(s), comma-separated (e.g. legal,papers,fiction)")
    exp.add_argument("--out", required=True, help="directory for the YAML and JSONL files (the --include_path)")
    exp.add_argument("--model", default="smollm2-135m", help="model whose tokenizer builds the samples")
    exp.add_argument("--model-path", default=None, help="checkpoint directory when --model is a local model")
    exp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="task setting, as in conf/task/<task>.yaml (repeatable), e.g. --set context_tokens=2048")
    exp.add_argument("--seed", type=int, default=0, help="the harness's seed=, which seeds the task's sampling")
    imp = sub.add_parser("import", help="convert lm-eval results JSON into result-store records")
    imp.add_argument("results", nargs="+", help="results_*.json files or lm-eval --output_path directories")
    imp.add_argument("--results-dir", default="results", help="kvbench results directory (store/ goes inside)")
    imp.add_argument("--aggregate-only", action="store_true",
                     help="one record per task even when --log_samples files are present")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``kvbench lmeval {run,export,import} ...``; errors are one line and exit status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":  # everything after `run` belongs to lm-eval, including its --help
        return run_lm_eval(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "export":
            for task in [t.strip() for t in args.task.split(",") if t.strip()]:
                data, yaml_path = export_task(task, args.out, args.model, args.model_path, args.overrides,
                                              args.seed)
                print(f"{yaml_path} ({data.name})")
            print(f"run: kvbench lmeval run --model_args pretrained={args.model} --tasks "
                  f"{','.join('kvbench_' + t.strip() for t in args.task.split(',') if t.strip())} "
                  f"--include_path {Path(args.out).resolve()}")
        elif args.command == "import":
            for source in args.results:
                for path in find_results_json(source):
                    target, n = import_results(path, args.results_dir, per_sample=not args.aggregate_only)
                    print(f"{path} -> {target} ({n} records)")
    except KVBenchError as exc:
        print(f"kvbench: error: {exc}", file=sys.stderr)
        return 2
    return 0


