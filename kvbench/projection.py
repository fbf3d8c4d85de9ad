"""The time a set of jobs will take on this kind of machine, from the medians of what the store measured.

Shared by ``kvbench sweep --dry-run`` and the first line of a run (:mod:`kvbench.runner`), so the two never
disagree about a job's expected time. Nothing here is a constant: a job without a measured figure is reported
as unmeasured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class JobInfo:
    """What a job's cost depends on, from its composed config."""

    model: str
    hardware: str
    context_tokens: int
    n_samples: int  # task.n_samples: contexts when a context carries several questions
    strategies: list[tuple[str, str]]  # (name, label), `full` first
    results_dir: str = "results"
    questions_per_context: int = 1  # task.questions_per_context (query-agnostic multi-question contexts)
    done: int = 0  # questions already stored with every one of the job's strategies, under the job's run id
    run_id: str = ""
    questions: int = 0  # counted from the built samples (0: not built; the config's n_samples x K stands in)
    contexts: int = 0  # the distinct contexts of the built samples (0: not built)
    task: str = ""  # the records' task name (kvbench.runner.dataset_name): its own timings first, within the band

    @property
    def n_questions(self) -> int:
        """The samples (questions) the job runs to, the unit ``engine.max_new_samples`` counts: the built samples'
        count when known (a file may hold fewer rows, or a context fewer turns, than the config asks for)."""
        return self.questions or self.n_samples * self.questions_per_context

    def contexts_for(self, questions: int) -> int:
        """Prefills ``questions`` of the job's questions take: a context's questions share its prefill."""
        if self.contexts and self.questions:
            return -(-questions * self.contexts // self.questions)
        return -(-questions // self.questions_per_context)


@dataclass
class Projection:
    """Serial job seconds for the jobs with measurements, and the jobs without."""

    seconds: float
    measured: int
    unmeasured: list[JobInfo]
    source: str


def _per_sample(df: Any) -> Any:
    """Seconds per sample a strategy adds after the shared prefill: compression, query and decoding."""
    return (df["compress_s"].fillna(0) + df["query_s"].fillna(0)
            + df["decode_ms_per_token"].fillna(0) * df["decode_steps"].fillna(0) / 1000)


def project(jobs: list[JobInfo], results_dir: str | Path = "results") -> Projection:
    """Serial seconds of ``jobs`` from records measured on this kind of machine.

    A job's cost is ``contexts x median prefill + questions x (sum over its strategies, baseline included, of
    the median compress + query + decode seconds per question)`` (one prefill per context; a context's
    compression is counted once per question, an over-estimate by the compress seconds when it has several),
    the medians taken over stored records of the same model, hardware and length band (a strategy matched by
    its exact parameters, else by its name). A job's ``context_tokens`` is the length its task was declared at,
    which is what a record's band is (:mod:`kvbench.bands`): one's own documents keep their natural lengths
    under that budget, so matching the exact length found none of their earlier timings. Within the band, the
    job's own task's records are used when the store has them (a natural-length task's contexts are shorter
    than a fixed-length task's at the same band), else every task's. A job any of whose figures has no such
    record is counted as unmeasured. Model loading is not in the records, so it is not in the projection; jobs
    already finished are skipped when run, so a re-run costs less.
    """
    source = (f"median per-sample prefill/compress/decode seconds in {results_dir}/store, same model/hardware/"
              "length band")
    try:
        from kvbench.results import read_store

        df = read_store(results_dir)
    except Exception:  # an unreadable store only costs the projection
        df = None
    need = {"model", "hardware", "context_tokens", "strategy", "strategy_name", "prefill_s", "compress_s",
            "query_s", "decode_ms_per_token", "decode_steps"}
    if df is None or df.empty or not need <= set(df.columns):
        return Projection(0.0, 0, list(jobs), source)
    from kvbench.bands import BAND, with_bands

    df = with_bands(df).assign(_rest=_per_sample(df))
    groups = {k: g for k, g in df.groupby(["model", "hardware", BAND])}
    total, measured, unmeasured = 0.0, 0, []
    for job in jobs:
        g = groups.get((job.model, job.hardware, float(job.context_tokens)))
        if g is None:
            unmeasured.append(job)
            continue
        if job.task and (g["task"] == job.task).any():
            g = g[g["task"] == job.task]
        costs = []
        for name, label in job.strategies:
            rows = g[g["strategy"] == label]
            rows = rows if not rows.empty else g[g["strategy_name"] == name]
            costs.append(float(rows["_rest"].median()) if not rows.empty else math.nan)
        if any(math.isnan(c) for c in costs):
            unmeasured.append(job)
            continue
        left = max(job.n_questions - job.done, 0)
        contexts = job.contexts_for(left)
        total += contexts * float(g["prefill_s"].median()) + left * sum(costs)
        measured += 1
    return Projection(total, measured, unmeasured, source)


def _fmt_duration(seconds: float) -> str:
    h, rem = divmod(int(round(seconds)), 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def projection_text(p: Projection, n_jobs: int, par: int) -> str:
    if not p.measured:
        return (f"estimate: no measurement yet for any of the {n_jobs} jobs ({p.source}); run one job of the "
                "sweep first and the dry run projects the rest")
    text = (f"estimate: {_fmt_duration(p.seconds)} of job time for {p.measured} of {n_jobs} jobs ({p.source}; "
            f"model loading not included); ~{_fmt_duration(p.seconds / par)} wall at {par} job(s) at once. "
            "Finished jobs are skipped.")
    if p.unmeasured:
        first = p.unmeasured[0]
        names = ",".join(n for n, _ in first.strategies)
        text += (f"\n  no measurement yet for {len(p.unmeasured)} job(s), e.g. {names} at {first.context_tokens} "
                 f"tokens on {first.model}/{first.hardware}")
    return text
