"""``kvbench throughput``: how many sequences fit a memory budget under each strategy, and how fast they decode.

    kvbench throughput                                   # the hardware profile's memory is the budget
    kvbench throughput 'strategies=[int8,int4]' 'contexts=[4096,8192]' 'budget=[1.5GB,2GB]' steps=16 repeats=5
    kvbench throughput model=llama-3.2-1b-random prefill=synthetic 'contexts=[16384,32768]' 'budget=weights+2.5GB'

Hydra-configured (``conf/throughput.yaml``; keys, defaults and types are :class:`ThroughputConfig`; ``model=``
and ``hardware=`` are the groups of ``python -m kvbench``). Per context length, one sequence is prefilled
(``prefill=shared``: one full-attention capture every strategy compresses, as the benchmark does;
``synthetic``: seeded random K/V handed to each store as its prefill (drawn in ``chunk_tokens`` chunks), no model
forward — for random-weight models, where only memory and speed mean anything). Then, per budget and strategy:

1. **capacity**: the budget minus the weights as the engine holds them (:func:`kvbench.footprint.weight_bytes`)
   is what sequences may use. One sequence's decode working set is measured
   (:func:`kvbench.footprint.decode_working_set`: stored bytes + scratch + the attention's peak); the batch
   of ``floor(available / that)`` copies is measured again as a batch and grown or shrunk one sequence at a
   time until it is the largest whose measured working set fits;
2. **throughput**: that many sequences, each a copy of the compressed cache given a question of its own length
   (``question_tokens`` minus 0-3, so rows are ragged and the engine's per-row masks are exercised), decode
   ``steps`` greedy tokens together. Measured: ms per step (median), decode tokens/s (sequences × steps /
   time), the question pass (the first token of every row), the prefill and compression of one sequence
   (time to first token = the three), and the process's peak RSS while decoding. Strategies take turns within
   each of ``repeats`` rounds, so each round's gain over ``full`` is a ratio within one stretch of machine time.

Also recorded, for the roofline (``scripts/bench_throughput.py``): the copy bandwidth and float32 matmul FLOP/s
measured at the start, and per step the weight bytes read, the KV bytes read and the FLOPs.

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


@dataclass
class ThroughputConfig:
    """``kvbench throughput`` keys (``conf/throughput.yaml`` adds the ``model`` and ``hardware`` groups)."""

    model: Any = None
    hardware: Any = None
    strategies: List[str] = field(default_factory=lambda: ["int8"])  # noqa: UP006  (``full`` is always added)
    strategies_params: Dict[str, Any] = field(default_factory=dict)  # noqa: UP006
    contexts: List[int] = field(default_factory=lambda: [4096])  # noqa: UP006
    # One budget or a list: bytes, "1.5GB", "2GiB", or "weights+2GB" (the weights as held, plus that); null:
    # the hardware profile's memory_bytes.
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


def parse_size(text: Any, weights: int = 0) -> int:
    """Bytes from ``123``, ``1.5GB``, ``2GiB`` or ``weights+2GB`` (``weights``: the weights' bytes)."""
    s = str(text).strip().replace(" ", "").replace("_", "")
    base = 0
    if s.lower().startswith("weights+"):
        base, s = weights, s[len("weights+"):]
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([A-Za-z]*)", s)
    if not m or m.group(2).upper() not in _UNITS:
        raise KVBenchError(f"budget {text!r} is not a size; valid: bytes, e.g. 1.5GB, 2GiB, 512MB, weights+2GB")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise KVBenchError(f"budget {text!r} must be positive")
    return base + int(value)


def check(cfg: Any) -> list[Any]:
    """Everything that needs no model; returns the strategies (``full`` first)."""
    from kvbench.attention import CHOICES as ATTENTION
    from kvbench.config import resolve_strategies
    from kvbench.linear import CHOICES as LINEAR

    if cfg.prefill not in PREFILLS:
        raise KVBenchError(f"unknown prefill {cfg.prefill!r}; valid: {', '.join(PREFILLS)}")
    if cfg.attention not in ATTENTION:
        raise KVBenchError(f"unknown attention {cfg.attention!r}; valid: {', '.join(ATTENTION)}")
    if cfg.linear not in LINEAR:
        raise KVBenchError(f"unknown linear {cfg.linear!r}; valid: {', '.join(LINEAR)}")
    for key in ("steps", "repeats", "question_tokens", "chunk_tokens", "max_batch"):
        if int(cfg[key]) < 1:
            raise KVBenchError(f"{key} must be >= 1 (got {cfg[key]})")
    if int(cfg.question_tokens) < RAGGED:
        raise KVBenchError(f"question_tokens must be >= {RAGGED} (rows differ by up to {RAGGED - 1} tokens)")
    if not cfg.contexts or any(int(c) < 1 for c in cfg.contexts):
        raise KVBenchError(f"contexts must be positive token counts (got {list(cfg.contexts)})")
    for b in _budget_list(cfg):
        if b is not None:
            parse_size(b, 1)
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
    cache: Any
    compress_s: float
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


class Bench:
    """The model, its engine and the machine figures shared by every measurement of one run."""

    def __init__(self, cfg: Any, hw: Any) -> None:
        from kvbench.engine import Engine
        from kvbench.footprint import weight_bytes
        from kvbench.hardware_probe import measure_copy_bandwidth, measure_matmul_flops
        from kvbench.models import load_model
        from kvbench.spec import release_freed_memory

        self.cfg, self.device = cfg, str(hw.device)
        dtype = str(cfg.dtype or cfg.model.get("dtype") or hw.dtype)
        self.lm = load_model(str(cfg.model.name), dtype=dtype, device=self.device, path=cfg.model.get("path"),
                             seed=int(cfg.seed))
        self.engine = Engine(self.lm, device=self.device, hardware=hw, attention=str(cfg.attention),
                             linear=str(cfg.linear), working_copy=bool(cfg.working_copy))
        self.engine.warmup()
        release_freed_memory()  # building a random-weight model frees its float32 initialisation
        self.weights = weight_bytes(self.lm.model)
        self.dtype = self.lm.model.dtype
        self.bandwidth = measure_copy_bandwidth(256 * 2**20, device=self.device) * 1e9
        flops_dtype = "float32" if self.device == "cpu" else dtype
        self.flops = measure_matmul_flops(1024, flops_dtype, device=self.device)
        self.vocab = int(self.lm.config.vocab_size)

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
            self.engine.bind(s, ids)
            with Timer(self.device) as t:
                cache = synthetic_cache(s, self.lm.config, context, int(cfg.chunk_tokens), self.dtype, self.device,
                                        int(cfg.seed))
            out.append(Built(s, cache, t.seconds))
        return out, float("nan")

    def batch(self, built: Built, rows: int) -> tuple[Any, list[Any], float, list[list[int]]]:
        """``rows`` copies of ``built``'s cache after each row's question (timed): (batched cache, the copies,
        the question pass's seconds, each row's first generated token)."""
        from kvbench.cache import RowsCache
        from kvbench.engine import attached, clone_cache
        from kvbench.spec import Timer

        caches = [clone_cache(built.cache, self.lm.model) for _ in range(rows)]
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

    def working_set(self, built: Built, rows: int) -> dict[str, int]:
        """The measured working set of ``rows`` copies decoding one step together (after their question), measured
        once per size (:attr:`Built.measured`)."""
        from kvbench.footprint import decode_working_set

        if rows not in built.measured:
            cache, _, _, tokens = self.batch(built, rows)
            built.measured[rows] = decode_working_set(self.lm.model, cache,
                                                      lambda: self.step(cache, built.strategy, tokens), self.device)
        return dict(built.measured[rows])

    def capacity(self, built: Built, available: int, single: dict[str, int]) -> tuple[int, dict[str, int]]:
        """The largest batch (at most ``max_batch``) whose measured working set fits ``available`` bytes.

        From ``floor(available / one sequence's working set)``: shrunk one at a time while it does not fit, then
        grown by the marginal cost measured so far and, past the budget, bisected; every size tried is measured
        (working sets grow with the batch, so the largest fitting size is found)."""
        per, cap = single["working_set_bytes"], int(self.cfg.max_batch)
        rows = min(cap, available // per) if per else cap
        if rows < 1:
            return 0, single
        ws = self.working_set(built, rows)
        while ws["working_set_bytes"] > available and rows > 1:
            rows -= 1
            ws = self.working_set(built, rows)
        if ws["working_set_bytes"] > available:
            return 0, single
        while rows < cap:
            marginal = (ws["working_set_bytes"] - per) / (rows - 1) if rows > 1 else per
            guess = min(cap, rows + max(1, int((available - ws["working_set_bytes"]) // max(marginal, 1))))
            more = self.working_set(built, guess)
            if more["working_set_bytes"] <= available:
                rows, ws = guess, more
                continue
            lo, hi = rows, guess  # lo fits, hi does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                m = self.working_set(built, mid)
                if m["working_set_bytes"] <= available:
                    lo, ws = mid, m
                else:
                    hi = mid
            rows = lo
            break
        return rows, ws

    def decode(self, built: Built, rows: int) -> dict[str, float]:
        """One timed round: ``rows`` sequences answer their questions and decode ``steps`` tokens together."""
        from kvbench.spec import PeakMemory, Timer, median

        cache, caches, first_s, tokens = self.batch(built, rows)
        times = []
        with PeakMemory(self.device) as peak:
            for _ in range(int(self.cfg.steps)):
                with Timer(self.device) as t:
                    tokens = self.step(cache, built.strategy, tokens)
                times.append(t.seconds)
        reads, held = attention_reads(caches[0], self.dtype.itemsize)
        del cache, caches
        return {"question_s": first_s, "ms_per_step": 1000 * median(times),
                "tokens_per_s": rows * len(times) / sum(times), "peak_rss_bytes": peak.peak_bytes,
                "kv_read_bytes_per_seq": reads, "held_tokens_per_seq": held}


def roofline_fields(bench: Bench, rows: int, reads: float, held_tokens: float) -> dict[str, float]:
    """Bytes and FLOPs of one decode step of ``rows`` sequences: weights + KV read, linear + attention FLOPs."""
    from kvbench.hardware import attention_flops

    cfg = bench.lm.config
    wbytes, params = linear_bytes_read(bench.lm.model, rows)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    # held_tokens sums every layer's held tokens (the same formula `kvbench advise` predicts with).
    attn = attention_flops(head_dim, held_tokens, heads)
    native, _ = linear_bytes_read(bench.lm.model, 1)
    return {"weight_read_bytes": wbytes, "weight_native_read_bytes": native, "kv_read_bytes": rows * reads,
            "flops": rows * (2 * params + attn)}


def run(cfg: Any, out: Path, command: str = "") -> list[dict[str, Any]]:
    """Measure every context, budget and strategy of ``cfg``; rows also go to ``out`` as they finish."""
    from kvbench.hardware import HardwareProfile

    strategies = check(cfg)
    hw = HardwareProfile.from_config(cfg.hardware)
    if hw.threads:
        torch.set_num_threads(int(hw.threads))
    bench = Bench(cfg, hw)
    budgets = [(str(b) if b is not None else f"{hw.name} memory",
                parse_size(b, bench.weights) if b is not None else int(hw.memory_bytes)) for b in _budget_list(cfg)]
    print(f"kvbench throughput: {bench.lm.name} ({bench.dtype}), weights as held {bench.weights / 1e9:.3f} GB; "
          f"copy bandwidth {bench.bandwidth / 1e9:.1f} GB/s, matmul {bench.flops / 1e9:.1f} GFLOP/s", flush=True)
    rows: list[dict[str, Any]] = []
    common = {"command": command, "commit": _commit(), "model": bench.lm.name,
              "dtype": str(bench.dtype).replace("torch.", ""),
              "device": bench.device,
              "hardware": hw.name, "prefill": str(cfg.prefill), "steps": int(cfg.steps),
              "weights_bytes": bench.weights, "bandwidth_bytes_per_s": bench.bandwidth,
              "flops_per_s": bench.flops, "threads": torch.get_num_threads(), "linear": bench.engine.linear,
              "attention": bench.engine.attention, "working_copy": bool(cfg.working_copy)}
    for context in map(int, cfg.contexts):
        limit = bench.lm.max_context
        if limit and context + int(cfg.question_tokens) + int(cfg.steps) > limit:
            raise KVBenchError(f"context {context} + question + steps exceeds {bench.lm.name}'s maximum of {limit} "
                               "tokens; lower contexts")
        built, prefill_s = bench.build(strategies, context)
        singles = {b.strategy.label(): bench.working_set(b, 1) for b in built}
        for label, budget in budgets:
            available = budget - bench.weights
            plan = {}
            for b in built:
                n, ws = bench.capacity(b, available, singles[b.strategy.label()]) if available > 0 else (0, {})
                plan[b.strategy.label()] = (n, ws)
                print(f"  {context} tokens, budget {label}: {b.strategy.name} fits {n}", flush=True)
            for r in range(int(cfg.repeats)):
                for b in built:
                    n, ws = plan[b.strategy.label()]
                    single = singles[b.strategy.label()]
                    row = {**common, "context": context, "budget": label, "budget_bytes": budget,
                           "strategy": b.strategy.name, "label": b.strategy.label(), "round": r, "batch": n,
                           "prefill_s": prefill_s, "compress_s": b.compress_s,
                           "seq_kv_bytes": single["kv_bytes"], "seq_scratch_bytes": single["scratch_bytes"],
                           "seq_working_set_bytes": single["working_set_bytes"],
                           "batch_working_set_bytes": ws.get("working_set_bytes", 0),
                           "batch_temp_bytes": ws.get("temp_bytes", 0)}
                    row["load_1m"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
                    if n:
                        d = bench.decode(b, n)
                        row.update(d)
                        row.update(roofline_fields(bench, n, d["kv_read_bytes_per_seq"], d["held_tokens_per_seq"]))
                        row["ttft_s"] = (0.0 if math.isnan(prefill_s) else prefill_s) + b.compress_s + d["question_s"]
                    rows.append(row)
            write_csv(rows, out)
        del built
    return rows


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
