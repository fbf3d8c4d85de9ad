"""The benchmark engine: one full-attention prefill per batch of samples, shared by every strategy in the run.

Per batch of ``batch_size`` samples (same context length, so the prefill needs no padding):

1. prefill the prefixes together with full attention, capturing per-layer K/V and the last-window
   post-RoPE queries (as many as the most demanding strategy asks for);
2. for every strategy (the ``full`` baseline first): build each sample's cache from its row of the capture,
   then (a) teacher-force the gold answer for KL / top-1 agreement / gold NLL against the baseline, and
   (b) rebuild the caches and greedy-decode the answers for the task metric and latency.

Each sample keeps its own batch-1 stores (:class:`~kvbench.cache.RowsCache`); only the model's forwards are
batched, with left padding and per-row masks for ragged question and answer lengths. So records equal
those of batch 1 (greedy tokens equal, log-probs within the dtype's matmul tolerance); ``batch_size`` says
which batch a record was measured in, and its latencies and peak memory are the batch's.

Teacher forcing (a) feeds ``query + gold[:-1]`` in one forward, except for strategies that change the
cache while decoding (eviction after every step: h2o, tova, streaming_llm, knorm/random with
``decode_evict``, and ``compose`` over them): those get the question in one forward and then the gold
tokens one per step, exactly as greedy decoding feeds its own tokens, so the fidelity metrics see the
evictions decoding makes.

Which samples are prefilled together, the baseline-first order and resuming are the sample loop's
(:mod:`kvbench.loop`). This module stays one (~570 lines) because its parts are the phases of one
measurement on shared state (the prefill, the cache copies, the passes, the record), read in that order.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench import SPEC_VERSION
from kvbench.cache import KVBenchCache, RowsCache
from kvbench.capture import QueryRecorder
from kvbench.errors import KVBenchError
from kvbench.models import LoadedModel
from kvbench.record import Record, StrategyResult
from kvbench.spec import PeakMemory, Timer, fidelity, median, memory_reduction
from kvbench.strategies.base import LayerCapture, RunContext, Strategy
from kvbench.tasks.base import Sample
from kvbench.tasks.metrics import normalize
from kvbench.tasks.metrics import score as task_score
from kvbench.workingset import WorkingSet


@dataclass
class PrefillRow:
    """One sample's share of a batched prefill: per-layer K/V ``[1, kv_heads, T, head_dim]`` and queries."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    captures: list[LayerCapture]
    #: A hybrid's recurrent layers after the prefill (transformers' ``LinearAttentionLayer``), by layer index;
    #: their ``keys``/``values`` entries are ``None``.
    states: dict[int, Any] = field(default_factory=dict)


@dataclass
class Prefill:
    """A captured full-attention prefill of one or more samples, shared read-only by all strategies."""

    rows: list[PrefillRow]
    seconds: float
    peak_bytes: int

    # Batch-1 views, for callers that built single-sample prefills.
    @property
    def keys(self) -> list[torch.Tensor]:
        return self.rows[0].keys

    @property
    def values(self) -> list[torch.Tensor]:
        return self.rows[0].values

    @property
    def captures(self) -> list[LayerCapture]:
        return self.rows[0].captures

    @property
    def states(self) -> dict[int, Any]:
        return self.rows[0].states


