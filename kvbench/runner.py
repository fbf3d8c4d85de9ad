"""One benchmark job: resolve the config, load model and samples, run the engine, store and print results."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml
from omegaconf import DictConfig, OmegaConf

from kvbench import SPEC_VERSION
from kvbench.arch import describe, nothing_to_compress, strategy_refusal
from kvbench.baselines import BaselineKey
from kvbench.engine import Engine, check_lengths
from kvbench.errors import KVBenchError
from kvbench.loop import run_samples
from kvbench.models import load_model
from kvbench.report import print_table, summarize
from kvbench.results import ActiveWorker, RunStore, SampleClaims, environment, slug, stable_hash, warn
from kvbench.strategies.base import Strategy
from kvbench.tasks.base import Sample, build_samples


def resolve_strategies(cfg: DictConfig) -> list[Strategy]:
    """The strategies a job runs, ``full`` first (:func:`kvbench.config.resolve_strategies`)."""
    from kvbench.config import resolve_strategies as resolve

    return resolve(cfg)


def _hardware(cfg: DictConfig) -> tuple[Any, str]:
    from kvbench.hardware import HardwareProfile, check_available

    profile = HardwareProfile.from_config(cfg.hardware)
    return profile, check_available(profile)


def _writable_results_dir(value: Any) -> Path:
    """``results_dir``, created if needed and proven writable before anything is measured."""
    root = Path(str(value)).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".kvbench-write-probe.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise KVBenchError(f"results_dir={str(value)!r} is not writable ({exc.strerror or type(exc).__name__}); "
                           "choose a writable directory with results_dir=<dir>") from None
    return root


def _inside(path: Path, root: Path) -> Path:
    """``path`` if it resolves inside ``root``; run ids are slugs, so this only guards against future edits."""
    if not path.resolve().is_relative_to(root.resolve()):
        raise KVBenchError(f"refusing to write {path}: it is outside results_dir={root}")
    return path


def dataset_name(task_cfg: Any) -> str:
    """The name records carry as ``task``: the task's name, or for ``task=jsonl`` its ``dataset_name``
    (default: the file's stem), so two JSON Lines datasets never pool into one task; ``task=ruler`` and
    ``task=hf`` name the subtask / dataset (``ruler_niah_single_1``, ``hf_<dataset>``)."""
    name = str(task_cfg.name)
    if name in ("ruler", "hf"):  # one task per RULER subtask / per Hugging Face dataset
        import importlib

        return importlib.import_module(f"kvbench.tasks.{name}").record_name(task_cfg)
    if name == "jsonl":
        given = task_cfg.get("dataset_name", None)
        path = task_cfg.get("path", None)
        return str(given) if given else (Path(str(path)).stem if path else name)
    return name


def _query_aware(task_cfg: Any, samples: list[Sample]) -> bool:
    """The run's setting: ``task.query_aware``, or where a task decides it (``hf``/``jsonl`` leave it unset:
    query-agnostic when questions share a context) what its samples say."""
    given = task_cfg.get("query_aware", None)
    if given is None:
        return bool(samples and samples[0].metadata.get("query_aware", False))
    return bool(given)


def applicable(model: torch.nn.Module, strategies: list[Strategy]) -> list[Strategy]:
    """``strategies`` less those that cannot apply to ``model`` (:func:`kvbench.arch.strategy_refusal`: snapkv on
    latent attention), each refused with its one line while the others run; :class:`KVBenchError` with that
    line when none but ``full`` would be left (load_model already checked the model itself)."""
    describe(model)
    refused = {s.label(): line for s in strategies if (line := strategy_refusal(model, s)) is not None}
    kept = [s for s in strategies if s.label() not in refused]
    if refused and all(s.name == "full" for s in kept):
        raise KVBenchError(next(iter(refused.values())))
    for line in refused.values():
        warn(f"{line}; the run goes on without it")
    return kept


def run(cfg: DictConfig, strategies: list[Strategy] | None = None) -> pd.DataFrame:
    """Execute one job and return its summary table. ``strategies``: those :func:`validate_cfg` built for
    ``cfg`` (``full`` first); built here when not given."""
    from kvbench import identity

    profile, device = _hardware(cfg)
    if getattr(profile, "threads", None):
        torch.set_num_threads(int(profile.threads))
    if strategies is None:
        strategies = resolve_strategies(cfg)
    dtype = cfg.model.get("dtype") or profile.dtype
    attn = cfg.model.get("attn_implementation")
    lm = load_model(cfg.model.name, dtype=dtype, device=device, path=cfg.model.get("path"), seed=cfg.seed,
                    attn_implementation=attn)
    strategies = applicable(lm.model, strategies)
    samples = build_samples(cfg.task.name, cfg.task, lm.tokenizer, lm.max_context)
    for s in samples:
        check_lengths(s, lm.max_context)
    if cfg.engine.progress:  # after the samples are built: the line counts what the task really holds
        print(announce(cfg, strategies, samples), flush=True)
    note = nothing_to_compress(lm.model.config, [s.name for s in strategies],
                               min((s.total_tokens for s in samples), default=None))
    if note:
        warn(note)
    # Checked after every input is validated, so bad input leaves results_dir untouched.
    results_dir = _writable_results_dir(cfg.results_dir)

    ident = run_identity(cfg, lm, strategies, profile, device, dtype)
    determinants, config_hash, run_id = ident.determinants, ident.config_hash, ident.run_id
    task_cfg, task_inputs, model_path = ident.task_cfg, ident.task_inputs, ident.model_path
    hardware_digest, model_digest, dataset = ident.hardware_digest, ident.model_digest, ident.dataset
    chunk_tokens, linear_choice = ident.chunk_tokens, ident.linear
    store = RunStore(results_dir, run_id)
    _inside(store.dir, results_dir)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    store.init(yaml.safe_dump(resolved, sort_keys=False), environment(),
               identity={**determinants, "config_hash": config_hash, "model_path": model_path,
                         "task_path": identity.task_location(str(cfg.task.name), task_cfg),
                         "hardware_digest": hardware_digest,
                         "strategies": [[s.label(), s.params()] for s in strategies]})

    labels = {s.label() for s in strategies}
    hw_name = getattr(profile, "name", str(cfg.hardware.get("name")))
    simulated = bool(getattr(profile, "simulate", False)) and device != getattr(profile, "device", device)
    engine = Engine(lm, device=device, hardware=profile, run_fields={
        "run_id": run_id, "config_hash": config_hash, "model": lm.name, "task": dataset,
        "task_type": str(cfg.task.name), "hardware": hw_name, "hardware_simulated": simulated, "device": device,
        "dtype": dtype, "seed": int(cfg.seed), "query_aware": _query_aware(cfg.task, samples),
        "model_path": model_path, "model_digest": model_digest,
        "task_digest": task_inputs.get("digest"), "hardware_digest": hardware_digest,
    }, working_copy=bool(cfg.engine.working_copy), attention=str(cfg.engine.attention),
       linear=linear_choice)

    baseline_key = BaselineKey(determinants, lm.model)
    baseline_dir = _inside(results_dir / "baselines", results_dir) if cfg.engine.reuse_baseline else None
    with ActiveWorker(results_dir) as worker:
        claims = SampleClaims(store, labels, worker)
        if cfg.engine.warmup and len(claims) < len(samples):
            engine.warmup()
        try:
            # `claims` is the done-set (asked per sample, just before computing it) and `claims.store` appends
            # through the claims, so concurrent workers split the samples.
            _run_with_progress(engine, samples, strategies, claims, claims.store_view(), baseline_dir,
                               baseline_key, bool(cfg.engine.progress), chunk_tokens, int(cfg.engine.batch_size),
                               int(cfg.engine.max_new_samples))
        finally:
            claims.release()
    if claims.contended:
        warn(f"{claims.contended} sample(s) were timed while another kvbench worker ran; their records say "
             "timing_contended=true (rerun them alone for clean latency)")

    records = store.load_records()
    complete = {r["sample_id"] for r in records if r.get("strategy") in labels}
    pending = claims.elsewhere - complete
    summary = summarize(pd.DataFrame([r for r in records if r.get("strategy") in labels]))
    store.write_outputs(summary)
    print_table(summary)
    print(f"results: {store.dir}")
    if pending:  # the run is not done: say so in its exit status, not only in a line a script never reads
        from kvbench.results.claims import OWNER_EXPIRY_SECONDS

        holders = sorted({claims.held_by.get(sid, "an unknown owner") for sid in pending})
        raise KVBenchError(
            f"{len(pending)} sample(s) left undone: claimed by another worker ({', '.join(holders[:3])}"
            f"{' ...' if len(holders) > 3 else ''}); the finished ones are stored — rerun once it is done (a claim "
            f"nobody refreshes expires after {OWNER_EXPIRY_SECONDS / 60:.0f} min, or at once when its process is "
            "dead on this host)")
    summary.attrs["run_dir"] = str(store.dir)  # a multirun job dir points here (kvbench.cli)
    return summary


def announce(cfg: DictConfig, strategies: list[Strategy], samples: list[Any] | None = None) -> str:
    """The run's first line, printed once the samples are built: what will run (the questions and contexts the
    task really produced — a file may hold fewer rows, a context more or fewer turns, than the config asks for),
    where it goes, and the time it is expected to take from the medians measured in the store (this run's, else
    the checkout's ``results/``). Without ``samples`` the config's counts stand in."""
    from kvbench.engine import context_of
    from kvbench.projection import JobInfo, _fmt_duration, project

    n = int(cfg.task.get("n_samples") or 1)
    qpc = int(cfg.task.get("questions_per_context") or 1)
    questions, contexts = (len(samples), len({context_of(s) for s in samples})) if samples else (n * qpc, n)
    tokens = int(cfg.task.get("context_tokens") or 0)  # the band the records will be in (kvbench.bands)
    dataset = dataset_name(cfg.task)
    job = JobInfo(str(cfg.model.name), str(cfg.hardware.name), tokens, n, [(s.name, s.label()) for s in strategies],
                  str(cfg.results_dir), qpc, questions=questions, contexts=contexts, task=dataset)
    what = (f"kvbench: {dataset}, {questions} question(s)"
            + (f" on {contexts} context(s)" if contexts != questions else "") + f" x {len(strategies)} strategies "
            f"({', '.join(s.name for s in strategies)}) on {cfg.model.name}"
            + (f" at {tokens} tokens" if tokens else "") + f", into {cfg.results_dir}")
    for store in dict.fromkeys([str(cfg.results_dir), "results"]):
        p = project([job], store)
        if p.measured:
            return (f"{what}; expected ~{_fmt_duration(p.seconds)} plus model loading "
                    f"(medians measured in {store}/store)")
    return f"{what}; no measured rate for it yet (the first sample's time gives the ETA)"


@dataclass
class RunIdentity:
    """What names a job's run (:func:`run_identity`)."""

    determinants: dict[str, Any]
    config_hash: str
    run_id: str
    task_cfg: dict[str, Any]
    task_inputs: dict[str, Any]
    model_path: Any
    model_digest: str
    hardware_digest: str
    dataset: str
    chunk_tokens: int
    linear: str


def run_identity(cfg: DictConfig, lm: Any, strategies: list[Strategy], profile: Any, device: str,
                 dtype: str) -> RunIdentity:
    """The run a job's records belong to: its determinants (kvbench.identity), config hash and run id. Shared by
    :func:`run` and the sweep's dry run, which counts a job's finished samples under the same id."""
    from kvbench import identity, linear
    from kvbench.tasks.suite import identity_settings

    # A setting at the value that leaves samples as they were before it existed does not name the run.
    task_cfg = identity_settings(OmegaConf.to_container(cfg.task, resolve=True))
    chunk_tokens = int(cfg.engine.chunk_tokens) if cfg.engine.prefill == "chunked" else 0
    hardware = identity.hardware_fields(profile)
    hardware_digest = stable_hash(hardware, 64)
    task_inputs = identity.task_digest(cfg.task.name, cfg.task)
    # The directory actually read (absolute), so two checkpoints never look alike in the store.
    model_path = str(lm.source_dir.resolve()) if cfg.model.get("path") and lm.source_dir else cfg.model.get("path")
    hub_id = None if lm.source_dir or cfg.model.name == "tiny-llama" else str(model_path or cfg.model.name)
    model_digest = identity.model_digest(lm, lm.source_dir, hub_id)
    determinants = identity.determinants(
        spec=SPEC_VERSION, task_name=str(cfg.task.name), task_cfg=task_cfg, task_inputs=task_inputs,
        model_name=lm.name, model_digest=model_digest, dtype=dtype,
        device=device, hardware=hardware, seed=int(cfg.seed), prefill=str(cfg.engine.prefill),
        chunk_tokens=chunk_tokens)
    attn = cfg.model.get("attn_implementation")
    if attn:  # only when chosen, so runs under transformers' default keep their identity
        determinants["attn_implementation"] = str(attn)
    linear_choice = linear.resolve(str(cfg.engine.get("linear", "auto")), device, lm.model)
    if linear_choice != "native":  # float32 sums in another order can flip a near-tie: a different run
        determinants["linear"] = linear_choice
    from kvbench import attention, fused

    fused.choose(str(cfg.engine.get("reader", "auto")))  # for the whole process: the run reads with it
    if attention.resolve(str(cfg.engine.get("attention", "auto")), device) == attention.NAME and fused.available():
        # A fused reader sums attention in another order than PyTorch's blocks and SDPA (what runs made before
        # it, and runs without a compiler, used), and the simd one scores integer keys against a quantized query:
        # records differ at float rounding or more, so each reader's runs are another run.
        determinants["attention_reader"] = fused.reader()
    config_hash = identity.config_hash(determinants, strategies)
    dataset = dataset_name(cfg.task)
    # Slugs + hash: no config value can steer a path; the real names stay in the records.
    run_id = f"{slug(dataset)}-{slug(lm.name)}-{config_hash}"
    return RunIdentity(determinants, config_hash, run_id, task_cfg, task_inputs, model_path, model_digest,
                       hardware_digest, dataset, chunk_tokens, linear_choice)


def _run_with_progress(engine: Engine, samples: list[Sample], strategies: list[Strategy], done: set[str],
                       store: RunStore, baseline_dir: Path | None, baseline_key: Any, show: bool,
                       chunk_tokens: int, batch_size: int = 1, max_new: int = 0) -> None:
    """One bar step per (sample, strategy) evaluation, labelled with the strategy running, with an ETA."""
    import sys
    import time

    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from kvbench.projection import _fmt_duration

    # A bar on a terminal; elsewhere (a log, CI, `| tee`) a bar is only drawn at the end, so one line per
    # finished sample instead, with its ETA.
    terminal = sys.stdout.isatty()
    total = len(samples) * len(strategies)
    start, evaluated, resumed = time.monotonic(), [0], [0]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("eta"), TimeRemainingColumn(), disable=not (show and terminal), transient=False) as bar:
        tid = bar.add_task("sample x strategy", total=total)

        def progress(n_done: int, strategy: str) -> None:
            if strategy:  # escaped: rich would read a label like `[full, int8]` as markup and drop it
                bar.update(tid, description=escape(f"sample x strategy: {strategy}"))
            if n_done:
                bar.advance(tid, n_done)
                if not strategy:  # a sample stored by an earlier run: skipped, not measured
                    resumed[0] += n_done
                before, evaluated[0] = evaluated[0], evaluated[0] + n_done
                if show and not terminal and strategy and evaluated[0] // len(strategies) > before // len(strategies):
                    elapsed = time.monotonic() - start
                    eta = elapsed / max(evaluated[0] - resumed[0], 1) * (total - evaluated[0])
                    kept = f", {resumed[0] // len(strategies)} kept from earlier runs" if resumed[0] else ""
                    print(f"kvbench: {evaluated[0] // len(strategies)} of {len(samples)} samples stored{kept} "
                          f"({_fmt_duration(elapsed)} elapsed, eta {_fmt_duration(eta)})", flush=True)

        run_samples(engine, samples, strategies, done, store.append, baseline_dir, baseline_key,
                    progress=progress, chunk_tokens=chunk_tokens, batch_size=batch_size, max_new=max_new)


def validate_cfg(cfg: DictConfig) -> list[Strategy]:
    """Checks that need no model; returns the job's strategies (:func:`kvbench.config.validate_cfg`)."""
    from kvbench.config import validate_cfg as validate

    return validate(cfg)
