"""The benchmark engine: one full-attention prefill per sample, shared by every strategy in the run.

Per sample:

1. prefill ``prefix_ids`` once with full attention, capturing per-layer K/V and the last-window
   post-RoPE queries (as many as the most demanding strategy asks for);
2. for every strategy (the ``full`` baseline first): build its cache from the capture, then
   (a) teacher-force ``query_ids + gold_ids`` for KL / top-1 agreement / gold NLL against the
   baseline, and (b) rebuild the cache and greedy-decode the answer for the task metric and latency.

Both passes start from an identically compressed cache, so the fidelity and accuracy numbers describe
the same cache state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbench import SPEC_VERSION
from kvbench.baselines import load_baseline as _load_baseline
from kvbench.baselines import save_baseline as _save_baseline
from kvbench.cache import KVBenchCache
from kvbench.capture import QueryRecorder
from kvbench.errors import KVBenchError
from kvbench.models import LoadedModel
from kvbench.spec import PeakMemory, Timer, fidelity, median, memory_reduction
from kvbench.tasks.base import Sample
from kvbench.tasks.metrics import score as task_score
from strategies.base import LayerCapture, RunContext, Strategy


@dataclass
class Prefill:
    """A captured full-attention prefill: per-layer K/V and queries, shared read-only by all strategies."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    captures: list[LayerCapture]
    seconds: float
    peak_bytes: int


@dataclass
class StrategyResult:
    record: dict[str, Any]
    logp: torch.Tensor  # teacher-forced log-probs over gold positions, [positions, vocab]