@dataclass
class Engine:
    lm: LoadedModel
    device: str = "cpu"
    hardware: Any = None
    run_fields: dict[str, Any] = field(default_factory=dict)
    #: Let quantized stores keep a dequantized working copy of their immutable prefix (``engine.working_copy``).
    working_copy: bool = True
    #: ``engine.attention``: ``auto`` (kvbench's short-query attention on CPU, SDPA elsewhere), ``sdpa`` or
    #: ``kvbench`` (:mod:`kvbench.attention`); the model is switched to it when the engine is made.
    attention: str = "auto"
    #: ``engine.linear``: ``auto``, ``native`` or ``float32`` (:mod:`kvbench.linear`); the resolved choice.
    linear: str = "auto"
    #: Measure each decode's working set on its first decode step (:mod:`kvbench.workingset`; the record's
    #: ``working_set_bytes``). That step is then not timed.
    measure_working_set: bool = True

    def __post_init__(self) -> None:
        from kvbench import attention, linear

        if hasattr(self.model, "set_attn_implementation"):
            self.attention = attention.use(self.model, self.attention, self.device)
        self.linear = linear.use(self.model, self.linear, self.device)

    @property
    def model(self) -> torch.nn.Module:
        return self.lm.model

    # -- phase 1: the shared prefill --------------------------------------------------------------
    def prefill(self, samples: Sample | list[Sample], query_window: int | None) -> Prefill:
        batch = [samples] if isinstance(samples, Sample) else list(samples)
        if len({len(s.prefix_ids) for s in batch}) != 1:
            raise KVBenchError("a batched prefill needs samples of one context length; got "
                               f"{sorted({len(s.prefix_ids) for s in batch})}")
        return self.capture(torch.tensor([s.prefix_ids for s in batch], device=self.device), query_window)

    def capture(self, ids: torch.Tensor, query_window: int | None) -> Prefill:
        """Full-attention prefill of the token rows ``ids`` ``[batch, T]``, capturing K/V and the last
        ``query_window`` queries per layer (``None``: all of them)."""
        batch = ids.shape[0]
        capture_cache = KVBenchCache(_full(), self.model.config, windows=False)  # every token, every layer
        with torch.inference_mode(), QueryRecorder(self.model, query_window) as rec, \
                PeakMemory(self.device) as peak, Timer(self.device) as timer:
            self.model(input_ids=ids, cache=capture_cache, use_cache=True, logits_to_keep=1)
        keys = [getattr(getattr(layer, "store", None), "keys", None) for layer in capture_cache.layers]
        values = [getattr(getattr(layer, "store", None), "values", None) for layer in capture_cache.layers]
        states = {i: layer for i, layer in enumerate(capture_cache.layers) if layer not in capture_cache.kv_layers}
        if batch == 1:
            return Prefill([PrefillRow(keys, values, rec.captures, states)], timer.seconds, peak.peak_bytes)
        if states:
            raise KVBenchError("engine.batch_size > 1 is not supported for hybrid models (their recurrent layers "
                               "hold one state per batch row); use engine.batch_size=1")
        # Each row gets storage of its own, so a store holding it (``full``) counts one sample's bytes.
        rows = [PrefillRow([k[r:r + 1].clone() for k in keys], [v[r:r + 1].clone() for v in values],
                           [_capture_row(c, r) for c in rec.captures]) for r in range(batch)]
        return Prefill(rows, timer.seconds, peak.peak_bytes)

    def warmup(self, n_tokens: int = 64) -> None:
        """One short forward so first-call allocation and kernel selection stay out of the timings."""
        ids = torch.arange(1, n_tokens + 1, device=self.device)[None] % 200 + 1
        with torch.inference_mode():
            cache = KVBenchCache(_full(), self.model.config)
            self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            self.model(input_ids=ids[:, :1], cache=cache, use_cache=True)

    # -- phase 2: one strategy on captured prefills ---------------------------------------------
    def bind(self, strategy: Strategy, prefix_ids: Sequence[int]) -> None:
        """Bind ``strategy`` to this run for one prefix: stores read their prefix ids when they are built."""
        prefix = torch.tensor([list(prefix_ids)], device=self.device, dtype=torch.long)
        strategy.bind(RunContext(model=self.model, hardware=self.hardware, prefix_ids=prefix, device=self.device,
                                 working_copy=self.working_copy))

    def _cache(self, strategy: Strategy, row: PrefillRow, tokens: int | None = None) -> tuple[KVBenchCache, float]:
        """The strategy's cache built from a captured prefill; ``tokens``: the most the sample's cache will see
        (:attr:`Sample.total_tokens`), so a window at least that long is compressed like a global layer."""
        with Timer(self.device) as t:
            cache = KVBenchCache.from_capture(strategy, self.model.config, row.keys, row.values, row.captures,
                                              row.states, tokens=tokens)
        return cache, t.seconds

    def chunked_prefill(self, strategy: Strategy, prefix: torch.Tensor,
                        chunk_tokens: int, tokens: int | None = None) -> tuple[KVBenchCache, float, int]:
        """Prefill in chunks straight into the strategy's cache, compacting after each chunk, so the cache
        never holds more than its budget plus one chunk (and quantized chunks are stored quantized at once).
        """
        cache = KVBenchCache(strategy, self.model.config, tokens=tokens)
        with torch.inference_mode(), cache.attach(self.model), PeakMemory(self.device) as peak, \
                Timer(self.device) as timer:
            for start in range(0, prefix.shape[1], chunk_tokens):
                self.model(input_ids=prefix[:, start:start + chunk_tokens], cache=cache, use_cache=True,
                           logits_to_keep=1)
                for layer in cache.kv_layers:
                    layer.store.compact()
        return cache, timer.seconds, peak.peak_bytes

    def evaluate(self, strategy: Strategy, sample: Sample, pre: Prefill | None,
                 baseline_logp: torch.Tensor | None, chunk_tokens: int = 0) -> StrategyResult:
        """Score one strategy on one sample: from the shared capture ``pre``, or, when ``pre`` is None, from
        its own chunked prefill of ``chunk_tokens`` per chunk."""
        return self.evaluate_batch(strategy, [sample], pre, [baseline_logp], chunk_tokens)[0]

    def evaluate_batch(self, strategy: Strategy, samples: list[Sample], pre: Prefill | None,
                       baseline_logps: list[torch.Tensor | None], chunk_tokens: int = 0,
                       rows: list[int] | None = None) -> list[StrategyResult]:
        """Score one strategy on ``samples`` together; ``rows`` picks their rows of ``pre`` (default: all)."""
        rows = list(range(len(samples))) if rows is None else rows
        if pre is None and len(samples) != 1:
            raise KVBenchError("chunked prefill evaluates one sample at a time; use engine.batch_size=1")
        compress_s = [0.0] * len(samples)

        if pre is not None:
            prefill_s, prefill_peak = pre.seconds, pre.peak_bytes

            def build() -> list[KVBenchCache]:
                out = []
                for i, (sample, r) in enumerate(zip(samples, rows, strict=True)):
                    self.bind(strategy, sample.prefix_ids)  # per sample: stores read their own prefix ids at build
                    cache, compress_s[i] = self._cache(strategy, pre.rows[r], sample.total_tokens)
                    out.append(cache)
                return out

            # Compress once: pass (a) gets copies, pass (b) the originals — unless a store cannot be copied
            # (can_clone), then each pass builds its own, as both passes must start from the compressed cache.
            built: list[KVBenchCache] = []

            def make_caches() -> list[KVBenchCache]:
                if built:
                    return [built.pop(0) for _ in range(len(built))]
                fresh = build()
                copies = [try_clone(strategy, c, self.model) for c in fresh]
                if any(c is None for c in copies):
                    return fresh
                built.extend(fresh)
                return copies  # type: ignore[return-value]
        else:
            self.bind(strategy, samples[0].prefix_ids)
            prefix = torch.tensor([samples[0].prefix_ids], device=self.device)
            built, prefill_s, prefill_peak = self.chunked_prefill(strategy, prefix, chunk_tokens,
                                                                  samples[0].total_tokens)
            # Compression happened inside the chunked prefill; pass (a) gets a copy, pass (b) the original.
            copies = [clone_cache(built, self.model), built]

            def make_caches() -> list[KVBenchCache]:
                return [copies.pop(0)]

        mode = "shared" if pre is not None else f"chunked:{chunk_tokens}"
        return self._score(strategy, samples, make_caches, compress_s, prefill_s, prefill_peak, mode,
                           baseline_logps)

    def evaluate_context(self, strategy: Strategy, questions: list[Sample], pre: Prefill,
                         baseline_logps: list[torch.Tensor | None]) -> list[StrategyResult]:
        """Score one strategy on questions that share one context (equal ``prefix_ids``, row 0 of ``pre``).

        The strategy compresses the context once; each question is then answered (teacher forcing and greedy
        decoding alike) from its own copy of that compressed cache, so no question sees another's tokens and
        the records equal those of one single-question run per question (a test checks it)."""
        prefix = questions[0].prefix_ids
        if any(q.prefix_ids != prefix for q in questions):
            raise KVBenchError("questions of one context must share their prefix_ids")
        self.bind(strategy, prefix)
        tokens = max(q.total_tokens for q in questions)
        built, seconds = self._cache(strategy, pre.rows[0], tokens)
        first = try_clone(strategy, built, self.model)
        if first is not None:
            spare = [first]  # the trial copy serves the first pass

            def copies() -> list[KVBenchCache]:
                return [spare.pop() if spare else clone_cache(built, self.model)]
        else:
            # Stores that hold more than tensors (files, cross-layer links, backend tensor subclasses): each
            # pass gets the cache rebuilt from the capture instead, equal by construction.
            def copies() -> list[KVBenchCache]:
                return [self._cache(strategy, pre.rows[0], tokens)[0]]

        results = []
        for question, base in zip(questions, baseline_logps, strict=True):
            results += self._score(strategy, [question], copies, [seconds], pre.seconds, pre.peak_bytes, "shared",
                                   [base])
        return results

    def _score(self, strategy: Strategy, samples: list[Sample], make_caches: Callable[[], list[KVBenchCache]],
               compress_s: list[float], prefill_s: float, prefill_peak: int, prefill_mode: str,
               baseline_logps: list[torch.Tensor | None]) -> list[StrategyResult]:
        """Measure, teacher-force and decode ``samples`` on caches from ``make_caches`` (called once per pass)."""
        queries = [list(s.query_ids) for s in samples]
        golds = [list(s.gold_ids) for s in samples]
        with torch.inference_mode():
            # (a) teacher forcing over the gold answers
            caches = make_caches()
            kv_bytes = [c.kv_bytes() for c in caches]
            kv_fp16 = [c.kv_bytes_fp16() for c in caches]
            kv_dense = [c.kv_bytes_dense() for c in caches]
            held = [c.held_tokens() for c in caches]
            stats = [c.stats() for c in caches]
            logps = self._teacher_force(_batched(caches), strategy, queries, golds)
            del caches
            fids = [fidelity(b if b is not None else lp, lp, torch.tensor(g, device=lp.device))
                    for b, lp, g in zip(baseline_logps, logps, golds, strict=True)]

            # (b) greedy decoding for the task metric and latency
            decode = [i for i, s in enumerate(samples) if s.metric != "token_accuracy"]
            gens = [_Generation() for _ in samples]
            scratch = [0] * len(samples)
            if decode:
                caches = make_caches()
                sub = [caches[i] for i in decode]
                cache = _batched(sub)
                with attached(cache, self.model, strategy), PeakMemory(self.device) as peak:
                    stops = [self._stop_for(samples[i]) for i in decode]
                    out = self.greedy(cache, [queries[i] for i in decode],
                                      [samples[i].max_new_tokens for i in decode], stop=stops)
                for i, g, c in zip(decode, out, sub, strict=True):
                    g.peak_bytes = peak.peak_bytes
                    gens[i] = g
                    scratch[i] = c.scratch_bytes()
                    # Figures the store only knows after decoding (measured transfers, recomputes) win.
                    stats[i] = {**stats[i], **c.stats()}
                del caches, sub, cache

        batch_scratch = sum(scratch)
        results = []
        for i, sample in enumerate(samples):
            gen, fid = gens[i], fids[i]
            prediction = "" if sample.metric == "token_accuracy" else \
                self.lm.tokenizer.decode(gen.tokens, skip_special_tokens=True)
            value = fid.gold_token_accuracy if sample.metric == "token_accuracy" else \
                task_score(sample.metric, prediction, sample.answers)
            held_mean = sum(held[i]) / len(held[i])
            record = Record(
                run=self.run_fields,
                spec_version=SPEC_VERSION,
                sample_id=sample.sample_id,
                context_id=context_of(sample),
                document_id=document_of(sample),
                strategy=strategy.label(),
                strategy_name=strategy.name,
                family=strategy.family,
                params=strategy.params(),
                metric=sample.metric,
                score=float(value),
                prediction=prediction,
                answers=list(sample.answers),
                context_tokens=sample.context_tokens,
                query_tokens=len(sample.query_ids),
                gold_tokens=len(sample.gold_ids),
                sample_meta=sample.metadata,
                kv_bytes=int(kv_bytes[i]),
                kv_bytes_fp16=int(kv_fp16[i]),
                memory_reduction=memory_reduction(kv_bytes[i], kv_dense[i]),
                bytes_per_token=kv_bytes[i] / sample.context_tokens,
                held_tokens_mean=held_mean,
                kept_fraction=held_mean / sample.context_tokens,
                prefill_mode=prefill_mode,
                batch_size=len(samples),
                prefill_s=prefill_s,
                compress_s=compress_s[i],
                query_s=gen.first_s,
                ttft_s=prefill_s + compress_s[i] + gen.first_s,
                decode_ms_per_token=1000 * median(gen.step_s),
                decode_steps=len(gen.step_s),
                generated_tokens=len(gen.tokens),
                kl=fid.kl,
                top1_agreement=fid.top1_agreement,
                gold_nll=fid.gold_nll,
                gold_token_accuracy=fid.gold_token_accuracy,
                peak_bytes_prefill=prefill_peak,
                peak_bytes_decode=gen.peak_bytes,
                scratch_bytes=int(scratch[i]),
                working_set_bytes=int(gen.working_set_bytes),
                # the decode peak is the whole batch's, so every decoded row's working copy comes off it
                peak_bytes_decode_excl_scratch=max(0, gen.peak_bytes - (batch_scratch if gen.tokens else 0)),
                stats=stats[i],
                kv_bytes_dense=int(kv_dense[i]),
                memory_reduction_fp16=memory_reduction(kv_bytes[i], kv_fp16[i]),
            )
            results.append(StrategyResult(record.to_dict(), logps[i]))
        return results

    # -- forwards over one cache or several rows --------------------------------------------------
    def forward(self, cache: KVBenchCache | RowsCache, tokens: list[list[int]], keep: int) -> torch.Tensor:
        """Logits ``[rows, keep, vocab]`` after feeding row ``i`` its ``tokens[i]``; rows are right-aligned
        (the last ``min(keep, len(tokens[i]))`` positions of row ``i`` are its own)."""
        model = self.model
        if not isinstance(cache, RowsCache):
            ids = torch.tensor(tokens, device=self.device)
            return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=keep).logits
        width = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), width, dtype=torch.long)
        pos = torch.zeros(len(tokens), width, dtype=torch.long)
        for i, (r, t) in enumerate(zip(cache.active, tokens, strict=True)):
            ids[i, width - len(t):] = torch.tensor(t)
            start = cache.seen(r)  # logical positions: evicted tokens still count, as at batch 1
            pos[i] = torch.arange(start + len(t) - width, start + len(t)).clamp(min=start)
        cache.lengths = [len(t) for t in tokens]
        with cache.masks(model):
            return model(input_ids=ids.to(self.device), position_ids=pos.to(self.device), cache=cache,
                         use_cache=True, logits_to_keep=keep).logits

    def _teacher_force(self, cache: KVBenchCache | RowsCache, strategy: Strategy, queries: list[list[int]],
                       golds: list[list[int]]) -> list[torch.Tensor]:
        """Log-probs ``[len(gold), vocab]`` per row of each gold token given the question and earlier gold."""
        model = self.model
        with attached(cache, model, strategy):
            if not changes_cache_while_decoding(strategy):
                keep = max(len(g) for g in golds)
                logits = self.forward(cache, [q + g[:-1] for q, g in zip(queries, golds, strict=True)], keep)
                return [torch.log_softmax(logits[i, keep - len(g):].float(), dim=-1) for i, g in enumerate(golds)]
            # Question in one forward, then one gold token per step: the cache evicts as it does when decoding.
            steps: list[list[torch.Tensor]] = [[] for _ in golds]
            logits = self.forward(cache, queries, 1)
            for i in range(len(golds)):
                steps[i].append(logits[i, -1])
            rows = list(range(len(golds)))
            for k in range(max(len(g) for g in golds) - 1):
                rows = [i for i in rows if k < len(golds[i]) - 1]
                _activate(cache, rows)
                logits = self.forward(cache, [[golds[i][k]] for i in rows], 1)
                for j, i in enumerate(rows):
                    steps[i].append(logits[j, -1])
            return [torch.log_softmax(torch.stack(s).float(), dim=-1) for s in steps]

    def greedy(self, cache: KVBenchCache | RowsCache, queries: list[list[int]] | torch.Tensor,
               max_new_tokens: list[int] | int,
               stop: StopFn | list[StopFn | None] | None = None) -> list[_Generation] | _Generation:
        """Greedy decoding of every row until its EOS (kept, as transformers' ``generate`` keeps it), its
        ``max_new_tokens``, or ``stop(tokens so far)`` (one function for every row, or one per row, None for
        none); finished rows leave the batch. The caller holds
        ``torch.inference_mode()`` and :class:`attached`.

        A single query tensor and an int limit (the batch-1 API) return one :class:`_Generation`."""
        single = isinstance(queries, torch.Tensor)
        if single:
            queries, max_new_tokens = [queries.tolist()], [int(max_new_tokens)]  # type: ignore[arg-type]
        eos = eos_ids(self.lm)
        gens = [_Generation() for _ in queries]
        stops = list(stop) if isinstance(stop, list) else [stop] * len(gens)
        with Timer(self.device) as t:
            logits = self.forward(cache, queries, 1)  # type: ignore[arg-type]
        toks = [int(x) for x in logits[:, -1].argmax(-1)]
        for g, tok in zip(gens, toks, strict=True):
            g.first_s = t.seconds
            g.tokens.append(tok)
        rows = list(range(len(gens)))
        measured = not self.measure_working_set
        while True:
            rows = [i for i in rows if len(gens[i].tokens) < max_new_tokens[i] and gens[i].tokens[-1] not in eos
                    and not (stops[i] and stops[i](gens[i].tokens))]
            if not rows:
                break
            _activate(cache, rows)
            if not measured:
                # The first decode step measures the working set (kvbench.workingset); its allocation tracking
                # slows it, so it is not among the timed steps.
                with WorkingSet(self.model, cache, self.device) as ws:
                    logits = self.forward(cache, [[gens[i].tokens[-1]] for i in rows], 1)
                    toks = [int(x) for x in logits[:, -1].argmax(-1)]
                measured = True
                for i in rows:
                    gens[i].working_set_bytes = ws.bytes
            else:
                with Timer(self.device) as t:
                    logits = self.forward(cache, [[gens[i].tokens[-1]] for i in rows], 1)
                    toks = [int(x) for x in logits[:, -1].argmax(-1)]
                for i in rows:
                    gens[i].step_s.append(t.seconds)
            for i, tok in zip(rows, toks, strict=True):
                gens[i].tokens.append(tok)
        return gens[0] if single else gens


    def _stop_for(self, sample: Sample) -> StopFn | None:
        """When greedy decoding of ``sample`` may end before ``max_new_tokens`` without changing its score.

        ``substring``: once a gold answer occurs in the reply up to its last whitespace. Normalisation works
        within whitespace-separated words (numbers, punctuation and articles never join across a space), so
        whatever follows cannot undo that match: the score is already 1 and final. Wrong replies are never
        cut this way. ``stop_at_newline`` (one-line answers) also ends at the first line's end: what a model
        writes after a one-line answer cannot be the answer (on every committed v1.1 record, no prediction's
        score changes when cut there)."""
        # A tokenizer that cleans up spaces on decode (" ," -> ",") could join later text onto a finished word.
        settle = sample.metric == "substring" and not getattr(self.lm.tokenizer, "clean_up_tokenization_spaces", False)
        if not settle and not sample.stop_at_newline:
            return None
        answers = [f" {a} " for a in (normalize(x) for x in sample.answers) if a]

        def stop(tokens: list[int]) -> bool:
            text = self.lm.tokenizer.decode(tokens, skip_special_tokens=True)
            if sample.stop_at_newline and "\n" in text.lstrip():
                return True
            if not settle:
                return False
            done = text[:max((i for i, c in enumerate(text) if c.isspace()), default=0)]
            return any(a in f" {normalize(done)} " for a in answers)

        return stop


