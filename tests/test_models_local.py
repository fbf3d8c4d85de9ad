"""Loading a user's model (issue 24): one line at once for every way it can be missing, attention kernels as a
validated key, and records that name the model so two local models never merge in the leaderboard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from test_arch_matrix import ROWS, _save, tiny  # the families' tiny configs and checkpoint writer

from kvbench.errors import KVBenchError
from kvbench.models import ATTN_IMPLEMENTATIONS, TOKENIZER_FILES, display_name, load_model, tiny_llama


def test_local_without_path_is_one_line() -> None:
    with pytest.raises(KVBenchError, match=r"model=local needs model.path="):
        load_model("local", path=None)


def test_hub_id_outside_the_local_cache_is_refused_without_a_download(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache
    with pytest.raises(KVBenchError, match=r"neither a local directory nor in the local hub cache"):
        load_model("local", path="some-org/some-model")


def test_checkpoint_without_tokenizer_names_the_missing_files(tmp_path) -> None:
    tiny_llama(seed=0).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(KVBenchError) as err:
        load_model("local", path=str(tmp_path / "ckpt"))
    assert "has no tokenizer" in str(err.value) and all(f in str(err.value) for f in TOKENIZER_FILES)


def test_attn_implementation_is_validated() -> None:
    with pytest.raises(KVBenchError) as err:
        load_model("tiny-llama", attn_implementation="flash")
    assert all(v in str(err.value) for v in ATTN_IMPLEMENTATIONS)
    assert load_model("tiny-llama", attn_implementation="eager").model.config._attn_implementation == "eager"


def test_gemma2_loads_by_default_and_an_unsupported_kernel_is_one_line(tmp_path) -> None:
    path = _save("gemma2", tmp_path / "tiny-gemma2")
    lm = load_model("local", path=str(path))  # null: transformers picks eager (Gemma-2 has no sdpa)
    assert lm.name == "tiny-gemma2" and lm.model.config._attn_implementation == "eager"
    with pytest.raises(KVBenchError, match=r"cannot load model"):
        load_model("local", path=str(path), attn_implementation="sdpa")


def test_display_name() -> None:
    assert display_name("local", Path("/models/Llama-3.2-1B-Instruct"), "/models/Llama-3.2-1B-Instruct/") \
        == "Llama-3.2-1B-Instruct"
    assert display_name("my-llama", Path("/models/x"), "/models/x") == "my-llama"
    assert display_name("local", None, "org/model") == "org/model"
    assert display_name("smollm2-135m", None, None) == "smollm2-135m"


def test_two_local_models_in_one_store_are_never_merged(tmp_path, capsys) -> None:
    from kvbench import cli, leaderboard
    from kvbench.results import read_store
    from kvbench.selection import Filters

    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    results = tmp_path / "results"
    names = []
    for seed, name in ((0, "model-a"), (1, "model-b")):
        torch.manual_seed(seed)
        path = _save("llama", tmp_path / name, model=tiny("llama", attn="sdpa", seed=seed))
        names.append(name)
        cli.main(["model=local", f"model.path={path}", "task=jsonl", f"task.path={qa}", "task.n_samples=1",
                  "task.max_new_tokens=2", "task.context_tokens=96", "strategy=int8", "engine.progress=false",
                  "engine.warmup=false", "hardware.threads=1", f"results_dir={results}"])
    capsys.readouterr()
    records = read_store(results)
    assert sorted(records["model"].unique()) == names
    assert records.groupby("model")["model_digest"].nunique().eq(1).all()
    assert records["model_digest"].nunique() == 2
    with pytest.raises(KVBenchError, match=r"mix models model-a, model-b"):
        leaderboard.build(records)
    for name in names:  # one table per model, each of its own single sample
        lb = leaderboard.build(records, Filters(model=name))
        assert set(lb.table["model"]) == {name}


def test_unsupported_family_in_python_is_one_line() -> None:
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=2, n_positions=64))
    from kvbench.arch import describe

    with pytest.raises(KVBenchError, match=r"model_type 'gpt2'\) is not supported"):
        describe(model)


def test_one_name_for_two_checkpoints_is_refused() -> None:
    import pandas as pd

    from kvbench.selection import check_comparable

    same = pd.DataFrame({"model": ["model", "model"], "model_digest": ["a" * 64, "a" * 64]})
    check_comparable(same)
    with pytest.raises(KVBenchError, match=r"model model names checkpoints with different model_digest"):
        check_comparable(same.assign(model_digest=["a" * 64, "b" * 64]))


def test_gguf_conversion_without_accelerate_is_one_line(tmp_path, monkeypatch) -> None:
    """transformers' GGUF loader needs accelerate: without it, one line naming the install, not a traceback."""
    import importlib.util

    from kvbench import models

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    monkeypatch.setattr(models, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(models, "embedded_gguf_dir", lambda: tmp_path)
    with pytest.raises(KVBenchError, match=r"needs accelerate, which is not installed in .*pip install accelerate"):
        models.converted_smollm2_dir()
