"""One benchmark job: resolve the config, load model and samples, run the engine, store and print results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml
from omegaconf import DictConfig, OmegaConf

import strategies as strategy_registry
from kvbench import SPEC_VERSION
from kvbench.engine import Engine, check_lengths, run_samples
from kvbench.errors import KVBenchError
from kvbench.models import load_model
from kvbench.report import print_table, summarize
from kvbench.results import RunStore, environment, stable_hash
from kvbench.tasks.base import Sample, build_samples
from strategies.base import Strategy


def strategy_params(cfg: DictConfig | dict) -> dict[str, Any]:
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    return {k: v for k, v in data.items() if k != "name"}


def _strategy_yaml(name: str) -> dict[str, Any]:
    from kvbench.config import conf_dir

    path = conf_dir() / "strategy" / f"{name}.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else {"name": name}


def _param_names(name: str) -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(strategy_registry.strategy_class(name))}  # type: ignore[arg-type]


def resolve_strategies(cfg: DictConfig) -> list[Strategy]:
    """``strategies=[...]`` (YAML defaults) or the single ``strategy`` group, with ``full`` first."""
    if cfg.get("strategies"):
        shared = dict(cfg.get("strategies_params") or {})
        specs = []
        for n in cfg.strategies:
            params = strategy_params(_strategy_yaml(n))
            # A shared override applies to every listed strategy that has that parameter.
            params.update({k: v for k, v in shared.items() if k in _param_names(n)})
            specs.append((n, params))
        unused = set(shared) - {k for n in cfg.strategies for k in _param_names(n)}
        if unused:
            raise KVBenchError(f"strategies_params {', '.join(sorted(unused))} matches no parameter of "
                               f"{', '.join(cfg.strategies)}")
    else:
        specs = [(cfg.strategy.name, strategy_params(cfg.strategy))]
    built = [strategy_registry.build(name, params) for name, params in specs]
    labels: set[str] = set()
    unique = []
    for s in [strategy_registry.build("full")] + built:
        if s.label() not in labels:
            labels.add(s.label())
            unique.append(s)
    return unique


def _hardware(cfg: DictConfig) -> tuple[Any, str]:
    from kvbench.hardware import HardwareProfile, check_available

    profile = HardwareProfile.from_config(cfg.hardware)
    return profile, check_available(profile)


def run(cfg: DictConfig) -> pd.DataFrame:
    """Execute one job and return its summary table."""
    profile, device = _hardware(cfg)
    if getattr(profile, "threads", None):
        torch.set_num_threads(int(profile.threads))
    strategies = resolve_strategies(cfg)
    dtype = cfg.model.get("dtype") or profile.dtype
    lm = load_model(cfg.model.name, dtype=dtype, device=device, path=cfg.model.get("path"), seed=cfg.seed)
    samples = build_samples(cfg.task.name, cfg.task, lm.tokenizer, lm.max_context)
    for s in samples:
        check_lengths(s, lm.max_context)

    task_cfg = OmegaConf.to_container(cfg.task, resolve=True)
    determinants = {
        "spec": SPEC_VERSION, "model": cfg.model.name, "model_path": cfg.model.get("path"), "dtype": dtype,
        "device": device, "task": task_cfg, "seed": cfg.seed, "prefill": cfg.engine.prefill,
    }
    chunk_tokens = int(cfg.engine.chunk_tokens) if cfg.engine.prefill == "chunked" else 0
    if chunk_tokens:
        determinants["chunk_tokens"] = chunk_tokens
    config_hash = stable_hash({**determinants, "strategies": [s.label() for s in strategies]})
    run_id = f"{cfg.task.name}-{cfg.model.name}-{config_hash}"
    store = RunStore(cfg.results_dir, run_id)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    store.init(yaml.safe_dump(resolved, sort_keys=False), environment())

    labels = {s.label() for s in strategies}
    by_sample: dict[str, set[str]] = {}
    for r in store.load_records():
        by_sample.setdefault(r["sample_id"], set()).add(r["strategy"])
    done = {sid for sid, have in by_sample.items() if labels <= have}

    hw_name = getattr(profile, "name", str(cfg.hardware.get("name")))
    simulated = bool(getattr(profile, "simulate", False)) and device != getattr(profile, "device", device)
    engine = Engine(lm, device=device, hardware=profile, run_fields={
        "run_id": run_id, "config_hash": config_hash, "model": cfg.model.name, "task": cfg.task.name,
        "hardware": hw_name, "hardware_simulated": simulated, "device": device, "dtype": dtype,
        "seed": int(cfg.seed), "query_aware": bool(cfg.task.get("query_aware", False)),
    }, working_copy=bool(cfg.engine.working_copy))
    if cfg.engine.warmup and len(done) < len(samples):
        engine.warmup()

    def baseline_key(sample: Sample) -> str:
        return stable_hash({**determinants, "sample": sample.sample_id})

    baseline_dir = Path(cfg.results_dir) / "baselines" if cfg.engine.reuse_baseline else None
    _run_with_progress(engine, samples, strategies, done, store, baseline_dir, baseline_key,
                       bool(cfg.engine.progress), chunk_tokens, cfg.engine.batch_size)

    records = pd.DataFrame([r for r in store.load_records() if r["strategy"] in labels])
    summary = summarize(records)
    store.write_outputs(summary)
    print_table(summary)
    print(f"results: {store.dir}")
    return summary


def _run_with_progress(engine: Engine, samples: list[Sample], strategies: list[Strategy], done: set[str],
                       store: RunStore, baseline_dir: Path | None, baseline_key: Any, show: bool,
                       chunk_tokens: int, batch_size: int = 1) -> None:
    """One bar step per (sample, strategy) evaluation, labelled with the strategy running, with an ETA."""
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("eta"), TimeRemainingColumn(), disable=not show, transient=False) as bar:
        tid = bar.add_task("sample x strategy", total=len(samples) * len(strategies))

        def progress(n_done: int, strategy: str) -> None:
            if strategy:  # escaped: rich would read a label like `[full, int8]` as markup and drop it
                bar.update(tid, description=escape(f"sample x strategy: {strategy}"))
            if n_done:
                bar.advance(tid, n_done)

        run_samples(engine, samples, strategies, done, store.append, baseline_dir, baseline_key,
                    progress=progress, chunk_tokens=chunk_tokens, batch_size=batch_size)


def validate_cfg(cfg: DictConfig) -> None:
    if cfg.engine.prefill not in ("shared", "chunked"):
        raise KVBenchError(f"unknown engine.prefill {cfg.engine.prefill!r}; valid: shared, chunked")
    if cfg.engine.prefill == "chunked" and int(cfg.engine.chunk_tokens) < 1:
        raise KVBenchError(f"engine.chunk_tokens must be >= 1 (got {cfg.engine.chunk_tokens})")
    if int(cfg.task.get("n_samples", 1)) < 1:
        raise KVBenchError(f"task.n_samples must be >= 1 (got {cfg.task.n_samples})")