StopFn = Callable[[list[int]], bool]


def context_of(sample: Sample) -> str:
    """The sample's context id: questions that share a prefill share it; otherwise the sample's own id."""
    return str(sample.metadata.get("context_id") or sample.sample_id)


def document_of(sample: Sample) -> str:
    """The document a sample's context comes from, the unit intervals cluster on: the whole work (a part cut
    from a long article or play counts as its work, ``work_id``), else the task's ``document_id``, else its
    first source document, else (no document, e.g. a JSON Lines row) the context itself."""
    meta = sample.metadata
    if meta.get("work_id"):
        return str(meta["work_id"])
    if meta.get("document_id"):
        return str(meta["document_id"])
    sources = meta.get("source_docs") or []
    return str(sources[0]) if sources else context_of(sample)


def try_clone(strategy: Strategy, cache: KVBenchCache, model: torch.nn.Module | None = None) -> KVBenchCache | None:
    """An independent copy of ``cache`` (:func:`clone_cache`), or None when it cannot be copied: the strategy
    (or, for ``compose``, a part) declares ``cache_copyable = False``, or the copy fails."""
    parts = [strategy] + [getattr(strategy, a) for a in ("evictor", "quantizer") if hasattr(strategy, a)]
    if not all(getattr(p, "cache_copyable", True) for p in parts):
        return None
    try:
        return clone_cache(cache, model)
    except (RuntimeError, TypeError):
        return None


