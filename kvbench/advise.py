"""``kvbench advise``: which KV-cache strategy to use on a given device, model, context and load.

    kvbench advise model=llama-3-70b task.context_tokens=12000 hardware=server-gpu-80g task=legal
    kvbench advise model=llama-3.1-8b task.context_tokens=32768 hardware=consumer-gpu-24g concurrency=8
    kvbench advise model=local model.path=/models/Llama-3.2-1B hardware=laptop-16g latency_ms=100
    kvbench advise model=llama-3.1-8b hardware=probed         # conf/hardware/probed.yaml from `kvbench hardware probe`
    kvbench advise model=llama-3-70b hardware=server-gpu-80g devices=2 hardware.memory_bytes=85899345920

Hydra-configured (``conf/advise.yaml``; keys, defaults and types are :class:`AdviseConfig`; ``model=``,
``hardware=`` and ``task=`` are the groups of ``python -m kvbench``, and ``model=`` also takes any
:data:`kvbench.calc.PRESETS` geometry such as ``llama-3-70b``). Nothing is downloaded or run: per strategy in the
committed result store,

* **bytes**: the KV bytes per token the store measured, turned into bytes per KV element on the model that
  measured them (:func:`kvbench.calc.bytes_per_element_from_token_bytes`), then projected onto the asked model
  and context by :mod:`kvbench.calc` (weights + ``sequences × KV`` against the profile's memory less its
  reserve): the sequences that fit;
* **speed**: one batched decode step reads the weights once and every sequence's KV, and computes 2 FLOPs per
  parameter per sequence plus the attention's products over the tokens held (the kept fraction the store
  measured); its time is the roofline of :mod:`kvbench.hardware` over the profile's bandwidth and peak FLOP/s,
  the bound named. Time to first token is the same roofline over one sequence's prefill (compression and
  queueing not modelled). Datasheet peaks make both upper bounds on speed (``results/perf/advise_validation.md``
  checks them against ``kvbench throughput`` on this CPU);
* **accuracy**: the strategy's Δ against ``full`` on the asked task from the committed leaderboards
  (``<results_root>/leaderboard.csv`` and ``<results_root>/*/leaderboard.csv``, each computed from its store by
  ``kvbench leaderboard``): the row with the most questions, its 95% interval and its verdict against the
  1-point margin (the leaderboard's words; per task, a store under a registered design gives the design's verdict
  on that task, its ``<task>.verdict`` column, and any other store's unadjusted interval decides, as the
  leaderboard does without records), with the model and context that measured it — labelled when that is not
  the asked model. A strategy never measured on the task says so; another task's verdict is never borrowed.

One recommendation follows: among the strategies that serve the load (``concurrency`` sequences at once, and
each decode step within ``latency_ms`` when given; otherwise as many sequences as fit), the evidence first
(``full`` and strategies whose interval holds the margin, then those undetermined with Δ above −1 point;
never one that fails, is undetermined below the margin, or was never measured on the task), then the
predicted tokens/s. Offloading (``tiered``) moves bytes off the device instead of saving them and is left out,
as the leaderboard leaves it out of its ranking. When nothing admissible fits as asked (Llama-3-70B's 141 GB of
bf16 weights on one 80 GB card), the same ranking is repeated for the smallest change that makes something fit —
the fewest accelerators to shard over (``devices=N``, up to 8; a host is not multiplied), and the least weight
quantisation (``weight_dtype=int8``, else ``int4``), each preferring what serves the whole load — and the sentence
names what each would use.

The leaderboard's "By hardware profile" section is :func:`hardware_rows` over the leaderboard's own table.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, List, Optional  # noqa: UP035  (OmegaConf reads these typing forms)

from kvbench import calc
from kvbench.errors import KVBenchError
from kvbench.hardware import HardwareProfile, attention_flops, profile_roofline
from kvbench.leaderboard.table import BEYOND, STOPPED, UNDECIDED_IN, UNDECIDED_OUT, WITHIN, margin_pp, task_lengths
from kvbench.vocab import BASELINE, OFFLOADING_FAMILIES, OVERALL, QUERY_AGNOSTIC, SETTINGS, setting_of

CONFIG_NAME = "advise"
NOT_MEASURED = "never measured on this task"
EXACT = "exact"  # the baseline's verdict: it is the reference every Δ is measured against
#: Evidence tiers, best first: what the recommendation may choose (the first two) and what it may not.
TIERS = {WITHIN: 0, UNDECIDED_IN: 1, NOT_MEASURED: 2, UNDECIDED_OUT: 3, STOPPED: 4, BEYOND: 5}
ADMISSIBLE = 1  # tiers up to this one may be recommended
#: What is tried when nothing admissible fits as asked: sharding over more identical accelerators (up to one node of
#: 8), and weights held in fewer bytes per parameter (weight quantisation's own accuracy cost is not measured here).
MAX_DEVICES = 8
LIGHTER_WEIGHTS = ("int8", "int4")
SHARD_OR_QUANTISE = "; shard them (devices=N) or quantise them (weight_dtype=int8|int4)"
WEIGHT_NOTE = ("weights below 2 bytes per parameter: weight quantisation's own accuracy cost is not measured here "
               "(the Δ column is each KV strategy's with 16-bit weights)")


@dataclass
class AdviseConfig:
    """``kvbench advise`` keys (``conf/advise.yaml`` adds the ``model``, ``hardware`` and ``task`` groups)."""

    model: Any = None
    hardware: Any = None
    task: Any = None                 # task=<name>; task.context_tokens is the context asked about
    concurrency: Optional[int] = None  # noqa: UP045  sequences served at once; null: as many as fit
    latency_ms: Optional[float] = None  # noqa: UP045  longest decode step (ms per generated token); null: none
    devices: int = 1                 # identical devices the model is sharded over (memory, bandwidth, FLOP/s × n)
    weight_dtype: str = "bf16"       # weights' dtype (kvbench.calc.DTYPE_BYTES)
    reserve: float = calc.DEFAULT_RESERVE_FRACTION  # memory held back for activations and the runtime
    setting: str = QUERY_AGNOSTIC    # whose accuracy evidence: query-agnostic | query-aware
    strategies: Optional[List[str]] = None  # noqa: UP006, UP045  names or short labels; null: every measured one
    results_root: str = "results"    # committed leaderboards: <root>/leaderboard.csv and <root>/*/leaderboard.csv
    out: Optional[str] = "results/adhoc/advise"  # noqa: UP045  advise.md and advise.csv; null: print only


# -- what the store measured ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Evidence:
    """A strategy's accuracy against ``full`` on one task (or the pooled scope) from one leaderboard."""

    task: str
    n: int
    delta_pp: float
    ci_low: float
    ci_high: float
    verdict: str
    model: str
    contexts: str  # the context length(s) as text: "4,096" or "2,048–4,096"
    source: str    # the leaderboard it comes from

    def text(self) -> str:
        return f"{self.delta_pp:+.1f} [{self.ci_low:+.1f}, {self.ci_high:+.1f}]"


