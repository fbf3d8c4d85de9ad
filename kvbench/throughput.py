"""``kvbench throughput``: how many sequences fit a memory budget under each strategy, and how fast they decode.

    kvbench throughput                                   # the hardware profile's memory is the budget
    kvbench throughput 'strategies=[int8,int4]' 'contexts=[4096,8192]' 'budget=[1.5GB,2GB]' steps=16 repeats=5
    kvbench throughput model=llama-3.2-1b-random prefill=synthetic 'contexts=[16384,32768]' 'budget=weights+2.5GB'

Hydra-configured (``conf/throughput.yaml``; keys, defaults and types are :class:`ThroughputConfig`; ``model=``
and ``hardware=`` are the groups of ``python -m kvbench``). Per context length, one sequence is prefilled
(``prefill=shared``: one full-attention capture every strategy compresses, as the benchmark does;
``synthetic``: seeded random K/V handed to each store as its prefill (drawn in ``chunk_tokens`` chunks), no model
forward — for random-weight models, where only memory and speed mean anything). Then, per budget and strategy:

1. **capacity**: the budget is what the whole process may hold. Spent before any cache: the process as loaded
   (``baseline``: RSS once the model is loaded and the engine warmed up, measured; it is the weights as held,
   :func:`kvbench.footprint.weight_bytes`, plus the harness's own ``overhead``: interpreter, libraries, the
   allocator's slack) and the compressed templates the harness keeps while a batch decodes (``held``: every
   strategy's one sequence under ``prefill=shared``; none under ``synthetic``, where a template is redrawn
   when needed and the batch's last row is the template itself). What is left is what a batch may use: its
   measured need (:meth:`Bench.working_set`: stored bytes + scratch + the step's temporaries, the larger of the
   attention's peak, :func:`kvbench.footprint.decode_working_set`, and every tensor the step allocates,
   :class:`kvbench.footprint.LiveBytes`). One sequence's need is measured; the batch of
   ``floor(available / that)`` copies is measured again as a batch and grown or shrunk one sequence at a time
   until it is the largest whose measured need fits (``accounted_batch``). That batch then decodes once with
   the process's RSS checked between steps; stopped or over the budget, it is shrunk by its excess and run
   again until the process keeps it (:meth:`Bench.keep`; the tries are ``keep_tries``): tensors are not all a
   process holds, and a fit is what the process kept, not what the accounting admitted;
2. **throughput**: that many sequences, each a copy of the compressed cache given a question of its own length
   (``question_tokens`` minus 0-3, so rows are ragged and the engine's per-row masks are exercised), decode
   ``steps`` greedy tokens together. Measured: ms per step (median), decode tokens/s (sequences × steps /
   time), the question pass (the first token of every row), the prefill and compression of one sequence
   (time to first token = the three), and the process's peak RSS from the batch's copies to its last step.
   Strategies take turns within each of ``repeats`` rounds, so each round's gain over ``full`` is a ratio
   within one stretch of machine time;
3. **the budget kept**: a row whose measured peak exceeds the budget by more than :data:`TOLERANCE` is
   ``over``, not a fit; between decode steps the process's memory is checked against that limit and a batch
   that crosses it is ``stopped`` (one line). Per context and budget, ``full`` is also tried at the largest
   batch another strategy fits (when that is more than its own): predicted over the budget, it is ``refused``
   before it starts (one line) — an overflow stops inference, as in a real server. On CUDA the budget is also
   the allocator's (``torch.cuda.set_per_process_memory_fraction``), so crossing it raises out-of-memory,
   and the row is ``stopped``.

Also recorded, for the roofline (``scripts/bench_throughput.py``, ``scripts/bench_advise.py``): the copy bandwidth
and the matmul FLOP/s measured at the start, in the dtype the model's linear layers compute in (``flops_dtype``),
the FLOP/s of one decode step's MLP product at each row's batch (``decode_flops_per_s``), and per step the
weight bytes read, the KV bytes read and the FLOPs (``flops``, of which attention's ``attn_flops``).

Results go to ``out`` (CSV, one row per strategy, budget, context and round), rewritten after every context
and budget so an interrupted run keeps what finished.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional  # noqa: UP035  (OmegaConf reads these typing forms)

import torch

from kvbench.errors import KVBenchError

PREFILLS = ("shared", "synthetic")
CONFIG_NAME = "throughput"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
#: Question lengths cycle through ``question_tokens - (row % RAGGED)``: rows of one batch differ in length.
RAGGED = 4
#: A row fits when its measured peak is at most ``budget * (1 + TOLERANCE)``: RSS counts pages, the allocator's
#: slack and what the sampler misses between samples, which no prediction of tensor bytes can hold to the byte.
TOLERANCE = 0.05
#: How many times, per context and budget, a batch that the process stops keeping in a round (stopped or over) is
#: kept again smaller and the rounds started again; past that, the rows are served and marked as they ran.
MAX_REKEEPS = 3


@dataclass
class ThroughputConfig:
    """``kvbench throughput`` keys (``conf/throughput.yaml`` adds the ``model`` and ``hardware`` groups)."""

    model: Any = None
    hardware: Any = None
    strategies: List[str] = field(default_factory=lambda: ["int8"])  # noqa: UP006  (``full`` is always added)
    strategies_params: Dict[str, Any] = field(default_factory=dict)  # noqa: UP006
    contexts: List[int] = field(default_factory=lambda: [4096])  # noqa: UP006
    # One budget or a list, for the whole process: bytes, "1.5GB", "2GiB", "weights+2GB" (the weights as held,
    # plus that), or "process+0.3GB" (the process as loaded, weights and harness overhead measured, plus that);
    # null: the hardware profile's memory_bytes.
    budget: Any = None
    steps: int = 16                 # decode steps per round
    repeats: int = 3                # rounds (strategies take turns in each): the gain's interval comes from them
    question_tokens: int = 8        # longest question; rows get 0-3 tokens fewer (ragged batches)
    prefill: str = "shared"         # shared | synthetic (random K/V streamed into the stores, no model forward)
    chunk_tokens: int = 1024        # synthetic: tokens per chunk of the random draw (one prefill per layer)
    max_batch: int = 256            # never decode more sequences than this, whatever fits
    dtype: Optional[str] = None     # noqa: UP045  (null: the hardware profile's dtype)
    attention: str = "auto"         # as engine.attention
    linear: str = "auto"            # as engine.linear
    reader: str = "auto"            # as engine.reader: what reads a compressed cache (kvbench/fused.py)
    working_copy: bool = True       # as engine.working_copy (quantized stores' dequantized copy of their prefix)
    seed: int = 0
    out: str = "results/perf/throughput.csv"


# -- configuration ----------------------------------------------------------------------------------------
def register() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from kvbench.config import register_configs

    register_configs()
    node = OmegaConf.structured(ThroughputConfig)
    OmegaConf.set_struct(node.strategies_params, False)
    ConfigStore.instance().store(name="kvbench_throughput_schema", node=node)


def compose(overrides: list[str]) -> Any:
    """The composed ``kvbench throughput`` config; a bad override is one :class:`KVBenchError` line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from kvbench.config import explain
    from kvbench.paths import conf_dir

    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise KVBenchError(explain(exc, list(overrides))) from None
    finally:
        GlobalHydra.instance().clear()