def can_clone(strategy: Strategy, cache: KVBenchCache, model: torch.nn.Module | None = None) -> bool:
    """Whether :func:`clone_cache` gives an independent copy of ``cache`` (a trial copy, :func:`try_clone`)."""
    return try_clone(strategy, cache, model) is not None


def clone_cache(cache: KVBenchCache, model: torch.nn.Module | None = None) -> KVBenchCache:
    """An independent copy of a built cache, sharing what is not cache state: the model (which a store may
    hold to recompute K/V), its config and the strategies (:meth:`Strategy.__deepcopy__` returns the strategy
    itself). Every tensor the stores hold is copied, so decoding into the copy never changes the original."""
    memo: dict[int, Any] = {id(cache.config): cache.config}
    if model is not None:
        memo[id(model)] = model
    return copy.deepcopy(cache, memo)


@dataclass
class _Generation:
    tokens: list[int] = field(default_factory=list)
    first_s: float = float("nan")
    step_s: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    working_set_bytes: int = 0  # measured on the first decode step (the batch's, with several rows)


class attached:
    """``cache.attach(model)`` for strategies that read queries during decoding; a no-op otherwise."""

    def __init__(self, cache: KVBenchCache | RowsCache, model: torch.nn.Module, strategy: Strategy) -> None:
        self.ctx = cache.attach(model) if strategy.query_window != 0 else None

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _batched(caches: list[KVBenchCache]) -> KVBenchCache | RowsCache:
    """One sample's cache as is (the batch-1 path), several behind a :class:`RowsCache`."""
    return caches[0] if len(caches) == 1 else RowsCache(caches)