@dataclass(frozen=True)
class Measured:
    """One strategy (full label) as the store measured it: KV bytes per token on ``model``, and its evidence."""

    label: str
    short: str
    name: str
    family: str
    model: str
    bytes_per_token: float
    kept_fraction: float
    evidence: Mapping[str, Evidence] = field(default_factory=dict)  # task -> the best-supported row

    def bytes_per_element(self) -> float:
        """Bytes per KV element on the measuring model (:func:`kvbench.calc.bytes_per_element_from_token_bytes`):
        transfers to another model where the format's cost per element does not depend on its shape."""
        return calc.bytes_per_element_from_token_bytes(self.bytes_per_token, calc.resolve_model(self.model))


def _num(row: Mapping[str, Any], key: str) -> float:
    try:
        value = float(row.get(key, math.nan))
    except (TypeError, ValueError):
        return math.nan
    return value


def interval_verdict(low: float, high: float, delta: float) -> str:
    """The leaderboard's verdict words from an unadjusted 95% interval against the 1-point margin
    (:func:`kvbench.leaderboard.table.claim_verdicts` without records)."""
    margin = margin_pp()
    if low > -margin:
        return WITHIN
    if high <= -margin:
        return BEYOND
    return UNDECIDED_IN if delta > -margin else UNDECIDED_OUT


def _evidence(row: Mapping[str, Any], scope: str, contexts: str, source: str) -> Evidence | None:
    # The pooled scope carries the clustered figures its verdict rests on; a task its own interval.
    pooled = not math.isnan(_num(row, f"{scope}.verdict_delta_pp"))
    keys = ("verdict_delta_pp", "verdict_ci_low", "verdict_ci_high") if pooled else \
        ("delta_pp", "delta_ci_low", "delta_ci_high")
    n = _num(row, f"{scope}.n")
    delta, low, high = (_num(row, f"{scope}.{k}") for k in keys)
    if math.isnan(n) or n <= 0 or any(math.isnan(v) for v in (delta, low, high)):
        return None
    verdict = row.get(f"{scope}.verdict")
    if not isinstance(verdict, str) or verdict not in TIERS:
        verdict = interval_verdict(low, high, delta)
    return Evidence(scope, int(n), delta, low, high, verdict, str(row.get("model", "")), contexts, source)


