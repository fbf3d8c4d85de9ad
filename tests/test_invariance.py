"""Results must not depend on what else ran: every registered strategy's records are identical whether it runs
alone (beside the ``full`` baseline) or beside every other strategy, in either order (issue 12).

The engine shares one prefill per sample and captures the widest query window any co-run strategy asks for, so
a strategy that reads more of the capture than its own window, or state another strategy left behind (an RNG,
a hook, a mutated tensor), shows up here. Parametrized over ``strategies.available()``: a new strategy is
covered without editing this file.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kvbench import strategies
from kvbench.config import strategy_params
from kvbench.engine import Engine
from kvbench.hardware import HardwareProfile
from kvbench.loop import run_samples
from kvbench.models import ByteTokenizer, LoadedModel, tiny_llama
from kvbench.tasks.base import Sample

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("single_torch_thread")

# What a reader cites from a record; timings and peak bytes legitimately vary between runs.
COMPARED = ("prediction", "score", "kv_bytes", "kl", "top1_agreement", "gold_nll", "gold_token_accuracy")
NAMES = strategies.available()


def _build(name: str) -> Any:
    """The strategy at the defaults the CLI gives it (the composed config of ``strategy=name``)."""
    return strategies.build(name, strategy_params(name))


def _samples() -> list[Sample]:
    # Long enough that every default budget, residual window and hot tier actually compresses something.
    g = torch.Generator().manual_seed(11)
    return [Sample(sample_id=f"s{i}", prefix_ids=torch.randint(1, 255, (320,), generator=g).tolist(),
                   query_ids=list(b"Q: x?"), gold_ids=list(b"ab c"), answers=["ab"], metric="substring",
                   max_new_tokens=4) for i in range(2)]


@cache
def _engine() -> Engine:
    profile = HardwareProfile.from_config(yaml.safe_load((ROOT / "conf" / "hardware" / "cpu.yaml").read_text()))
    # head_dim 64, so every strategy's default group/block size divides it, as on real models.
    lm = LoadedModel("tiny-llama", tiny_llama(seed=0, hidden_size=128, head_dim=64), ByteTokenizer())
    return Engine(lm, device="cpu", hardware=profile, run_fields={"config_hash": "invariance"})


@cache
def _run(names: tuple[str, ...]) -> dict[tuple[str, str], dict[str, Any]]:
    """Records keyed by (strategy name, sample id) of one run of ``full`` + ``names`` (fresh instances)."""
    strats = [strategies.build("full")] + [_build(n) for n in names if n != "full"]
    out: list[dict[str, Any]] = []
    run_samples(_engine(), _samples(), strats, set(), out.extend)
    return {(r["strategy_name"], r["sample_id"]): r for r in out}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("company", ["forward", "reverse"])
def test_records_do_not_depend_on_co_run_strategies(name: str, company: str) -> None:
    alone = _run((name,))
    everyone = _run(tuple(NAMES) if company == "forward" else tuple(reversed(NAMES)))
    diffs = []
    for sample in _samples():
        a, b = alone[(name, sample.sample_id)], everyone[(name, sample.sample_id)]
        diffs += [f"{sample.sample_id}.{k}: alone {a[k]!r} vs with all ({company}) {b[k]!r}"
                  for k in COMPARED if not _same(a[k], b[k])]
    assert not diffs, f"{name} changes when other strategies run beside it: " + "; ".join(diffs)
