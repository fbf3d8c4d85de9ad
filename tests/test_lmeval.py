"""lm-eval integration on the tiny model: the ``kvbench`` model against lm-eval's own ``hf`` model, compressed
caches, task export, result import into the store and the leaderboard, and command-line registration."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from kvbench import SPEC_VERSION, lmeval  # noqa: E402
from kvbench.errors import KVBenchError  # noqa: E402
from kvbench.results import RECORD_KEY, read_store  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS_DIR = ROOT / "tests" / "fixtures" / "lmeval"
FIXTURE_TASKS = ["kvbench_tiny_mc", "kvbench_tiny_gen", "kvbench_tiny_rolling"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, the alphabet of byte-level BPE."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def save_tiny_checkpoint(directory: Path) -> Path:
    """``tiny_llama()`` as a transformers checkpoint with a byte-level fast tokenizer (id = byte value, as
    kvbench's ByteTokenizer), loadable by lm-eval's ``hf`` model and by ``load_model`` from a path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvbench.models import tiny_llama

    b2u = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=b2u[0], model_max_length=2048)
    model = tiny_llama(seed=0)
    # Byte 0 is the end of sequence for both tokenizers; no BOS, as kvbench's tiny model has none.
    model.config.eos_token_id, model.config.bos_token_id = 0, None
    model.generation_config.eos_token_id, model.generation_config.bos_token_id = 0, None
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Other test processes share two cores; one thread keeps these runs fast and deterministic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_lm(tiny_dir: Path) -> Any:
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(tiny_dir), device="cpu", batch_size=1, max_length=48)


def _kv(tiny_dir: Path, **kwargs: Any) -> lmeval.KVBenchLM:
    return lmeval.KVBenchLM(pretrained=str(tiny_dir), device="cpu", **kwargs)


def _requests() -> dict[str, list[Instance]]:
    ctx = "Alice keeps the red key in the blue box. Where is the key? "
    long_text = "The river bends twice before the old mill, where the miller counts sacks. " * 2
    return {
        "loglikelihood": [Instance("loglikelihood", {}, (ctx, c), i)
                          for i, c in enumerate(["In the blue box.", "Under the mat.", "x"])]
        + [Instance("loglikelihood", {}, ("", "hello there"), 3),
           # longer than max_length=48: both left-truncate the context the same way
           Instance("loglikelihood", {}, (long_text, " and so on"), 4)],
        "loglikelihood_rolling": [Instance("loglikelihood_rolling", {}, (long_text,), 0)],
        "generate_until": [Instance("generate_until", {}, (ctx, {"until": ["\n", "."], "max_gen_toks": 12,
                                                                 "do_sample": False}), 0),
                           Instance("generate_until", {}, ("Count: one two", {"until": ["zzz"], "max_gen_toks": 8}),
                                    1)],
    }


# ------------------------------------------------------------------------------ cross-check with hf


def test_full_equals_lm_eval_hf_request_by_request(tiny_dir, hf_lm):
    """strategy=full through the compressed-cache path (prefill, rebuild, continue) is lm-eval's hf model:
    log-likelihoods, greedy flags, rolling windows past max_length (chunked), and greedy generations."""
    kv = _kv(tiny_dir, max_length=48, rolling_chunk=16)
    reqs = _requests()
    ours, theirs = kv.loglikelihood(reqs["loglikelihood"]), hf_lm.loglikelihood(reqs["loglikelihood"])
    for (a, ga), (b, gb) in zip(ours, theirs, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
        assert ga == gb
    (ra,), (rb,) = kv.loglikelihood_rolling(reqs["loglikelihood_rolling"]), \
        hf_lm.loglikelihood_rolling(reqs["loglikelihood_rolling"])
    assert ra == pytest.approx(rb, abs=1e-3)
    assert kv.generate_until(reqs["generate_until"]) == hf_lm.generate_until(reqs["generate_until"])
    assert kv.stats.caches > 0  # every request went through a cache built from a captured prefill


def test_full_equals_lm_eval_hf_on_tasks(tiny_dir):
    """The same through lm-eval's evaluator on the fixture tasks (multiple choice, generation, perplexity):
    identical per-document responses and metrics."""
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    common = dict(tasks=FIXTURE_TASKS, task_manager=tm, log_samples=True, bootstrap_iters=0, device="cpu")
    ours = lm_eval.simple_evaluate(model="kvbench", model_args={"pretrained": str(tiny_dir)}, **common)
    theirs = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(tiny_dir)}, **common)
    for task in FIXTURE_TASKS:
        for a, b in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            assert a["doc_id"] == b["doc_id"]
            for ra, rb in zip(a["resps"], b["resps"], strict=True):
                if isinstance(ra[0], str):
                    assert ra == rb
                else:  # (loglikelihood, is_greedy) or a rolling total
                    va = ra[0][0] if isinstance(ra[0], tuple) else ra[0]
                    vb = rb[0][0] if isinstance(rb[0], tuple) else rb[0]
                    assert float(va) == pytest.approx(float(vb), abs=1e-3)
        for key, value in theirs["results"][task].items():
            if isinstance(value, float):
                assert ours["results"][task][key] == pytest.approx(value, rel=1e-4), (task, key)
    info = ours["config"]["kvbench"]
    assert info["strategy"] == "full" and info["cache"]["requests"]["generate_until"] == 4