def measured_from_table(table: Any, setting: str, lengths: Callable[[str, str], str], source: str,
                        tasks: Iterable[str]) -> list[Measured]:
    """The strategies of a leaderboard table (``leaderboard.csv``'s columns; ``Leaderboard.table``) in ``setting``:
    bytes per token and kept fraction from the first of ``tasks`` that has them, evidence per task and for the
    pooled scope. ``lengths(label, task)``: the context length(s) that task was measured at, as text."""
    tasks = list(tasks)
    out = []
    for row in table[table["setting"] == setting].to_dict("records"):
        label = str(row["strategy"])
        size = next(((b, _num(row, f"{t}.kept_fraction")) for t in tasks
                     if not math.isnan(b := _num(row, f"{t}.bytes_per_token"))), None)
        if size is None:
            continue
        evidence = {}
        if label != BASELINE:
            for scope in [*tasks, OVERALL]:
                e = _evidence(row, scope, lengths(label, scope), source)
                if e is not None:
                    evidence[scope] = e
        out.append(Measured(label=label, short=str(row.get("label", label)), name=str(row.get("name", label)),
                            family=str(row.get("family", "")), model=str(row.get("model", "")),
                            bytes_per_token=size[0], kept_fraction=1.0 if math.isnan(size[1]) else size[1],
                            evidence=evidence))
    return out


def _better(a: Evidence, b: Evidence, context: int) -> bool:
    """Whether ``a`` is better support than ``b``: more questions, then a measured length nearer ``context``."""
    def distance(e: Evidence) -> float:
        try:
            return abs(math.log(int(e.contexts.split("–")[-1].replace(",", "")) / context))
        except ValueError:
            return math.inf
    return (a.n, -distance(a)) > (b.n, -distance(b))


def merge(groups: Iterable[list[Measured]], context: int) -> list[Measured]:
    """One entry per strategy label over several leaderboards: per task, the evidence with the most questions."""
    merged: dict[str, Measured] = {}
    for group in groups:
        for m in group:
            have = merged.get(m.label)
            if have is None:
                merged[m.label] = m
                continue
            evidence = dict(have.evidence)
            for task, e in m.evidence.items():
                if task not in evidence or _better(e, evidence[task], context):
                    evidence[task] = e
            merged[m.label] = replace(have, evidence=evidence)
    return list(merged.values())


def leaderboard_files(root: str | Path) -> list[Path]:
    """The committed leaderboards under ``root``: its own and its subdirectories' ``leaderboard.csv``."""
    base = Path(root)
    return [p for p in [base / "leaderboard.csv", *sorted(base.glob("*/leaderboard.csv"))] if p.is_file()]


def _store_lengths(results_dir: Path) -> Any:
    """(setting, strategy, task, context_tokens) of every record in ``results_dir/store``: four columns only."""
    import pandas as pd

    frames = []
    for f in sorted((results_dir / "store").glob("*.parquet")):
        try:
            frames.append(pd.read_parquet(f, columns=["strategy", "task", "context_tokens", "query_aware"]))
        except Exception:  # an unreadable file only costs the lengths shown (read_store names it elsewhere)
            continue
    if not frames:
        return pd.DataFrame(columns=["setting", "strategy", "task", "context_tokens"])
    df = pd.concat(frames, ignore_index=True)
    return df.assign(setting=[setting_of(v) for v in df["query_aware"]])


def load_measured(root: str | Path, setting: str, context: int) -> list[Measured]:
    """Every strategy in the committed leaderboards under ``root``, merged (:func:`merge`)."""
    import pandas as pd

    groups = []
    for path in leaderboard_files(root):
        table = pd.read_csv(path)
        if "setting" not in table or "strategy" not in table:
            continue
        if "interim" in table and table["interim"].astype(bool).any():
            continue  # a registered design's store before its first look: nothing in it is a verdict yet
        records = _store_lengths(path.parent)
        mine = records[records["setting"] == setting]

        def lengths(label: str, task: str, mine: Any = mine) -> str:
            own = mine[mine["strategy"] == label]
            return task_lengths(own.assign(task=OVERALL) if task == OVERALL else own, task)

        tasks = sorted({c.split(".", 1)[0] for c in table.columns if c.endswith(".bytes_per_token")})
        groups.append(measured_from_table(table, setting, lengths, str(path), tasks))
    return merge(groups, context)


# -- the projection ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Deployment:
    """What is asked: the model, its context, the device(s) and the load."""

    arch: calc.ModelArch
    hardware: HardwareProfile
    context: int
    task: str
    concurrency: int | None = None
    latency_ms: float | None = None
    devices: int = 1
    weight_bytes_per_param: float = 2.0
    reserve: float = calc.DEFAULT_RESERVE_FRACTION

    @property
    def device(self) -> HardwareProfile:
        """The profile scaled to ``devices`` identical devices (tensor-parallel: communication not modelled)."""
        if self.devices == 1:
            return self.hardware
        hw = self.hardware
        scale = {k: getattr(hw, k) * self.devices for k in ("device_mem_bw_gbps", "peak_flops")
                 if getattr(hw, k) is not None}
        return replace(hw, name=f"{self.devices} × {hw.name}", memory_bytes=hw.memory_bytes * self.devices, **scale)

    def load_text(self) -> str:
        parts = [f"{self.concurrency} concurrent sequences" if self.concurrency else "as many sequences as fit"]
        if self.latency_ms:
            parts.append(f"each decode step within {self.latency_ms:g} ms")
        return ", ".join(parts)


