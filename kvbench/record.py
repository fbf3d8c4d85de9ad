"""The per-sample record of the measurement spec (``docs/measurement-spec.md`` §5; its version is
``kvbench.SPEC_VERSION``) and the metrics registry.

:class:`Record` is the one definition of what the engine writes for each (strategy, sample): the engine
builds one and stores :meth:`Record.to_dict`, and readers take field names from here instead of re-listing
them. Field order is the on-disk key order (the run's own fields first), so it must not be reshuffled.

:data:`METRICS` is the one place to add a metric: how ``kvbench.report.summarize`` aggregates it per
(task, setting, strategy), its unit, and which way is better (the leaderboard's sort direction).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

#: Field groups, in the order they appear in a record.
GROUPS = ("identity", "sample", "memory", "latency", "fidelity", "stats")


def _f(group: str, doc: str, *, measured: bool = False, **default: Any) -> Any:
    """A record field: its group, a one-line doc, and ``measured`` for the engine's numeric measurements
    (what an importer of another harness's results, such as lm-eval, lacks and fills with NaN); ``default=``
    for a field the engine only sometimes knows."""
    assert group in GROUPS, group
    return field(metadata={"group": group, "doc": doc, "measured": measured}, **default)


@dataclass
class Record:
    """One strategy scored on one sample: every figure the measurement spec defines for it."""

    # -- identity: which run, spec and strategy ------------------------------------------------------
    run: dict[str, Any] = _f("identity", "the run's own fields (run_id, config_hash, model, task, hardware, "
                                         "...), written first and flattened into the record")
    spec_version: str = _f("identity", "measurement spec version the record follows")
    sample_id: str = _f("identity", "the task's id of the sample (one question)")
    context_id: str = _f("identity", "the prefilled context the question was asked of (questions sharing one "
                                     "prefill and compression share it; the cluster of spec §2.3)")
    document_id: str = _f("identity", "the work the context is drawn from (its first source document's whole "
                                      "work: parts of one article share it; the outer cluster of spec §2)")
    strategy: str = _f("identity", "strategy label: name plus its parameters")
    strategy_name: str = _f("identity", "registry name of the strategy")
    family: str = _f("identity", "strategy family (baseline, quantization, eviction, ...)")
    params: dict[str, Any] = _f("identity", "the strategy's parameters")

    # -- sample: the question and how it was answered ------------------------------------------------
    metric: str = _f("sample", "task metric that produced ``score``")
    score: float = _f("sample", "task metric of the prediction (or gold-token accuracy), in [0, 1]")
    prediction: str = _f("sample", "greedy decoded answer ('' for token_accuracy tasks, which decode nothing)")
    answers: list[str] = _f("sample", "accepted gold answers")
    context_tokens: int = _f("sample", "model tokens of the long context", measured=True)
    query_tokens: int = _f("sample", "model tokens of the query", measured=True)
    gold_tokens: int = _f("sample", "model tokens of the gold answer", measured=True)
    sample_meta: dict[str, Any] = _f("sample", "the task's metadata of the sample (needle depth, ...)")

    # -- memory: what the cache holds after prefill and compression ----------------------------------
    kv_bytes: int = _f("memory", "bytes of the tensors the cache holds", measured=True)
    kv_bytes_fp16: int = _f("memory", "bytes a dense 16-bit cache of the same tokens would hold", measured=True)
    memory_reduction: float = _f("memory", "1 - kv_bytes / kv_bytes_fp16", measured=True)
    bytes_per_token: float = _f("memory", "kv_bytes per context token", measured=True)
    held_tokens_mean: float = _f("memory", "tokens held, averaged over layers", measured=True)
    kept_fraction: float = _f("memory", "held_tokens_mean / context_tokens", measured=True)

    # -- latency: how the prefill ran and how long each phase took -----------------------------------
    prefill_mode: str = _f("latency", "'shared' (one capture for every strategy) or 'chunked:<tokens>'")
    batch_size: int = _f("latency", "samples evaluated together")
    prefill_s: float = _f("latency", "seconds of the prefill", measured=True)
    compress_s: float = _f("latency", "seconds building the strategy's cache from the prefill", measured=True)
    query_s: float = _f("latency", "seconds from the query to the first generated token", measured=True)
    ttft_s: float = _f("latency", "time to first token: prefill_s + compress_s + query_s", measured=True)
    decode_ms_per_token: float = _f("latency", "median milliseconds per decode step (NaN without steps)",
                                    measured=True)
    decode_steps: int = _f("latency", "decode steps timed", measured=True)
    generated_tokens: int = _f("latency", "tokens generated", measured=True)

    # -- fidelity: teacher-forced agreement with the full cache over the gold answer -----------------
    kl: float = _f("fidelity", "mean KL(full || strategy) of next-token distributions", measured=True)
    top1_agreement: float = _f("fidelity", "fraction of positions whose argmax matches full", measured=True)
    gold_nll: float = _f("fidelity", "mean negative log-likelihood of the gold tokens", measured=True)
    gold_token_accuracy: float = _f("fidelity", "fraction of gold tokens that are the argmax", measured=True)

    # -- memory peaks, measured around the forwards (after fidelity: the on-disk order is historical) ---
    peak_bytes_prefill: int = _f("memory", "peak device bytes allocated during the prefill", measured=True)
    peak_bytes_decode: int = _f("memory", "peak device bytes during the (batch's) decode", measured=True)
    scratch_bytes: int = _f("memory", "bytes of the store's working copy (not in kv_bytes)", measured=True)
    peak_bytes_decode_excl_scratch: int = _f("memory", "peak_bytes_decode less the batch's working copies",
                                             measured=True)

    # -- stats: strategy-specific figures ------------------------------------------------------------
    stats: dict[str, Any] = _f("stats", "the store's own figures (transfers, recomputes, ...)")

    # -- identity, appended last (the on-disk order is historical) ------------------------------------
    baseline_sha256: str | None = _f("identity", "sha256 of the stored baseline file this sample's delta and "
                                                 "fidelity rest on; None when the baseline was computed fresh",
                                     default=None)

    # -- measured decode working set, appended last (the on-disk order is historical) ----------------------
    working_set_bytes: int = _f("memory", "bytes the cache, its scratch and attention's temporaries held at the "
                                          "peak of the first decode step, measured while it ran "
                                          "(kvbench.workingset; 0 when nothing was decoded)",
                                measured=True, default=0)

    def to_dict(self) -> dict[str, Any]:
        """The record as stored: the run's fields first, then every other field in declaration order.
        Values are the objects given (no deep copy), as the engine's dict literal had them."""
        return {**self.run, **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "run"}}