# ------------------------------------------------------------------------------- compressed caches


def test_compression_reaches_every_continuation_token(tiny_dir):
    full, int8 = _kv(tiny_dir), _kv(tiny_dir, strategy="int8", **{"strategy.group_size": 16})
    req = [Instance("loglikelihood", {}, ("Alice keeps the red key in the blue box. Where? ", "B"), 0)]
    (a, _), (b, _) = full.loglikelihood(req)[0], int8.loglikelihood(req)[0]
    # a one-token continuation is predicted from the held-back last context token, against the int8 cache
    assert a != b and a == pytest.approx(b, abs=0.05)
    cache = int8.get_model_info()["kvbench"]["cache"]
    # float32 model, int8 with a float16 scale per 16 channels: 9 bits against the 16-bit reference
    assert cache["memory_reduction"] == pytest.approx(1 - 9 / 32)  # against the float32 model's own cache
    assert cache["memory_reduction_fp16"] == pytest.approx(1 - 9 / 16)
    assert cache["caches"] == 1 and cache["kept_fraction"] == pytest.approx(1.0)


def test_strategy_parameter_spellings_and_yaml_defaults(tiny_dir):
    assert lmeval.build_strategy("int8").label() == "int8(axis=token,group_size=64)"  # conf/strategy/int8.yaml
    dotted = _kv(tiny_dir, strategy="int8", **{"strategy.group_size": 16})
    as_dict = _kv(tiny_dir, strategy="int8", strategy_params={"group_size": 16})
    as_json = _kv(tiny_dir, strategy="int8", strategy_params='{"group_size": 16}')
    assert dotted.strategy.label() == as_dict.strategy.label() == as_json.strategy.label() \
        == "int8(axis=token,group_size=16)"
    nested = lmeval.build_strategy("compose", {"evict": "streaming_llm", "evict_params": {"budget_tokens": 8}})
    assert nested.params()["evict_params"]["budget_tokens"] == 8
    with pytest.raises(KVBenchError, match="has no parameter"):
        lmeval.build_strategy("int8", {"bits": 4})
    with pytest.raises(KVBenchError, match="JSON object"):
        lmeval.strategy_params_from_arg("group_size=16")
    with pytest.raises(KVBenchError, match="query_tokens"):
        _kv(tiny_dir, query_tokens=0)


# ------------------------------------------------------------------------------- export and import


@pytest.fixture
def unit_tasks() -> Any:
    """Two harness tasks on byte tokens, a generation task (substring) and a continuation task, registered
    for one test only (other tests may list the registered tasks)."""
    from kvbench.tasks import base

    _register_unit_tasks()
    yield
    for name in ("lmeval_unit_gen", "lmeval_unit_cont"):
        base._TASKS.pop(name, None)


def _register_unit_tasks() -> None:
    from kvbench.tasks.base import Sample, register_task

    def build(metric: str) -> Any:
        def builder(cfg: Any, tokenizer: Any, max_context: int) -> list[Sample]:
            out = []
            for i in range(int(cfg.get("n_samples", 3))):
                doc = f"Record {i}: the password is {i}{i}{i}. " * 3
                out.append(Sample(f"u{i}", tokenizer.encode(doc), tokenizer.encode("Q: password? A:"),
                                  tokenizer.encode(f" {i}{i}{i}"), [f"{i}{i}{i}"], metric, {"i": i}, 4))
            return out
        return builder

    register_task("lmeval_unit_gen")(build("substring"))
    register_task("lmeval_unit_cont")(build("token_accuracy"))


