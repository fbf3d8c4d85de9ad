"""The sample loop: which samples run together, the ``full`` baseline first (reused from its store where it
verifies), then every strategy against it, each sample's records written together.

:mod:`kvbench.engine` measures one strategy on one prefill; this module decides what is prefilled together
(a batch of samples of one context length, or the questions that share one context) and in which order,
skips and claims samples already done (concurrent workers split them), and stops after a round's worth
(``engine.max_new_samples``).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import Any

import torch

from kvbench.baselines import load_baseline as _load_baseline
from kvbench.baselines import save_baseline as _save_baseline
from kvbench.baselines import stamp as _stamp_baseline
from kvbench.engine import Engine, Prefill, context_of, query_window_for
from kvbench.errors import KVBenchError
from kvbench.record import StrategyResult
from kvbench.strategies.base import Strategy
from kvbench.tasks.base import Sample

#: ``progress(evaluations_done, strategy)``: called with 0 when ``strategy`` starts on a batch, and with the
#: number of (sample, strategy) evaluations finished when it ends (``strategy`` empty for resumed samples).
ProgressFn = Callable[[int, str], None]


def batches(samples: list[Sample], batch_size: int) -> list[list[Sample]]:
    """Consecutive runs of up to ``batch_size`` samples of equal context length, in order."""
    out: list[list[Sample]] = []
    for s in samples:
        if out and len(out[-1]) < batch_size and len(out[-1][0].prefix_ids) == len(s.prefix_ids):
            out[-1].append(s)
        else:
            out.append([s])
    return out


def _claimed_batches(samples: list[Sample], done: Container[str], batch_size: int,
                     skipped: Callable[[], None], limit: int = 0) -> Iterator[list[Sample]]:
    """:func:`batches` of the samples not in ``done``, asking ``sample_id in done`` only when a sample joins a
    batch about to run: with a claiming done-set (:class:`kvbench.results.SampleClaims`) concurrent workers
    then split the samples instead of one worker claiming them all up front. ``limit > 0`` stops after that
    many new samples, asking (and so claiming) no sample beyond them."""
    batch: list[Sample] = []
    taken = 0
    for s in samples:
        if batch and (len(batch) == batch_size or len(batch[0].prefix_ids) != len(s.prefix_ids)):
            yield batch
            batch = []
        if limit and taken == limit:
            break
        if s.sample_id in done:
            skipped()
            continue
        batch.append(s)
        taken += 1
    if batch:
        yield batch


def run_samples(engine: Engine, samples: list[Sample], strategies: list[Strategy],
                done: set[str], write: Callable[[list[dict[str, Any]]], None],
                baseline_dir: Path | None = None, baseline_key: Callable[[Sample], str] | None = None,
                progress: ProgressFn | None = None, chunk_tokens: int = 0, batch_size: int = 1,
                max_new: int = 0) -> None:
    """Evaluate every not-yet-done sample, ``batch_size`` at a time; each sample's records are written together.

    ``max_new > 0`` evaluates at most that many not-yet-done samples, the first ones in order (a sweep can
    bring several runs up in rounds, so an interrupted sweep leaves every run at a similar n).

    ``chunk_tokens > 0`` selects chunked prefill: no shared capture, each strategy prefills into its own
    cache chunk by chunk (lower peak memory, but later chunks attend to already-compressed earlier ones),
    one sample at a time.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise KVBenchError(f"engine.batch_size must be an integer >= 1 (got {batch_size!r})")
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
        raise KVBenchError(f"engine.max_new_samples must be an integer >= 0 (got {max_new!r})")
    window = query_window_for(strategies)

    def skipped() -> None:
        if progress:
            progress(len(strategies), "")

    if not chunk_tokens and batch_size == 1 and any(len(g) > 1 for g in _contexts(samples)):
        for group in _claimed_contexts(samples, done, skipped, max_new):
            _run_context(engine, group, strategies, write, baseline_dir, baseline_key, progress, window)
        return
    for batch in _claimed_batches(samples, done, 1 if chunk_tokens else batch_size, skipped, max_new):
        pre = None if chunk_tokens else engine.prefill(batch[0] if len(batch) == 1 else batch, window)

        def evaluate(s: Strategy, rows: list[int], logps: list[torch.Tensor | None],
                     batch: list[Sample] = batch, pre: Prefill | None = pre) -> list[StrategyResult]:
            return engine.evaluate_batch(s, [batch[i] for i in rows], pre, logps, chunk_tokens, rows=rows)

        _evaluate_all(batch, strategies, evaluate, write, baseline_dir, baseline_key, progress, engine.run_fields)
        del pre, evaluate  # the batch's capture is freed before the next prefill


