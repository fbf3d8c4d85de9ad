"""``engine.linear`` (kvbench/linear.py): 16-bit linear layers computed as float32 GEMMs on CPU.

What it must keep: the native path's result up to the order of float32 sums (so within one bf16 rounding of
the output), single-row products exactly native, float32 models untouched, a way back (``native``), and a
run identity of its own (a different summation order can flip a greedy near-tie).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbench import linear
from kvbench.engine import Engine
from kvbench.errors import KVBenchError
from kvbench.models import ByteTokenizer, LoadedModel, tiny_llama

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _bf16_model() -> torch.nn.Module:
    return tiny_llama(seed=0).to(torch.bfloat16)


def _patched(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and "forward" in m.__dict__]


def test_resolve_by_device_and_dtype() -> None:
    bf16, f32 = _bf16_model(), tiny_llama(seed=0)
    assert linear.resolve("auto", "cpu", bf16) == "float32"
    assert linear.resolve("auto", "cpu", f32) == "native"          # nothing 16-bit to upcast
    assert linear.resolve("float32", "cuda", bf16) == "native"     # accelerators have 16-bit GEMMs
    assert linear.resolve("native", "cpu", bf16) == "native"
    assert linear.resolve("upcast", "cpu", bf16) == ("upcast" if linear.rows_kernel() else "upcast-slices")
    assert linear.resolve("upcast", "cpu", f32) == linear.resolve("upcast", "cuda", bf16) == "native"
    with pytest.raises(KVBenchError, match="valid: auto, native, float32"):
        linear.resolve("fp32", "cpu", bf16)


def test_float32_path_is_the_native_product_up_to_sum_order() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(1, 5, 64).to(torch.bfloat16)
    native = F.linear(x, lin.weight, lin.bias)
    model = torch.nn.Sequential(lin)
    assert linear.use(model, "float32", "cpu") == "float32"
    out = lin(x)
    assert out.dtype == torch.bfloat16
    exact = (x.double() @ lin.weight.double().T + lin.bias.double())
    # Both round one float32 accumulation to bf16: each is within one bf16 ulp of the exact product.
    ulp = exact.abs() * 2.0 ** -7 + 1e-30
    assert ((out.double() - exact).abs() <= ulp).all()
    assert ((native.double() - exact).abs() <= ulp).all()
    one = x[:, :1]
    assert torch.equal(lin(one), F.linear(one, lin.weight, lin.bias))  # one row: native, bit for bit
    assert linear.use(model, "native", "cpu") == "native"
    assert "forward" not in lin.__dict__ and torch.equal(lin(x), native)


def test_engine_applies_it_and_greedy_tokens_match_native() -> None:
    ids = torch.randint(1, 255, (1, 40), generator=torch.Generator().manual_seed(1))
    native_model, upcast_model = _bf16_model(), _bf16_model()
    Engine(LoadedModel("tiny", native_model, ByteTokenizer()), linear="native")
    engine = Engine(LoadedModel("tiny", upcast_model, ByteTokenizer()), linear="auto")
    assert engine.linear == "float32" and _patched(upcast_model) and not _patched(native_model)
    with torch.inference_mode():
        a = native_model(input_ids=ids).logits.float()
        b = upcast_model(input_ids=ids).logits.float()
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a - b).abs().max() < 0.1 * a.abs().max()


def test_float32_models_are_left_alone() -> None:
    model = tiny_llama(seed=0)
    assert Engine(LoadedModel("tiny", model, ByteTokenizer()), linear="float32").linear == "native"
    assert not _patched(model)


def test_linear_subclasses_keep_their_own_forward() -> None:
    """Only plain ``nn.Linear`` is upcast: Llama-4's router (a Linear subclass returning scores and logits) keeps its
    forward, and a tiny Llama-4 with MoE on every layer runs a bfloat16 forward on the float32 path (issue 51: the
    replaced router returned one tensor and the MoE block failed to unpack it)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Llama4TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                 num_local_experts=2, interleave_moe_layer_step=1, attention_chunk_size=32)
    model = tf.Llama4ForCausalLM(config).to(torch.bfloat16).eval()
    routers = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear]
    assert len(routers) == 2  # one per layer: MoE on every layer
    assert linear.use(model, "float32", "cpu") == "float32"
    assert _patched(model) and not any("forward" in m.__dict__ for m in routers)
    with torch.inference_mode():
        logits = model(input_ids=torch.randint(1, 255, (1, 24))).logits
    assert logits.shape == (1, 24, 256) and torch.isfinite(logits).all()


def test_upcast_slices_compute_float32_products_and_hold_no_copies(monkeypatch) -> None:
    """``upcast`` without its kernel (``upcast-slices``): the float32 products of ``float32`` (within one bf16
    rounding of the exact product), the weight converted a slice of output rows at a time at each call; nothing
    held beside the 16-bit weights, one row native bit for bit, and ``native`` restores the class's forward."""
    from kvbench.footprint import weight_bytes

    monkeypatch.setattr(linear, "rows_kernel", lambda: None)
    monkeypatch.setattr(linear, "UPCAST_BYTES", 4 * 64 * 5)  # 5 output rows a slice: 48 rows in 10 slices
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48).to(torch.bfloat16)
    model = torch.nn.Sequential(lin)
    plain = weight_bytes(model)
    x = torch.randn(2, 7, 64).to(torch.bfloat16)
    assert linear.use(model, "upcast", "cpu") == "upcast-slices"
    assert lin.forward.rows == 5 and lin.forward.kernel is None and weight_bytes(model) == plain
    out = lin(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 7, 48)
    exact = x.double() @ lin.weight.double().T + lin.bias.double()
    assert ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -7 + 1e-30).all()
    # A slice boundary dropped or shifted would put whole columns far off: each slice is the float32 product.
    whole = F.linear(x.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16)
    assert torch.equal(out, whole)
    one = x[:1, :1]
    assert torch.equal(lin(one), F.linear(one, lin.weight, lin.bias))
    assert linear.use(model, "native", "cpu") == "native" and "forward" not in lin.__dict__