#: Names of the record's fields, in on-disk order (``run``'s keys vary by caller and are not listed).
FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Record) if f.name != "run")
#: The engine's numeric measurements: fields a record imported from elsewhere carries as NaN.
MEASURED_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Record) if f.metadata["measured"])

Aggregation = Literal["mean", "median", "nanmedian", "paired"]


@dataclass(frozen=True)
class Metric:
    """One summary metric: ``source`` record field aggregated by ``agg`` and multiplied by ``scale``.
    ``agg == "paired"`` marks figures of the paired accuracy test (``kvbench.spec``), not a field's
    aggregate; ``higher_is_better`` is None where no direction makes sense."""

    name: str
    agg: Aggregation
    unit: str
    higher_is_better: bool | None
    source: str | None = None
    scale: float = 1.0

    @property
    def field(self) -> str:
        return self.source or self.name


def _metrics(*ms: Metric) -> dict[str, Metric]:
    return {m.name: m for m in ms}


#: Every metric a summary row carries, in summary-column order within each kind.
METRICS: dict[str, Metric] = _metrics(
    # paired test against the baseline (kvbench.spec.accuracy_delta / accuracy_interval)
    Metric("n", "paired", "samples", True),
    Metric("accuracy", "paired", "fraction", True),
    Metric("accuracy_ci_low", "paired", "fraction", True),
    Metric("accuracy_ci_high", "paired", "fraction", True),
    Metric("baseline_accuracy", "paired", "fraction", None),
    Metric("delta_pp", "paired", "pp", True),
    Metric("delta_ci_low", "paired", "pp", True),
    Metric("delta_ci_high", "paired", "pp", True),
    Metric("delta_method", "paired", "name of the test", None),
    Metric("n_only_strategy", "paired", "samples", True),
    Metric("n_only_baseline", "paired", "samples", False),
    Metric("mcnemar_p", "paired", "p-value", True),
    Metric("relative_loss", "paired", "fraction", False),
    # aggregates of record fields
    Metric("kv_mib", "mean", "MiB", False, source="kv_bytes", scale=2.0**-20),
    Metric("kv_mib_fp16", "mean", "MiB", None, source="kv_bytes_fp16", scale=2.0**-20),
    Metric("memory_reduction", "mean", "fraction", True),
    Metric("bytes_per_token", "mean", "bytes", False),
    Metric("kept_fraction", "mean", "fraction", False),
    Metric("prefill_s", "median", "s", False),
    Metric("compress_s", "median", "s", False),
    Metric("ttft_s", "median", "s", False),
    Metric("decode_ms_per_token", "nanmedian", "ms", False),
    Metric("kl", "mean", "nats", False),
    Metric("top1_agreement", "mean", "fraction", True),
    Metric("gold_nll", "mean", "nats", False),
)
#: Figures of the paired test, in summary-column order.
PAIRED: tuple[str, ...] = tuple(m.name for m in METRICS.values() if m.agg == "paired")
#: The metrics ``summarize`` computes from record fields, in summary-column order.
AGGREGATED: tuple[Metric, ...] = tuple(m for m in METRICS.values() if m.agg != "paired")
#: Sort direction per metric: True when larger is better.
HIGHER_IS_BETTER: dict[str, bool] = {m.name: m.higher_is_better for m in METRICS.values()
                                     if m.higher_is_better is not None}


@dataclass
class StrategyResult:
    """What evaluating one strategy on one sample yields: its record (:meth:`Record.to_dict`) and its
    teacher-forced log-probs over the gold positions (``[positions, vocab]``), which the fidelity metrics of
    later strategies compare against when this is the ``full`` baseline (:mod:`kvbench.baselines` stores both)."""

    record: dict[str, Any]
    logp: torch.Tensor