def _evaluate_to_files(task_dir: Path, tasks: list[str], out: Path, model_args: dict[str, Any]) -> Path:
    """Run lm-eval in-process and save its outputs exactly as its CLI does (results + per-sample files)."""
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(task_dir), include_defaults=False)
    tracker = EvaluationTracker(output_path=str(out))
    res = lm_eval.simple_evaluate(model="kvbench", model_args=model_args, tasks=tasks, task_manager=tm,
                                  log_samples=True, bootstrap_iters=0, device="cpu",
                                  evaluation_tracker=tracker)
    samples = res.pop("samples")
    tracker.save_results_aggregated(results=res, samples=samples)
    for task in res["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])
    (found,) = list(out.rglob("results_*.json"))
    return found


def test_export_run_import_round_trip_into_store_and_leaderboard(tmp_path, capsys, unit_tasks):
    out = tmp_path / "tasks"
    assert lmeval.main(["export", "--task", "lmeval_unit_gen,lmeval_unit_cont", "--out", str(out),
                        "--model", "tiny-llama", "--set", "n_samples=3"]) == 0
    assert "--include_path" in capsys.readouterr().out
    rows = [json.loads(x) for x in (out / "kvbench_lmeval_unit_gen.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["u0", "u1", "u2"] and rows[1]["answers"] == ["111"]
    assert rows[0]["prompt"].endswith("Q: password? A:") and rows[0]["metric"] == "substring"
    assert "output_type: generate_until" in (out / "kvbench_lmeval_unit_gen.yaml").read_text()
    assert "output_type: loglikelihood" in (out / "kvbench_lmeval_unit_cont.yaml").read_text()

    tasks = ["kvbench_lmeval_unit_gen", "kvbench_lmeval_unit_cont"]
    full_json = _evaluate_to_files(out, tasks, tmp_path / "full", {"pretrained": "tiny-llama"})
    _evaluate_to_files(out, tasks, tmp_path / "int8",
                                   {"pretrained": "tiny-llama", "strategy": "int8", "strategy.group_size": 16})
    results = tmp_path / "results"
    assert lmeval.main(["import", str(full_json), str(tmp_path / "int8"), "--results-dir", str(results)]) == 0
    assert lmeval.main(["import", str(full_json), "--results-dir", str(results)]) == 0  # again: no duplicates
    store = read_store(results)
    assert len(list((results / "store").glob("lmeval-*.parquet"))) == 2
    assert not store.duplicated(subset=RECORD_KEY).any()
    gen = store[store["task"] == "kvbench_lmeval_unit_gen"]
    # per-document records (from --log_samples files), scored with kvbench's own metric
    assert sorted(gen["sample_id"].unique()) == ["doc-0", "doc-1", "doc-2"]
    assert set(gen["metric"]) == {"substring"} and gen["score"].between(0, 1).all()
    cont = store[store["task"] == "kvbench_lmeval_unit_cont"]
    assert set(cont["metric"]) == {"acc"} and len(cont) == 2 * 3
    assert all("perplexity,none" in json.loads(m) for m in cont["lmeval_metrics"])
    int8 = store[store["strategy_name"] == "int8"]
    assert set(store["strategy"]) == {"full", "int8(axis=token,group_size=16)"}
    assert int8["memory_reduction"].tolist() == pytest.approx([1 - 9 / 32] * len(int8))  # the float32 model's own
    assert int8["memory_reduction_fp16"].tolist() == pytest.approx([1 - 9 / 16] * len(int8))
    assert (store["spec_version"] == SPEC_VERSION).all()
    assert store["kl"].isna().all() and store["decode_ms_per_token"].isna().all()
    assert (store["model"] == "tiny-llama").all() and (store["source"] == "lm-eval").all()

    leaderboard = pytest.importorskip("kvbench.leaderboard")
    lb = leaderboard.build(store)
    assert set(lb.table["strategy"]) == {"full", "int8(axis=token,group_size=16)"}
    assert not math.isnan(lb.table.set_index("strategy").loc["int8(axis=token,group_size=16)",
                                                              "kvbench_lmeval_unit_gen.memory_reduction"])


def test_import_rejects_what_is_not_lm_eval_output(tmp_path):
    bad = tmp_path / "results_x.json"
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(KVBenchError, match="not an lm-eval results JSON"):
        lmeval.lmeval_records(bad)
    assert lmeval.main(["import", str(tmp_path / "nothing-here"), "--results-dir", str(tmp_path)]) == 2


# ----------------------------------------------------------------------------- command-line registration


@pytest.mark.integration
def test_command_line_run_registers_the_model(tmp_path):
    """`python -m kvbench.lmeval run ...` is lm-eval's own CLI with `kvbench` registered (lm-eval 0.4 has no
    model plugin entry points), then its output imports. A fresh interpreter: ~30 s on two cores."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvbench.lmeval", "run", "--model_args",
           "pretrained=tiny-llama,strategy=int8,strategy.group_size=16,threads=1",
           "--tasks", "kvbench_tiny_mc", "--include_path", str(TASKS_DIR), "--limit", "2",
           "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kvbench_tiny_mc" in proc.stdout
    (results_json,) = list(out.rglob("results_*.json"))
    assert json.loads(results_json.read_text())["config"]["kvbench"]["strategy"] == "int8(axis=token,group_size=16)"
    target, n = lmeval.import_results(results_json, tmp_path / "results")
    assert n == 2 and target.is_file()