def test_upcast_kernel_reads_a_few_rows_against_bf16_weights() -> None:
    """``linear_rows.cpp``: up to ``max_rows()`` rows (one included) times a bf16 weight, each weight row read
    once for all of them, in float32: within one bf16 rounding of the exact product, bias added, any leading
    shape; more rows take the slices; float16 weights never reach it. Its result is not ``float32``'s bit for bit
    (another order of sums), which is why ``upcast`` is its own run identity."""
    from kvbench.footprint import weight_bytes

    kernel = linear.rows_kernel()
    if kernel is None:
        pytest.skip("no C++ toolchain for kvbench/linear_rows.cpp (or KVBENCH_FUSED=0)")
    torch.manual_seed(0)
    for in_features, bias in ((64, True), (72, False), (20, True)):  # 20: not a multiple of 8, the scalar loop
        lin = torch.nn.Linear(in_features, 37, bias=bias).to(torch.bfloat16)
        model = torch.nn.Sequential(lin)
        plain = weight_bytes(model)
        assert linear.use(model, "upcast", "cpu") == "upcast"
        assert lin.forward.kernel is kernel and weight_bytes(model) == plain
        for rows in (1, 2, 8, 9, kernel.max_rows(), kernel.max_rows() + 3):
            x = torch.randn(1, rows, in_features).to(torch.bfloat16)
            out = lin(x)
            assert out.dtype == torch.bfloat16 and out.shape == (1, rows, 37)
            exact = x.double() @ lin.weight.double().T + (lin.bias.double() if bias else 0)
            assert ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -7 + 1e-6).all(), (in_features, rows)
        # A row of the weight read for the wrong output, or an input row for another: whole entries far off.
        x = torch.randn(3, in_features).to(torch.bfloat16)
        got = kernel.linear_rows(x.float(), lin.weight.contiguous(), lin.bias)
        want = x.float() @ lin.weight.float().T + (lin.bias.float() if bias else 0)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    half = torch.nn.Linear(64, 8).to(torch.float16)
    linear.use(torch.nn.Sequential(half), "upcast", "cpu")
    assert half.forward.kernel is None  # float16 weights take the slices


def _eight_lane_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``linear_rows.cpp``'s order, written out: lane j of y[m, n] takes x[m, k] * w[n, k] for k = j (mod 8) by
    fused multiply-adds in increasing k (the bf16 x float32 product is exact in float64, so one rounding of the
    float64 sum is the FMA's for these inputs), then the lanes are added as its hsum does (4 + 4, 2 + 2, 1 + 1)."""
    lanes = torch.zeros(x.shape[0], w.shape[0], 8, dtype=torch.float32)
    for k in range(0, x.shape[1], 8):
        p = x[:, None, k:k + 8].double() * w[None, :, k:k + 8].double()
        lanes = (p + lanes.double()).float()
    s4 = lanes[..., :4] + lanes[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    return s2[..., 0] + s2[..., 1]


def test_upcast_kernel_sums_in_one_order_whatever_the_block() -> None:
    """Every output is summed in the one order above, bit for bit, whatever the rows batched with it, its place in
    the kernel's blocks of weight rows (48 per thread's block, 6 to 16 at once with AVX-512, the rest one by one)
    and the CPU's vector width: ``upcast`` runs then reproduce across batch sizes and machines with AVX2 or
    AVX-512. A kernel that sums in another order (faster or not) is another run identity, and fails here."""
    kernel = linear.rows_kernel()
    if kernel is None:
        pytest.skip("no C++ toolchain for kvbench/linear_rows.cpp (or KVBENCH_FUSED=0)")
    torch.manual_seed(3)
    w = torch.randn(101, 64).to(torch.bfloat16)  # 48 + 48 + 5 weight rows
    bias = torch.randn(101)
    x = torch.randn(kernel.max_rows(), 64) * 4
    want = _eight_lane_sums(x, w.float())
    for rows in range(1, kernel.max_rows() + 1):
        assert torch.equal(kernel.linear_rows(x[:rows].contiguous(), w, None), want[:rows]), rows
        assert torch.equal(kernel.linear_rows(x[:rows].contiguous(), w, bias), want[:rows] + bias), rows
    for n in (0, 47, 48, 100):  # one weight row alone: the same bits as inside a block
        assert torch.equal(kernel.linear_rows(x[:5].contiguous(), w[n:n + 1].contiguous(), None), want[:5, n:n + 1])


def test_upcast_kernel_build_holds_its_prefetches(disassembly) -> None:
    """With AVX-512 the kernel prefetches the next block of weight rows (from memory, blocks of rows read at once
    were slower than one row at a time without it): the instructions must be in the object, as a compiler once
    left another file's prefetch loop out without a word (tests/test_fused.py)."""
    from pathlib import Path

    kernel = linear.rows_kernel()
    info = Path("/proc/cpuinfo")
    if kernel is None or " avx512f" not in (info.read_text() if info.exists() else ""):
        pytest.skip("no kernel build, or no AVX-512 (the AVX2 loop reads one row at a time, unprefetched)")
    assert "prefetcht0" in disassembly(kernel)