@dataclass(frozen=True)
class Row:
    """One strategy's prediction for a deployment, and the evidence on its accuracy."""

    strategy: Measured
    bytes_per_element: float
    kv_bytes_per_seq: float
    memory_saved: float
    fits: int
    batch: int
    serves: bool
    tokens_per_s: float
    ms_per_step: float
    decode_bound: str
    ttft_s: float
    ttft_bound: str
    evidence: Evidence | None
    verdict: str

    @property
    def tier(self) -> int:
        return 0 if self.strategy.label == BASELINE else TIERS[self.verdict]

    @property
    def admissible(self) -> bool:
        return self.tier <= ADMISSIBLE


def decode_step(d: Deployment, bpe: float, kept: float, batch: int) -> tuple[float, str]:
    """(seconds, bound) of one decode step of ``batch`` sequences at ``d.context`` tokens."""
    a = d.arch
    nbytes = calc.weight_bytes(a, d.weight_bytes_per_param) + batch * calc.kv_bytes(a, d.context, 1, bpe)
    held = kept * d.context * a.num_layers
    flops = batch * (2 * a.params + attention_flops(a.head_dim, held, a.num_attention_heads))
    return profile_roofline(d.device, nbytes, flops)


def prefill(d: Deployment) -> tuple[float, str]:
    """(seconds, bound) of one sequence's prefill: weights read once, the exact KV written, 2 FLOPs per parameter
    per token plus causal attention (each token attends to those before it: half the square on average)."""
    a = d.arch
    nbytes = calc.weight_bytes(a, d.weight_bytes_per_param) + calc.kv_bytes(a, d.context, 1, 2.0)
    held = a.num_layers * d.context * d.context / 2
    flops = 2 * a.params * d.context + attention_flops(a.head_dim, held, a.num_attention_heads)
    return profile_roofline(d.device, nbytes, flops)


def project(d: Deployment, m: Measured) -> Row:
    """``m``'s prediction for ``d``: sequences that fit, the batch the load runs, its speed and first token."""
    bpe = m.bytes_per_element()
    options = {"weight_bytes_per_param": d.weight_bytes_per_param, "reserve_fraction": d.reserve}
    fits = calc.max_batch(d.arch, d.device, d.context, bpe, **options)
    full_bpe = calc.dtype_bytes(d.hardware.dtype)
    batch = min(d.concurrency, fits) if d.concurrency else fits
    if d.latency_ms and batch:  # the largest batch whose step stays within the target (steps grow with it)
        lo, hi = 0, batch
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if decode_step(d, bpe, m.kept_fraction, mid)[0] * 1000 <= d.latency_ms else (lo, mid - 1)
        batch = lo
    serves = batch >= 1 and (not d.concurrency or batch >= d.concurrency)
    step, bound = decode_step(d, bpe, m.kept_fraction, max(batch, 1))
    first, first_bound = prefill(d)
    evidence = m.evidence.get(d.task)
    return Row(strategy=m, bytes_per_element=bpe, kv_bytes_per_seq=calc.kv_bytes(d.arch, d.context, 1, bpe),
               memory_saved=1 - bpe / full_bpe, fits=fits, batch=batch, serves=serves,
               tokens_per_s=batch / step if batch else 0.0, ms_per_step=1000 * step, decode_bound=bound,
               ttft_s=first, ttft_bound=first_bound, evidence=evidence,
               verdict=EXACT if m.label == BASELINE else evidence.verdict if evidence else NOT_MEASURED)


@dataclass(frozen=True)
class Advice:
    deployment: Deployment
    rows: list[Row]
    recommendation: Row | None
    reason: str
    notes: list[str]
    #: When nothing admissible fits as asked: (the override, its advice) for the smallest change that helps.
    alternatives: list[tuple[str, Advice]] = field(default_factory=list)


def _rank_key(r: Row) -> tuple:
    group = 0 if r.admissible and r.serves else 1 if r.admissible else 2
    return (group, r.tier, -r.tokens_per_s, -r.memory_saved, r.strategy.short)


def _evidence_phrase(r: Row, d: Deployment) -> str:
    if r.strategy.label == BASELINE:
        return "it is the exact cache"
    e = r.evidence
    assert e is not None
    other = "" if _same_model(e.model, d.arch) else f", another model than {d.arch.name}"
    where = "pooled over the tasks" if e.task == OVERALL else f"on {e.task}"
    return (f"its Δ {where} is {e.text()} points ({e.verdict}; {e.model} at {e.contexts} tokens, "
            f"n = {e.n}{other})")


