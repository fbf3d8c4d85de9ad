"""Projection calculator: arithmetic against hand-computed values, inversions, presets and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from kvbench import calc_cli
from kvbench.calc import (
    PRESETS,
    ModelArch,
    analyse_claim,
    arch_from_config,
    arch_from_path,
    bytes_per_element_from_token_bytes,
    count_params,
    fits,
    kv_bytes,
    kv_bytes_per_token,
    max_batch,
    max_context,
    memory_plan,
    preset,
    resolve_model,
)
from kvbench.errors import KVBenchError
from kvbench.hardware import load_profile

# (layers, KV heads, head_dim) from each model's public config.json, as listed in the brief.
EXPECTED_SHAPES = {
    "llama-3-8b": (32, 8, 128),
    "llama-3-70b": (80, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "mistral-7b": (32, 8, 128),
    "smollm2-135m": (30, 3, 64),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_SHAPES))
def test_preset_kv_shapes(name):
    arch = preset(name)
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim) == EXPECTED_SHAPES[name]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_param_counts_match_their_config(name):
    # Rebuild each preset from its config.json fields on the meta device: a mistyped field in
    # PRESETS changes the count and fails here. Layers are identical, so a 1- and a 2-layer build
    # give the count exactly (params = p1 + (L - 1)(p2 - p1)) without building 80 layers.
    entry = PRESETS[name]
    fields = entry["config"]
    p1, p2 = (count_params(AutoConfig.for_model(**{**fields, "num_hidden_layers": n})) for n in (1, 2))
    assert p1 + (fields["num_hidden_layers"] - 1) * (p2 - p1) == entry["params"]
    config = AutoConfig.for_model(**fields)
    assert arch_from_config(config) == arch_from_config(fields)


def test_hand_computed_kv_sizes():
    l70, l8 = preset("llama-3-70b"), preset("llama-3-8b")
    assert kv_bytes_per_token(l70, 2) == 2 * 80 * 8 * 128 * 2 == 327_680
    assert kv_bytes(l70, 12_000, 1, 2) == 2 * 80 * 8 * 128 * 12_000 * 2 == 3_932_160_000
    assert kv_bytes(l70.without_gqa(), 12_000, 1, 2) == 31_457_280_000
    assert kv_bytes(l8, 8192, 1, 2) == 1_073_741_824
    assert kv_bytes(l8, 8192, 4, 0.5) == 1_073_741_824  # int4 at batch 4 = fp16 at batch 1
    assert kv_bytes(preset("smollm2-135m"), 1, 1, 2) == 23_040
    assert kv_bytes(preset("qwen2.5-7b"), 32_768, 1, 0.625) == 2 * 28 * 4 * 128 * 32_768 * 0.625


def test_claim_analysis_for_the_source_document():
    c = analyse_claim(preset("llama-3-70b"), 12_000, 48e9, 2.0)
    assert c.actual_bytes == 3_932_160_000
    assert c.implied_batch == pytest.approx(48e9 / 3_932_160_000) == pytest.approx(12.207, abs=1e-3)
    assert (c.batch_below, c.batch_above) == (12, 13)
    assert c.bytes_below == 47_185_920_000 and c.bytes_above == 51_118_080_000
    assert c.mha_kv_heads == 64 and c.mha_bytes == 31_457_280_000
    assert c.context_for_claim == 146_484 and c.mha_context_for_claim == 18_310
    assert dict(c.readings)["MHA (64 KV heads), 4 B/element"] == 62_914_560_000
    assert c.max_position_embeddings == 8192


def test_memory_plan_and_fits():
    l8, gpu = preset("llama-3-8b"), load_profile("consumer-gpu-24g")
    plan = memory_plan(l8, gpu, 8192, 1, 2.0)
    assert plan.usable_bytes == pytest.approx(24 * 2**30 * 0.9)
    assert plan.weight_bytes == 8_030_261_248 * 2
    assert plan.free_bytes == pytest.approx(24 * 2**30 * 0.9 - 8_030_261_248 * 2 - 1_073_741_824)
    assert fits(l8, gpu, 8192, 1, 2.0)
    assert not fits(preset("llama-3-70b"), load_profile("server-gpu-80g"), 1, 1, 2.0)  # 141 GB of weights
    assert fits(preset("llama-3-70b"), load_profile("server-gpu-80g"), 12_000, 1, 2.0,
                weight_bytes_per_param=0.5)  # int4 weights: 35 GB
    assert not fits(l8, gpu, 8192, 1, 2.0, reserve_fraction=0.99)


@pytest.mark.parametrize(("model", "hw", "bpe"), [
    ("llama-3-8b", "consumer-gpu-24g", 2.0),
    ("qwen2.5-7b", "consumer-gpu-24g", 0.625),
    ("mistral-7b", "server-gpu-80g", 1.0),
    ("smollm2-135m", "cpu", 2.0),
])
def test_max_context_and_max_batch_are_exact_boundaries(model, hw, bpe):
    arch, profile = preset(model), load_profile(hw)
    for batch in (1, 3, 16):
        c = max_context(arch, profile, batch, bpe)
        assert c > 0 and fits(arch, profile, c, batch, bpe) and not fits(arch, profile, c + 1, batch, bpe)
        # Inverting back: at context c, the batch we asked for is within the max batch.
        assert max_batch(arch, profile, c, bpe) >= batch
    for context in (1024, 8192):
        b = max_batch(arch, profile, context, bpe)
        assert fits(arch, profile, context, b, bpe) and not fits(arch, profile, context, b + 1, bpe)
        assert max_context(arch, profile, max(b, 1), bpe) >= context or b == 0


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(min_value=1, max_value=2**40), batch=st.integers(1, 64),
       bpe=st.sampled_from([0.25, 0.5, 0.625, 1.0, 2.0, 4.0, 0.3]),
       reserve=st.sampled_from([0.0, 0.1, 0.35]))
def test_inversion_consistency_for_any_budget(budget, batch, bpe, reserve):
    arch = ModelArch("toy", num_layers=4, num_kv_heads=2, head_dim=16, num_attention_heads=8, params=1000)
    kw = {"weight_bytes_per_param": 2.0, "reserve_fraction": reserve}
    c = max_context(arch, budget, batch, bpe, **kw)
    assert not fits(arch, budget, c + 1, batch, bpe, **kw)
    if c > 0:
        assert fits(arch, budget, c, batch, bpe, **kw)
        b = max_batch(arch, budget, c, bpe, **kw)
        assert b >= batch and not fits(arch, budget, c, b + 1, bpe, **kw)


def test_nothing_fits_when_the_weights_do_not():
    arch, server = preset("llama-3-70b"), load_profile("server-gpu-80g")
    assert max_context(arch, server, 1, 2.0) == 0 and max_batch(arch, server, 1000, 2.0) == 0


def test_strategy_bytes_per_token_conversion():
    smol = preset("smollm2-135m")
    assert bytes_per_element_from_token_bytes(23_040, smol) == 2.0
    assert bytes_per_element_from_token_bytes(7_200, smol) == 0.625
    with pytest.raises(KVBenchError, match="positive"):
        bytes_per_element_from_token_bytes(0, smol)


def test_gqa_and_head_dim_fallbacks_from_a_transformers_config(tmp_path):
    # GPT-2 configs have neither num_key_value_heads nor head_dim: MHA, hidden // heads.
    mha_dir = tmp_path / "gpt2-like"
    mha_dir.mkdir()
    (mha_dir / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 3, "n_head": 4, "n_embd": 64, "vocab_size": 50,
         "n_positions": 128}))
    arch = arch_from_path(mha_dir)
    assert (arch.num_layers, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim) == (3, 4, 4, 16)
    assert arch.params == count_params(AutoConfig.from_pretrained(mha_dir)) and arch.params > 0

    gqa = tmp_path / "gqa.json"  # a config file path, not a directory
    gqa.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
                               "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 256}))
    arch = resolve_model(str(gqa))
    assert (arch.num_kv_heads, arch.head_dim, arch.max_position_embeddings) == (2, 32, 256)
    assert kv_bytes(arch, 10, 1, 2) == 2 * 2 * 2 * 32 * 10 * 2

    # A bare mapping missing both keys takes the same fallbacks.
    bare = arch_from_config({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512})
    assert (bare.num_kv_heads, bare.head_dim) == (8, 64)


def test_model_errors_are_one_line(tmp_path):
    with pytest.raises(KVBenchError, match="unknown model 'gpt-5'; valid presets: llama-3-8b, llama-3-70b"):
        resolve_model("gpt-5")
    with pytest.raises(KVBenchError, match="num_attention_heads"):
        arch_from_config({"num_hidden_layers": 2, "hidden_size": 64})
    bad = tmp_path / "config.json"
    bad.write_text("{}")
    with pytest.raises(KVBenchError, match="transformers cannot read this config"):
        arch_from_path(tmp_path)
    with pytest.raises(KVBenchError, match="parameter count unknown"):
        memory_plan(ModelArch("x", 1, 1, 1, 1), 10**9, 1)
    with pytest.raises(KVBenchError, match="context must be an integer"):
        kv_bytes(preset("llama-3-8b"), -1)
    with pytest.raises(KVBenchError, match=r"reserve fraction must be in \[0, 1\)"):
        fits(preset("llama-3-8b"), 10**12, 1, reserve_fraction=1.0)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = calc_cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_projection_json(capsys):
    rc, out, _ = _run(capsys, "--model", "llama-3-70b", "--context", "12000", "--batch", "1",
                      "--dtype", "fp16", "--hardware", "server-gpu-80g", "--json")
    r = json.loads(out)
    assert rc == 0 and r["kv_bytes"] == 3_932_160_000 and r["fits"] is False
    assert r["max_context_at_batch"] == 0 and any("weights alone" in n for n in r["notes"])
    assert any("8,192 positions" in n for n in r["notes"])

    rc, out, _ = _run(capsys, "--model", "smollm2-135m", "--context", "4096", "--strategy-bytes-per-token",
                      "11520", "--json")
    assert rc == 0 and json.loads(out)["bytes_per_element"] == 1.0


def test_cli_table_and_explain(capsys):
    rc, out, _ = _run(capsys, "--model", "llama-3-8b", "--context", "8192", "--hardware", "consumer-gpu-24g",
                      "--bytes-per-element", "0.625", "--explain")
    assert rc == 0
    assert "KV bytes per token = 2 × 32 layers × 8 KV heads × 128 head_dim × 0.625 B = 40,960 B" in out
    assert "max context @ batch 1" in out


def test_cli_claim(capsys):
    rc, out, _ = _run(capsys, "claim", "--json")
    c = json.loads(out)
    assert rc == 0 and c["actual_bytes"] == 3_932_160_000 and c["batch_below"] == 12
    rc, out, _ = _run(capsys, "claim")
    assert rc == 0 and "3,932,160,000 B" in out and "31,457,280,000 B" in out and "12.21" in out


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--model", "gpt-5", "--context", "1"], "valid presets"),
    (["--model", "llama-3-8b", "--context", "1", "--hardware", "tpu-v5"], "valid: consumer-gpu-24g"),
    (["--model", "llama-3-8b"], "give --context"),
    (["--model", "llama-3-8b", "--context", "0"], "--context must be an integer >= 1"),
    (["--model", "llama-3-8b", "--context", "1", "--bytes-per-element", "1",
      "--strategy-bytes-per-token", "9"], "not both"),
    (["--model", "llama-3-8b", "--context", "1", "--hardware", "cpu", "--reserve", "1"], "reserve fraction"),
    (["claim", "--model", "nope"], "valid presets"),
])
def test_cli_errors_exit_2_with_one_line(capsys, argv, fragment):
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and fragment in err and err.count("\n") == 1


def test_cli_argparse_exit_codes(capsys):
    assert calc_cli.main(["--help"]) == 0
    assert calc_cli.main(["claim", "--help"]) == 0
    assert calc_cli.main([]) == 2  # --model is required
    assert calc_cli.main(["--model", "llama-3-8b", "--dtype", "fp12"]) == 2
    capsys.readouterr()


def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "kvbench.calc_cli", "claim"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0 and "3,932,160,000 B" in proc.stdout