@dataclass
class Engine:
    lm: LoadedModel
    device: str = "cpu"
    hardware: Any = None
    run_fields: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> torch.nn.Module:
        return self.lm.model

    # -- phase 1: the shared prefill --------------------------------------------------------------
    def prefill(self, sample: Sample, query_window: int | None) -> Prefill:
        ids = torch.tensor([sample.prefix_ids], device=self.device)
        capture_cache = KVBenchCache(_full(), self.model.config)
        with torch.inference_mode(), QueryRecorder(self.model, query_window) as rec, \
                PeakMemory(self.device) as peak, Timer(self.device) as timer:
            self.model(input_ids=ids, cache=capture_cache, use_cache=True, logits_to_keep=1)
        keys = [layer.store.keys for layer in capture_cache.layers]
        values = [layer.store.values for layer in capture_cache.layers]
        return Prefill(keys, values, rec.captures, timer.seconds, peak.peak_bytes)

    def warmup(self, n_tokens: int = 64) -> None:
        """One short forward so first-call allocation and kernel selection stay out of the timings."""
        ids = torch.arange(1, n_tokens + 1, device=self.device)[None] % 200 + 1
        with torch.inference_mode():
            cache = KVBenchCache(_full(), self.model.config)
            self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            self.model(input_ids=ids[:, :1], cache=cache, use_cache=True)

    # -- phase 2: one strategy on one captured prefill ----------------------------------------
    def _cache(self, strategy: Strategy, pre: Prefill) -> tuple[KVBenchCache, float]:
        with Timer(self.device) as t:
            cache = KVBenchCache.from_capture(strategy, self.model.config, pre.keys, pre.values, pre.captures)
        return cache, t.seconds

    def chunked_prefill(self, strategy: Strategy, prefix: torch.Tensor,
                        chunk_tokens: int) -> tuple[KVBenchCache, float, int]:
        """Prefill in chunks straight into the strategy's cache, compacting after each chunk, so the cache
        never holds more than its budget plus one chunk (and quantized chunks are stored quantized at once).
        """
        cache = KVBenchCache(strategy, self.model.config)
        with torch.inference_mode(), cache.attach(self.model), PeakMemory(self.device) as peak, \
                Timer(self.device) as timer:
            for start in range(0, prefix.shape[1], chunk_tokens):
                self.model(input_ids=prefix[:, start:start + chunk_tokens], cache=cache, use_cache=True,
                           logits_to_keep=1)
                for layer in cache.layers:
                    layer.store.compact()
        return cache, timer.seconds, peak.peak_bytes

    def evaluate(self, strategy: Strategy, sample: Sample, pre: Prefill | None,
                 baseline_logp: torch.Tensor | None, chunk_tokens: int = 0) -> StrategyResult:
        """Score one strategy on one sample: from the shared capture ``pre``, or, when ``pre`` is None, from
        its own chunked prefill of ``chunk_tokens`` per chunk."""
        model = self.model
        prefix = torch.tensor([sample.prefix_ids], device=self.device)
        strategy.bind(RunContext(model=model, hardware=self.hardware, prefix_ids=prefix, device=self.device))
        query = torch.tensor(sample.query_ids, device=self.device)
        gold = torch.tensor(sample.gold_ids, device=self.device)

        if pre is not None:
            prefill_s, prefill_peak = pre.seconds, pre.peak_bytes

            def make_cache() -> tuple[KVBenchCache, float]:
                return self._cache(strategy, pre)
        else:
            built, prefill_s, prefill_peak = self.chunked_prefill(strategy, prefix, chunk_tokens)
            # Compression happened inside the chunked prefill; pass (a) gets a copy, pass (b) the original.
            copies = [copy.deepcopy(built), built]

            def make_cache() -> tuple[KVBenchCache, float]:
                return copies.pop(0), 0.0

        with torch.inference_mode():
            # (a) teacher forcing over the gold answer
            cache, compress_s = make_cache()
            kv_bytes, kv_fp16 = cache.kv_bytes(), cache.kv_bytes_fp16()
            held = cache.held_tokens()
            stats = cache.stats()
            forced = torch.cat([query, gold[:-1]])[None]
            with _attached(cache, model, strategy):
                logits = model(input_ids=forced, cache=cache, use_cache=True,
                               logits_to_keep=len(sample.gold_ids)).logits[0]
            logp = torch.log_softmax(logits.float(), dim=-1)
            del cache, logits
            fid = fidelity(baseline_logp if baseline_logp is not None else logp, logp, gold)

            # (b) greedy decoding for the task metric and latency
            prediction, gen = "", _Generation()
            if sample.metric != "token_accuracy":
                cache, _ = make_cache()
                with _attached(cache, model, strategy), PeakMemory(self.device) as peak:
                    gen = self._greedy(cache, query, sample.max_new_tokens)
                gen.peak_bytes = peak.peak_bytes
                prediction = self.lm.tokenizer.decode(gen.tokens, skip_special_tokens=True)
                # Figures the store only knows after decoding (measured transfers, recomputes) win.
                stats = {**stats, **cache.stats()}
                del cache
        value = fid.gold_token_accuracy if sample.metric == "token_accuracy" else \
            task_score(sample.metric, prediction, sample.answers)
        held_mean = sum(held) / len(held)
        record = {
            **self.run_fields,
            "spec_version": SPEC_VERSION,
            "sample_id": sample.sample_id,
            "strategy": strategy.label(),
            "strategy_name": strategy.name,
            "family": strategy.family,
            "params": strategy.params(),
            "metric": sample.metric,
            "score": float(value),
            "prediction": prediction,
            "answers": list(sample.answers),
            "context_tokens": sample.context_tokens,
            "query_tokens": len(sample.query_ids),
            "gold_tokens": len(sample.gold_ids),
            "sample_meta": sample.metadata,
            "kv_bytes": int(kv_bytes),
            "kv_bytes_fp16": int(kv_fp16),
            "memory_reduction": memory_reduction(kv_bytes, kv_fp16),
            "bytes_per_token": kv_bytes / sample.context_tokens,
            "held_tokens_mean": held_mean,
            "kept_fraction": held_mean / sample.context_tokens,
            "prefill_mode": "shared" if pre is not None else f"chunked:{chunk_tokens}",
            "prefill_s": prefill_s,
            "compress_s": compress_s,
            "query_s": gen.first_s,
            "ttft_s": prefill_s + compress_s + gen.first_s,
            "decode_ms_per_token": 1000 * median(gen.step_s),
            "decode_steps": len(gen.step_s),
            "generated_tokens": len(gen.tokens),
            "kl": fid.kl,
            "top1_agreement": fid.top1_agreement,
            "gold_nll": fid.gold_nll,
            "gold_token_accuracy": fid.gold_token_accuracy,
            "peak_bytes_prefill": prefill_peak,
            "peak_bytes_decode": gen.peak_bytes,
            "stats": stats,
        }
        return StrategyResult(record, logp)

    def _greedy(self, cache: KVBenchCache, query: torch.Tensor, max_new_tokens: int) -> _Generation:
        model = self.model
        eos = _eos_ids(self.lm)
        gen = _Generation()
        with Timer(self.device) as t:
            logits = model(input_ids=query[None], cache=cache, use_cache=True, logits_to_keep=1).logits
        gen.first_s = t.seconds
        tok = int(logits[0, -1].argmax())
        gen.tokens.append(tok)
        while len(gen.tokens) < max_new_tokens and tok not in eos:
            with Timer(self.device) as t:
                step = torch.tensor([[tok]], device=self.device)
                logits = model(input_ids=step, cache=cache, use_cache=True).logits
                tok = int(logits[0, -1].argmax())
            gen.step_s.append(t.seconds)
            gen.tokens.append(tok)
        return gen