def _same_model(measured: str, arch: calc.ModelArch) -> bool:
    try:
        return calc.resolve_model(measured).name == arch.name
    except KVBenchError:
        return measured == arch.name


def recommend(d: Deployment, rows: list[Row]) -> tuple[Row | None, str]:
    """The first admissible row of the ranking, and why, in one sentence."""
    a, hw = d.arch, d.device
    if not rows or all(r.fits == 0 for r in rows):
        weights = calc.weight_bytes(a, d.weight_bytes_per_param)
        usable = hw.memory_bytes * (1 - d.reserve)
        if weights > usable:
            return None, (f"Nothing fits: {a.name}'s weights alone ({weights / calc.GB:,.1f} GB) exceed the usable "
                          f"{usable / calc.GB:,.1f} GB of {hw.name}{SHARD_OR_QUANTISE}.")
        return None, (f"Nothing fits: not one {d.context:,}-token sequence fits beside {a.name}'s weights on "
                      f"{hw.name} under any measured strategy.")
    ok = [r for r in rows if r.admissible and r.fits]
    if not ok:
        return None, (f"No strategy with acceptable accuracy evidence on {d.task} fits one {d.context:,}-token "
                      "sequence; the ranked table shows what each lacks.")
    best = ok[0] if ok[0].serves else max(ok, key=lambda r: (r.batch, -r.tier, r.tokens_per_s))
    name = best.strategy.short
    if best.serves:
        speed = f"a predicted {best.tokens_per_s:,.0f} tokens/s ({best.decode_bound}-bound)"
        if d.concurrency:
            why = f"it serves the {d.concurrency} sequences at {speed}"
        elif d.latency_ms:
            why = f"{best.batch:,} sequences decode within {d.latency_ms:g} ms a step, {speed}"
        else:
            why = (f"{best.fits:,} sequences fit, decoding {speed} together" if best.fits > 1 else
                   f"one sequence fits, decoding {speed}")
        faster = [r for r in rows if r.serves and r.tokens_per_s > best.tokens_per_s * 1.001]
        caveat = ""
        if faster:
            f = max(faster, key=lambda r: r.tokens_per_s)
            caveat = (f"; the faster {f.strategy.short} ({f.tokens_per_s:,.0f} tokens/s) has the verdict "
                      f"'{f.verdict}'")
        return best, f"Use {name}: {why}, and {_evidence_phrase(best, d)}{caveat}."
    return best, (f"Use {name}, which serves the most of the load — {best.batch} of {d.concurrency} sequences at "
                  f"{best.tokens_per_s:,.0f} tokens/s — with acceptable evidence: {_evidence_phrase(best, d)}; "
                  "the load needs more memory (devices=N) or a strategy not yet shown to keep accuracy.")


def alternatives(d: Deployment, measured: list[Measured], only: list[str] | None = None) -> list[tuple[str, Advice]]:
    """The smallest changes under which :func:`advise` finds an admissible strategy that fits — the fewest devices
    (accelerators only: on a host, more memory means another machine), and separately the least weight quantisation —
    each the first that serves the whole load when one does, as (the ``kvbench advise`` override, its advice)."""
    tries: list[list[tuple[str, Deployment]]] = [[], []]
    if d.hardware.device != "cpu":
        tries[0] = [(f"devices={n}", replace(d, devices=n)) for n in range(d.devices + 1, MAX_DEVICES + 1)]
    tries[1] = [(f"weight_dtype={t}", replace(d, weight_bytes_per_param=calc.dtype_bytes(t)))
                for t in LIGHTER_WEIGHTS if calc.dtype_bytes(t) < d.weight_bytes_per_param]
    out = []
    for options in tries:
        found = [(how, advise(alt, measured, only, explore=False)) for how, alt in options]
        found = [(how, a) for how, a in found if a.recommendation is not None]
        serving = [(how, a) for how, a in found if a.recommendation.serves]
        if serving or found:
            out.append((serving or found)[0])
    # The asked deployment's notes are printed once, above; an alternative keeps only what is its own.
    return [(how, replace(a, notes=[n for n in a.notes if n == WEIGHT_NOTE])) for how, a in out]


def _summary(how: str, a: Advice) -> str:
    """One clause for an alternative: the override, the strategy it would use, how much of the load it serves."""
    r, d = a.recommendation, a.deployment
    assert r is not None
    load = f"{r.batch:,} of {d.concurrency} sequences" if d.concurrency and not r.serves else \
        f"{r.batch:,} sequence{'s' if r.batch != 1 else ''}"
    return f"with {how} use {r.strategy.short} ({load} at a predicted {r.tokens_per_s:,.0f} tokens/s)"