def parse_size(text: Any, weights: int = 0, process: int = 0) -> int:
    """Bytes from ``123``, ``1.5GB``, ``2GiB``, ``weights+2GB`` (``weights``: the weights' bytes) or
    ``process+0.3GB`` (``process``: the process as loaded, weights and overhead)."""
    s = str(text).strip().replace(" ", "").replace("_", "")
    base = 0
    for prefix, value in (("weights+", weights), ("process+", process)):
        if s.lower().startswith(prefix):
            base, s = value, s[len(prefix):]
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([A-Za-z]*)", s)
    if not m or m.group(2).upper() not in _UNITS:
        raise KVBenchError(f"budget {text!r} is not a size; valid: bytes, e.g. 1.5GB, 2GiB, 512MB, weights+2GB, "
                           "process+0.3GB")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise KVBenchError(f"budget {text!r} must be positive")
    return base + int(value)


def check(cfg: Any) -> list[Any]:
    """Everything that needs no model; returns the strategies (``full`` first)."""
    from kvbench.attention import CHOICES as ATTENTION
    from kvbench.config import resolve_strategies
    from kvbench.fused import CHOICES as READER
    from kvbench.linear import CHOICES as LINEAR

    if cfg.prefill not in PREFILLS:
        raise KVBenchError(f"unknown prefill {cfg.prefill!r}; valid: {', '.join(PREFILLS)}")
    if cfg.attention not in ATTENTION:
        raise KVBenchError(f"unknown attention {cfg.attention!r}; valid: {', '.join(ATTENTION)}")
    if cfg.linear not in LINEAR:
        raise KVBenchError(f"unknown linear {cfg.linear!r}; valid: {', '.join(LINEAR)}")
    if cfg.reader not in READER:
        raise KVBenchError(f"unknown reader {cfg.reader!r}; valid: {', '.join(READER)}")
    for key in ("steps", "repeats", "question_tokens", "chunk_tokens", "max_batch"):
        if int(cfg[key]) < 1:
            raise KVBenchError(f"{key} must be >= 1 (got {cfg[key]})")
    if int(cfg.question_tokens) < RAGGED:
        raise KVBenchError(f"question_tokens must be >= {RAGGED} (rows differ by up to {RAGGED - 1} tokens)")
    if not cfg.contexts or any(int(c) < 1 for c in cfg.contexts):
        raise KVBenchError(f"contexts must be positive token counts (got {list(cfg.contexts)})")
    for b in _budget_list(cfg):
        if b is not None:
            parse_size(b, 1, 1)
    built = resolve_strategies(cfg)
    if cfg.prefill == "synthetic":
        needs = [s.name for s in built if s.query_window != 0]
        if needs:
            raise KVBenchError(f"prefill=synthetic has no queries to score tokens with; {', '.join(needs)} "
                               "need(s) them: use prefill=shared, or strategies that do not read queries")
    return built


