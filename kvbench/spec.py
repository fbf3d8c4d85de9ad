"""Measurement spec v1.2, implemented in one place (the text is ``docs/measurement-spec.md``).

Every record carries :data:`SPEC_VERSION`; reports refuse to rank records of different versions together.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from kvbench import SPEC_VERSION, stats
from kvbench.stats import CI_LEVEL
from kvbench.tasks.metrics import TASK_METRICS

__all__ = [
    "SPEC_VERSION", "BINARY_METRICS", "PeakMemory", "accuracy_delta", "accuracy_interval", "bootstrap_mean_ci",
    "fidelity", "memory_reduction", "median",
]

BOOTSTRAP_RESAMPLES = 2000
#: Task metrics whose per-sample scores are 0 or 1 (kvbench's, from their registry, and lm-eval's per-document
#: ``acc``/``acc_norm``/``exact_match``, which imported records carry).
BINARY_METRICS = (*(n for n, m in TASK_METRICS.items() if m.binary), "acc", "acc_norm", "exact_match")
#: Task metrics with scores anywhere in [0, 1].
CONTINUOUS_METRICS = tuple(n for n, m in TASK_METRICS.items() if not m.binary)
#: ``Delta.method`` of each kind of score.
NEWCOMBE, BCA = "newcombe-paired", "bca-bootstrap"


# -- memory -----------------------------------------------------------------------------------------
def memory_reduction(kv_bytes: int, reference_bytes: int) -> float:
    """``1 - kv_bytes / reference_bytes``: the fraction of a dense reference cache of the same tokens saved (the
    model's own K/V dtype for ``memory_reduction``, 16-bit for ``memory_reduction_fp16``)."""
    if reference_bytes <= 0:
        return float("nan")
    return 1.0 - kv_bytes / reference_bytes


def release_freed_memory() -> None:
    """Hand memory the C allocator keeps after ``free`` back to the OS (glibc's ``malloc_trim``; a no-op where
    there is none). Without it a long process's RSS only grows: in one process, loading the embedded model
    three times (each freed) grew RSS by ~150 MiB a load (1,095 -> 1,405 MiB), against 579 -> 618 MiB with a
    trim after each (``scripts/bench_phases.py`` reports what a phase holds)."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None

#: Allocations of at least this many bytes get their own mapping, returned to the OS when freed.
MMAP_THRESHOLD = 1 << 20


def bound_heap_growth() -> None:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` (``mallopt(M_MMAP_THRESHOLD)``; a no-op elsewhere).

    By default glibc raises the threshold each time a mapped block is freed (up to 32 MiB), so a run's many
    few-MiB tensors (a layer's K/V in float32 while it is quantized, a prefill's activations) move onto the heap,
    whose freed space fragments and stays resident: compressing one 4K sample with int8 grew RSS by ~460 MiB for a
    55 MiB tensor peak, and the 4K process peak was 2,190 MiB. With the threshold fixed at 1 MiB the same run
    peaks at 1,792 MiB (``scripts/bench_phases.py``). Called by the CLI and the memory benchmark, not on import."""
    release_freed_memory()  # loads libc
    mallopt = getattr(_LIBC, "mallopt", None) if _LIBC else None  # glibc only
    if mallopt is not None:
        mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (glibc's malloc.h)


class PeakMemory:
    """Peak process memory over a phase: CUDA peak allocated on GPU, sampled RSS on CPU.

    RSS is sampled every ``interval`` seconds by a daemon thread (plus at entry and exit), because the
    OS only keeps a lifetime peak, which cannot be reset between phases. On CPU the phase starts from a
    trimmed heap (:func:`release_freed_memory`), so memory earlier phases freed is not counted as this one's.
    """

    def __init__(self, device: str = "cpu", interval: float = 0.002) -> None:
        self.device = device
        self.interval = interval
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = psutil.Process()

    def _sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self._proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakMemory:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            release_freed_memory()
            self._sample()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.peak_bytes = int(torch.cuda.max_memory_allocated())
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self._sample()


# -- latency ----------------------------------------------------------------------------------------
class Timer:
    """Wall-clock timer that synchronises CUDA at both ends so GPU work is inside the interval."""

    def __init__(self, device: str = "cpu") -> None:
        self.cuda = device.startswith("cuda")
        self.seconds = float("nan")

    def __enter__(self) -> Timer:
        if self.cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self._t0


def median(values: Sequence[float]) -> float:
    vals = [v for v in values if v == v]
    return float(np.median(vals)) if vals else float("nan")


# -- accuracy ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Delta:
    """Strategy minus baseline on paired samples, in percentage points, with a 95% interval.

    ``method`` names the interval: ``newcombe-paired`` (binary scores; then ``n_only_strategy`` /
    ``n_only_baseline`` count the discordant pairs and ``mcnemar_p`` is the exact McNemar p-value) or
    ``bca-bootstrap`` (continuous scores; discordant counts are 0 and ``mcnemar_p`` NaN).
    """

    baseline: float
    strategy: float
    delta_pp: float
    ci_low: float
    ci_high: float
    relative_loss: float
    n: int
    method: str = NEWCOMBE
    n_only_strategy: int = 0
    n_only_baseline: int = 0
    mcnemar_p: float = float("nan")


def bootstrap_mean_ci(values: Sequence[float], seed: int = 0,
                      resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float, float]:
    """Mean and percentile bootstrap 95% CI of ``values`` (spec v1.0's interval; kept for the task
    calibration tables, not used for accuracy deltas any more)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(resamples, x.size))
    means = x[idx].mean(axis=1)
    alpha = (1 - CI_LEVEL) / 2
    return float(x.mean()), float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def binary_metric(metrics: Sequence[str]) -> bool | None:
    """Whether scores of ``metrics`` (one comparison may pool several tasks) are binary: ``True`` when
    every metric is binary, ``False`` when any is continuous, ``None`` (decide from the scores) otherwise."""
    names = {str(m) for m in metrics}
    if names and names <= set(BINARY_METRICS):
        return True
    if names & set(CONTINUOUS_METRICS):
        return False
    return None


def _binary(binary: bool | None, *arms: np.ndarray) -> bool:
    """The metric decides (``binary``); without it, scores that are all 0/1 count as binary."""
    if binary is None:
        return all(stats.is_binary(a) for a in arms)
    if binary and not all(stats.is_binary(a) for a in arms):
        raise ValueError("a binary metric's scores must be 0 or 1")
    return binary


def accuracy_interval(scores: Sequence[float], binary: bool | None = None,
                      seed: int = 0) -> tuple[float, float, float]:
    """Mean accuracy and its 95% interval: Wilson for binary scores, BCa bootstrap for continuous ones
    (Wilson on the scores rounded to 0/1 where the bootstrap is undefined, e.g. all scores equal)."""
    x = np.asarray(scores, dtype=float)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    if _binary(binary, x):
        return (float(x.mean()), *stats.wilson_interval(int(x.sum()), x.size))
    mean, lo, hi = stats.bca_mean_interval(x, seed=seed)
    if math.isnan(lo):
        lo, hi = stats.wilson_interval(int(np.round(x).sum()), x.size)
    return mean, lo, hi


def accuracy_delta(baseline: Sequence[float], strategy: Sequence[float], seed: int = 0,
                   binary: bool | None = None) -> Delta:
    """Paired comparison on identical inputs: scores are per-sample metric values in [0, 1].

    ``delta_pp = 100 * (mean(strategy) - mean(baseline))``; ``relative_loss = (mean(baseline) -
    mean(strategy)) / mean(baseline)``. ``binary`` says whether the metric is binary (``None``: decided
    from the scores). The interval is Newcombe's paired score interval for binary scores and a BCa
    bootstrap of the paired differences for continuous ones; where the bootstrap is undefined (all
    differences equal, or one pair) the continuous scores are rounded to 0/1 and get the Newcombe
    interval, so an all-agree comparison never reports a zero-width interval.
    """
    b = np.asarray(baseline, dtype=float)
    s = np.asarray(strategy, dtype=float)
    if b.shape != s.shape:
        raise ValueError(f"paired scores need equal lengths, got {b.size} and {s.size}")
    bm = float(b.mean()) if b.size else float("nan")
    sm = float(s.mean()) if s.size else float("nan")
    rel = (bm - sm) / bm if bm and not math.isnan(bm) else float("nan")
    if b.size == 0:
        return Delta(bm, sm, float("nan"), float("nan"), float("nan"), rel, 0)
    if not _binary(binary, b, s):
        mean_d, lo, hi = stats.bca_mean_interval(s - b, seed=seed)
        if not math.isnan(lo):
            return Delta(bm, sm, 100 * mean_d, 100 * lo, 100 * hi, rel, int(b.size), BCA)
        b, s = np.round(b), np.round(s)  # the bootstrap is undefined: fall back to the binary interval
        counts = stats.paired_counts(s, b)
        _, lo, hi = stats.newcombe_paired_interval(counts)
        d = sm - bm
        return Delta(bm, sm, 100 * d, 100 * min(lo, d), 100 * max(hi, d), rel, int(b.size), NEWCOMBE,
                     counts.only_a, counts.only_b, stats.mcnemar_exact_p(counts.only_a, counts.only_b))
    counts = stats.paired_counts(s, b)
    d, lo, hi = stats.newcombe_paired_interval(counts)
    return Delta(bm, sm, 100 * d, 100 * lo, 100 * hi, rel, int(b.size), NEWCOMBE, counts.only_a, counts.only_b,
                 stats.mcnemar_exact_p(counts.only_a, counts.only_b))


@dataclass(frozen=True)
class Fidelity:
    kl: float
    top1_agreement: float
    gold_nll: float
    gold_token_accuracy: float


def fidelity(logp_baseline: torch.Tensor, logp_strategy: torch.Tensor, gold: torch.Tensor) -> Fidelity:
    """Teacher-forced fidelity over answer positions.

    ``logp_*``: ``[positions, vocab]`` log-probabilities; ``gold``: ``[positions]`` token ids.
    ``kl`` = mean over positions of KL(baseline || strategy) in nats; ``top1_agreement`` = fraction of
    positions whose argmax agrees; ``gold_nll`` = mean NLL of the gold tokens under the strategy;
    ``gold_token_accuracy`` = fraction of positions whose argmax is the gold token.
    """
    pb, ps = logp_baseline.float(), logp_strategy.float()
    kl = (pb.exp() * (pb - ps)).sum(-1).mean().item()
    agree = (pb.argmax(-1) == ps.argmax(-1)).float().mean().item()
    nll = -ps.gather(-1, gold[:, None]).mean().item()
    acc = (ps.argmax(-1) == gold).float().mean().item()
    return Fidelity(max(kl, 0.0), agree, nll, acc)