def advise(d: Deployment, measured: Iterable[Measured], only: list[str] | None = None,
           explore: bool = True) -> Advice:
    """Rank every measured strategy for ``d`` and recommend one (see the module docstring). When nothing
    admissible fits and ``explore``, :func:`alternatives` says what would: more devices or lighter weights."""
    measured = list(measured)
    notes = []
    if only:
        known = sorted({m.name for m in measured} | {m.short for m in measured})
        unknown = [s for s in only if s not in known]
        if unknown:
            raise KVBenchError(f"unknown or unmeasured strategy {', '.join(map(repr, unknown))}; valid (measured in "
                               f"the store): {', '.join(known)}")
        measured = [m for m in measured if m.name in only or m.short in only or m.label == BASELINE]
    offloading = sorted(m.short for m in measured if m.family in OFFLOADING_FAMILIES)
    if offloading:
        notes.append(f"left out: {', '.join(offloading)} (offloading moves bytes off the device rather than saving "
                     "them; its cost is the host link, see docs/tiered-cache.md)")
    rows, skipped = [], []
    for m in measured:
        if m.family in OFFLOADING_FAMILIES:
            continue
        try:
            rows.append(project(d, m))
        except KVBenchError:  # bytes measured on a model whose geometry is not known here
            skipped.append(m.short)
    if skipped:
        notes.append(f"left out: {', '.join(sorted(skipped))} (measured on a model whose geometry is unknown here)")
    rows.sort(key=_rank_key)
    limit = d.arch.max_position_embeddings
    if limit and d.context > limit:
        notes.append(f"{d.arch.name} is configured for {limit:,} positions; {d.context:,} tokens needs a "
                     "long-context variant of the same shape (the arithmetic holds for it)")
    if d.weight_bytes_per_param < 2:
        notes.append(WEIGHT_NOTE)
    if any(r.strategy.name == "quant_recompute" for r in rows):
        notes.append("quant_recompute's recomputation is not in its predicted speed (its stored bytes are)")
    best, reason = recommend(d, rows)
    others = alternatives(d, measured, only) if best is None and explore else []
    if others:
        reason = (f"{reason.removesuffix('.').removesuffix(SHARD_OR_QUANTISE)}; "
                  f"{', or '.join(_summary(how, a) for how, a in others)} "
                  f"({'each ' if len(others) > 1 else ''}ranked below).")
    return Advice(d, rows, best, reason, notes, others)


# -- output -----------------------------------------------------------------------------------------------
HEADER = ("rank", "strategy", "fits", "batch", "tokens/s (bound)", "ms/step", "TTFT s (bound)", "KV GB/seq",
          "memory saved", "Δ pp [95% CI]", "verdict", "measured on")


def _cells(i: int, r: Row, d: Deployment) -> list[str]:
    e = r.evidence
    if r.strategy.label == BASELINE:
        delta, verdict, where = "reference", EXACT, "–"
    elif e is None:
        delta, verdict, where = "–", f"never measured on {d.task}", "–"
    else:
        other = "" if _same_model(e.model, d.arch) else " (other model)"
        delta, verdict, where = e.text(), e.verdict, f"{e.model}{other}, {e.contexts} tok, n={e.n}"
    speed = f"{r.tokens_per_s:,.0f} ({r.decode_bound})" if r.batch else "–"
    return [str(i), r.strategy.short, f"{r.fits:,}", f"{r.batch:,}", speed,
            f"{r.ms_per_step:,.1f}" if r.batch else "–", f"{r.ttft_s:,.2f} ({r.ttft_bound})",
            f"{r.kv_bytes_per_seq / calc.GB:,.3f}", f"{100 * r.memory_saved:.1f}%", delta, verdict, where]


def _tflops(flops: float) -> str:
    t = flops / 1e12
    return f"{t:,.0f}" if t >= 100 else f"{t:.3g}"