def _budget_list(cfg: Any) -> list[Any]:
    from omegaconf import ListConfig

    b = cfg.budget
    return [None] if b is None else list(b) if isinstance(b, (list, ListConfig)) else [b]


# -- measurement --------------------------------------------------------------------------------------------
@dataclass
class Built:
    """One compressed sequence of one strategy (cloned per batch row), and what building it cost."""

    strategy: Any
    cache: Any                      # None once a batch took it as its last row (``rebuild`` draws it again)
    compress_s: float
    #: Draws the same cache again (``prefill=synthetic``: seeded), so the harness need not hold it while a batch
    #: decodes; None under ``prefill=shared``, whose capture is not kept (the template is held instead).
    rebuild: Optional[Callable[[], Any]] = field(default=None, repr=False)  # noqa: UP045
    # Working sets measured so far, by batch size: each size is measured once per sequence, so the capacity search
    # and everything reported from it read one figure (the profiler's peak varies a little between calls, with the
    # allocator's state, and a size re-measured could otherwise disagree with the decision made on it).
    measured: dict[int, dict[str, int]] = field(default_factory=dict, repr=False)


def synthetic_cache(strategy: Any, config: Any, context: int, chunk: int, dtype: torch.dtype, device: str,
                    seed: int) -> Any:
    """A strategy's cache of ``context`` tokens of seeded random K/V (N(0, 1), the model's shapes and dtype), no model
    forward: layer by layer, the whole context is drawn (``chunk`` tokens at a time, so the float32 draw stays
    small) and handed to the store as its prefill, so only one layer's dense K/V exist at a time.

    One prefill per layer, not a stream of appends: under kvbench's attention a cache defers every later update to
    the attention that reads it (``kvbench.attention.PendingKV``), and with no attention here an appended chunk
    would never reach the store."""
    from kvbench.cache import KVBenchCache

    cache = KVBenchCache(strategy, config)
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for layer in cache.layers:
            if not hasattr(layer, "store"):  # a hybrid's recurrent layer holds no K/V
                continue
            k = torch.empty(1, heads, context, head_dim, dtype=dtype, device=device)
            v = torch.empty_like(k)
            for start in range(0, context, chunk):
                n = min(chunk, context - start)
                k[:, :, start:start + n] = torch.randn(1, heads, n, head_dim, generator=gen).to(k)
                v[:, :, start:start + n] = torch.randn(1, heads, n, head_dim, generator=gen).to(v)
            layer.update(k, v)
            del k, v
    for layer in cache.layers:
        if hasattr(layer, "store"):
            assert layer.store.num_tokens() <= context and layer.get_seq_length() == context
    return cache


def process_bytes(device: str) -> int:
    """What the process holds now: its resident set on CPU, the CUDA allocator's bytes on a GPU."""
    if device.startswith("cuda"):
        return int(torch.cuda.memory_allocated())
    import psutil

    return int(psutil.Process().memory_info().rss)


def free_garbage() -> None:
    """Collect reference cycles and trim the heap. A measured batch's caches sit in cycles (the profiler's and the
    dispatch mode's records, a row cache and its rows) that Python's collector frees only when it next runs: in
    one tiny-model run a capacity search left ~30 MB resident (6% of the process) until the next batch."""
    import gc

    from kvbench.spec import release_freed_memory

    gc.collect()
    release_freed_memory()


class OverBudget(Exception):
    """A batch crossed its budget while decoding (the RSS checked between steps, or CUDA out of memory)."""

    def __init__(self, step: int, held: int) -> None:
        super().__init__(step, held)
        self.step, self.held = step, held


def questions(rows: int, longest: int, seed: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(1, max(vocab, 2), (longest - (r % RAGGED),), generator=gen).tolist() for r in range(rows)]


def linear_bytes_read(model: torch.nn.Module, rows: int) -> tuple[int, int]:
    """(bytes of linear weights one forward of ``rows`` new tokens reads, their parameters): the float32 copies
    when ``engine.linear=float32`` takes that many rows (:mod:`kvbench.linear`), else the weights themselves."""
    from kvbench.linear import MIN_ROWS

    total = params = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            fwd = m.__dict__.get("forward")
            w = fwd.weight if fwd is not None and hasattr(fwd, "weight") and rows >= MIN_ROWS else m.weight
            total += w.numel() * w.element_size()
            params += w.numel()
    return total, params


def attention_reads(cache: Any, dtype_bytes: int) -> tuple[int, int]:
    """(KV bytes one decode step of ``cache`` reads, tokens held summed over layers). A store that decodes from a
    working copy reads the dense copy of its held tokens, not its codes."""
    held = sum(cache.held_tokens())
    if cache.scratch_bytes() == 0:
        return cache.kv_bytes(), held
    dense = 0
    for layer in cache.layers:
        if layer.kv_shape is not None:
            _, h, d = layer.kv_shape
            dense += 2 * h * d * layer.store.num_tokens() * dtype_bytes
    return dense, held


