"""Strategy x architecture matrix (issues 24, 43): every registered strategy on every verified model family.

Per family (a tiny random config of the family's own transformers classes: 2 layers, hidden 64, GQA 2:1):

* it loads and :func:`kvbench.arch.describe` accepts it, from its capabilities (no list of names);
* the queries kvbench captures equal the ones each layer attends with (eager, fp32, max |d| <= 1e-5), read
  from the attention function the module calls — so RoPE on some layers only (Cohere2, SmolLM3's NoPE layers),
  Llama-4's complex RoPE, L2 norm and NoPE temperature are checked, not assumed;
* ``full``'s bytes equal transformers' own ``DynamicCache`` after the same prefill, byte for byte (sliding and
  chunked layers hold ``window - 1`` tokens), and its greedy tokens through the engine equal ``model.generate``;
* per strategy, on one family per distinct capability set: one short sample runs end to end and its bytes
  are honest — ``kv_bytes_fp16`` is the dense 16-bit reference per layer type, and a window-bounded layer holds
  exactly its dense window whatever the strategy (MLA refuses the strategies :func:`strategy_refusal` names).

Parametrized over ``strategies.available()`` x :data:`FAMILIES`: a new strategy or family is covered without
editing the tests, and every capability :data:`kvbench.arch.VERIFIED` claims is used by some family here.
Phi-3 (fused qkv, partial rotary) and Gemma-2 (sliding layers, soft-capping) also run int4 and snapkv from a
saved checkpoint through the CLI; an unsupported layout or capability exits 2 with one line, the same line
:func:`kvbench.generate` and :meth:`KVBenchCache.attach` give.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
import yaml
from transformers.cache_utils import DummyLayer

from kvbench import strategies
from kvbench.arch import VERIFIED, capabilities, describe, layer_kinds, strategy_refusal, unsupported
from kvbench.cache import KVBenchCache, WindowStore
from kvbench.capture import QueryRecorder
from kvbench.config import strategy_params
from kvbench.engine import Engine, query_window_for
from kvbench.hardware import HardwareProfile
from kvbench.models import ByteTokenizer, LoadedModel
from kvbench.tasks.base import Sample

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("single_torch_thread")

WINDOW = 32  # sliding window of the families that have one: shorter than the sample, so windows really trim
#: head_dim 64 so every strategy's default group/block size divides it, as on real models.
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, bos_token_id=1, eos_token_id=0,
              pad_token_id=0)
MOE = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32}
#: family -> (config class, model class, what makes the family itself)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": WINDOW}),  # every layer sliding
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM,  # layer 0 global, layer 1 sliding
              {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {}),  # q/k norm over head_dim
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM,  # sliding + global, soft-capping, query_pre_attn_scalar
               {"sliding_window": WINDOW, "query_pre_attn_scalar": 32, "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0}),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,  # q/k norm, per-layer-type RoPE bases
               {"sliding_window": WINDOW, "query_pre_attn_scalar": 32,
                "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {"partial_rotary_factor": 0.5}),  # fused qkv_proj
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, {}),  # q/k norm over the whole projection
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, {"num_local_experts": 2, "num_experts_per_tok": 1}),
    # Llama-shaped families accepted from their capabilities alone (issue 43)
    "glm4": (tf.Glm4Config, tf.Glm4ForCausalLM, {}),  # partial, interleaved rotary; extra norms
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, {"attention_multiplier": 0.5}),  # scaling != d^-1/2
    "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM, {"no_rope_layer_interval": 2}),  # layer 1 is NoPE
    "olmo3": (tf.Olmo3Config, tf.Olmo3ForCausalLM,  # sliding + global, q norm over the projection
              {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    "ministral": (tf.MinistralConfig, tf.MinistralForCausalLM,
                  {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    "exaone4": (tf.Exaone4Config, tf.Exaone4ForCausalLM,  # q/k norm over head_dim, sliding + global
                {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, {**MOE, "shared_expert_intermediate_size": 32}),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, MOE),
    # attention sinks, chunked attention, RoPE on some layers only
    "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM,  # learned sinks, sliding + global
                {"num_local_experts": 2, "num_experts_per_tok": 1, "sliding_window": WINDOW}),
    "llama4": (tf.Llama4TextConfig, tf.Llama4ForCausalLM,  # layer 0 chunked + complex RoPE + L2 norm,
               {"attention_chunk_size": WINDOW, "num_local_experts": 2, "intermediate_size_mlp": 128,
                "no_rope_layers": [1, 0], "floor_scale": 4,  # layer 1 global NoPE, temperature from token 3
                "interleave_moe_layer_step": 1}),  # MoE (and its tuple-returning router) on every layer
    "cohere2": (tf.Cohere2Config, tf.Cohere2ForCausalLM,  # RoPE on the sliding layer only
                {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    # hybrids: strategies hold the attention layers; the recurrent layers keep transformers' own state
    "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM,  # gated delta rule + gated-query attention
                   {**MOE, "layer_types": ["linear_attention", "full_attention"],
                    "shared_expert_intermediate_size": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                    "linear_key_head_dim": 16, "linear_value_head_dim": 16}),
    "jamba": (tf.JambaConfig, tf.JambaForCausalLM,  # Mamba + NoPE attention
              {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
               "num_experts": 2, "mamba_d_state": 8, "mamba_dt_rank": 8}),
    # hybrids whose linear-attention blocks have query projections too: judged by their layer type, not attributes
    "minimax": (tf.MiniMaxConfig, tf.MiniMaxForCausalLM,  # lightning attention in MiniMax's own cache class
                {"num_local_experts": 2, "num_experts_per_tok": 1, "block_size": 16,
                 "layer_types": ["linear_attention", "full_attention"]}),
    "olmo_hybrid": (tf.OlmoHybridConfig, tf.OlmoHybridForCausalLM,  # gated delta rule + NoPE attention
                    {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                     "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16}),
    "nemotron_h": (tf.NemotronHConfig, tf.NemotronHForCausalLM,  # Mamba-2, attention and cache-less MLP layers
                   {"num_hidden_layers": 3, "layers_block_type": ["mamba", "full_attention", "mlp"],
                    "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 1,
                    "chunk_size": 16}),
    # multi-head latent attention: the cache holds a 64-wide latent and a 32-wide shared rotary key per token;
    # query/key heads 96 wide and values 64, DeepSeek-V3's 192/128
    "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,  # RoPE on part of each head
                    {**MOE, "num_key_value_heads": 2, "kv_lora_rank": 64, "q_lora_rank": 48, "qk_rope_head_dim": 32,
                     "qk_nope_head_dim": 64, "v_head_dim": 64, "head_dim": 32, "n_routed_experts": 2,
                     "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM,  # complex RoPE, full-rank queries (V2-Lite)
                    {**MOE, "num_key_value_heads": 2, "kv_lora_rank": 64, "q_lora_rank": None,
                     "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64, "head_dim": 32,
                     "n_routed_experts": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "kimi_linear": (tf.KimiLinearConfig, tf.KimiLinearForCausalLM,  # delta attention + NoPE latent attention
                    {**MOE, "num_key_value_heads": 2, "num_local_experts": 2, "kv_lora_rank": 64,
                     "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
                     "layer_types": ["linear_attention", "full_attention"], "linear_head_dim": 16,
                     "linear_num_heads": 2}),
    # MLA at the real widths of MiniCPM3 (query/key 96, values 64) and GLM-4.7-Flash (256 and 256), halved
    "minicpm3": (tf.MiniCPM3Config, tf.MiniCPM3ForCausalLM,
                 {"num_key_value_heads": 2, "kv_lora_rank": 64, "q_lora_rank": 48, "qk_rope_head_dim": 16,
                  "qk_nope_head_dim": 32, "v_head_dim": 32}),
    "glm4_moe_lite": (tf.Glm4MoeLiteConfig, tf.Glm4MoeLiteForCausalLM,
                      {**MOE, "num_key_value_heads": 2, "kv_lora_rank": 64, "q_lora_rank": 48, "qk_rope_head_dim": 32,
                       "qk_nope_head_dim": 96, "v_head_dim": 128, "n_routed_experts": 2, "first_k_dense_replace": 1,
                       "n_group": 1, "topk_group": 1}),
    # two MLA sublayers per decoder layer (cache layers 2i, 2i + 1), low-rank queries scaled before RoPE
    "longcat_flash": (tf.LongcatFlashConfig, tf.LongcatFlashForCausalLM,
                      {"num_layers": 1, "num_key_value_heads": 2, "kv_lora_rank": 64, "q_lora_rank": 48,
                       "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64, "head_dim": 32,
                       "ffn_hidden_size": 128, "expert_ffn_hidden_size": 32, "n_routed_experts": 4,
                       "zero_expert_num": 1, "moe_topk": 2}),
    # plain GQA with value heads narrower than query/key heads at MiMo-V2-Flash's real widths (192/128), twice the
    # KV heads and learned sinks on its sliding layers
    "mimo_v2_flash": (tf.MiMoV2FlashConfig, tf.MiMoV2FlashForCausalLM,
                      {**MOE, "head_dim": 192, "v_head_dim": 128, "sliding_window": WINDOW, "n_routed_experts": 2,
                       "layer_types": ["full_attention", "sliding_attention"], "n_group": 1, "topk_group": 1}),
    # per-layer head widths (Gemma-4: global layers' heads twice the sliding ones'), a one-tensor rotary call
    "gemma4": (tf.Gemma4TextConfig, tf.Gemma4ForCausalLM,
               {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                "global_head_dim": 128, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 256}),
    # layers 2-3 attend over layers 0-1's K/V (kv_sharing_modes): they hold no cache of their own
    "gemma3n": (tf.Gemma3nTextConfig, tf.Gemma3nForCausalLM,
                {"num_hidden_layers": 4, "sliding_window": WINDOW, "layer_types": ["sliding_attention",
                 "full_attention"] * 2, "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16,
                 "vocab_size_per_layer_input": 256, "laurel_rank": 8, "intermediate_size": [128] * 4,
                 "activation_sparsity_pattern": [0.0] * 4}),
    # a window longer than the sequence bounds nothing (Mistral's 4,096 tokens at a short context)
    "mistral_long_window": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 4096}),
}
#: Families kvbench refuses, and the capability the refusal must name.
REFUSED: dict[str, tuple[Any, Any, dict[str, Any], str]] = {
    "falcon_h1": (tf.FalconH1Config, tf.FalconH1ForCausalLM,
                  {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1},
                  "attention and a state-space block in parallel in one layer"),
    # DeepSeek-V3.2's sparse attention: a lightning indexer picks the tokens each query reads, from a key cache of
    # its own beside MLA's (transformers' "indexed_attention" layers)
    "deepseek_v32": (tf.DeepseekV32Config, tf.DeepseekV32ForCausalLM,
                     {**MOE, "num_key_value_heads": 2, "kv_lora_rank": 64, "q_lora_rank": 48, "qk_rope_head_dim": 32,
                      "qk_nope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 2, "first_k_dense_replace": 1,
                      "n_group": 1, "topk_group": 1, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 16},
                     "layer type(s) indexed_attention are not supported"),
}
NAMES = strategies.available()


def tiny(family: str, attn: str = "eager", seed: int = 0) -> Any:
    config_cls, model_cls, extra = FAMILIES[family] if family in FAMILIES else REFUSED[family][:3]
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**COMMON, **extra}, attn_implementation=attn)).eval()


def _sample() -> Sample:
    g = torch.Generator().manual_seed(5)
    return Sample(sample_id="s0", prefix_ids=torch.randint(2, 255, (160,), generator=g).tolist(),
                  query_ids=list(b"Q: x?"), gold_ids=list(b"ab c"), answers=["ab"], metric="substring",
                  max_new_tokens=4)


@cache
def _engine(family: str) -> Engine:
    profile = HardwareProfile.from_config(yaml.safe_load((ROOT / "conf" / "hardware" / "cpu.yaml").read_text()))
    lm = LoadedModel(family, tiny(family), ByteTokenizer())
    return Engine(lm, device="cpu", hardware=profile, run_fields={"config_hash": "matrix"})


@cache
def _baseline(family: str) -> Any:
    engine = _engine(family)
    full = strategies.build("full")
    pre = engine.prefill(_sample(), None)  # every query: enough for any strategy's window
    return pre, engine.evaluate(full, _sample(), pre, None)


@contextlib.contextmanager
def _module_queries(model: Any) -> Iterator[dict[int, torch.Tensor]]:
    """The queries each attention module attends with, recorded at the attention function it calls (the
    module's own eager attention, through transformers' registry: ``get_interface`` looks ``eager`` up there
    before falling back to the modeling module's function)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen: dict[int, torch.Tensor] = {}

    def recording(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen[module.layer_idx] = query.detach().clone()
        return sys.modules[type(module).__module__].eager_attention_forward(module, query, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["eager"] = recording
    try:
        yield seen
    finally:
        del ALL_ATTENTION_FUNCTIONS["eager"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_and_queries_equal_the_modules_own(family: str) -> None:
    model = tiny(family)
    attention_layers = [i for i, k in enumerate(layer_kinds(model.config)) if k.kv]
    assert [a.layer_idx for a in describe(model)] == attention_layers
    ids = torch.tensor([_sample().prefix_ids])
    with torch.no_grad(), QueryRecorder(model, None) as rec, _module_queries(model) as own:
        model(input_ids=ids, use_cache=True)  # a cache, as in every kvbench run (Llama-4 reads positions from it)
    # Every layer holding K/V attends (so do Gemma-3n's readers of another layer's K/V, which hold no cache).
    reuse = [i for i, mode in enumerate(getattr(model.config, "kv_sharing_modes", None) or []) if mode == "reuse"]
    assert sorted(own) == sorted(attention_layers + reuse)
    for cap in rec.captures:
        assert cap.queries is not None
        assert (cap.queries - own[cap.layer_idx]).abs().max().item() <= 1e-5, f"layer {cap.layer_idx}"


@pytest.mark.parametrize("family", FAMILIES)
def test_full_greedy_equals_model_generate(family: str) -> None:
    engine = _engine(family)
    sample = _sample()
    pre, _ = _baseline(family)
    cache_ = KVBenchCache.from_capture(strategies.build("full"), engine.model.config, pre.keys, pre.values,
                                       pre.captures, pre.states)
    n = 8
    with torch.inference_mode():
        gen = engine.greedy(cache_, torch.tensor(sample.query_ids), n)
        ref = engine.model.generate(torch.tensor([sample.prefix_ids + sample.query_ids]), max_new_tokens=n,
                                    do_sample=False, min_new_tokens=n, eos_token_id=None)
    expected = ref[0, len(sample.prefix_ids) + len(sample.query_ids):].tolist()
    assert gen.tokens == expected[: len(gen.tokens)] and len(gen.tokens) >= 1


def _dense_reference(model: Any, tokens: int) -> int:
    """Dense 16-bit K/V bytes of ``tokens`` per layer type, from the config and the K/V projections' widths (MLA:
    one latent and one shared rotary key per token; Gemma-4: each layer's own head width and KV heads; MiMo-V2-Flash:
    narrower values, more KV heads on sliding layers; no bytes for layers without K/V)."""
    config = model.config
    projections = {m.layer_idx: (m.k_proj, m.v_proj) for m in model.modules()
                   if isinstance(getattr(m, "k_proj", None), torch.nn.Linear)
                   and isinstance(getattr(m, "v_proj", None), torch.nn.Linear)}

    def width(i: int, layer: Any) -> int:
        if getattr(config, "kv_lora_rank", None):
            return int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
        if i in projections:
            return sum(p.out_features for p in projections[i])
        return 2 * int(layer.num_key_value_heads) * int(layer.head_dim)

    return sum(width(i, layer) * 2 * (min(tokens, k.window - 1) if k.sliding else tokens)
               for i, (k, layer) in enumerate(zip(layer_kinds(config), config.per_layer_config, strict=True)) if k.kv)


@cache
def capabilities_of(family: str) -> frozenset[str]:
    """The family's capabilities, by short name (``MLA``, ...: the constants' names in :mod:`kvbench.arch`)."""
    from kvbench import arch

    names = {getattr(arch, n): n for n in dir(arch) if n.isupper() and isinstance(getattr(arch, n), str)}
    return frozenset(names.get(c, c) for c in capabilities(tiny(family)))


@cache
def _representative(family: str) -> str:
    """The first family in :data:`FAMILIES` with ``family``'s capability set: only it runs every strategy (the
    others share its code paths, and their own checks above still run), which keeps the matrix within CI's
    budget while a family bringing a new capability is covered automatically."""
    signature = frozenset(capabilities(tiny(family)))
    return next(f for f in FAMILIES if frozenset(capabilities(tiny(f))) == signature)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_runs_with_honest_bytes(name: str, family: str) -> None:
    if _representative(family) != family:
        pytest.skip(f"same attention capabilities as {_representative(family)}, which runs every strategy")
    engine = _engine(family)
    sample = _sample()
    pre, base = _baseline(family)
    strategy = strategies.build(name, strategy_params(name))
    refusal = strategy_refusal(engine.model, strategy)
    if refusal is not None:  # MLA: a strategy scoring with queries has no per-head keys; refused, by name
        assert "MLA" in capabilities_of(family) and "multi-head latent attention" in refusal
        assert strategy.query_window != 0 or strategy.same_kv_width
        return
    assert query_window_for([strategy]) is None or pre.captures[0].queries is not None
    result = engine.evaluate(strategy, sample, pre, base.logp)
    rec = result.record
    config = engine.model.config
    assert rec["kv_bytes_fp16"] == _dense_reference(engine.model, sample.context_tokens)
    assert rec["kv_bytes"] > 0 and rec["generated_tokens"] >= 1
    # Sliding layers keep their dense window (model dtype) whatever the strategy; the strategy holds the rest.
    engine.bind(strategy, sample.prefix_ids)
    built = KVBenchCache.from_capture(strategy, config, pre.keys, pre.values, pre.captures, pre.states,
                                      tokens=sample.total_tokens)
    for layer, kind in zip(built.layers, layer_kinds(config), strict=True):
        if kind.recurrent:  # a hybrid's state: transformers' own layer, the same for every strategy
            assert not hasattr(layer, "store") and rec["stats"]["recurrent_state_bytes"] == built.state_bytes() > 0
            continue
        if not kind.kv:  # an MLP layer, or one attending over another layer's K/V: no cache at all
            assert isinstance(layer, DummyLayer)
            continue
        # A window shorter than the sample is left dense; a longer one bounds nothing, the strategy holds it.
        assert isinstance(layer.store, WindowStore) == kind.bounds(sample.total_tokens)
        if kind.bounds(sample.total_tokens):
            assert layer.store.num_tokens() == min(sample.context_tokens, kind.window - 1)
    if name == "full":  # fp32 model: the dense cache is exactly twice its 16-bit reference
        assert rec["kv_bytes"] == 2 * rec["kv_bytes_fp16"]


@pytest.mark.parametrize("family", FAMILIES)
def test_full_bytes_equal_transformers_cache(family: str) -> None:
    """``full`` holds what transformers' own cache holds after the same prefix: per layer, byte for byte."""
    engine = _engine(family)
    pre, base = _baseline(family)
    with torch.inference_mode():
        ref = engine.model(input_ids=torch.tensor([_sample().prefix_ids]), use_cache=True).past_key_values
    built = KVBenchCache.from_capture(strategies.build("full"), engine.model.config, pre.keys, pre.values,
                                      states=pre.states)
    # Layers holding K/V (a hybrid's recurrent layers, MLP layers and shared-KV readers hold none; MiniMax's cache
    # creates placeholder layers, empty, for its lightning-attention layers).
    attn = [layer for layer in ref.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]
    assert [layer.store.num_tokens() for layer in built.kv_layers] == [layer.keys.shape[-2] for layer in attn]
    ref_bytes = sum(t.numel() * t.element_size() for layer in attn for t in (layer.keys, layer.values))
    assert built.kv_bytes() == base.record["kv_bytes"] == ref_bytes
    states = [t for layer in ref.layers if hasattr(layer, "recurrent_states")
              for d in (layer.conv_states, layer.recurrent_states) for t in d.values() if t is not None]
    states += [t for t in getattr(ref, "linear_cache", []) if isinstance(t, torch.Tensor)]  # MiniMax's own cache
    assert built.state_bytes() == sum(t.numel() * t.element_size() for t in states)
    assert (built.state_bytes() > 0) == any(k.recurrent for k in layer_kinds(engine.model.config))


def test_attention_sinks_match_gpt_oss_eager_attention() -> None:
    """GPT-OSS's sink logits: kvbench's attention equals the model's eager attention on a full cache (prefill and
    a decode step), and the scores attention-scored strategies read equal the eager attention weights."""
    from kvbench.strategies._eviction import attention_column_sums, attention_probs

    from kvbench.attention import use

    ids = torch.tensor([_sample().prefix_ids[:100]])  # longer than SHORT_QUERY: sinks keep prefill off SDPA
    eager, fast = tiny("gpt_oss"), tiny("gpt_oss")
    use(fast, "kvbench", "cpu")
    step = torch.tensor([[7]])
    with torch.no_grad():
        with QueryRecorder(eager, None) as rec:
            ref = eager(input_ids=ids, use_cache=True, output_attentions=True)
        ref_step = eager(input_ids=step, cache=ref.past_key_values, use_cache=True).logits
    with torch.no_grad():
        cache_ = KVBenchCache(strategies.build("full"), fast.config)
        got = fast(input_ids=ids, cache=cache_, use_cache=True).logits
        got_step = fast(input_ids=step, cache=cache_, use_cache=True).logits
    assert (got - ref.logits).abs().max().item() <= 1e-5
    assert (got_step - ref_step).abs().max().item() <= 1e-5
    layer = 1  # the global layer (the sliding one's mask is the model's, not the scorer's)
    cap, module = rec.captures[layer], eager.model.layers[layer].self_attn
    assert cap.sinks is not None and torch.equal(cap.sinks, module.sinks)
    keys = ref.past_key_values.layers[layer].keys[..., :ids.shape[1], :]
    weights = ref.attentions[layer]  # [b, q_heads, T, T], the sink column already dropped
    b, hq, t, _ = weights.shape
    probs = attention_probs(cap.queries[..., -8:, :], keys, cap.scaling, cap.sinks)
    assert (probs.reshape(b, hq, 8, t) - weights[..., -8:, :]).abs().max().item() <= 1e-6
    sums = attention_column_sums(cap.queries, keys, cap.scaling, sinks=cap.sinks)
    assert (sums.reshape(b, hq, t) - weights.sum(dim=-2)).abs().max().item() <= 1e-5
    assert (probs.sum(dim=-1) < 1 - 1e-3).any()  # the sinks really took mass (the test can fail without them)


def test_a_strategy_that_can_change_nothing_is_said_in_one_line() -> None:
    """Every layer window-bounded (this Mistral): the CLI's warning and kvbench.generate's say so; a model with a
    global layer gets no such line."""
    import kvbench
    from kvbench.arch import nothing_to_compress

    mistral = tiny("mistral")
    line = nothing_to_compress(mistral.config, ["full", "int4", "snapkv"])
    assert line is not None and "int4, snapkv cannot change" in line and "\n" not in line
    assert nothing_to_compress(mistral.config, ["full"]) is None
    assert nothing_to_compress(tiny("gemma2").config, ["int4"]) is None
    with pytest.warns(UserWarning, match="cannot change its cache"):
        kvbench.generate(mistral, ByteTokenizer(), "abc " * 10, "Q?", strategy="int4", max_new_tokens=1)


def test_a_model_without_sdpa_gets_kvbench_attention_or_one_line() -> None:
    """GPT-OSS has no SDPA (its sinks): ``auto`` picks kvbench's attention on every device, ``sdpa`` is one line."""
    from kvbench.attention import use
    from kvbench.errors import KVBenchError

    model = tiny("gpt_oss")
    assert use(model, "auto", "cuda") == "kvbench"  # resolution only: the tiny model stays on the CPU
    with pytest.raises(KVBenchError, match=r"engine.attention=sdpa: .*does not support .*; use engine.attention"):
        use(model, "sdpa", "cpu")


def test_every_verified_capability_is_exercised_by_a_family() -> None:
    used = {c for family in FAMILIES for c in capabilities(tiny(family))}
    assert used == VERIFIED, f"claimed but not in the matrix: {sorted(VERIFIED - used)}"


@pytest.mark.parametrize("family", REFUSED)
def test_refusal_names_the_missing_capability(family: str) -> None:
    line = unsupported(tiny(family))
    assert line is not None and "\n" not in line and REFUSED[family][3] in line, line
    assert f"model_type {family!r}" in line


@pytest.mark.parametrize("family", ["cohere2", "gpt_oss", "deepseek_v3", "falcon_h1"])
def test_every_entry_point_gives_the_same_line(family: str) -> None:
    """``kvbench.generate`` and ``KVBenchCache.attach`` run the CLI's model check (:func:`describe`)."""
    import kvbench
    from kvbench.errors import KVBenchError

    model = tiny(family)
    line = unsupported(model) or strategy_refusal(model, strategies.build("snapkv"))
    tok = ByteTokenizer()
    if line is None:  # supported: the library path runs and attends with sinks / per-layer RoPE
        assert isinstance(kvbench.generate(model, tok, "abc " * 20, "Q?", strategy="snapkv", max_new_tokens=2), str)
        return
    with pytest.raises(KVBenchError) as exc:
        kvbench.generate(model, tok, "abc " * 20, "Q?", strategy="snapkv", max_new_tokens=2)
    assert str(exc.value) == line
    if family in FAMILIES or family == "deepseek_v3":  # a config KVBenchCache can be built from
        cache_ = KVBenchCache(strategies.build("snapkv"), model.config)
        with pytest.raises(KVBenchError) as exc, cache_.attach(model):
            pass
        assert str(exc.value) == line


# -- end to end through the CLI, from saved checkpoints -----------------------------------------------------------
ROWS = [{"id": f"q{i}", "context": "The quorum of the committee is seven members. " * 3, "input": "What is the quorum?",
         "answers": ["seven"]} for i in range(2)]


def _save(family: str, where: Path, model: Any = None) -> Path:
    """A tiny checkpoint of ``family`` with a byte-level BPE tokenizer (256 ids), as a user's model directory."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tok_models

    (model if model is not None else tiny(family)).save_pretrained(where)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(tok_models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[0]).save_pretrained(where)
    return where


def kvbench(capsys: pytest.CaptureFixture, tmp_path: Path, *args: str) -> tuple[int, list[str]]:
    """``python -m kvbench`` in this process on a two-row JSON Lines task: (exit status, stderr lines)."""
    from kvbench import cli

    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    capsys.readouterr()  # only the run's own output (not save_pretrained's progress bars)
    code = 0
    try:
        cli.main(["task=jsonl", f"task.path={qa}", "task.n_samples=1", "task.max_new_tokens=2",
                  "task.context_tokens=96", "engine.progress=false", "engine.warmup=false", "hardware.threads=1",
                  f"results_dir={tmp_path / 'results'}", *args])
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


@pytest.mark.parametrize("family", ["phi3", "gemma2", "gpt_oss"])
def test_int4_and_snapkv_end_to_end_from_a_saved_checkpoint(family: str, tmp_path: Path, capsys) -> None:
    path = _save(family, tmp_path / f"tiny-{family}")
    code, err = kvbench(capsys, tmp_path, "model=local", f"model.path={path}", "strategies=[int4,snapkv]")
    assert code == 0, err
    files = list((tmp_path / "results" / "runs").glob("*/records.jsonl"))
    assert len(files) == 1
    records = [json.loads(x) for x in files[0].read_text().splitlines()]
    assert {r["strategy_name"] for r in records} == {"full", "int4", "snapkv"}
    assert {r["model"] for r in records} == {f"tiny-{family}"}  # named after the checkpoint, not "local"


def test_unsupported_layout_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=2, n_positions=256,
                                                  bos_token_id=0, eos_token_id=0))
    path = _save("gpt2", tmp_path / "tiny-gpt2", model=gpt2)
    code, err = kvbench(capsys, tmp_path, "model=local", f"model.path={path}", "strategy=int4")
    assert code == 2
    assert len(err) == 1 and "gpt2" in err[0] and "not supported" in err[0], err
    assert "q_proj or qkv_proj" in err[0]  # names what the layout lacks


def test_a_strategy_refused_on_latent_attention_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    path = _save("deepseek_v3", tmp_path / "tiny-deepseek")
    code, err = kvbench(capsys, tmp_path, "model=local", f"model.path={path}", "strategy=snapkv")
    assert code == 2
    assert len(err) == 1 and "strategy snapkv does not apply" in err[0] and "multi-head latent attention" in err[0]


#: Issue 51's families under the CLI's defaults (CPU: bfloat16 weights, float32 GEMMs through kvbench.linear,
#: kvbench's attention): each runs int8 and snapkv, or refuses snapkv alone (latent attention) while int8 runs.
CLI_DEFAULTS = ["llama4", "deepseek_v3", "gemma4", "gemma3n", "minimax", "olmo_hybrid", "nemotron_h", "mimo_v2_flash",
                "mistral_long_window"]


@pytest.mark.parametrize("family", CLI_DEFAULTS)
def test_2026_families_run_under_cli_defaults(family: str, tmp_path: Path, capsys) -> None:
    path = _save(family, tmp_path / f"tiny-{family}")
    code, err = kvbench(capsys, tmp_path, "model=local", f"model.path={path}", "strategies=[int8,snapkv]")
    assert code == 0 and not any("Traceback" in line for line in err), err
    (records_file,) = (tmp_path / "results" / "runs").glob("*/records.jsonl")
    records = {r["strategy_name"]: r for r in map(json.loads, records_file.read_text().splitlines())}
    assert records["full"]["dtype"] == "bfloat16"
    refused = [line for line in err if "strategy snapkv does not apply" in line]
    if refused:  # refused alone, by name and reason, in one line; the other strategies ran
        assert "MLA" in capabilities_of(family) and len(refused) == 1 and "snapkv" not in records
        assert set(records) == {"full", "int8"}
    else:
        assert set(records) == {"full", "int8", "snapkv"}
    assert records["full"]["kv_bytes"] == records["full"]["kv_bytes_fp16"]  # bfloat16: full is its own reference
    assert not any("cannot change its cache" in line for line in err)  # a 4,096-token window over 96 tokens
    if family == "mistral_long_window":  # every token held, so int8 really compresses it (not 0%)
        assert records["int8"]["memory_reduction"] > 0.4


def test_a_window_longer_than_the_sequence_bounds_nothing() -> None:
    """Mistral's 4,096-token window at 512 tokens: no all-sliding warning; int8 saves > 40% in bfloat16; the same
    window at 8,000 tokens would bound, and is said to."""
    from kvbench.arch import nothing_to_compress

    config = tiny("mistral_long_window").config
    assert nothing_to_compress(config, ["full", "int8"], 512) is None
    assert nothing_to_compress(config, ["full", "int8"], 8000) is not None
    assert nothing_to_compress(config, ["full", "int8"]) is not None  # length unknown: the window may bound
    torch.manual_seed(0)
    model = tiny("mistral_long_window").to(torch.bfloat16)
    ids = torch.randint(2, 255, (1, 512))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=True).past_key_values
        cache_ = KVBenchCache(strategies.build("int8"), model.config, tokens=512 + 8)
        model(input_ids=ids, cache=cache_, use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in ref.layers for t in (layer.keys, layer.values))
    assert held == 262_144 == cache_.kv_bytes_fp16()  # every token, as a global cache holds them
    assert 1 - cache_.kv_bytes() / held > 0.4


@pytest.mark.integration
def test_lm_eval_command_line_refuses_in_one_line(tmp_path: Path, capsys) -> None:
    """lm-eval's command line with the kvbench model: a strategy that cannot apply is kvbench's one line and
    exit status 2, not the end of a traceback."""
    pytest.importorskip("lm_eval")
    from kvbench.lmeval.cli import main

    path = _save("deepseek_v3", tmp_path / "tiny-deepseek")
    capsys.readouterr()
    code = main(["run", "--model_args", f"pretrained={path},strategy=snapkv,threads=1", "--tasks",
                 "kvbench_tiny_mc", "--include_path", str(ROOT / "tests" / "fixtures" / "lmeval"), "--limit", "1"])
    err = capsys.readouterr().err
    # (Not "no Traceback at all": a logging handler an earlier test left on its closed capture prints one.)
    assert code == 2 and "KVBenchError" not in err, err
    assert err.strip().splitlines()[-1].startswith("kvbench: error: strategy snapkv does not apply")