def _activate(cache: KVBenchCache | RowsCache, rows: list[int]) -> None:
    if isinstance(cache, RowsCache):
        cache.active = rows


def _capture_row(cap: LayerCapture, r: int) -> LayerCapture:
    q, pos = cap.queries, cap.positions
    return LayerCapture(cap.layer_idx, cap.num_kv_groups, cap.scaling,
                        queries=None if q is None else q[r:r + 1].clone(),
                        positions=None if pos is None else (pos[r:r + 1] if pos.shape[0] > 1 else pos),
                        sinks=cap.sinks)


def changes_cache_while_decoding(strategy: Strategy) -> bool:
    """Whether the strategy evicts after decoding steps (itself, or the eviction inside ``compose``)."""
    for s in (strategy, getattr(strategy, "evictor", None)):
        evicts = getattr(s, "evicts_during_decode", None)
        if callable(evicts) and evicts():
            return True
    return False


def _full() -> Strategy:
    from kvbench.strategies.full import Full

    return Full()


def eos_ids(lm: LoadedModel) -> set[int]:
    """End-of-sequence ids: the tokenizer's and the generation config's (where transformers' ``generate`` stops)."""
    ids: set[int] = set()
    generation_config = getattr(lm.model, "generation_config", None)
    for src in (getattr(lm.tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
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