#: The most weight bytes (in the model's dtype) the decode products' FLOP/s is measured on (``Bench.decode_flops``).
RATE_WEIGHT_BYTES = 2 * 2**20


class Bench:
    """The model, its engine and the machine figures shared by every measurement of one run."""

    def __init__(self, cfg: Any, hw: Any) -> None:
        from kvbench import fused
        from kvbench.engine import Engine
        from kvbench.footprint import weight_bytes
        from kvbench.hardware_probe import measure_copy_bandwidth, measure_matmul_flops
        from kvbench.models import load_model
        from kvbench.spec import release_freed_memory

        self.cfg, self.device = cfg, str(hw.device)
        fused.choose(str(cfg.reader))  # for the whole process, as a run's engine.reader
        dtype = str(cfg.dtype or cfg.model.get("dtype") or hw.dtype)
        self.lm = load_model(str(cfg.model.name), dtype=dtype, device=self.device, path=cfg.model.get("path"),
                             seed=int(cfg.seed))
        self.engine = Engine(self.lm, device=self.device, hardware=hw, attention=str(cfg.attention),
                             linear=str(cfg.linear), working_copy=bool(cfg.working_copy))
        self.engine.warmup()
        self.weights = weight_bytes(self.lm.model)
        self.dtype = self.lm.model.dtype
        # The roofline is a bound: its rates are each the fastest of their timed runs (noise only slows a run).
        self.bandwidth = measure_copy_bandwidth(256 * 2**20, device=self.device, best=True) * 1e9
        # The rate of the products the model's linear layers compute, in the dtype they compute in: float32 where
        # engine.linear holds float32 copies, else the model's own (a bf16 GEMM on a CPU without bf16 instructions
        # runs tens of times below float32's, so a float32 figure would put the roofline far above the run).
        self.flops_dtype = ("float32" if self.engine.linear in ("float32", "upcast", "upcast-slices")
                            else str(self.dtype).removeprefix("torch."))
        self.flops = measure_matmul_flops(1024, self.flops_dtype, device=self.device, best=True)
        self._decode_flops: dict[int, float] = {}
        self.vocab = int(self.lm.config.vocab_size)
        # The process as loaded, before any cache: weights as held plus the harness's own overhead, measured once
        # the probes above and one measured decode step of a short cache (the profiler and dispatch modes the
        # working sets are read with load libraries and buffers that stay) have run and their tensors are freed,
        # from a trimmed heap (a random-weight model's float32 initialisation is freed too).
        from kvbench import strategies

        full = strategies.build("full")
        self.engine.bind(full, list(range(1, 65)))
        warm = Built(full, synthetic_cache(full, self.lm.config, 64, 64, self.dtype, self.device, 0), 0.0)
        self.working_set(warm, 1)
        del warm
        release_freed_memory()
        self.baseline = process_bytes(self.device)
        self.overhead = max(0, self.baseline - self.weights)

    def decode_flops(self, rows: int) -> float:
        """FLOP/s of one decode step's MLP product at ``rows`` sequences, in the dtype it computes in (a product of
        fewer than :data:`kvbench.linear.MIN_ROWS` rows stays native), measured once per batch size."""
        from kvbench.hardware_probe import measure_linear_flops
        from kvbench.linear import MIN_ROWS

        if rows not in self._decode_flops:
            native = str(self.dtype).removeprefix("torch.")
            if self.engine.linear.startswith("upcast"):  # timed as the step runs it, the conversion included
                dtype, path = native, "upcast"
            else:
                dtype, path = (self.flops_dtype if rows >= MIN_ROWS else native), "native"
            hidden = int(self.lm.config.hidden_size)
            inner = int(getattr(self.lm.config, "intermediate_size", None) or 4 * hidden)  # the usual MLP width
            # The arithmetic's rate, with the weight at hand: the roofline's memory term already reads every
            # weight, so a weight streamed from memory here would count its bytes twice — a few rows of
            # Llama-3.2-1B's 33 MB MLP weight read at whatever bandwidth the moment gave put the roofline under
            # the measured tokens/s. A slice of its columns stays in the caches (SmolLM2's whole weight does).
            width = torch.empty((), dtype=self.dtype).element_size()
            inner = min(inner, max(64, RATE_WEIGHT_BYTES // (hidden * width)))
            self._decode_flops[rows] = measure_linear_flops(rows, hidden, inner, dtype, device=self.device,
                                                            path=path, best=True)
        return self._decode_flops[rows]

    # ---------------------------------------------------------------------------------------------------
    def build(self, strategies: list[Any], context: int) -> tuple[list[Built], float]:
        """Every strategy's compressed cache of one sequence of ``context`` tokens, and the prefill's seconds."""
        from kvbench.engine import query_window_for
        from kvbench.spec import Timer

        cfg = self.cfg
        gen = torch.Generator().manual_seed(int(cfg.seed))
        ids = torch.randint(1, self.vocab, (context,), generator=gen).tolist()
        out = []
        if cfg.prefill == "shared":
            pre = self.engine.capture(torch.tensor([ids], device=self.device), query_window_for(strategies))
            for s in strategies:
                self.engine.bind(s, ids)
                cache, seconds = self.engine._cache(s, pre.rows[0])
                out.append(Built(s, cache, seconds))
            return out, pre.seconds
        for s in strategies:
            def draw(s: Any = s) -> Any:
                self.engine.bind(s, ids)
                return synthetic_cache(s, self.lm.config, context, int(cfg.chunk_tokens), self.dtype, self.device,
                                       int(cfg.seed))
            with Timer(self.device) as t:
                cache = draw()
            out.append(Built(s, cache, t.seconds, rebuild=draw))
        return out, float("nan")

    def batch(self, built: Built, rows: int) -> tuple[Any, list[Any], float, list[list[int]]]:
        """``rows`` copies of ``built``'s cache after each row's question (timed): (batched cache, the copies,
        the question pass's seconds, each row's first generated token). A template that can be drawn again is
        the last row itself, so the harness holds no copy of its own while the batch decodes."""
        from kvbench.cache import RowsCache
        from kvbench.engine import attached, clone_cache
        from kvbench.spec import Timer

        if built.cache is None:
            built.cache = built.rebuild()
        template = built.cache
        caches = [clone_cache(template, self.lm.model) for _ in range(rows - (built.rebuild is not None))]
        if built.rebuild is not None:
            caches.append(template)
            built.cache = template = None
        cache = caches[0] if rows == 1 else RowsCache(caches)
        qs = questions(rows, int(self.cfg.question_tokens), int(self.cfg.seed), self.vocab)
        with torch.inference_mode(), attached(cache, self.lm.model, built.strategy), Timer(self.device) as t:
            logits = self.engine.forward(cache, qs, 1)
        return cache, caches, t.seconds, [[int(x)] for x in logits[:, -1].argmax(-1)]

    def step(self, cache: Any, strategy: Any, tokens: list[list[int]]) -> list[list[int]]:
        from kvbench.engine import attached

        with torch.inference_mode(), attached(cache, self.lm.model, strategy):
            logits = self.engine.forward(cache, tokens, 1)
        return [[int(x)] for x in logits[:, -1].argmax(-1)]

    @staticmethod
    def held(built: list[Built]) -> int:
        """Bytes of the templates the harness keeps while a batch decodes: those that cannot be drawn again."""
        return sum(b.cache.kv_bytes() + b.cache.scratch_bytes() for b in built
                   if b.rebuild is None and b.cache is not None)

    def working_set(self, built: Built, rows: int) -> dict[str, int]:
        """What ``rows`` copies decoding one step together (after their question) need, measured once per size
        (:attr:`Built.measured`): ``working_set_bytes`` (stored + scratch + the attention's peak,
        :func:`kvbench.footprint.decode_working_set`), ``step_temp_bytes`` (the most bytes of tensors a second
        step allocates and holds at once — MLP activations, logits, a store's re-allocation, the attention's
        blocks — :class:`kvbench.footprint.LiveBytes`) and ``need_bytes``, what the batch adds to the process:
        stored + scratch + the larger of the two temporaries."""
        from kvbench.footprint import LiveBytes, decode_working_set

        if rows not in built.measured:
            cache, _, _, tokens = self.batch(built, rows)
            ws = decode_working_set(self.lm.model, cache, lambda: self.step(cache, built.strategy, tokens),
                                    self.device)
            with LiveBytes() as live:
                self.step(cache, built.strategy, tokens)
            ws["step_temp_bytes"] = live.peak
            ws["need_bytes"] = ws["kv_bytes"] + ws["scratch_bytes"] + max(ws["temp_bytes"], live.peak)
            built.measured[rows] = ws
            del cache, tokens
            free_garbage()
        return dict(built.measured[rows])

    def predicted_need(self, built: Built, rows: int) -> int:
        """A batch's need without running it: measured where this size was, else extrapolated from the largest
        size measured below it by the per-sequence growth measured so far (at least one sequence's need each)."""
        if rows in built.measured:
            return built.measured[rows]["need_bytes"]
        below = max((n for n in built.measured if n < rows), default=None)
        if below is None:
            return rows * built.measured[min(built.measured)]["need_bytes"]
        one = built.measured[min(built.measured)]["need_bytes"]
        need = built.measured[below]["need_bytes"]
        marginal = (need - one) / (below - 1) if below > 1 else one
        return int(need + (rows - below) * marginal)

    def capacity(self, built: Built, available: int, single: dict[str, int]) -> tuple[int, dict[str, int]]:
        """The largest batch (at most ``max_batch``) whose measured need (:meth:`working_set`) fits ``available``.

        From ``floor(available / one sequence's need)``: shrunk one at a time while it does not fit, then
        grown by the marginal cost measured so far and, past the budget, bisected; every size tried is measured
        (needs grow with the batch, so the largest fitting size is found). Trial sizes are measurements, not
        served batches: their peaks may pass the budget; the rows served are checked (:meth:`decode`)."""
        key = "need_bytes"
        per, cap = single[key], int(self.cfg.max_batch)
        rows = min(cap, available // per) if per else cap
        if rows < 1:
            return 0, single
        ws = self.working_set(built, rows)
        while ws[key] > available and rows > 1:
            rows -= 1
            ws = self.working_set(built, rows)
        if ws[key] > available:
            return 0, single
        while rows < cap:
            marginal = (ws[key] - per) / (rows - 1) if rows > 1 else per
            guess = min(cap, rows + max(1, int((available - ws[key]) // max(marginal, 1))))
            more = self.working_set(built, guess)
            if more[key] <= available:
                rows, ws = guess, more
                continue
            lo, hi = rows, guess  # lo fits, hi does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                m = self.working_set(built, mid)
                if m[key] <= available:
                    lo, ws = mid, m
                else:
                    hi = mid
            rows = lo
            break
        return rows, ws

    def keep(self, built: Built, rows: int, budget: int) -> tuple[int, list[str]]:
        """The largest batch, at most ``rows`` (what the accounting admits, :meth:`capacity`), that the process
        keeps within ``budget`` when it runs: the batch decodes once, its RSS checked between steps; stopped or
        over, it is shrunk by its excess over the limit in sequences of the measured need (at least one) and run
        again. The accounting counts tensors; the process also holds the allocator's pages and slack, so a batch
        it admits can still cross the budget. Returns the kept size and one "N status" per try."""
        tries: list[str] = []
        one = built.measured[min(built.measured)]["need_bytes"] if built.measured else 0
        while rows > 0:
            status = self.decode(built, rows, budget)
            tries.append(f"{rows} {status['budget_status']}")
            if status["budget_status"] == "fits":
                break
            excess = max(0, int(status["peak_rss_bytes"]) - self.limit(budget))
            rows -= max(1, math.ceil(excess / one) if one else 1)
        return max(rows, 0), tries

    def limit(self, budget: int) -> int:
        """The most the process may hold under ``budget`` before a batch is stopped (:data:`TOLERANCE`)."""
        return int(budget * (1 + TOLERANCE))

    def decode(self, built: Built, rows: int, budget: int | None = None) -> dict[str, Any]:
        """One timed round: ``rows`` sequences answer their questions and decode ``steps`` tokens together.

        With a ``budget``, the process's memory is checked after the question pass and after every step; past
        :meth:`limit` the batch stops (``budget_status`` "stopped"), as a server out of memory stops decoding.
        Otherwise the row's status is "fits" when the peak (RSS sampled from the copies to the last step) is
        within the limit, else "over"."""
        from kvbench.spec import PeakMemory, Timer, median

        limit = self.limit(budget) if budget is not None else None
        oom = (torch.cuda.OutOfMemoryError,) if self.device.startswith("cuda") else ()
        times: list[float] = []
        first_s, reads, held, stopped = float("nan"), 0, 0, None
        free_garbage()
        with PeakMemory(self.device) as peak:
            try:
                cache, caches, first_s, tokens = self.batch(built, rows)
                for i in range(int(self.cfg.steps)):
                    if limit is not None and process_bytes(self.device) > limit:
                        raise OverBudget(i, process_bytes(self.device))
                    with Timer(self.device) as t:
                        tokens = self.step(cache, built.strategy, tokens)
                    times.append(t.seconds)
                reads, held = attention_reads(caches[0], self.dtype.itemsize)
                del cache, caches, tokens
            except OverBudget as over:  # keep the numbers, not the exception (its frame holds the batch)
                stopped = (over.step, over.held)
            except oom:
                stopped = (len(times), process_bytes(self.device))
        free_garbage()
        out: dict[str, Any] = {"question_s": first_s, "peak_rss_bytes": peak.peak_bytes, "steps_done": len(times),
                               "kv_read_bytes_per_seq": reads, "held_tokens_per_seq": held}
        if stopped is not None:
            out["budget_status"] = "stopped"
            out["stop_line"] = (f"{built.strategy.name} x {rows}: stopped before decode step {stopped[0] + 1} of "
                                f"{int(self.cfg.steps)}: the process holds {stopped[1] / 1e9:.3f} GB, over its "
                                f"budget {budget / 1e9:.3f} GB (+{TOLERANCE:.0%})")
            return out
        out["budget_status"] = "fits" if limit is None or peak.peak_bytes <= limit else "over"
        out.update({"ms_per_step": 1000 * median(times), "tokens_per_s": rows * len(times) / sum(times)})
        return out


def roofline_fields(bench: Bench, rows: int, reads: float, held_tokens: float) -> dict[str, float]:
    """Bytes and FLOPs of one decode step of ``rows`` sequences: weights + KV read, linear + attention FLOPs (all of
    them, and attention's alone: the roofline times the two at different rates)."""
    from kvbench.hardware import attention_flops

    cfg = bench.lm.config
    wbytes, params = linear_bytes_read(bench.lm.model, rows)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    # held_tokens sums every layer's held tokens (the same formula `kvbench advise` predicts with).
    attn = attention_flops(head_dim, held_tokens, heads)
    native, _ = linear_bytes_read(bench.lm.model, 1)
    return {"weight_read_bytes": wbytes, "weight_native_read_bytes": native, "kv_read_bytes": rows * reads,
            "flops": rows * (2 * params + attn), "attn_flops": rows * attn}


def run(cfg: Any, out: Path, command: str = "") -> list[dict[str, Any]]:
    """Measure every context, budget and strategy of ``cfg``; rows also go to ``out`` as they finish."""
    from kvbench import fused
    from kvbench.hardware import HardwareProfile

    strategies = check(cfg)
    hw = HardwareProfile.from_config(cfg.hardware)
    if hw.threads:
        torch.set_num_threads(int(hw.threads))
    bench = Bench(cfg, hw)
    budgets = [(str(b) if b is not None else f"{hw.name} memory",
                parse_size(b, bench.weights, bench.baseline) if b is not None else int(hw.memory_bytes))
               for b in _budget_list(cfg)]
    print(f"kvbench throughput: {bench.lm.name} ({bench.dtype}), weights as held {bench.weights / 1e9:.3f} GB, "
          f"process as loaded {bench.baseline / 1e9:.3f} GB (harness overhead {bench.overhead / 1e9:.3f} GB); "
          f"copy bandwidth {bench.bandwidth / 1e9:.1f} GB/s, {bench.flops_dtype} matmul {bench.flops / 1e9:.1f} "
          "GFLOP/s", flush=True)
    rows: list[dict[str, Any]] = []
    common = {"command": command, "commit": _commit(), "model": bench.lm.name,
              "dtype": str(bench.dtype).replace("torch.", ""),
              "device": bench.device, "processor": _processor(bench.device),
              "hardware": hw.name, "prefill": str(cfg.prefill), "steps": int(cfg.steps),
              "weights_bytes": bench.weights, "baseline_bytes": bench.baseline, "overhead_bytes": bench.overhead,
              "tolerance": TOLERANCE, "bandwidth_bytes_per_s": bench.bandwidth,
              "flops_per_s": bench.flops, "flops_dtype": bench.flops_dtype, "threads": torch.get_num_threads(),
              "linear": bench.engine.linear,
              "attention": bench.engine.attention, "reader": fused.reader(),
              "working_copy": bool(cfg.working_copy)}
    for context in map(int, cfg.contexts):
        limit = bench.lm.max_context
        if limit and context + int(cfg.question_tokens) + int(cfg.steps) > limit:
            raise KVBenchError(f"context {context} + question + steps exceeds {bench.lm.name}'s maximum of {limit} "
                               "tokens; lower contexts")
        built, prefill_s = bench.build(strategies, context)
        singles = {b.strategy.label(): bench.working_set(b, 1) for b in built}
        held = bench.held(built)  # after the single measurements: drawable templates are not held any more
        for label, budget in budgets:
            _cuda_budget(bench.device, budget)
            available = budget - bench.baseline - held
            plan, kept = {}, {}
            for b in built:
                n, ws = bench.capacity(b, available, singles[b.strategy.label()]) if available > 0 else (0, {})
                accounted, tries = n, []
                if n:
                    n, tries = bench.keep(b, n, budget)
                    if n != accounted:
                        ws = bench.working_set(b, n) if n else {}
                plan[b.strategy.label()] = (n, ws)
                kept[b.strategy.label()] = {"accounted_batch": accounted, "keep_tries": "; ".join(tries)}
                print(f"  {context} tokens, budget {label} ({budget / 1e9:.3f} GB, {max(available, 0) / 1e9:.3f} GB "
                      f"for caches): {b.strategy.name} fits {n} (accounting {accounted}; run: "
                      f"{', '.join(tries) or 'none'})", flush=True)
            probe = _overflow_probe(built, plan)
            done: list[dict[str, Any]] = []  # this context and budget's rows so far
            r = rekept = 0
            while r < int(cfg.repeats):
                shrunk = None
                for b, n, ws, is_probe in [(b, *plan[b.strategy.label()], False) for b in built] + \
                        ([(*probe, True)] if probe and r == 0 else []):
                    single = singles[b.strategy.label()]
                    predicted = bench.baseline + held + (ws["need_bytes"] if n and not is_probe
                                                         else bench.predicted_need(b, n) if n else 0)
                    row = {**common, "context": context, "budget": label, "budget_bytes": budget,
                           "strategy": b.strategy.name,
                           "label": b.strategy.label() + (" (over budget)" if is_probe else ""), "probe": is_probe,
                           "round": r, "batch": n, **({} if is_probe else kept[b.strategy.label()]),
                           "prefill_s": prefill_s, "compress_s": b.compress_s,
                           "held_bytes": held, "predicted_bytes": predicted,
                           "seq_kv_bytes": single["kv_bytes"], "seq_scratch_bytes": single["scratch_bytes"],
                           "seq_working_set_bytes": single["working_set_bytes"], "seq_need_bytes": single["need_bytes"],
                           "batch_working_set_bytes": ws.get("working_set_bytes", 0),
                           "batch_temp_bytes": ws.get("temp_bytes", 0),
                           "batch_step_temp_bytes": ws.get("step_temp_bytes", 0),
                           "batch_need_bytes": ws.get("need_bytes", 0), "budget_status": "none" if not n else ""}
                    row["load_1m"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
                    if n and predicted > budget:
                        row["budget_status"] = "refused"
                        print(f"  {b.strategy.name} x {n}: refused: predicted {predicted / 1e9:.3f} GB (process "
                              f"{bench.baseline / 1e9:.3f} + held {held / 1e9:.3f} + batch "
                              f"{(predicted - bench.baseline - held) / 1e9:.3f}) is over the budget "
                              f"{budget / 1e9:.3f} GB; an overflow would stop inference", flush=True)
                    elif n:
                        d = bench.decode(b, n, budget)
                        if "stop_line" in d:
                            print("  " + d.pop("stop_line"), flush=True)
                        row.update(d)
                        row["decode_flops_per_s"] = bench.decode_flops(n)
                        if d["steps_done"]:
                            row.update(roofline_fields(bench, n, d["kv_read_bytes_per_seq"],
                                                       d["held_tokens_per_seq"]))
                        if d["budget_status"] != "stopped":
                            row["ttft_s"] = ((0.0 if math.isnan(prefill_s) else prefill_s) + b.compress_s
                                             + d["question_s"])
                        if d["budget_status"] == "over":
                            print(f"  {b.strategy.name} x {n}: not a fit: peak RSS {d['peak_rss_bytes'] / 1e9:.3f} GB "
                                  f"> budget {budget / 1e9:.3f} GB (+{TOLERANCE:.0%})", flush=True)
                        if d["budget_status"] != "fits" and not is_probe and rekept < MAX_REKEEPS:
                            shrunk = (b, n, d)
                            break
                    done.append(row)
                if shrunk is None:
                    r += 1
                    continue
                # The process no longer keeps a batch it kept before (its heap has grown with the batches run
                # since): kept again, smaller, and every round starts again, so that all rounds serve one batch.
                b, n, d = shrunk
                rekept += 1
                name = b.strategy.label()
                # One fewer, not the excess's worth: this peak is the heap's drift, not the batch's own need.
                n2, tries = bench.keep(b, n - 1, budget)
                plan[name] = (n2, bench.working_set(b, n2) if n2 else {})
                kept[name]["keep_tries"] = "; ".join([kept[name]["keep_tries"],
                                                      f"{n} {d['budget_status']} in round {r + 1}", *tries])
                print(f"  {b.strategy.name} x {n}: {d['budget_status']} in round {r + 1}; kept again: {n2} "
                      f"({', '.join(tries) or 'none'}); the rounds start again", flush=True)
                probe = _overflow_probe(built, plan)
                done, r = [], 0
            rows.extend(done)
            write_csv(rows, out)
        del built
    return rows


def step_flops_rate(row: Any) -> float:
    """The FLOP/s a decode step's products reach, from one row of this command's CSV: measured at the row's batch
    in the dtype they compute in (``decode_flops_per_s``), else the square matmul's (CSVs written before it)."""
    rate = row.get("decode_flops_per_s", math.nan)
    return float(rate) if rate == rate and rate else float(row["flops_per_s"])


def _cuda_budget(device: str, budget: int) -> None:
    """On CUDA the budget is the allocator's too: past it an allocation raises out-of-memory."""
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), index)


def _overflow_probe(built: list[Built], plan: dict[str, tuple[int, dict[str, int]]]) -> tuple[Built, int, dict] | None:
    """``full`` at the largest batch another strategy fits, when that is more than ``full`` fits: the row that
    shows what the budget means (refused before it starts, or stopped when the limit is crossed)."""
    full = next((b for b in built if b.strategy.name == "full"), None)
    if full is None:
        return None
    others = [plan[b.strategy.label()][0] for b in built if b is not full]
    n = max(others, default=0)
    if n <= plan[full.strategy.label()][0]:
        return None
    return full, n, {}


def _commit() -> str:
    """The kvbench checkout's git commit (with ``+dirty`` for uncommitted changes outside ``results/``, which the
    benchmarks themselves write), or "" outside git."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!results"],
                               cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+dirty" if dirty else "")


def _processor(device: str) -> str:
    """What ran the rows, for the table's header: the CPU's model and instruction sets, or the GPU's name."""
    from kvbench import kernels

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return kernels.cpu_description()


def write_csv(rows: list[dict[str, Any]], out: Path) -> None:
    """All rows so far, written to a temporary file and renamed: a crash leaves the previous complete file."""
    import pandas as pd

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    pd.DataFrame(rows).to_csv(tmp, index=False)
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvbench throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. 'strategies=[int8,int4]' budget=2GB")
    p.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    args = p.parse_args(argv)
    try:
        cfg = compose(args.overrides)
        check(cfg)
        if args.cfg:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(cfg), end="")
            return 0
        out = Path(str(cfg.out))
        started = time.time()
        rows = run(cfg, out, " ".join(["kvbench throughput", *args.overrides]))
    except KVBenchError as exc:
        print(f"kvbench throughput: error: {exc}", file=sys.stderr)
        return 2
    print(f"{len(rows)} rows in {time.time() - started:.0f} s -> {out}")
    return 0