def render_markdown(a: Advice, title: bool = True) -> str:
    d = a.deployment
    hw = d.device
    lines = [f"# kvbench advise: {d.arch.name} at {d.context:,} tokens on {hw.name}, task {d.task}", ""] if title \
        else []
    lines += [f"Load: {d.load_text()}. Memory: {hw.memory_bytes / calc.GB:,.1f} GB less a {d.reserve:g} reserve, "
              f"weights {calc.weight_bytes(d.arch, d.weight_bytes_per_param) / calc.GB:,.1f} GB at "
              f"{d.weight_bytes_per_param:g} B/param. Roofline over {hw.device_mem_bw_gbps:,g} GB/s and "
              f"{_tflops(hw.peak_flops)} TFLOP/s (the profile's figures: speeds are upper bounds).", "",
              f"**Recommendation.** {a.reason}", "",
              "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_cells(i, r, d)) + " |" for i, r in enumerate(a.rows, 1)]
    lines += ["", *(f"Note: {n}." for n in a.notes)]
    for how, alt in a.alternatives:
        lines += ["", f"## With `{how}`", "", render_markdown(alt, title=False).rstrip()]
    return "\n".join(lines).rstrip() + "\n"


def render_csv(a: Advice) -> str:
    """Every ranked row, the alternatives' after the asked deployment's (``variant``: ``as asked`` or the override)."""
    import pandas as pd

    rows = [*_csv_rows(a, "as asked")]
    for how, alt in a.alternatives:
        rows += _csv_rows(alt, how)
    return pd.DataFrame(rows).to_csv(index=False, float_format="%.6g", lineterminator="\n")


def _csv_rows(a: Advice, variant: str) -> list[dict[str, Any]]:
    d = a.deployment
    rows = []
    for i, r in enumerate(a.rows, 1):
        e = r.evidence
        rows.append({"variant": variant, "rank": i, "strategy": r.strategy.short, "label": r.strategy.label,
                     "model": d.arch.name,
                     "context": d.context, "hardware": d.device.name, "task": d.task, "concurrency": d.concurrency,
                     "latency_ms": d.latency_ms, "weight_bytes_per_param": d.weight_bytes_per_param,
                     "bytes_per_element": r.bytes_per_element,
                     "kv_bytes_per_seq": r.kv_bytes_per_seq, "memory_saved": r.memory_saved, "fits": r.fits,
                     "batch": r.batch, "serves": r.serves, "tokens_per_s": r.tokens_per_s, "ms_per_step": r.ms_per_step,
                     "decode_bound": r.decode_bound, "ttft_s": r.ttft_s, "ttft_bound": r.ttft_bound,
                     "verdict": r.verdict, "delta_pp": e.delta_pp if e else None, "ci_low": e.ci_low if e else None,
                     "ci_high": e.ci_high if e else None, "n": e.n if e else None,
                     "measured_model": e.model if e else None, "measured_contexts": e.contexts if e else None,
                     "evidence_source": e.source if e else None,
                     "recommended": a.recommendation is r})
    return rows


#: The leaderboard's "By hardware profile" columns (:func:`hardware_rows`' keys, in order).
HARDWARE_COLUMNS = ("hardware", "recommendation", "fits (recommended)", "tokens/s (bound)", "why")


def shipped_profiles() -> list[str]:
    """The committed profiles: ``conf/hardware/*.yaml`` without ``probed`` (``kvbench hardware probe``'s
    untracked output), so a page computed from them is the same on every machine."""
    from kvbench.hardware import available_profiles

    return [p for p in available_profiles() if p != "probed"]


def hardware_rows(table: Any, records: Any, tasks: list[str], setting: str, model: str, context: int,
                  profiles: Iterable[str] | None = None) -> list[dict[str, str]]:
    """The leaderboard's "By hardware profile" rows (keys :data:`HARDWARE_COLUMNS`): for its own model at its
    pooled length, what :func:`advise` recommends on each shipped profile from the leaderboard's own table and
    pooled evidence; empty when the model's geometry is not known here."""
    from kvbench.hardware import load_profile

    try:
        arch = calc.resolve_model(model)
    except KVBenchError:
        return []

    def lengths(label: str, scope: str) -> str:
        return f"{context:,}" if scope == OVERALL else task_lengths(records[records["strategy"] == label], scope)

    measured = measured_from_table(table, setting, lengths, "this leaderboard", tasks)
    out = []
    for name in profiles or shipped_profiles():
        a = advise(Deployment(arch=arch, hardware=load_profile(name), context=context, task=OVERALL), measured)
        r = a.recommendation
        cells = (name, r.strategy.short if r else "–", f"{r.fits:,}" if r else "–",
                 f"{r.tokens_per_s:,.0f} ({r.decode_bound})" if r else "–", a.reason)
        out.append(dict(zip(HARDWARE_COLUMNS, cells, strict=True)))
    return out


def hardware_section(*args: Any, **kwargs: Any) -> list[str]:
    """:func:`hardware_rows` as Markdown table lines (none when there are no rows)."""
    rows = hardware_rows(*args, **kwargs)
    if not rows:
        return []
    return ["| " + " | ".join(HARDWARE_COLUMNS) + " |", "|---|---|---:|---:|---|",
            *("| " + " | ".join(r.values()) + " |" for r in rows)]


# -- configuration and command line -----------------------------------------------------------------------
def register() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from kvbench.config import register_configs

    register_configs()
    ConfigStore.instance().store(name="kvbench_advise_schema", node=OmegaConf.structured(AdviseConfig))


def _model_override(overrides: list[str]) -> list[str]:
    """``model=<preset>`` (a :data:`kvbench.calc.PRESETS` geometry that is not a ``model`` group option) becomes
    ``model.name=<preset>`` on the default group entry: advise needs only its geometry."""
    from kvbench.config import group_options

    options = group_options("model")
    out = []
    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and key == "model" and value not in options:
            base = value[: -len("-random")] if value.endswith("-random") else value
            if base.lower() not in calc.PRESETS:
                raise KVBenchError(f"unknown model {value!r}; valid: {', '.join(options)}, "
                                   f"{', '.join(calc.PRESETS)} (or model=local model.path=<checkpoint or config.json>)")
            out.append(f"model.name={value}")
            continue
        out.append(o)
    return out


def compose(overrides: list[str]) -> Any:
    """The composed ``kvbench advise`` config; a bad override is one :class:`KVBenchError` line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from kvbench.config import explain
    from kvbench.paths import conf_dir

    overrides = _model_override(list(overrides))
    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return hydra_compose(config_name=CONFIG_NAME, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise KVBenchError(explain(exc, overrides)) from None
    finally:
        GlobalHydra.instance().clear()


def model_arch(model: Any) -> calc.ModelArch:
    """The asked model's geometry without its weights: ``model.path`` (a config.json or checkpoint directory),
    a :data:`kvbench.calc.PRESETS` name (``-random`` geometries too) or the built-in ``tiny-llama``."""
    path = model.get("path")
    if path:
        return calc.resolve_model(str(path))
    name = str(model.name)
    if name == "local":  # conf/model/local.yaml's path is mandatory (???): say which key is missing
        raise KVBenchError("model=local: model.path must be given (a checkpoint directory or its config.json), "
                           "e.g. model.path=/models/Llama-3.2-1B")
    if name == "tiny-llama":
        from kvbench.models import tiny_llama

        return calc.arch_from_config(tiny_llama().config, name=name, params=calc.count_params(tiny_llama().config))
    return calc.resolve_model(name[: -len("-random")] if name.endswith("-random") else name)


def deployment(cfg: Any) -> Deployment:
    """The :class:`Deployment` a composed config asks about; every bad value is one :class:`KVBenchError` line."""
    from omegaconf.errors import OmegaConfBaseException

    if cfg.setting not in SETTINGS:
        raise KVBenchError(f"unknown setting {cfg.setting!r}; valid: {', '.join(SETTINGS)}")
    for key in ("concurrency", "devices"):
        value = cfg.get(key)
        if value is not None and int(value) < 1:
            raise KVBenchError(f"{key} must be an integer >= 1, got {value}")
    if cfg.latency_ms is not None and not float(cfg.latency_ms) > 0:
        raise KVBenchError(f"latency_ms must be a positive number, got {cfg.latency_ms}")
    calc.check_reserve(float(cfg.reserve))
    try:
        context = int(cfg.task.context_tokens)
    except (OmegaConfBaseException, TypeError, ValueError) as exc:
        raise KVBenchError(f"task.context_tokens: {str(exc).splitlines()[0]}") from None
    calc.check_count("task.context_tokens", context)
    arch = model_arch(cfg.model)
    if arch.params is None:
        raise KVBenchError(f"model {arch.name}: parameter count unknown (transformers cannot build it)")
    return Deployment(arch=arch, hardware=HardwareProfile.from_config(cfg.hardware), context=context,
                      task=str(cfg.task.name), concurrency=None if cfg.concurrency is None else int(cfg.concurrency),
                      latency_ms=None if cfg.latency_ms is None else float(cfg.latency_ms), devices=int(cfg.devices),
                      weight_bytes_per_param=calc.dtype_bytes(str(cfg.weight_dtype)), reserve=float(cfg.reserve))


def run(cfg: Any) -> Advice:
    d = deployment(cfg)
    measured = load_measured(str(cfg.results_root), str(cfg.setting), d.context)
    if not measured:
        raise KVBenchError(f"no committed leaderboard.csv under {cfg.results_root!s} (nor its subdirectories); "
                           "run `kvbench leaderboard` over a store first")
    return advise(d, measured, list(cfg.strategies) if cfg.strategies else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvbench advise", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=llama-3.1-8b task.context_tokens=32768")
    p.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    args = p.parse_args(argv)
    try:
        cfg = compose(args.overrides)
        if args.cfg:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(cfg), end="")
            return 0
        a = run(cfg)
    except KVBenchError as exc:
        print(f"kvbench advise: error: {exc}", file=sys.stderr)
        return 2
    text = render_markdown(a)
    print(text, end="")
    if cfg.out:
        from kvbench.results import atomic_write_text

        out = Path(str(cfg.out))
        atomic_write_text(out / "advise.md", text)
        atomic_write_text(out / "advise.csv", render_csv(a))
        print(f"\nwritten: {out / 'advise.md'}, {out / 'advise.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