def _contexts(samples: list[Sample]) -> list[list[Sample]]:
    """Consecutive runs of samples that share a context (same ``context_id`` and ``prefix_ids``)."""
    out: list[list[Sample]] = []
    for s in samples:
        if out and context_of(out[-1][0]) == context_of(s) and out[-1][0].prefix_ids == s.prefix_ids:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def _claimed_contexts(samples: list[Sample], done: Container[str], skipped: Callable[[], None],
                      limit: int = 0) -> Iterator[list[Sample]]:
    """Each context's questions not in ``done`` (asked, and so claimed, one context at a time); ``limit > 0``
    stops once that many new questions have been taken, finishing the context it is in."""
    taken = 0
    for group in _contexts(samples):
        if limit and taken >= limit:
            break
        todo = []
        for s in group:
            if s.sample_id in done:
                skipped()
            else:
                todo.append(s)
        if todo:
            taken += len(todo)
            yield todo


def _run_context(engine: Engine, questions: list[Sample], strategies: list[Strategy],
                 write: Callable[[list[dict[str, Any]]], None], baseline_dir: Path | None,
                 baseline_key: Callable[[Sample], str] | None, progress: ProgressFn | None,
                 window: int | None) -> None:
    """One prefill of the shared context; each strategy compresses it once and answers every question."""
    pre = engine.prefill(questions[0], window)

    def evaluate(s: Strategy, rows: list[int], logps: list[torch.Tensor | None]) -> list[StrategyResult]:
        return engine.evaluate_context(s, [questions[i] for i in rows], pre, logps)

    _evaluate_all(questions, strategies, evaluate, write, baseline_dir, baseline_key, progress, engine.run_fields)


def _evaluate_all(samples: list[Sample], strategies: list[Strategy],
                  evaluate: Callable[[Strategy, list[int], list[torch.Tensor | None]], list[StrategyResult]],
                  write: Callable[[list[dict[str, Any]]], None], baseline_dir: Path | None,
                  baseline_key: Callable[[Sample], str] | None, progress: ProgressFn | None,
                  run_fields: dict[str, Any]) -> None:
    """``full`` first (reused from its stored baseline where one verifies, else computed and stored), then every
    other strategy against it; each sample's records written together. ``evaluate(strategy, rows, logps)``
    scores ``samples[rows]`` (a batch sharing a prefill, or questions sharing a context)."""
    baseline, others = strategies[0], strategies[1:]
    bases: list[StrategyResult | None] = []
    for sample in samples:
        base = _load_baseline(baseline_dir, baseline_key, sample) if baseline_dir and baseline_key else None
        if base is not None:
            base.record.update(run_fields)
        bases.append(base)
    missing = [i for i, b in enumerate(bases) if b is None]
    if progress:
        progress(0, baseline.name)
    if missing:
        for i, base in zip(missing, evaluate(baseline, missing, [None] * len(missing)), strict=True):
            bases[i] = base
            if baseline_dir and baseline_key:
                _save_baseline(baseline_dir, baseline_key(samples[i]), base)
    # The last strategy's progress is reported once the samples' records are written, so "finished" on screen
    # always means stored (an interrupt after it loses nothing shown as done).
    if progress and others:
        progress(len(samples), baseline.name)
    done = [b for b in bases if b is not None]
    results: list[list[StrategyResult]] = [[b] for b in done]
    for s in others:
        if progress:
            progress(0, s.name)
        for i, r in enumerate(evaluate(s, list(range(len(samples))), [b.logp for b in done])):
            results[i].append(r)
        if progress and s is not others[-1]:
            progress(len(samples), s.name)
    for rs in results:
        write(_stamp_baseline([r.record for r in rs]))
    if progress:
        progress(len(samples), (others[-1] if others else baseline).name)