@dataclass
class _Generation:
    tokens: list[int] = field(default_factory=list)
    first_s: float = float("nan")
    step_s: list[float] = field(default_factory=list)
    peak_bytes: int = 0


class _attached:
    """``cache.attach(model)`` for strategies that read queries during decoding; a no-op otherwise."""

    def __init__(self, cache: KVBenchCache, model: torch.nn.Module, strategy: Strategy) -> None:
        self.ctx = cache.attach(model) if strategy.query_window != 0 else None

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _full() -> Strategy:
    from strategies.full import Full

    return Full()


def _eos_ids(lm: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(lm.tokenizer, "eos_token_id", None), getattr(lm.model.generation_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids


def query_window_for(strategies: list[Strategy]) -> int | None:
    """The widest query window any strategy needs (``None`` = all prefix queries)."""
    windows = [s.query_window for s in strategies]
    if any(w is None for w in windows):
        return None
    return max(windows, default=0)


def check_lengths(sample: Sample, max_context: int) -> None:
    total = sample.context_tokens + len(sample.query_ids) + max(len(sample.gold_ids), sample.max_new_tokens)
    if max_context and total > max_context:
        raise KVBenchError(
            f"sample {sample.sample_id} needs {total} tokens (context {sample.context_tokens} + question + answer) "
            f"but the model's maximum context is {max_context}; lower task.context_tokens")


ProgressFn = Callable[[str], None]


def run_samples(engine: Engine, samples: list[Sample], strategies: list[Strategy],
                done: set[str], write: Callable[[list[dict[str, Any]]], None],
                baseline_dir: Path | None = None, baseline_key: Callable[[Sample], str] | None = None,
                progress: Callable[[], None] | None = None, chunk_tokens: int = 0) -> None:
    """Evaluate every not-yet-done sample; each sample's records are written together.

    ``chunk_tokens > 0`` selects chunked prefill: no shared capture, each strategy prefills into its own
    cache chunk by chunk (lower peak memory, but later chunks attend to already-compressed earlier ones).
    """
    window = query_window_for(strategies)
    baseline, others = strategies[0], strategies[1:]
    for sample in samples:
        if sample.sample_id in done:
            if progress:
                progress()
            continue
        pre = None if chunk_tokens else engine.prefill(sample, window)
        base = _load_baseline(baseline_dir, baseline_key, sample) if baseline_dir and baseline_key else None
        if base is None:
            base = engine.evaluate(baseline, sample, pre, None, chunk_tokens)
            if baseline_dir and baseline_key:
                _save_baseline(baseline_dir, baseline_key(sample), base)
        else:
            base.record.update({k: v for k, v in engine.run_fields.items()})
        results = [base] + [engine.evaluate(s, sample, pre, base.logp, chunk_tokens) for s in others]
        write([r.record for r in results])
        del pre
        if progress:
            progress()
